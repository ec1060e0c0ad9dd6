"""The intra-operator ILP: one strategy per node, minimising node and edge costs under a
per-device memory budget (as in Alpa, section 4.2), reduced exactly (presolve.py), then solved
as a MIP with HiGHS (mip.py; CP-SAT where HiGHS is missing) and, for the least memory,
with CP-SAT (cpsat.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
from ortools.sat.python import cp_model

from shardplan import progress
from shardplan.intra.solve import (
    cpsat,
    greedy,
    least_memory,
    message_passing,
    mip,
    presolve,
    rows,
    types,
)
from shardplan.intra.solve.types import (
    InfeasibleMemory,
    SearchTimeout,
    Solution,
    SolverInput,
)
from shardplan.units import Deadline

# Under a memory budget and a deadline, where no fallback (the hint, the greedy choices) fits:
# HiGHS's share of the time; the rest is kept for CP-SAT to find any plan that fits if HiGHS
# found none (solve, _any_fitting).
MIP_SHARE = 0.7


# Under a memory budget, on a problem of mip.MESSAGE_COLUMNS pair columns or more: the share of
# the time left that message passing may take to find a plan that fits (message_passing.fitting,
# FIT_ITERATIONS iterations per weight of memory), a fallback and the MIP's first incumbent.
# Llama2-70B in 2 micro-batches on 16x16 under 15.75 GiB (491 nodes, 546k pair columns): a plan
# of 20.76 s a step that fits, in 4.6 s, where the LP relaxation's bound is 20.75 s, the greedy
# choices' best 37.08 s, and HiGHS's MIP found none in 66 s
# (tests/test_intra_solve_message_passing.py::test_a_budgeted_ilp_starts_from_message_passings_plan).
FIT_SHARE = 0.25
FIT_ITERATIONS = 5


class _Infeasible(Exception):
    pass


def solve(inp: SolverInput) -> Solution:
    """The best choice the solver finds within the time limit (optimal if it proves so).

    The problem is first reduced exactly (shardplan.intra.solve.presolve: dominated choices and
    chains go). Memory rows are added lazily: solve with the rows where memory piles up,
    evaluate every row at the solution, add the rows it overflows, again until none does. A
    subset of the rows has fewer constraints, so its optimum that fits every row is the
    optimum, and its infeasibility proves the whole problem's."""
    if inp.num_nodes == 0:
        return Solution((), 0.0, 0.0, True, "empty")
    budget = inp.memory_budget
    whole, fits = inp, None
    if budget is not None and budget < rows.simple_bound(inp):
        # Below what every node at its smallest holds: no plan fits, said without a search
        # (tests/test_intra_memory.py::
        # test_a_budget_below_every_nodes_smallest_is_infeasible_without_a_search)
        raise _infeasible(inp)
    if budget is not None and (inp.deadline is not None or inp.solver.deterministic):
        fits = _fallbacks(inp)
    kept = fits == []
    if kept and inp.deadline is not None:
        # No fallback fits: HiGHS gets most of the time, the rest is kept for CP-SAT to find
        # any plan that fits; a fallback that fits leaves HiGHS all of it
        # (tests/test_intra_solve_ilp.py::test_time_is_kept_for_cp_sat_when_highs_finds_no_plan_that_fits)
        inp = inp.replace(deadline=Deadline(inp.deadline.remaining() * MIP_SHARE, grace=0.0))
    perturbed = mip.perturbed(inp)
    lazy = budget is not None and len(inp.memory_rows) > rows.PER_ROUND
    active = rows.first(inp) if lazy else set(range(len(inp.memory_rows)))
    # the cheapest fallback that fits bounds the MIP's search from above (mip.py)
    hint = min(fits)[1] if fits else inp.hint
    reporter, rounds = inp.solver.progress, 0
    while True:
        # Presolve sees the active rows only: a node no active row names is eliminated as
        # without a budget (the core is smaller than with every row)
        sub = rows.restrict(perturbed, active) if lazy else perturbed
        rounds += 1
        try:
            with progress.phase(reporter, "presolve"):
                reduced = presolve.reduce(dataclasses.replace(sub, hint=hint))
            with progress.phase(reporter, f"MIP (HiGHS), {len(active)} memory rows" if lazy
                                else "MIP (HiGHS)", rounds if lazy else None):
                found = _solve_rows(reduced.inp)
        except _Infeasible:
            raise _infeasible(whole) from None
        if found is None:
            break
        choice = reduced.expand(found.choice)
        obj, peak = types.evaluate(inp, choice)
        over = rows.top(inp, choice, budget, active) if lazy else []
        if not over:
            return Solution(choice, obj, peak, found.optimal, found.solver)
        active |= set(over)
        hint = None
        if inp.remaining() <= 0:
            break
    # Out of time: the cheapest of the hint and the greedy choices that fits.
    fits = _fallbacks(inp) if fits is None else fits
    if fits:
        obj, choice, peak = min(fits)
        return Solution(choice, obj, peak, False, "fallback")
    if kept and (found := _any_fitting(whole, active if lazy else None)):
        return found
    limit = inp.deadline.limit_s if inp.deadline is not None else inp.solver.time_limit
    raise SearchTimeout(limit, "the ILP found no plan that fits within its time limit")


def _infeasible(inp: SolverInput) -> InfeasibleMemory:
    """No plan fits: the least memory any needs, searched for, or (inp.least_memory False)
    bounded at once by what every node holds at its smallest, with the greedy choices' least
    as a plan found (tests/test_planning_driver.py::
    test_the_step_as_a_whole_is_bounded_at_once_where_a_rematerialized_step_follows)."""
    if inp.least_memory:
        value, exact, least = least_memory.least(inp)
    else:
        value, exact = rows.simple_bound(inp), False
        least = min(types.evaluate(inp, c)[1] for c in greedy.choices(inp))
    return InfeasibleMemory(inp.memory_budget, value, exact, found_bytes=least)


def without_memory(inp: SolverInput) -> SolverInput:
    """The same problem with no memory budget (nor rows): a relaxation of it, and the
    fast one to solve (presolve eliminates what no row names, the LP is often integral)."""
    return dataclasses.replace(inp, memory_budget=None, memory_rows=(), memory_base=(),
                               copies=(), row_copies=())


def _fallbacks(inp: SolverInput) -> list[tuple[float, tuple[int, ...], float]]:
    """(objective, choice, peak) of the hint and the greedy choices that fit the budget."""
    fits = []
    for fallback in (inp.hint, *greedy.choices(inp), _fitted(inp)):
        if fallback is None:
            continue
        obj, peak = types.evaluate(inp, fallback)
        if np.isfinite(obj) and (inp.memory_budget is None or peak <= inp.memory_budget):
            fits.append((obj, tuple(fallback), peak))
    return fits


def _fitted(inp: SolverInput) -> tuple[int, ...] | None:
    """Message passing's plan that fits the budget, on a large problem (None otherwise)."""
    if (inp.memory_budget is None
            or sum(np.size(m) for _, _, m in inp.edges) < mip.MESSAGE_COLUMNS):
        return None
    # its iterations limit it where the solve is limited by its work
    end = (inp.remaining() * (1 - FIT_SHARE) if inp.deadline is not None
           and not inp.solver.deterministic else -float("inf"))
    with progress.phase(inp.solver.progress, "message passing under the budget"):
        return message_passing.fitting(inp, FIT_ITERATIONS, lambda: inp.remaining() - end)[0]


def _any_fitting(inp: SolverInput, active: set[int] | None) -> Solution | None:
    """A plan that fits the budget, found by CP-SAT in the time kept from HiGHS (which can spend
    it all on a tight budget finding none), rows added lazily as in solve; None if none is
    found in time."""
    while inp.remaining() > 0:
        sub = rows.restrict(inp, active) if active is not None else inp
        model, x = cpsat.build_model(sub, minimise_memory=False)
        solver = cpsat.solver_for(sub)
        if cpsat.solve(solver, model, sub, "any plan that fits",
                       minimise_memory=False) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        choice = tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)
        obj, peak = types.evaluate(inp, choice)
        over = rows.top(inp, choice, inp.memory_budget, active) if active is not None else []
        if not over and np.isfinite(obj) and peak <= inp.memory_budget:
            return Solution(choice, obj, peak, False, "cp-sat")
        if not over:
            return None
        active = active | set(over)
    return None


def _solve_rows(inp: SolverInput) -> Solution | None:
    """The MIP (HiGHS) with the rows of `inp`: a Solution (objective and peak not yet
    evaluated), None when the time ran out first, or _Infeasible when no choice fits them."""
    if inp.num_nodes == 0:
        return Solution((), 0.0, 0.0, True, "presolve")
    if inp.remaining() <= 0:
        return None
    status, choice = mip.solve(inp)
    if choice is not None and status == "optimal":
        choice = presolve.canonical(inp, choice)
    if status == "infeasible" and inp.memory_budget is not None:
        raise _Infeasible()
    if choice is None:
        return None
    return Solution(choice, 0.0, 0.0, status == "optimal", "highs")
