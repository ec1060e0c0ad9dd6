"""Cheap choices, node by node, for when a search ran out of time (ilp.solve's fallbacks) and as
an upper bound of the least memory (least_memory.least)."""

from __future__ import annotations

import numpy as np

from shardplan.intra.solve.types import Implication, SolverInput


def choices(inp: SolverInput) -> list[tuple[int, ...]]:
    """Cheap choices for when the search ran out of time: node by node, the cheapest given the
    nodes already chosen (edges to them included), with memory weighed not at all, some, and
    above all (then each node takes its smallest layout that costs least)."""
    offsets, base, rows, _ = inp.memory_matrices
    if rows.shape[0]:
        # the most a choice weighs in any row, or in the base (rows' bytes are never negative)
        base = np.maximum(base, rows.max(axis=0).toarray().ravel())
    mem = [base[offsets[n]:offsets[n + 1]] for n in range(inp.num_nodes)]
    adj: dict[int, list[tuple[int, np.ndarray]]] = {}
    for a, b, m in inp.edges:
        # oriented [this node's choice, the other's]
        adj.setdefault(b, []).append((a, np.asarray(m).T))
        adj.setdefault(a, []).append((b, np.asarray(m)))
    forced: dict[int, list[Implication]] = {}
    for r in inp.implications:
        forced.setdefault(max(r.a, r.b), []).append(r)
    biggest = max([float(np.max(m)) for m in mem] + [1.0])
    scale = max([float(np.max(np.where(np.isfinite(c), c, 0))) for c in inp.node_costs] + [1e-12])
    out = []
    for weight in (0.0, scale / biggest, 1e6 * scale / biggest):
        choice: list[int] = []
        for i, c in enumerate(inp.node_costs):
            score = np.asarray(c, dtype=float) + weight * mem[i]
            for j, m in adj.get(i, ()):
                if j < i:
                    score = score + m[:, choice[j]]
            for r in forced.get(i, ()):  # rows whose other member is chosen
                if r.a == i and not r.allowed[choice[r.b]]:
                    score = np.where(r.when, np.inf, score)
                elif r.b == i and r.when[choice[r.a]]:
                    score = np.where(r.allowed, score, np.inf)
            choice.append(int(np.argmin(np.where(np.isnan(score), np.inf, score))))
        out.append(tuple(choice))
    return out
