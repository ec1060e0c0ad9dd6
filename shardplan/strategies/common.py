"""Helpers every strategy rule shares: the replicated fallback, building a checked Strategy,
and enumerating how mesh axes are assigned to roles or hold partial sums."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from shardplan.ir.graph import Graph, Node, Value
from shardplan.strategies.base import Collective, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs

# Elementwise and partial-passthrough rules limit splits to this many dimensions, to keep
# the strategy count of high-rank values modest on meshes with more than two axes.
MAX_SPLIT_DIMS = 2


def in_values(node: Node, graph: Graph) -> list[Value]:
    return [graph.value(v) for v in node.inputs]


def out_values(node: Node, graph: Graph) -> list[Value]:
    return [graph.value(v) for v in node.outputs]


def replicated_specs(values: Sequence[Value]) -> tuple[ShardSpec, ...]:
    return tuple(ShardSpec.replicated(v.ndim) for v in values)


def replicated(node: Node, graph: Graph) -> Strategy:
    """Every input and output replicated: each device runs the whole node. Always feasible."""
    return Strategy("replicated", replicated_specs(in_values(node, graph)),
                    replicated_specs(out_values(node, graph)), float(node.flops))


def replicated_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """The rule of primitives that must run whole on every device (random bits, callbacks)."""
    return [replicated(node, graph)]


def make(
    node: Node,
    graph: Graph,
    mesh: MeshShape,
    in_specs: Sequence[ShardSpec],
    out_specs: Sequence[ShardSpec],
    *,
    name: str | None = None,
    split: int | None = None,
    comms: Sequence[Collective] = (),
) -> Strategy | None:
    """A Strategy, or None if some spec does not fit its value (indivisible, axis reused).

    `split` is how many devices share the node's work; by default the largest number of
    shards among the specs (right for ops whose work follows their biggest operand).
    """
    ins, outs = in_values(node, graph), out_values(node, graph)
    if len(in_specs) != len(ins) or len(out_specs) != len(outs):
        raise ValueError(
            f"{node.primitive}: a rule gave {len(in_specs)} input and {len(out_specs)} output "
            f"specs for {len(ins)} inputs and {len(outs)} outputs")
    for spec, val in zip((*in_specs, *out_specs), (*ins, *outs)):
        if not spec.valid_for(val.shape, mesh):
            return None
    if split is None:
        split = max((s.num_shards(mesh) for s in (*in_specs, *out_specs)), default=1)
    if name is None:
        name = " ".join(str(s) for s in in_specs) + " -> " + " ".join(str(s) for s in out_specs)
    return Strategy(name, tuple(in_specs), tuple(out_specs), float(node.flops) / split,
                    tuple(comms))


def mesh_order(axes, mesh: MeshShape) -> tuple[str, ...]:
    """Axes sorted as in the mesh: the canonical order of a dimension's axes and of partials."""
    return tuple(sorted(set(axes), key=mesh.names.index))


def assignments(mesh: MeshShape, n_roles: int) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every way to give each useful mesh axis one of `n_roles` roles or none: yields, per
    role, the axes it got (in mesh order). Starts with the all-none assignment."""
    axes = mesh.useful_axes()
    for choice in itertools.product(range(-1, n_roles), repeat=len(axes)):
        yield tuple(tuple(a for a, c in zip(axes, choice) if c == r) for r in range(n_roles))


def partial_subsets(mesh: MeshShape, used: Sequence[str]) -> list[tuple[str, ...]]:
    """The non-empty sets of useful axes, not in `used`, that a value can be a partial sum over."""
    free = [a for a in mesh.useful_axes() if a not in used]
    return [c for r in range(1, len(free) + 1) for c in itertools.combinations(free, r)]


def with_dims(spec: ShardSpec, dims: Sequence[tuple[str, ...]]) -> ShardSpec:
    return ShardSpec(tuple(dims), spec.partial)


def drop_dims(spec: ShardSpec, dropped: Sequence[int]) -> ShardSpec:
    return ShardSpec(tuple(d for i, d in enumerate(spec.dims) if i not in dropped), spec.partial)


def unsplit(spec: ShardSpec, dims: Sequence[int]) -> bool:
    """True when none of `dims` is split."""
    return all(not spec.dims[d] for d in dims)


NARROW_FLOATS = frozenset({"bfloat16", "float16"})


def shard_bytes(value: Value, spec: ShardSpec, mesh: MeshShape) -> int:
    return math.prod(spec.shard_shape(value.shape, mesh)) * value.itemsize


def is_float(value: Value) -> bool:
    """Floating or complex: the dtypes where a partial sum means something."""
    return "float" in value.dtype or "complex" in value.dtype


def partial_passthrough(
    node: Node, graph: Graph, mesh: MeshShape, bases: Sequence[Strategy], carriers: Sequence[int]
) -> list[Strategy]:
    """For each base strategy without partial inputs, the same strategy with the inputs
    `carriers` partial over each set of axes the base leaves unused, and every output partial
    over those too. Only for float values, never for literals (a constant is no partial sum)."""
    ins, outs = in_values(node, graph), out_values(node, graph)
    if not carriers or any(ins[k].is_literal or not is_float(ins[k]) for k in carriers):
        return []
    if not all(is_float(o) for o in outs):
        return []
    found = []
    for base in bases:
        if any(s.partial for s in base.in_specs):
            continue
        used = {a for s in (*base.in_specs, *base.out_specs) for a in s.used_axes()}
        for axes in partial_subsets(mesh, sorted(used)):
            in_specs = [s.with_partial(axes) if k in carriers else s
                        for k, s in enumerate(base.in_specs)]
            out_specs = [s.with_partial(mesh_order(s.partial + axes, mesh))
                         for s in base.out_specs]
            found.append(make(node, graph, mesh, in_specs, out_specs))
    return [s for s in found if s is not None]


def same_spec(
    node: Node, graph: Graph, mesh: MeshShape, whole: Sequence[int], *, max_split_dims=None
) -> list[Strategy]:
    """Every split of the first input that leaves the dimensions `whole` unsplit, shared by
    all inputs and outputs of the same rank (their sizes may differ only on `whole`);
    scalars replicated. The rule of slices, pads, concatenation, sorts and windows."""
    ins, outs = in_values(node, graph), out_values(node, graph)
    if not ins:
        return []
    ndim = ins[0].ndim
    if any(v.ndim not in (0, ndim) for v in (*ins, *outs)):
        return []
    found = []
    for spec in enumerate_specs(ins[0].shape, mesh, max_split_dims or MAX_SPLIT_DIMS):
        if not unsplit(spec, whole):
            continue
        specs = [spec if v.ndim == ndim else ShardSpec(()) for v in (*ins, *outs)]
        found.append(make(node, graph, mesh, specs[:len(ins)], specs[len(ins):]))
    return [s for s in found if s is not None]


def dedupe(strategies: Sequence[Strategy | None]) -> list[Strategy]:
    """Drop Nones and strategies equal to an earlier one up to the name, keeping order."""
    seen, out = set(), []
    for s in strategies:
        if s is None:
            continue
        key = (s.in_specs, s.out_specs, s.comms)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out
