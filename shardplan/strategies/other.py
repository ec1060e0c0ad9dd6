"""Random number generation (replicated by design), ops XLA cannot partition, and
identities with several operands.

Control flow (while, scan, cond), shard_map and callbacks have no rule on purpose (families
"control" and "replicated" in shardplan/ir/primitives.py): they run replicated through the
registry's default and unknown_primitives() reports them."""

from __future__ import annotations

from shardplan import _compat
from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs


def identity_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Each output is its input. One strategy per split of the largest operand, applied to
    every operand it fits (others replicated); enumerating all combinations would explode."""
    ins = common.in_values(node, graph)
    if not ins or len(ins) != len(node.outputs):
        return []
    big = max(ins, key=lambda v: (v.nbytes, -v.id))
    found = []
    for spec in enumerate_specs(big.shape, mesh, common.MAX_SPLIT_DIMS):
        specs = [spec if v.ndim == spec.ndim and spec.valid_for(v.shape, mesh)
                 else ShardSpec.replicated(v.ndim) for v in ins]
        found.append(common.make(node, graph, mesh, specs, specs))
    return [s for s in found if s is not None]


def random_bits_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """With jax_threefry_partitionable (the default since jax 0.5), each device draws its own
    block of the bits, equal to that block of the unsharded draw: any split of the output,
    the key replicated, no communication. Without it, replicated only."""
    if not _compat.threefry_partitionable():
        return []
    ins = common.in_values(node, graph)
    out = common.out_values(node, graph)[0]
    keys = common.replicated_specs(ins)
    found = [common.make(node, graph, mesh, keys, [spec])
             for spec in enumerate_specs(out.shape, mesh, common.MAX_SPLIT_DIMS)]
    return [s for s in found if s is not None]


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py).
    Random keys and bits: every device draws the same ones, as splitting them would change
    the random stream. Unpartitioned ops (top_k): Shardy has no sharding rule for them, XLA
    gathers their operands whatever the plan says."""
    return {"random": common.replicated_rule,
            "unpartitioned": common.replicated_rule,
            "random_bits": random_bits_rule,
            "identity": identity_rule}
