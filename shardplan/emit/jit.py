"""Emit a plan as one jax.jit: in/out shardings, and with_sharding_constraint on the
planned intermediates, by interpreting the graph's equations again. The model's own sharding
constraints pass their value on: the plan's layout of it is emitted in their place (on the
plan's mesh, whatever mesh the model named: tests/test_model_constraints.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding

from shardplan import _compat
from shardplan.ir import constraints as constraints_mod
from shardplan.ir import interpret
from shardplan.ir.graph import Graph
from shardplan.strategies.spec import ShardSpec


class _Constraints:
    """Hooks of the interpreter that pin planned layouts with with_sharding_constraint.

    Operands of top-level nodes that move one value through the same layouts share one
    chain of constraints, as the plan prices one reshard per value and layout
    (intra/estimate.py): given a chain per reader, XLA runs the first step once but a final
    collective-permute once per reader
    (tests/test_emit_jit.py::test_readers_moving_a_value_through_the_same_layouts_share_one_reshard).
    Inside loop bodies, traced apart, every reader keeps its own chain."""

    def __init__(self, values, operands, top: frozenset[int] = frozenset()):
        self.values, self.operands, self.top = values, operands, top
        self.moved: dict[tuple, tuple] = {}  # (id(x), layouts so far) -> (x, moved x)

    def value(self, vid, x):
        sharding = self.values.get(vid)
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def operand(self, node_id, index, x):
        route = self.operands.get((node_id, index), ())
        if node_id not in self.top:
            for sharding in route:
                x = jax.lax.with_sharding_constraint(x, sharding)
            return x
        origin, y = x, x
        for k, sharding in enumerate(route):
            key = (id(origin), tuple(route[:k + 1]))
            hit = self.moved.get(key)
            if hit is not None and hit[0] is origin:
                y = hit[1]
                continue
            y = jax.lax.with_sharding_constraint(y, sharding)
            self.moved[key] = (origin, y)
        return y


def graph_fn(graph: Graph, mesh, constraints: Mapping[int, ShardSpec],
             operand_specs: Mapping[tuple[int, int], Sequence[ShardSpec]] | None = None):
    """A function of the flat inputs that runs the graph's equations (loops bound again with
    constrained bodies), constraining the values in `constraints` to their specs, and
    resharding operands through `operand_specs` (the layouts the plan moves a value through
    before a node reads it), so that XLA runs the collectives the plan priced rather than
    choosing its own. The model's sharding constraints are not bound (identity): a layout the
    plan did not choose would be a collective it did not price, and their mesh may not be the
    plan's."""
    shardings = {v: NamedSharding(mesh, s.to_partition_spec()) for v, s in constraints.items()}
    operand_shardings = {k: [NamedSharding(mesh, s.to_partition_spec()) for s in route]
                         for k, route in (operand_specs or {}).items()}
    top = frozenset(n.id for n in graph.nodes if n.loop is None)

    def run(*flat_args):
        return interpret.run(graph, flat_args, _Constraints(shardings, operand_shardings, top),
                             identity=constraints_mod.is_constraint)

    return run


def emit_jit(graph: Graph, mesh, in_tree, out_tree, input_specs, output_specs,
             constraints: Mapping[int, ShardSpec], operand_specs=None, donate_argnums=()):
    """The planned step: a jax.jit taking the step's original (pytree) arguments."""
    mesh = _compat.auto_mesh(mesh)
    run = graph_fn(graph, mesh, constraints, operand_specs)

    def step(*args):
        flat = jax.tree_util.tree_leaves(args)
        return jax.tree_util.tree_unflatten(out_tree, run(*flat))

    in_shardings = jax.tree_util.tree_unflatten(
        in_tree, [NamedSharding(mesh, s.to_partition_spec()) for s in input_specs])
    out_shardings = jax.tree_util.tree_unflatten(
        out_tree, [NamedSharding(mesh, s.to_partition_spec()) for s in output_specs])
    jitted = jax.jit(step, in_shardings=tuple(in_shardings), out_shardings=out_shardings,
                     donate_argnums=donate_argnums)
    return jitted, in_shardings, out_shardings
