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


def unknown_primitives(graph: Graph) -> set[str]:
    """Primitives of the graph's nodes that have no rule and so run replicated: the planner
    warns about them once per plan (control flow and callbacks land here)."""
    return {n.primitive for n in graph.nodes if rule_of(n.primitive) is None}
