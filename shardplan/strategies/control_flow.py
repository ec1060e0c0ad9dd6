"""Loops: the rules of the pseudo-nodes a lifted loop has at its entry and exit.

A loop's body is planned once, jointly with the rest of the step (its nodes are ordinary
nodes run `trips` times). What is particular to a loop is where values cross into and out of
it: a carry keeps one layout for every iteration (loop_carry; the value a body hands to the
next iteration is resharded into it, priced per iteration), a stacked input `xs[i]` is read
in the body's layout with the leading (layer) dimension unsplit (loop_slice), a stacked
output likewise (loop_stack), a final carry leaves in the carry's layout (loop_result), and a
cond's results have one layout whichever branch ran (cond_merge)."""

from __future__ import annotations

from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs

PSEUDO = primitives.PSEUDO


def _stacked(spec: ShardSpec) -> ShardSpec:
    """The spec of the stacked [L, ...] value whose slices have `spec`: L unsplit."""
    return ShardSpec(((),) + spec.dims)


def _each_spec(node: Node, graph: Graph, mesh: MeshShape, shape, specs_of) -> list[Strategy]:
    found = []
    for spec in enumerate_specs(shape, mesh, common.MAX_SPLIT_DIMS):
        ins, outs = specs_of(spec)
        found.append(common.make(node, graph, mesh, ins[:len(node.inputs)], outs))
    return [s for s in found if s is not None]


def same_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """loop_carry, loop_result, cond_merge: every input and the output in one layout."""
    out = graph.values[node.outputs[0]]
    n = len(node.inputs)
    return _each_spec(node, graph, mesh, out.shape, lambda s: ([s] * n, [s]))


def slice_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """loop_slice: xs[i] in the body's layout, xs with its leading dimension unsplit."""
    out = graph.values[node.outputs[0]]
    return _each_spec(node, graph, mesh, out.shape, lambda s: ([_stacked(s)], [s]))


def stack_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """loop_stack: ys[i] in the body's layout, ys with its leading dimension unsplit."""
    out = graph.values[node.outputs[0]]
    return _each_spec(node, graph, mesh, out.shape[1:], lambda s: ([s], [_stacked(s)]))


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {"loop_same": same_rule, "loop_slice": slice_rule, "loop_stack": stack_rule}
