"""A node's sharding strategy, the collectives it performs, and the signature of a rule (one
per primitive family; strategies/registry.py maps families to rules)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from shardplan.ir.graph import Graph, Node
from shardplan.strategies.spec import MeshShape, ShardSpec


@dataclasses.dataclass(frozen=True)
class Collective:
    """A collective a strategy performs inside the node.

    kind: "all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all".
    nbytes: bytes of the per-device buffer: the input of an all-reduce, reduce-scatter or
    all-to-all, the (gathered) output of an all-gather.
    narrow: the buffer is a 16-bit float (bf16, f16), nbytes counted at 16 bits: XLA:CPU sends
    it as f32 (cost.model.AlphaBetaCost.node_comms).
    """

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    narrow: bool = False


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run a node: the spec each input must arrive in, the spec of each output,
    the collectives the node itself performs, and the flops each device computes."""

    name: str
    in_specs: tuple[ShardSpec, ...]
    out_specs: tuple[ShardSpec, ...]
    flops: float
    comms: tuple[Collective, ...] = ()


Rule = Callable[[Node, Graph, MeshShape], list[Strategy]]
