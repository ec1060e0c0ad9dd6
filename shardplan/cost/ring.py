"""The alpha-beta time of one collective over mesh axes, on the ring model.

- Collective.nbytes is the per-device buffer: the input of an all-reduce, reduce-scatter or
  all-to-all, the gathered output of an all-gather, the moved buffer of a collective-permute.
- A collective over several axes is one ring over all their devices (group size = product of
  the sizes) at the slowest of their links: that is what XLA emits (one op whose replica groups
  span the axes) and what NCCL runs (one ring through the NICs).
- Ring model (B = nbytes, n = group size): all-reduce sends 2(n-1)/n B in 2(n-1) steps;
  all-gather, reduce-scatter and all-to-all send (n-1)/n B in n-1 steps; a permute sends B in
  one step. Time = steps * latency + bytes_sent / bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from shardplan.cost.hardware import Link
from shardplan.strategies.base import Collective, Strategy
from shardplan.strategies.spec import MeshShape

PERMUTE = "collective-permute"

# kind -> (fraction of the buffer each device sends, ring steps), as functions of group size n
_RING = {
    "all-reduce": (lambda n: 2 * (n - 1) / n, lambda n: 2 * (n - 1)),
    "all-gather": (lambda n: (n - 1) / n, lambda n: n - 1),
    "reduce-scatter": (lambda n: (n - 1) / n, lambda n: n - 1),
    "all-to-all": (lambda n: (n - 1) / n, lambda n: n - 1),
    PERMUTE: (lambda n: 1.0, lambda n: 1),
}
_ALIASES = {"permute": PERMUTE}
KINDS = tuple(_RING)


def _kind(kind: str) -> str:
    kind = _ALIASES.get(kind, kind)
    if kind not in _RING:
        raise ValueError(
            f"unknown collective kind {kind!r}; known: {', '.join(KINDS)} (or 'permute')"
        )
    return kind


def bytes_sent(kind: str, nbytes: float, group_size: int) -> float:
    """Bytes each device sends in the ring model (0 for a group of one device)."""
    kind = _kind(kind)
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    return _RING[kind][0](group_size) * nbytes


def latency_steps(kind: str, group_size: int) -> int:
    """Ring steps, each paying the link latency once."""
    kind = _kind(kind)
    return 0 if group_size <= 1 else _RING[kind][1](group_size)


def _as_axes(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def check_axes(axes: Sequence[str], mesh: MeshShape) -> None:
    for a in axes:
        if a not in mesh.names:
            raise ValueError(
                f"mesh axis {a!r} is not in the mesh {dict(zip(mesh.names, mesh.sizes))}"
            )


def slowest_link(
    axes: str | Sequence[str], mesh: MeshShape, links: Mapping[str, Link]
) -> Link | None:
    """The link a ring over these axes runs at: the least bandwidth and the largest latency among
    the axes of size > 1 (None if there are none)."""
    axes = _as_axes(axes)
    check_axes(axes, mesh)
    used = [a for a in axes if mesh.size(a) > 1]
    missing = [a for a in used if a not in links]
    if missing:
        raise KeyError(
            f"no link for mesh axis {missing}; links has {sorted(links)} "
            "(build them with HardwareProfile.axis_links(mesh))"
        )
    if not used:
        return None
    return Link(min(links[a].bandwidth for a in used), max(links[a].latency for a in used))


def collective_time(
    kind: str, nbytes: float, axes: str | Sequence[str], mesh: MeshShape, links: Mapping[str, Link]
) -> float:
    """Seconds for one collective over `axes` of a buffer of `nbytes` per device."""
    axes = _as_axes(axes)
    link = slowest_link(axes, mesh, links)
    n = mesh.size(axes) if axes else 1
    if link is None or n <= 1 or nbytes <= 0:
        return 0.0
    return latency_steps(kind, n) * link.latency + bytes_sent(kind, nbytes, n) / link.bandwidth


def comms_time(comms: Sequence[Collective], mesh: MeshShape, links: Mapping[str, Link]) -> float:
    """Seconds for collectives run one after another."""
    return math.fsum(collective_time(c.kind, c.nbytes, c.axes, mesh, links) for c in comms)


def comms_bytes(comms: Sequence[Collective], mesh: MeshShape) -> float:
    """Bytes each device sends over all these collectives (ring model)."""
    return math.fsum(
        bytes_sent(c.kind, c.nbytes, mesh.size(c.axes) if c.axes else 1) for c in comms
    )


def strategy_comm_time(strategy: Strategy, mesh: MeshShape, links: Mapping[str, Link]) -> float:
    """Seconds of the collectives a strategy performs inside its node."""
    return comms_time(strategy.comms, mesh, links)
