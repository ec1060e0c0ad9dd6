"""Emit a plan as one jax.jit: in/out shardings, and with_sharding_constraint on the
planned intermediates, by interpreting the graph's equations again."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
from jax.sharding import NamedSharding

from shardplan import _compat
from shardplan.ir import interpret
from shardplan.ir.graph import Graph
from shardplan.strategies.spec import ShardSpec


class _Constraints:
    """Hooks of the interpreter that pin planned layouts with with_sharding_constraint."""

    def __init__(self, values, operands):
        self.values, self.operands = values, operands

    def value(self, vid, x):
        sharding = self.values.get(vid)
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def operand(self, node_id, index, x):
        for sharding in self.operands.get((node_id, index), ()):
            x = jax.lax.with_sharding_constraint(x, sharding)
        return x


def graph_fn(graph: Graph, mesh, constraints: Mapping[int, ShardSpec],
             operand_specs: Mapping[tuple[int, int], Sequence[ShardSpec]] | None = None):
    """A function of the flat inputs that runs the graph's equations (loops bound again with
    constrained bodies), constraining the values in `constraints` to their specs, and
    resharding operands through `operand_specs` (the layouts the plan moves a value through
    before a node reads it), so that XLA runs the collectives the plan priced rather than
    choosing its own."""
    shardings = {v: NamedSharding(mesh, s.to_partition_spec()) for v, s in constraints.items()}
    operand_shardings = {k: [NamedSharding(mesh, s.to_partition_spec()) for s in route]
                         for k, route in (operand_specs or {}).items()}
    hooks = _Constraints(shardings, operand_shardings)

    def run(*flat_args):
        return interpret.run(graph, flat_args, hooks)

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
