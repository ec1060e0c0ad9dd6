"""The strategy rule of every primitive family, and the lookup the planner uses: a node's
family comes from the primitive table (shardplan/ir/primitives.py)."""

from __future__ import annotations

from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Node
from shardplan.strategies import (
    common,
    control_flow,
    conv,
    dot,
    elementwise,
    gather,
    other,
    reduce,
    shape_ops,
)
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape

replicated_rule = common.replicated_rule


def _build_rules() -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    for module in (dot, elementwise, reduce, shape_ops, conv, gather, other,
                   control_flow):
        for family, rule in module.rules().items():
            if family in table:
                raise ValueError(f"family {family!r} has rules in two modules; keep one")
            table[family] = rule
    return dict(sorted(table.items()))


RULES: dict[str, Rule] = _build_rules()
"""Family -> rule. Families without one ("replicated", "control", "call") run replicated."""


def rule_of(primitive: str) -> Rule | None:
    """The rule that shards `primitive`, None when it has none (unknown, control flow)."""
    return RULES.get(primitives.info(primitive).family)


def strategies_for(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """The ways to shard `node` on `mesh`: the replicated strategy first (it keeps every plan
    feasible), then what the primitive's rule offers, without duplicates, in a fixed order.
    A primitive without a rule gets the replicated strategy alone (see unknown_primitives)."""
    rule = rule_of(node.primitive) or replicated_rule
    return common.dedupe([common.replicated(node, graph), *rule(node, graph, mesh)])


def _value_key(value) -> tuple:
    if value.const is not None and not value.is_literal:
        return ("const", value.id)  # a captured array: not compared by value
    # A literal's value is not compared: no rule reads it (a dropout's fold-in of its layer's
    # seed is the same operator in every layer).
    return (value.shape, value.dtype, value.itemsize, value.is_literal)


def _node_key(node: Node, graph: Graph) -> tuple | None:
    """What a rule reads of a node: its primitive, parameters, flops and operand and result
    values (not their ids); None when the parameters cannot be compared."""
    try:
        params = tuple(sorted((k, repr(v)) for k, v in node.params.items()))
    except TypeError:
        return None
    return (node.primitive, params, float(node.flops),
            tuple(_value_key(graph.values[v]) for v in node.inputs),
            tuple(_value_key(graph.values[v]) for v in node.outputs))


def strategies_of_graph(graph: Graph, mesh: MeshShape) -> list[list[Strategy]]:
    """strategies_for every node of `graph`, in order. Nodes that read and write values of the
    same shapes with the same parameters (the same operator in every layer) share one list:
    a rule sees nothing else of a node, and strategies are immutable."""
    memo: dict[tuple, list[Strategy]] = {}
    out = []
    for node in graph.nodes:
        key = _node_key(node, graph)
        if key is None:
            out.append(strategies_for(node, graph, mesh))
            continue
        if key not in memo:
            memo[key] = strategies_for(node, graph, mesh)
        out.append(memo[key])
    return out


def unknown_primitives(graph: Graph) -> set[str]:
    """Primitives of the graph's nodes that have no rule and so run replicated: the planner
    warns about them once per plan (control flow and callbacks land here)."""
    return {n.primitive for n in graph.nodes if rule_of(n.primitive) is None}
