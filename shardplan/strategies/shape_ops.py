"""Ops that move data: a split follows each dimension to where the op puts it, and dimensions
the op cuts, pads, reverses, sorts or concatenates stay whole."""

from __future__ import annotations

import math

from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs


def _input_specs(node: Node, graph: Graph, mesh: MeshShape) -> list[ShardSpec]:
    return enumerate_specs(graph.value(node.inputs[0]).shape, mesh, common.MAX_SPLIT_DIMS)


def _with_partials(node: Node, graph: Graph, mesh: MeshShape, found) -> list[Strategy]:
    """Movements linear in their operand also carry a partial sum through unchanged."""
    bases = [s for s in found if s is not None]
    linear = primitives.info(node.primitive).linear
    return bases + common.partial_passthrough(node, graph, mesh, bases, linear)


def transpose_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    perm = node.params["permutation"]
    found = [common.make(node, graph, mesh, [s], [common.with_dims(s, [s.dims[p] for p in perm])])
             for s in _input_specs(node, graph, mesh)]
    return _with_partials(node, graph, mesh, found)


def squeeze_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Squeezed dimensions have size 1, so are never split."""
    dims = tuple(d % graph.value(node.inputs[0]).ndim for d in node.params["dimensions"])
    found = [common.make(node, graph, mesh, [s], [common.drop_dims(s, dims)])
             for s in _input_specs(node, graph, mesh)]
    return _with_partials(node, graph, mesh, found)


def broadcast_in_dim_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Any split of the output: an operand dimension follows the output dimension it maps to
    (unless it is broadcast from size 1), and new dimensions each device builds locally."""
    if len(node.inputs) != 1:  # dynamic shape operands
        return []
    operand, out = graph.value(node.inputs[0]), graph.value(node.outputs[0])
    bdims = node.params["broadcast_dimensions"]
    found = []
    for spec in enumerate_specs(out.shape, mesh, common.MAX_SPLIT_DIMS):
        dims = [spec.dims[o] if operand.shape[i] == out.shape[o] else ()
                for i, o in enumerate(bdims)]
        found.append(common.make(node, graph, mesh, [ShardSpec(tuple(dims))], [spec],
                                 split=spec.num_shards(mesh)))
    return _with_partials(node, graph, mesh, found)


def reshape_map(in_shape, out_shape) -> dict[int, int]:
    """Input dimension -> the output dimension a split of it survives as.

    A split of input dimension i into blocks is a split of output dimension o iff the
    elements before both are equally many (equal prefix products): both then cut every
    prefix row into the same contiguous blocks. That is the major-most non-1 dimension of
    a group of merged or split dimensions; the divisibility of o is checked by the caller.
    """
    out_at = {}
    for o, size in enumerate(out_shape):
        if size > 1:
            out_at[math.prod(out_shape[:o])] = o
    return {i: out_at[p] for i in range(len(in_shape))
            if in_shape[i] > 1 and (p := math.prod(in_shape[:i])) in out_at}


def reshape_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Splits that survive the reshape (see reshape_map); others are refused. A reshape with
    `dimensions` transposes its operand by them first (the kernel of a depthwise
    convolution's input gradient: tests/test_strategies_conv.py)."""
    if len(node.inputs) != 1:
        return []
    in_shape = graph.value(node.inputs[0]).shape
    out_shape = graph.value(node.outputs[0]).shape
    perm = node.params.get("dimensions") or range(len(in_shape))
    perm = tuple(perm)
    moved = reshape_map([in_shape[d] for d in perm], out_shape)
    where = {perm[j]: o for j, o in moved.items()}
    found = []
    for spec in _input_specs(node, graph, mesh):
        dims = [()] * len(out_shape)
        for i, axes in enumerate(spec.dims):
            if axes:
                if i not in where:
                    break
                dims[where[i]] = axes
        else:
            found.append(common.make(node, graph, mesh, [spec], [ShardSpec(tuple(dims))]))
    return _with_partials(node, graph, mesh, found)


def _whole(dims_of) -> Rule:
    """A rule that keeps the dimensions dims_of(node, graph) whole and shares one spec."""
    def rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
        return common.same_spec(node, graph, mesh, tuple(dims_of(node, graph)))
    rule.__doc__ = dims_of.__doc__
    return rule


def _shape(node: Node, graph: Graph, k: int = 0) -> tuple[int, ...]:
    return graph.value(node.inputs[k]).shape


def _sliced(node: Node, graph: Graph):
    """slice: the dimensions it cuts or strides stay whole."""
    p, shape = node.params, _shape(node, graph)
    strides = p.get("strides") or (1,) * len(shape)
    return [d for d, size in enumerate(shape)
            if p["start_indices"][d] != 0 or p["limit_indices"][d] != size or strides[d] != 1]


def _dynamic_sliced(node: Node, graph: Graph):
    """dynamic_slice: the dimensions it cuts stay whole; the start indices are replicated."""
    return [d for d, (n, size) in enumerate(zip(node.params["slice_sizes"], _shape(node, graph)))
            if n != size]


def _updated(node: Node, graph: Graph):
    """dynamic_update_slice: dimensions the update does not cover stay whole."""
    return [d for d, (a, b) in enumerate(zip(_shape(node, graph), _shape(node, graph, 1)))
            if a != b]


def _padded(node: Node, graph: Graph):
    """pad: padded dimensions stay whole (a split one would need halo exchange)."""
    return [d for d, cfg in enumerate(node.params["padding_config"]) if tuple(cfg) != (0, 0, 0)]


def _reversed(node: Node, graph: Graph):
    """rev: reversed dimensions stay whole (a split one would need a permutation)."""
    return node.params["dimensions"]


def _along_dimension(node: Node, graph: Graph):
    """concatenate, sort: the dimension they work along stays whole."""
    return [node.params["dimension"]]


def _along_axis(node: Node, graph: Graph):
    """split: the axis it works along stays whole."""
    ndim = len(_shape(node, graph))
    axis = node.params.get("axis")
    return [ndim - 1 if axis is None else axis % ndim]


def _tiled(node: Node, graph: Graph):
    """tile: the dimensions it repeats stay whole."""
    return [d for d, r in enumerate(node.params["reps"]) if r != 1]


def stack_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Every operand split alike; the new dimension whole, the others as the operands'."""
    axis = node.params["axis"] % (graph.value(node.inputs[0]).ndim + 1)
    found = []
    for s in _input_specs(node, graph, mesh):
        out = common.with_dims(s, [*s.dims[:axis], (), *s.dims[axis:]])
        found.append(common.make(node, graph, mesh, [s] * len(node.inputs), [out]))
    return [s for s in found if s is not None]


def unstack_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """The dimension it unstacks whole; each result split as the operand's other dimensions."""
    axis = node.params["axis"] % graph.value(node.inputs[0]).ndim
    found = [common.make(node, graph, mesh, [s], [common.drop_dims(s, [axis])] * len(node.outputs))
             for s in _input_specs(node, graph, mesh) if common.unsplit(s, [axis])]
    return [s for s in found if s is not None]


def iota_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Any split: each device builds its own piece of the iota."""
    out = graph.value(node.outputs[0])
    found = [common.make(node, graph, mesh, [ShardSpec(())] * len(node.inputs), [spec])
             for spec in enumerate_specs(out.shape, mesh, common.MAX_SPLIT_DIMS)]
    return [s for s in found if s is not None]


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {
        "transpose": transpose_rule,
        "squeeze": squeeze_rule,
        "broadcast": broadcast_in_dim_rule,
        "reshape": reshape_rule,
        "slice": _whole(_sliced),
        "dynamic_slice": _whole(_dynamic_sliced),
        "dynamic_update_slice": _whole(_updated),
        "pad": _whole(_padded),
        "rev": _whole(_reversed),
        "along_dimension": _whole(_along_dimension),
        "split": _whole(_along_axis),
        "iota": iota_rule,
        "stack": stack_rule,
        "unstack": unstack_rule,
        "tile": _whole(_tiled),
    }
