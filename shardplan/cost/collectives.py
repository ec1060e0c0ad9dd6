"""Communication costs: the cheapest sequence of collectives that turns one ShardSpec of a
value into another (resharding), priced by the ring model of shardplan.cost.ring (whose
functions are re-exported here: the cost model and the planner read both from this module).

A collective over several axes is one ring over all their devices at the slowest of their
links (shardplan.cost.ring). Resharding compares plans that gather or move axes together or
one at a time, so with per-axis links it can still send the large buffers over the fast axes.

Led through `reshard_path` with sharding constraints, XLA sends exactly the predicted bytes
(tests/test_cost_collectives.py::test_reshard_path_leads_xla_to_the_model); given only src
and dst it matches in most cases (test_reshard_matches_xla), and elsewhere sends more (it
replicates and re-slices) or less (it splits a mesh axis into sub-axes, which these plans do
not).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence

from shardplan.cost.hardware import Link
from shardplan.cost.ring import (
    KINDS,
    PERMUTE,
    bytes_sent,
    check_axes,
    collective_time,
    comms_bytes,
    comms_time,
    latency_steps,
    slowest_link,
    strategy_comm_time,
)
from shardplan.strategies.base import Collective
from shardplan.strategies.spec import MeshShape, ShardSpec

__all__ = ["KINDS", "PERMUTE", "bytes_sent", "collective_time", "comms_bytes", "comms_time",
           "latency_steps", "reshard", "reshard_path", "reshard_time", "slowest_link",
           "strategy_comm_time"]

# -- resharding -----------------------------------------------------------------------------


def reshard(
    shape: Sequence[int],
    itemsize: int,
    src: ShardSpec,
    dst: ShardSpec,
    mesh: MeshShape,
    *,
    forms_reduce_scatter: bool = True,
    links: Mapping[str, Link] | None = None,
) -> tuple[Collective, ...]:
    """The collectives that turn a value sharded as `src` into `dst`: the cheapest candidate by
    time over `links` if given, else by bytes sent per device, then by fewer collectives.

    Candidates follow one recipe in a few orders: partial sums are reduced (a reduce-scatter
    onto the dimension dst splits over the partial axis, else an all-reduce; always an
    all-reduce without forms_reduce_scatter, as XLA:CPU compiles it), axes dst adds are sliced
    locally (free) before anything is sent, axes that change dimension move by all-to-all, and
    axes dst drops are all-gathered last. Where the order of axes inside a dimension would
    leave devices with the wrong blocks, one collective-permute of the smallest buffer fixes it
    (XLA does the same). When each dst tile lies inside a src tile, a local slice plus one
    permute is a candidate too (XLA's choice for e.g. [d] -> [m] on a 2x4 mesh).
    """
    return tuple(
        c for _, c in _plan(shape, itemsize, src, dst, mesh, forms_reduce_scatter, links) if c
    )


def reshard_time(
    shape: Sequence[int],
    itemsize: int,
    src: ShardSpec,
    dst: ShardSpec,
    mesh: MeshShape,
    links: Mapping[str, Link],
    *,
    forms_reduce_scatter: bool = True,
) -> float:
    """Seconds to reshard a value from `src` to `dst` (the cheapest sequence for `links`)."""
    comms = reshard(
        shape, itemsize, src, dst, mesh, forms_reduce_scatter=forms_reduce_scatter, links=links
    )
    return comms_time(comms, mesh, links)


@dataclasses.dataclass(frozen=True)
class _Op:
    """One step of a resharding plan: "rs" | "slice" | "ar" | "a2a" | "ag" | "permute". `frm` is
    the tensor dimension the axes leave (a2a, ag), `to` the one they join (rs, slice, a2a);
    `layout` is the axes of every dimension after a permute."""

    kind: str
    axes: tuple[str, ...] = ()
    frm: int = -1
    to: int = -1
    layout: tuple[tuple[str, ...], ...] | None = None


Plan = tuple[tuple[_Op, Collective | None], ...]


def _plan(shape, itemsize, src, dst, mesh, forms_reduce_scatter, links) -> Plan:
    """The chosen plan: each step with the collective it costs (None for local steps)."""
    shape = tuple(int(s) for s in shape)
    _validate(shape, src, dst, mesh)
    key_links = None if links is None else tuple(sorted(dict(links).items()))
    return _best_plan(shape, int(itemsize), src, dst, mesh, bool(forms_reduce_scatter), key_links)


def _validate(shape: tuple[int, ...], src: ShardSpec, dst: ShardSpec, mesh: MeshShape) -> None:
    if dst.partial:
        raise ValueError(
            f"reshard target {dst} holds partial sums over {dst.partial}: a value only becomes "
            "partial inside a node; reshard to a spec without partial axes"
        )
    for name, spec in (("source", src), ("target", dst)):
        check_axes(spec.used_axes(), mesh)
        if not spec.valid_for(shape, mesh):
            raise ValueError(
                f"reshard {name} spec {spec} does not fit shape {shape} on mesh "
                f"{dict(zip(mesh.names, mesh.sizes))}: each axis once, ndim equal, and every split "
                "dimension divisible by the product of its axes"
            )


@functools.lru_cache(maxsize=1 << 16)
def _best_plan(shape, itemsize, src, dst, mesh, forms_rs, links) -> Plan:
    # the ILP asks for the same (shape, src, dst) many times over repeated layers: cached
    useful = set(mesh.useful_axes())
    src = ShardSpec(
        tuple(tuple(a for a in d if a in useful) for d in src.dims),
        tuple(a for a in src.partial if a in useful),
    )
    dst = ShardSpec(tuple(tuple(a for a in d if a in useful) for d in dst.dims))
    if src == dst:
        return ()
    # The candidates depend on the shape only through which splits divide it, i.e. through
    # gcd(dim, devices) per dimension, and their bytes scale with the value's: enumerated once
    # per such class (a model's many shapes share a few), scaled here.
    unit = tuple(math.gcd(s, mesh.num_devices) for s in shape)
    scale, per = itemsize * math.prod(shape), math.prod(unit)
    best, best_key = None, None
    for index, unit_plan in enumerate(_unit_candidates(unit, src, dst, mesh, forms_rs)):
        plan = tuple((op, c and dataclasses.replace(c, nbytes=c.nbytes * scale // per))
                     for op, c in unit_plan)
        comms = [c for _, c in plan if c]
        key = (comms_bytes(comms, mesh), len(comms), index)
        if links is not None:
            key = (_comms_time(comms, mesh, links),) + key
        if best_key is None or key < best_key:
            best, best_key = plan, key
    return best


def _comms_time(comms: Sequence[Collective], mesh: MeshShape, links: tuple) -> float:
    """ring.comms_time with each (kind, axes)'s link terms looked up once (`links` sorted
    (axis, Link) pairs): the same arithmetic, so the same seconds to the last bit."""
    total = []
    for c in comms:
        steps_latency, fraction, bandwidth = _ring_terms(c.kind, c.axes, mesh, links)
        total.append(0.0 if bandwidth is None or c.nbytes <= 0
                     else steps_latency + fraction * c.nbytes / bandwidth)
    return math.fsum(total)


@functools.lru_cache(maxsize=1 << 12)
def _ring_terms(kind: str, axes, mesh: MeshShape, links: tuple):
    """(latency steps x latency, fraction of the buffer sent, bandwidth) of one collective
    over `axes`, as ring.collective_time prices it; bandwidth None where it is free."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    link = slowest_link(axes, mesh, dict(links))
    n = mesh.size(axes) if axes else 1
    if link is None or n <= 1:
        return 0.0, 0.0, None
    return latency_steps(kind, n) * link.latency, bytes_sent(kind, 1.0, n), link.bandwidth


@functools.lru_cache(maxsize=1 << 14)
def _unit_candidates(unit, src, dst, mesh, forms_rs) -> tuple[Plan, ...]:
    return tuple(_candidates(unit, 1, src, dst, mesh, forms_rs))


def _candidates(shape, itemsize, src, dst, mesh, forms_rs):
    seen = set()
    for ops in itertools.chain(
        _op_sequences(src, dst, mesh, forms_rs), [_fallback(src, dst, mesh)]
    ):
        if ops not in seen:
            seen.add(ops)
            plan = _simulate(ops, shape, itemsize, src, dst, mesh)
            if plan is not None:
                yield plan
    refine = _refine(shape, itemsize, src, dst, mesh)
    if refine is not None:
        yield refine


def _op_sequences(src: ShardSpec, dst: ShardSpec, mesh: MeshShape, forms_rs: bool):
    """The recipe's steps in every order worth comparing (phases, grouping, which axis first)."""
    rank = {a: i for i, a in enumerate(mesh.names)}  # mesh order: major (often slower) first
    src_dim = {a: i for i, d in enumerate(src.dims) for a in d}
    dst_pos = {a: (i, p) for i, d in enumerate(dst.dims) for p, a in enumerate(d)}
    scattered = [p for p in src.partial if forms_rs and p in dst_pos]
    reduced = tuple(sorted((p for p in src.partial if p not in scattered), key=rank.get))
    late = [p for p in reduced if p in dst_pos]  # sliced after their all-reduce
    new = [a for a in dst_pos if a not in src_dim and a not in src.partial]
    moves = [a for a in src_dim if a in dst_pos and dst_pos[a][0] != src_dim[a]]
    gathers = [a for a in src_dim if a not in dst_pos]

    def slices(axes):
        return [_Op("slice", (a,), to=dst_pos[a][0]) for a in sorted(axes, key=dst_pos.get)]

    # The axes scattered onto one dimension are reduce-scattered by one collective over all
    # of them, as XLA does and as they are gathered
    # (tests/test_cost_collectives.py::test_partial_sums_over_two_axes_match_xla).
    rs_orders = []
    for key in (dst_pos.get, lambda a: -rank[a]):
        groups = {}
        for p in sorted(scattered, key=key):
            groups.setdefault(dst_pos[p][0], []).append(p)
        rs_orders.append([_Op("rs", tuple(sorted(g, key=dst_pos.get)), to=d)
                          for d, g in groups.items()])
    ar = [_Op("ar", reduced)] if reduced else []
    move_orders = []
    for per_axis, key in itertools.product(
        (False, True), (dst_pos.get, lambda a: (src_dim[a], -src.dims[src_dim[a]].index(a)))
    ):
        groups: dict = {}
        for a in sorted(moves, key=key):
            groups.setdefault(a if per_axis else (src_dim[a], dst_pos[a][0]), []).append(a)
        move_orders.append(
            [_Op("a2a", tuple(g), frm=src_dim[g[0]], to=dst_pos[g[0]][0]) for g in groups.values()]
        )
    # The axes a dimension drops are gathered by one all-gather over all of them, as XLA
    # does, at the slowest of their links, not as a permute and an all-gather per axis
    # (tests/test_cost_collectives.py::test_a_dimension_split_on_two_axes_is_gathered_by_one_all_gather).
    gather_orders = []
    for sign in (1, -1):
        groups = {}
        for a in sorted(gathers, key=lambda a: sign * rank[a]):
            groups.setdefault(src_dim[a], []).append(a)
        gather_orders.append([_Op("ag", tuple(g), frm=src_dim[g[0]]) for g in groups.values()])

    # S slices, R reduce-scatters, A all-reduce, P slices of all-reduced axes, Q = S + P after
    # A, M all-to-alls, G all-gathers
    phase_orders = ("SRAPMG", "RSAPMG", "RAQMG")
    if not src.partial:  # partial sums are reduced first (XLA reduces a dot's output first)
        phase_orders += ("MSRAPG", "MRSAPG", "MRAQG")
    variants = (_unique(rs_orders), _unique(move_orders), _unique(gather_orders))
    for order, rs, mv, ag in itertools.product(phase_orders, *variants):
        phases = {
            "S": slices(new),
            "R": rs,
            "A": ar,
            "P": slices(late),
            "Q": slices(new + late),
            "M": mv,
            "G": ag,
        }
        yield tuple(op for ph in order for op in phases[ph])


def _unique(options: list[list[_Op]]) -> list[list[_Op]]:
    out: list[list[_Op]] = []
    for o in options:
        if o not in out:
            out.append(o)
    return out


def _fallback(src: ShardSpec, dst: ShardSpec, mesh: MeshShape) -> tuple[_Op, ...]:
    """Reduce everything, gather everything, slice to dst: always valid, rarely cheapest."""
    ops = [_Op("ar", tuple(a for a in mesh.names if a in src.partial))] if src.partial else []
    ops += [_Op("ag", d, frm=i) for i, d in enumerate(src.dims) if d]
    ops += [_Op("slice", (a,), to=i) for i, d in enumerate(dst.dims) for a in d]
    return tuple(ops)


def _shard_bytes(shape, itemsize, dims, mesh) -> int:
    return itemsize * math.prod(s // mesh.size(d) if d else s for s, d in zip(shape, dims))


def _simulate(ops, shape, itemsize, src, dst, mesh, force_at=None) -> Plan | None:
    """Run `ops` on the per-dimension axis lists (major to minor), inserting a permute where
    devices would otherwise hold the wrong blocks; None if a split does not divide the shape.

    Every state between two steps is a plain spec (so XLA can be led through them): an
    all-gather or all-to-all takes the minor axes of its dimension and an all-to-all or slice
    appends its axes as the minor ones of the dimension they join."""
    cur = [list(d) for d in src.dims]
    nbytes = _shard_bytes(shape, itemsize, src.dims, mesh)
    out: list = []
    run: dict[int, int] = {}  # reduce-scatters in a row: dimension -> devices it was split over
    for k, op in enumerate(ops):
        if op.kind != "rs":
            run = {}
        if op.kind in ("a2a", "ag"):
            leaving = [a for a in cur[op.frm] if a in op.axes]
            if k == force_at or cur[op.frm][len(cur[op.frm]) - len(leaving) :] != leaving:
                _permute(cur, _ideal_layout(cur, ops[k:], dst), nbytes, mesh, out)
            op = dataclasses.replace(op, axes=tuple(a for a in cur[op.frm] if a in op.axes))
        elif k == force_at:
            _permute(cur, _ideal_layout(cur, ops[k:], dst), nbytes, mesh, out)
        size = mesh.size(op.axes)
        comm = None
        if op.kind == "rs":
            # Reduce-scatters onto different dimensions each reduce the buffer as the ones
            # onto the other dimensions left it: XLA all-reduces the whole partial sum over
            # each axis before slicing, so two reduce-scatters onto two dimensions send more
            # than one over both axes onto one
            # (tests/test_cost_collectives.py::test_partial_sums_over_two_axes_match_xla).
            base = nbytes * math.prod(n for d, n in run.items() if d != op.to)
            comm = Collective("reduce-scatter", op.axes, base)
            run[op.to] = run.get(op.to, 1) * size
            nbytes //= size
            cur[op.to] += op.axes
        elif op.kind == "slice":
            nbytes //= size
            cur[op.to] += op.axes
        elif op.kind == "ar":
            comm = Collective("all-reduce", op.axes, nbytes)
        elif op.kind == "a2a":
            comm = Collective("all-to-all", op.axes, nbytes)
            del cur[op.frm][len(cur[op.frm]) - len(op.axes) :]
            cur[op.to] += op.axes
        else:  # ag
            nbytes *= size
            del cur[op.frm][len(cur[op.frm]) - len(op.axes) :]
            comm = Collective("all-gather", op.axes, nbytes)
        out.append((op, comm))
        if any(s % mesh.size(d) for s, d in zip(shape, cur)):
            return None
    if [tuple(d) for d in cur] != list(dst.dims):
        if force_at is None:
            # blocks end on the wrong devices: permute before the trailing gathers, where the
            # buffer is smallest (gathers only drop minor axes, so they stay valid)
            t = len(ops)
            while t > 0 and ops[t - 1].kind == "ag":
                t -= 1
            return _simulate(ops, shape, itemsize, src, dst, mesh, force_at=t)
        _permute(cur, [list(d) for d in dst.dims], nbytes, mesh, out)  # only if t == len(ops)
    return tuple(out)


def _permute(cur, layout, nbytes, mesh, out) -> None:
    """Append the collective-permute that reorders the axes of `cur` into `layout`."""
    changed = [i for i in range(len(cur)) if cur[i] != layout[i]]
    if changed:
        axes = {a for i in changed for a in cur[i]}
        comm = Collective(PERMUTE, tuple(a for a in mesh.names if a in axes), nbytes)
        out.append((_Op("permute", layout=tuple(tuple(d) for d in layout)), comm))
        for i in changed:
            cur[i] = list(layout[i])


def _ideal_layout(cur, ops, dst) -> list[list[str]]:
    """The axis order in each dimension a permute should leave: the axes that stay, in dst's
    order, then the axes still to leave, the first to leave most minor."""
    leave = {}
    for r, op in enumerate(ops):
        if op.kind in ("a2a", "ag"):
            for p, a in enumerate(op.axes):
                leave.setdefault(a, (r, p))
    out = []
    for i, axes in enumerate(cur):
        order = dst.dims[i]
        stay = sorted(
            (a for a in axes if a not in leave),
            key=lambda a: order.index(a) if a in order else len(order),
        )
        go = sorted((a for a in axes if a in leave), key=lambda a: (-leave[a][0], leave[a][1]))
        out.append(stay + go)
    return out


def _refine(shape, itemsize, src, dst, mesh) -> Plan | None:
    """When every dst tile lies inside one src tile (each dimension's tile count a multiple of
    src's), a device slices what another needs and one permute delivers it. None when that
    does not apply or every device already holds its tile."""
    if src.partial:
        return None
    moved = False
    for s, d in zip(src.dims, dst.dims):
        if mesh.size(d) % mesh.size(s):
            return None
        moved |= d[: len(s)] != s
    if not moved:
        return None
    changed = {a for s, d in zip(src.dims, dst.dims) if d[: len(s)] != s for a in s + d}
    axes = tuple(a for a in mesh.names if a in changed)
    comm = Collective(PERMUTE, axes, _shard_bytes(shape, itemsize, dst.dims, mesh))
    return ((_Op("permute", layout=dst.dims), comm),)


def reshard_path(
    shape: Sequence[int],
    itemsize: int,
    src: ShardSpec,
    dst: ShardSpec,
    mesh: MeshShape,
    *,
    forms_reduce_scatter: bool = True,
    links: Mapping[str, Link] | None = None,
) -> tuple[ShardSpec, ...]:
    """The specs a value passes through on the plan `reshard` chose, ending with dst.

    Constraining the value to each in turn (with_sharding_constraint) makes XLA run the plan
    step by step; given only src and dst, XLA sometimes replicates and re-slices instead.
    States that still hold partial sums cannot be written as a spec and are skipped.
    """
    plan = _plan(shape, itemsize, src, dst, mesh, forms_reduce_scatter, links)
    cur = [list(d) for d in src.dims]
    partial = set(src.partial)
    out: list[ShardSpec] = []
    for op, _ in plan:
        if op.kind == "permute":
            cur = [list(d) for d in op.layout]
        elif op.kind in ("a2a", "ag"):
            del cur[op.frm][len(cur[op.frm]) - len(op.axes) :]
        if op.kind in ("rs", "slice", "a2a"):
            cur[op.to] += op.axes
        partial -= set(op.axes) if op.kind in ("rs", "ar") else set()
        spec = ShardSpec(tuple(tuple(d) for d in cur))
        if not partial and (not out or out[-1] != spec):
            out.append(spec)
    useful = set(mesh.useful_axes())
    if out and out[-1].dims == tuple(tuple(a for a in d if a in useful) for d in dst.dims):
        out.pop()
    return tuple(out) + (dst,)
