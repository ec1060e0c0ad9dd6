"""The strategy rules of every primitive, keyed by name, and the lookup the planner uses."""

from __future__ import annotations

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
    for module in (dot, elementwise, reduce, shape_ops, conv, gather, other, control_flow):
        for name, rule in module.rules().items():
            if name in table:
                raise ValueError(f"primitive {name!r} has rules in two modules; keep one")
            table[name] = rule
    return dict(sorted(table.items()))


RULES: dict[str, Rule] = _build_rules()


def strategies_for(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """The ways to shard `node` on `mesh`: the replicated strategy first (it keeps every plan
    feasible), then what the primitive's rule offers, without duplicates, in a fixed order.
    A primitive without a rule gets the replicated strategy alone (see unknown_primitives)."""
    rule = RULES.get(node.primitive, replicated_rule)
    return common.dedupe([common.replicated(node, graph), *rule(node, graph, mesh)])


def unknown_primitives(graph: Graph) -> set[str]:
    """Primitives of the graph's nodes that have no rule and so run replicated: the planner
    warns about them once per plan (control flow and callbacks land here)."""
    return {n.primitive for n in graph.nodes if n.primitive not in RULES}
