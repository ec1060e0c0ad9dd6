"""Coverage: which operators of a step run replicated because no rule knows how to split
them, how many, and what share of the step's flops they hold."""

from __future__ import annotations

import dataclasses

from shardplan.ir import primitives
from shardplan.ir.graph import Graph
from shardplan.strategies import registry


def intended(primitive: str) -> bool:
    """Whether running `primitive` replicated is by design: the primitive table lists it (a
    loop kept whole, a callback, a kernel: its `why`), rather than not knowing it or failing
    to inline a call."""
    info = primitives.PRIMITIVES.get(primitive)
    return info is not None and info.family != "call"


@dataclasses.dataclass(frozen=True)
class Coverage:
    """`replicated` rows: (primitive, nodes, flops per step) for primitives without a rule."""

    num_nodes: int
    flops: float
    replicated: tuple[tuple[str, int, float], ...]

    @property
    def unintended(self) -> tuple[str, ...]:
        """Replicated primitives that are not so by design: the primitive table does not
        know them (they need an entry in shardplan/ir/primitives.py)."""
        return tuple(p for p, _, _ in self.replicated if not intended(p))

    @property
    def replicated_share(self) -> float:
        """Share of the step's flops in operators that run whole on every device."""
        return sum(f for _, _, f in self.replicated) / self.flops if self.flops else 0.0

    def __str__(self) -> str:
        if not self.replicated:
            return f"coverage: every one of {self.num_nodes} operators has a sharding rule"
        rows = ", ".join(f"{p} x{n} ({f / self.flops:.1%} of flops)" if self.flops else f"{p} x{n}"
                         for p, n, f in self.replicated)
        unknown = (f"; not in the primitive table: {', '.join(sorted(self.unintended))}"
                   if self.unintended else "")
        return (f"coverage: {sum(n for _, n, _ in self.replicated)} of {self.num_nodes} "
                f"operators run replicated for lack of a sharding rule "
                f"({self.replicated_share:.1%} of flops): {rows}{unknown}")


def coverage(graph: Graph) -> Coverage:
    unknown = registry.unknown_primitives(graph)
    counts: dict[str, list] = {}
    for node in graph.nodes:
        if node.primitive in unknown:
            row = counts.setdefault(node.primitive, [0, 0.0])
            row[0] += 1
            row[1] += node.flops * node.trips
    rows = sorted(((p, n, f) for p, (n, f) in counts.items()), key=lambda r: (-r[2], -r[1], r[0]))
    return Coverage(len(graph.nodes), graph.flops, tuple(rows))
