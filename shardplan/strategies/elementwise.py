"""Elementwise ops: operands and outputs share one split; linear ones pass partial sums through."""

from __future__ import annotations

from collections.abc import Sequence

from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Node, Value
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs


def operand_spec(value: Value, shape: Sequence[int], spec: ShardSpec) -> ShardSpec | None:
    """The spec of an operand of an elementwise op whose output has `shape` and `spec`:
    scalars and size-1 (implicitly broadcast) dimensions replicated, None if not elementwise."""
    if value.ndim == 0:
        return ShardSpec(())
    if value.ndim != len(shape):
        return None
    dims = []
    for size, out_size, d in zip(value.shape, shape, spec.dims):
        if size == out_size:
            dims.append(d)
        elif size == 1:
            dims.append(())
        else:
            return None
    return ShardSpec(tuple(dims))


def shared_spec_strategies(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """One strategy per split of the first output, every operand and output following it."""
    ins, outs = common.in_values(node, graph), common.out_values(node, graph)
    if not outs:
        return []
    shape = outs[0].shape
    found = []
    for spec in enumerate_specs(shape, mesh, common.MAX_SPLIT_DIMS):
        specs = [operand_spec(v, shape, spec) for v in (*ins, *outs)]
        if any(s is None for s in specs):
            continue
        found.append(common.make(node, graph, mesh, specs[:len(ins)], specs[len(ins):]))
    return [s for s in found if s is not None]


def linear_carriers(node: Node, graph: Graph) -> list[tuple[int, ...]]:
    """The sets of inputs that may carry a partial sum into this elementwise node: each
    operand the primitive is linear in, alone (add and sub are left out: XLA's SPMD
    partitioner reduces each operand before the add, so offering it would price one
    all-reduce of `a @ b + c @ d` with the contraction split where the program runs two),
    nor a convert that widens (XLA reduces a bf16 dot's partial sum in bf16, where the dot
    makes it, not in the f32 the convert makes of it;
    tests/test_strategies_elementwise.py::test_partial_sums_pass_only_through_linear_ops)."""
    if node.primitive == "convert_element_type" and _widens(node, graph):
        return []
    return [(k,) for k in primitives.info(node.primitive).linear if k < len(node.inputs)]


def _widens(node: Node, graph: Graph) -> bool:
    """A convert to a wider dtype (a bf16 weight gradient to its f32 parameter's dtype)."""
    return graph.values[node.outputs[0]].itemsize > graph.values[node.inputs[0]].itemsize


def elementwise_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Shared splits, then the partial-passthrough variants of linear ops."""
    bases = shared_spec_strategies(node, graph, mesh)
    found = list(bases)
    for carriers in linear_carriers(node, graph):
        found += common.partial_passthrough(node, graph, mesh, bases, carriers)
    return found


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {"elementwise": elementwise_rule}
