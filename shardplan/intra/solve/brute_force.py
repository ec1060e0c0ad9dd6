"""The brute-force reference: every choice tried, for the ILP's tests on tiny problems."""

from __future__ import annotations

import itertools

from shardplan.intra.solve.types import (
    InfeasibleMemory,
    Solution,
    SolverInput,
    evaluate,
)


def brute_force(inp: SolverInput) -> Solution:
    """Try every choice: the reference the ILP is tested against on tiny problems."""
    best = None
    for choice in itertools.product(*(range(len(c)) for c in inp.node_costs)):
        obj, peak = evaluate(inp, choice)
        if inp.memory_budget is not None and peak > inp.memory_budget:
            continue
        if best is None or obj < best[0] - 1e-12:
            best = (obj, peak, choice)
    if best is None:
        raise InfeasibleMemory(inp.memory_budget, min_peak(inp))
    return Solution(tuple(best[2]), best[0], best[1], True, "brute-force")


def min_peak(inp: SolverInput) -> float:
    """The least peak of any choice."""
    return min(evaluate(inp, c)[1] for c in itertools.product(
        *(range(len(c)) for c in inp.node_costs)))
