"""The time to move a value between two pipeline stages' submeshes, as the MPMD runtime moves
it (shardplan.emit.transfer), over the links of the hardware profile.

Stages on disjoint submeshes of one shape: a `ppermute`, each source device sending its block
to its counterpart. Otherwise: the value gathered on the source submesh, then each receiving
device's block sent by `ppermute` from one source device, in ceil(receivers / sources)
rounds. The link is the profile's inter-host link when the two submeshes' devices sit on more
than one host (device id // devices_per_host, as for mesh axes), else its intra-host link; in
a multi-controller job (jax.distributed, one process per host) those are the moves between
processes. The value is taken as spread evenly over the receiving submesh's devices, as the
stage DP assumes (shardplan.inter.tables).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from shardplan.cost.hardware import HardwareProfile, Link


@dataclasses.dataclass(frozen=True)
class Move:
    """One move: its program ("permute", "scatter" or "local"), its time, and its link."""

    program: str
    seconds: float
    inter_host: bool


def link_between(hw: HardwareProfile, *device_sets: Sequence[int]) -> tuple[Link, bool]:
    """The link a collective over the union of `device_sets` runs over, and whether it is the
    inter-host one."""
    hosts = {d // hw.devices_per_host for ids in device_sets for d in ids}
    return (hw.inter_host, True) if len(hosts) > 1 else (hw.intra_host, False)


def move(nbytes: float, src: Sequence[int], src_shape: Sequence[int], dst: Sequence[int],
         dst_shape: Sequence[int], hw: HardwareProfile) -> Move:
    """Moving `nbytes` laid out on the devices `src` (a submesh of shape `src_shape`) to the
    devices `dst` (shape `dst_shape`)."""
    src_set, dst_set = set(src), set(dst)
    if src_set == dst_set or nbytes <= 0:
        return Move("local", 0.0, False)
    link, inter = link_between(hw, src, dst)
    if tuple(src_shape) == tuple(dst_shape) and not src_set & dst_set:
        return Move("permute", link.latency + nbytes / len(dst) / link.bandwidth, inter)
    n = len(src)
    src_link, _ = link_between(hw, src)
    gather = 0.0 if n == 1 else (n - 1) * (src_link.latency
                                           + nbytes / n / src_link.bandwidth)
    rounds = math.ceil(len(dst_set - src_set) / n)
    send = rounds * (link.latency + nbytes / len(dst) / link.bandwidth)
    return Move("scatter", gather + send, inter and rounds > 0)


def boundary(nbytes: float, prev: Sequence[int], prev_shape: Sequence[int],
             this: Sequence[int], this_shape: Sequence[int], hw: HardwareProfile
             ) -> tuple[Move, Move]:
    """The activations into a stage (from the stage before it) and their gradients back."""
    return (move(nbytes, prev, prev_shape, this, this_shape, hw),
            move(nbytes, this, this_shape, prev, prev_shape, hw))


def hosts_differ_from_processes(hw: HardwareProfile, devices) -> bool:
    """Whether the profile's hosts (device id // devices_per_host) group `devices` (jax
    devices) otherwise than their processes do."""
    by_host: dict[int, set[int]] = {}
    by_process: dict[int, set[int]] = {}
    for d in devices:
        by_host.setdefault(d.id // hw.devices_per_host, set()).add(d.id)
        by_process.setdefault(d.process_index, set()).add(d.id)
    return sorted(map(sorted, by_host.values())) != sorted(map(sorted, by_process.values()))
