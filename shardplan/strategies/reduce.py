"""Reductions and cumulative ops: any split of the input; a sum over split dimensions leaves a
partial sum, other reductions all-reduce, cumulative ops and argmax/argmin keep their axis whole."""

from __future__ import annotations

from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Collective, Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs


def _reduced(node: Node) -> tuple[int, ...]:
    return tuple(node.params["axes"])


def _input_specs(node: Node, graph: Graph, mesh: MeshShape) -> list[ShardSpec]:
    return enumerate_specs(graph.value(node.inputs[0]).shape, mesh, common.MAX_SPLIT_DIMS)


def reduce_sum_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """A split reduced dimension leaves the output partial over its axes: no comms here, the
    consumer's edge pays the all-reduce or reduce-scatter. Partial inputs stay partial."""
    axes = _reduced(node)
    found = []
    for spec in _input_specs(node, graph, mesh):
        partial = common.mesh_order([a for d in axes for a in spec.dims[d]], mesh)
        out = common.drop_dims(spec, axes).with_partial(partial)
        found.append(common.make(node, graph, mesh, [spec], [out]))
    bases = [s for s in found if s is not None]
    return bases + common.partial_passthrough(node, graph, mesh, bases, (0,))


def all_reduce_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """A split reduced dimension costs an all-reduce (max, min, prod, and, or) of the output."""
    axes = _reduced(node)
    out_val = graph.value(node.outputs[0])
    found = []
    for spec in _input_specs(node, graph, mesh):
        over = common.mesh_order([a for d in axes for a in spec.dims[d]], mesh)
        out = common.drop_dims(spec, axes)
        comms = [Collective("all-reduce", over, common.shard_bytes(out_val, out, mesh),
                            narrow=out_val.dtype in common.NARROW_FLOATS)] if over else []
        found.append(common.make(node, graph, mesh, [spec], [out], comms=comms))
    return [s for s in found if s is not None]


def whole_axes_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """argmax/argmin, reduce_xor: the reduced dimensions stay whole (argmax over a split one
    would need an all-reduce of (value, index) pairs, which no single collective does)."""
    axes = _reduced(node)
    found = [common.make(node, graph, mesh, [spec], [common.drop_dims(spec, axes)])
             for spec in _input_specs(node, graph, mesh) if common.unsplit(spec, axes)]
    return [s for s in found if s is not None]


def combined_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """lax.reduce with its own combiner, over n operands and their n initial values: every
    operand split alike with the reduced dimensions whole (the combiner is no collective's
    monoid), the initial values replicated."""
    dims = tuple(node.params["dimensions"])
    ins, n = common.in_values(node, graph), len(node.outputs)
    if len(ins) != 2 * n:
        return []
    found = []
    for spec in _input_specs(node, graph, mesh):
        if common.unsplit(spec, dims):
            inits = [ShardSpec.replicated(v.ndim) for v in ins[n:]]
            found.append(common.make(node, graph, mesh, [spec] * n + inits,
                                     [common.drop_dims(spec, dims)] * n))
    return [s for s in found if s is not None]


def cumulative_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """cumsum and friends along an unsplit axis; linear ones (cumsum) pass partials."""
    axis = node.params["axis"]
    found = [common.make(node, graph, mesh, [spec], [spec])
             for spec in _input_specs(node, graph, mesh) if not spec.dims[axis]]
    bases = [s for s in found if s is not None]
    linear = primitives.info(node.primitive).linear
    return bases + common.partial_passthrough(node, graph, mesh, bases, linear)


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {
        "reduce_sum": reduce_sum_rule,
        "reduce": all_reduce_rule,
        "reduce_whole": whole_axes_rule,
        "reduce_combined": combined_rule,
        "cumulative": cumulative_rule,
    }
