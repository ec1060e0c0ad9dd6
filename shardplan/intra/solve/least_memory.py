"""The least memory any plan needs: CP-SAT minimising the peak over the memory rows, added
lazily as ilp.solve adds them; what InfeasibleMemory reports."""

from __future__ import annotations

from ortools.sat.python import cp_model

from shardplan import progress
from shardplan.intra.solve import cpsat, greedy, rows, types
from shardplan.intra.solve.types import SolverInput


def min_memory_bound(inp: SolverInput) -> tuple[float, bool]:
    """(the smallest peak memory any choice reaches, True) or, when the search for it ran out
    of time, (a lower bound of it, False). Rows are added lazily, as in solve."""
    value, exact, _ = least(inp)
    return value, exact


def least(inp: SolverInput) -> tuple[float, bool, float]:
    """min_memory_bound's (value, proven), and the least peak of a choice the search found
    (every row evaluated: a plan that needs this much exists)."""
    if not inp.memory_rows and not inp.memory_base:
        return 0.0, True, 0.0
    with progress.phase(inp.solver.progress, "least memory (CP-SAT)"):
        return _least_memory(inp)


def _least_memory(inp: SolverInput) -> tuple[float, bool, float]:
    lazy = len(inp.memory_rows) > rows.PER_ROUND
    active = rows.first(inp) if lazy else set(range(len(inp.memory_rows)))
    floor = rows.simple_bound(inp)
    # the greedy choices (the last weighs memory above all) bound the least from above even
    # when the solver finds nothing in its time
    found = min(types.evaluate(inp, c)[1] for c in greedy.choices(inp))
    # the rounds share one work budget: the time limit in CP-SAT's deterministic seconds (a
    # deterministic search has no wall-clock deadline to stop them; tests/test_targets.py::
    # test_a_plan_over_hbm_is_never_said_to_fit ran six rounds of a full limit each)
    work = [float(inp.solver.time_limit)]
    while True:
        value, exact, choice = _min_rows(rows.restrict(inp, active) if lazy else inp, work)
        if choice is None:
            return max(value, floor), False, found
        peak = types.evaluate(inp, choice)[1]
        found = min(found, peak)
        over = rows.top(inp, choice, value + 0.5, active) if lazy else []
        if not over:
            # Optimal over a subset of the rows and fitting them all: optimal.
            return (peak, True, peak) if exact else (max(value, floor), False, found)
        active |= set(over)
        if inp.remaining() <= 0 or work[0] <= 0:
            return max(value, floor), False, found


def _min_rows(inp: SolverInput, work: list[float]
              ) -> tuple[float, bool, tuple[int, ...] | None]:
    """(least peak over the rows of inp or a lower bound, proven, a choice reaching it),
    searched within work[0] deterministic seconds, which it spends (work[0] decreases)."""
    model, x = cpsat.build_model(inp, minimise_memory=True)
    solver = cpsat.solver_for(inp)
    solver.parameters.max_deterministic_time = max(0.01, min(
        solver.parameters.max_deterministic_time, work[0]))
    status = cpsat.solve(solver, model, inp, "least memory", minimise_memory=True)
    work[0] -= solver.response_proto.deterministic_time
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)
        if status == cp_model.OPTIMAL:
            return types.evaluate(inp, choice)[1], True, choice
        return float(solver.BestObjectiveBound()), False, choice
    return 0.0, False, None


def min_memory(inp: SolverInput) -> float:
    """The smallest peak memory (max over rows) that any choice reaches (nan if not proven
    within the time limit)."""
    value, exact = min_memory_bound(inp)
    return value if exact else float("nan")
