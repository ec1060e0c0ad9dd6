"""The intra-op SolverInput as a linear program for OR-Tools' linear solvers: its LP relaxation
(GLOP) and the MIP itself (HiGHS: branch and cut on that LP). The model is cpsat.py's (Alpa's
edge pairs, the memory rows); here the pair variables stay continuous: with the node choices
integral, each pair's row and column sums make them integral too.

The MIP proves what CP-SAT does not: on a transformer layer on 8x8 (GPT-2 1.5B, 157 nodes
after presolve) the LP bound is within 0.02% of the optimum and HiGHS closes it at the root
with cuts in about 10 s, where CP-SAT ran 30 s (deterministic) and stopped 3.5% above it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from ortools.linear_solver import pywraplp

from shardplan.intra import cpsat

if TYPE_CHECKING:  # annotations only: ilp imports this module
    from shardplan.intra.ilp import SolverInput

# Relative gap at which HiGHS stops and calls its plan optimal (its default is 1e-4: a
# plan 0.01% dearer than the best would pass as optimal).
MIP_GAP = 1e-7


def _model(lp, inp: SolverInput, integer: bool):
    """Variables, rows and objective of `inp` in `lp`: the per-node choice variables."""
    x = [[lp.BoolVar("") if integer else lp.NumVar(0.0, 1.0, "") for _ in c]
         for c in inp.node_costs]
    # Seconds -> units with the largest cost at 1e4: costs of 1e-12 s in seconds sit below
    # HiGHS's tolerances.
    unit = 1e-4 * cpsat.scale_of(inp)
    objective = lp.Objective()
    for i, c in enumerate(inp.node_costs):
        row = lp.Constraint(1.0, 1.0)
        for k, v in enumerate(c):
            row.SetCoefficient(x[i][k], 1.0)
            if not np.isfinite(v):
                x[i][k].SetUb(0.0)
            elif v:
                objective.SetCoefficient(x[i][k], unit * float(v))
    copy_terms: dict[int, list] = {}
    for pair in cpsat.pairs(inp):
        a, b, rows, cols, m = pair.a, pair.b, pair.rows, pair.cols, pair.cost
        ev = [[lp.NumVar(0.0, 0.0 if not np.isfinite(m[k, l]) else 1.0, "")
               for l in range(m.shape[1])] for k in range(m.shape[0])]
        for k in range(m.shape[0]):
            row = lp.Constraint(0.0, 0.0)
            for i in np.flatnonzero(rows == k):
                row.SetCoefficient(x[a][int(i)], -1.0)
            for l in range(m.shape[1]):
                row.SetCoefficient(ev[k][l], 1.0)
                if np.isfinite(m[k, l]) and m[k, l]:
                    objective.SetCoefficient(ev[k][l], unit * float(m[k, l]))
        for l in range(m.shape[1]):
            row = lp.Constraint(0.0, 0.0)
            for j in np.flatnonzero(cols == l):
                row.SetCoefficient(x[b][int(j)], -1.0)
            for k in range(m.shape[0]):
                row.SetCoefficient(ev[k][l], 1.0)
        for j, size in pair.copies:
            copy_terms.setdefault(j, []).extend(
                (ev[k][l], float(size[k, l])) for k in range(m.shape[0])
                for l in range(m.shape[1]) if size[k, l] > 0)
        if inp.remaining() <= 0:
            return None
    if inp.memory_budget is not None:
        _memory(lp, inp, x, copy_terms)
    objective.SetMinimization()
    return x, unit


def _time_limit_ms(inp: SolverInput) -> int:
    return max(1, int(1000 * min(inp.time_limit_s, inp.remaining())))


def relaxation(inp: SolverInput):
    """Solve the LP relaxation with GLOP: (per-node fractional choices, objective) or None."""
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    # Dual simplex: 8x faster than primal on these problems (measured on a GPT layer, 2x4 mesh).
    lp.SetSolverSpecificParametersAsString("use_dual_simplex: true")
    built = _model(lp, inp, integer=False)
    if built is None:
        return None
    x, unit = built
    if inp.deadline is not None:
        lp.SetTimeLimit(_time_limit_ms(inp))
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return [np.array([v.solution_value() for v in xs]) for xs in x], lp.Objective().Value() / unit


class Unavailable(Exception):
    """This OR-Tools has no HiGHS."""


def mip(inp: SolverInput):
    """Solve the MIP with HiGHS: ('optimal' | 'feasible', choice), ('infeasible', None) when no
    choice fits the memory rows (proven), or ('timeout', None). The time limit is the wall
    clock (HiGHS has no deterministic one): a solve cut short may differ between runs."""
    lp = pywraplp.Solver.CreateSolver("HIGHS")
    if lp is None:
        raise Unavailable()
    # The reported status is False whatever HiGHS accepts; its log shows the options took.
    lp.SetSolverSpecificParametersAsString(
        f"output_flag = false\nmip_rel_gap = {MIP_GAP}\nrandom_seed = {inp.seed}\n"
        f"threads = {max(1, inp.workers)}")
    built = _model(lp, inp, integer=True)
    if built is None or inp.remaining() <= 0:
        return "timeout", None
    x, _ = built
    lp.SetTimeLimit(_time_limit_ms(inp))
    status = lp.Solve()
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        choice = tuple(int(np.argmax([v.solution_value() for v in xs])) for xs in x)
        return ("optimal" if status == pywraplp.Solver.OPTIMAL else "feasible"), choice
    if status == pywraplp.Solver.INFEASIBLE:
        return "infeasible", None
    return "timeout", None


def _memory(lp, inp: SolverInput, x, copy_terms) -> None:
    """The memory rows, as cpsat writes them for CP-SAT."""
    def add(row, terms, sign=1.0):
        for n, mem in terms:
            for k, v in enumerate(mem):
                if v:
                    row.SetCoefficient(x[n][k], row.GetCoefficient(x[n][k]) + sign * float(v))

    base = lp.NumVar(0.0, lp.infinity(), "")
    row = lp.Constraint(0.0, 0.0)
    row.SetCoefficient(base, -1.0)
    add(row, inp.memory_base)
    copy_vars = []
    for j in range(len(inp.copies)):
        size = lp.NumVar(0.0, lp.infinity(), "")
        row = lp.Constraint(0.0, 0.0)
        row.SetCoefficient(size, -1.0)
        for var, v in copy_terms.get(j, ()):
            row.SetCoefficient(var, v)
        copy_vars.append(size)
    rows = inp.memory_rows or (((),) if inp.memory_base else ())
    for r, mem_row in enumerate(rows):
        row = lp.Constraint(-lp.infinity(), float(inp.memory_budget))
        row.SetCoefficient(base, 1.0)
        add(row, mem_row)
        for j in (inp.row_copies[r] if r < len(inp.row_copies) else ()):
            row.SetCoefficient(copy_vars[j], 1.0)
