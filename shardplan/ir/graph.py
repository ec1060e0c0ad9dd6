"""The graph a train step is lifted into: values, nodes and roles. No jax import here."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import numpy as np


class Role(str, enum.Enum):
    """What an input of the step is: state carried between steps, the batch, or anything else."""

    STATE = "state"
    BATCH = "batch"
    OTHER = "other"


@dataclasses.dataclass(frozen=True)
class Value:
    """A tensor in the graph. `const` holds the literal's value for literals, else None."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    const: Any = None
    is_literal: bool = False

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclasses.dataclass(frozen=True, eq=False)
class Node:
    """One equation. `params` are the equation's parameters with sub-jaxprs removed;
    `eqn` is the original equation (opaque here) that the emitter binds again."""

    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    flops: float
    subgraphs: tuple[Graph, ...] = ()
    eqn: Any = None
    name: str = ""
    # Times the node runs per step: the product of the trip counts of the loops around it.
    trips: float = 1.0
    # The innermost loop (index into Graph.loops) whose body holds the node, or whose entry
    # or exit it is (loop pseudo-nodes); None at the top level.
    loop: int | None = None


@dataclasses.dataclass(frozen=True)
class Body:
    """One sub-jaxpr of a loop, inlined in the graph: the value bound to each of its invars
    (an outer value for loop constants), the values of its outvars, and its nodes (nested
    loops' included) in program order."""

    invars: tuple[int, ...]
    outvars: tuple[int, ...]
    nodes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Loop:
    """A scan, while or cond whose bodies are inlined in the graph, planned once for all
    iterations. `enter` holds a pseudo-node per carry (loop_carry: the carry's layout in the
    loop) and, for a scan, per stacked input (loop_slice); `leave` one per result (loop_result
    for a final carry, loop_stack for a scan's stacked output, cond_merge for a cond)."""

    id: int
    kind: str                     # "scan" | "while" | "cond"
    eqn: Any
    parent: int | None
    trips: float                  # iterations per run of the enclosing level
    operands: tuple[int, ...]     # outer values, in the equation's operand order
    results: tuple[int, ...]      # outer values, in the equation's result order
    bodies: tuple[Body, ...]      # scan: (body,); while: (cond, body); cond: branches
    enter: tuple[int, ...]
    leave: tuple[int, ...]
    num_carry: int = 0

    def carry_values(self, graph: Graph) -> tuple[int, ...]:
        """The value of each carry inside the loop (the loop_carry pseudo-nodes' outputs)."""
        return tuple(graph.nodes[n].outputs[0] for n in self.enter[:self.num_carry])


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """A lifted jaxpr. Nodes are in topological (program) order; values are indexed by id.

    `input_roles[i]` is the role of flat input i; `output_ties[j]` is the flat input index that
    output j carries back (the new value of a state input), or None.
    """

    values: tuple[Value, ...]
    nodes: tuple[Node, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    input_roles: tuple[Role, ...]
    output_ties: tuple[int | None, ...]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    consts: tuple[int, ...] = ()
    loops: tuple[Loop, ...] = ()

    def value(self, vid: int) -> Value:
        return self.values[vid]

    @property
    def flops(self) -> float:
        return float(sum(n.flops * n.trips for n in self.nodes))

    def carry_edges(self) -> list[tuple[int, int, float]]:
        """(value a body produces for a carry, the carry's value in the loop, iterations): the
        value the next iteration starts from must be in the carry's layout."""
        edges = []
        for loop in self.loops:
            if loop.kind == "cond":
                continue
            body = loop.bodies[-1]
            for k, carry in enumerate(loop.carry_values(self)):
                src = body.outvars[k]
                if src != carry and not self.values[src].is_literal:
                    edges.append((src, carry, self.nodes[loop.enter[k]].trips))
        return edges

    def boundary_values(self) -> frozenset[int]:
        """The step's inputs, constants and outputs: what lives in device memory across the
        step (a fused op reads or writes memory only for these)."""
        cached = self.__dict__.get("_boundary")
        if cached is None:
            cached = frozenset((*self.inputs, *self.consts, *self.outputs))
            self.__dict__["_boundary"] = cached
        return cached

    def producers(self) -> dict[int, tuple[int, int]]:
        """Map value id -> (node id, output index) for every value a node produces."""
        out = {}
        for n in self.nodes:
            for k, v in enumerate(n.outputs):
                out[v] = (n.id, k)
        return out

    def upstream(self, seeds, heads: frozenset[str] = frozenset()) -> frozenset[int]:
        """The values from which a value of `seeds` or a node of `heads` (primitives) is
        reachable, through nodes and loop carries (a carry's source reaches the carry): a
        walk back from them, each value once; kept per (seeds, heads), as planning asks for
        the same ones several times."""
        memo = self.__dict__.setdefault("_upstream", {})
        key = (frozenset(seeds), frozenset(heads))
        if key in memo:
            return memo[key]
        makers = self.producers()
        sources: dict[int, list[int]] = {}
        for src, carry, _ in self.carry_edges():
            sources.setdefault(carry, []).append(src)
        found: set[int] = set()
        todo = list(seeds) + [v for n in self.nodes if n.primitive in heads for v in n.inputs]
        while todo:
            v = todo.pop()
            if v in found:
                continue
            found.add(v)
            if v in makers:
                todo.extend(self.nodes[makers[v][0]].inputs)
            todo.extend(sources.get(v, ()))
        memo[key] = frozenset(found)
        return memo[key]

    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """Map value id -> [(node id, input index)] in program order."""
        out: dict[int, list[tuple[int, int]]] = {}
        for n in self.nodes:
            for k, v in enumerate(n.inputs):
                out.setdefault(v, []).append((n.id, k))
        return out

    def last_use(self) -> dict[int, int]:
        """Map value id -> index of the last node that reads it (len(nodes) for outputs)."""
        last: dict[int, int] = {}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                last[v] = i
        for v in self.outputs:
            last[v] = len(self.nodes)
        return last

    def primitive_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.primitive] = counts.get(n.primitive, 0) + 1
        return dict(sorted(counts.items()))

    def state_bytes(self) -> int:
        return sum(
            self.values[v].nbytes
            for v, r in zip(self.inputs, self.input_roles)
            if r == Role.STATE
        )

    def summary(self) -> str:
        roles = {r: sum(1 for x in self.input_roles if x == r) for r in Role}
        top = sorted(self.primitive_counts().items(), key=lambda kv: -kv[1])[:8]
        return (
            f"Graph: {len(self.nodes)} nodes, {len(self.values)} values, "
            f"{self.flops / 1e9:.3f} GFLOP, state {self.state_bytes() / 2**20:.1f} MiB; "
            f"inputs {roles[Role.STATE]} state / {roles[Role.BATCH]} batch / "
            f"{roles[Role.OTHER]} other; ties {sum(t is not None for t in self.output_ties)}; "
            "top ops " + ", ".join(f"{k}x{v}" for k, v in top)
        )


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element for numpy dtypes and JAX extended dtypes (PRNG keys)."""
    size = getattr(dtype, "itemsize", None)
    if size:
        return int(size)
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 8
