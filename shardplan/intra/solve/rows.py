"""Memory rows added lazily: a search starts from the rows where the step's memory piles up and
adds the rows its solution overflows (ilp.solve, least_memory.least)."""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.intra.solve.types import SolverInput

PER_ROUND = 8


def restrict(inp: SolverInput, active) -> SolverInput:
    """The same problem with only the memory rows in `active` (and the copies they name)."""
    active = sorted(active)
    named = [np.asarray(inp.row_copies[r], dtype=np.int64) for r in active] if (
        inp.row_copies) else []
    used = np.unique(np.concatenate(named)) if named else np.zeros(0, np.int64)
    return dataclasses.replace(
        inp, memory_rows=tuple(inp.memory_rows[r] for r in active),
        row_copies=tuple(np.searchsorted(used, js) for js in named),
        copies=tuple(inp.copies[j] for j in used))


def top(inp: SolverInput, choice, above: float = -1.0, skip=()) -> list[int]:
    peaks = np.asarray(inp.row_peaks(choice)[:len(inp.memory_rows)])
    order = [int(r) for r in np.argsort(-peaks, kind="stable")
             if peaks[r] > above and int(r) not in skip]
    return order[:PER_ROUND]


def first(inp: SolverInput) -> set[int]:
    """The rows that peak under all-first choices (replicated) and under each node's
    smallest: where the step's memory piles up, whatever the plan."""
    first = set(top(inp, inp.hint or tuple(0 for _ in inp.node_costs)))
    last = {n: mem for n, mem in inp.memory_base + tuple(t for row in inp.memory_rows
                                                         for t in row)}
    smallest = [int(np.argmin(last[n])) if n in last else 0 for n in range(inp.num_nodes)]
    return first | set(top(inp, tuple(smallest)))


def simple_bound(inp: SolverInput) -> float:
    """A lower bound of any choice's peak: each row with every node at its smallest."""
    base = sum(float(np.min(mem)) for _, mem in inp.memory_base)
    rows = [sum(float(np.min(mem)) for _, mem in row) for row in inp.memory_rows]
    return base + max(rows, default=0.0)
