"""The intra-operator ILP: one strategy per node, minimising node and edge costs under a
per-device memory budget, solved with OR-Tools CP-SAT (as in Alpa, section 4.2)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
from ortools.linear_solver import pywraplp
from ortools.sat.python import cp_model

from shardplan.options import DEFAULTS


@dataclasses.dataclass(frozen=True, eq=False)
class SolverInput:
    """Everything the solver sees. Costs are in seconds, memory in bytes per device.

    node_costs[i][k]: cost of node i choosing strategy k.
    edges: (a, b, C) with C[k, l] the cost when a chooses k and b chooses l.
    memory_rows: each row is a list of (node, bytes per strategy) whose sum must stay within
      memory_budget; a row is one moment of the step with the values alive then.
    hint: a known feasible choice (for example all replicated) to start the search from.
    workers: CP-SAT workers; 1 (the default) is deterministic, more are faster but may race.
    """

    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...] = ()
    memory_rows: tuple[tuple[tuple[int, np.ndarray], ...], ...] = ()
    memory_budget: float | None = None
    time_limit_s: float = DEFAULTS.time_limit
    seed: int = DEFAULTS.solver_seed
    workers: int = DEFAULTS.workers
    hint: tuple[int, ...] | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    objective: float
    peak_memory: float
    optimal: bool
    solver: str


class InfeasibleMemory(Exception):
    """No strategy choice fits the memory budget; `min_bytes` is the least any choice needs."""

    def __init__(self, budget: float, min_bytes: float):
        self.budget, self.min_bytes = budget, min_bytes
        super().__init__(
            f"no plan fits the memory budget of {budget / 2**30:.3f} GiB per device; the "
            f"smallest any plan needs is {min_bytes / 2**30:.3f} GiB per device. Raise the "
            "budget, use more devices, or shrink the model or batch")


def compress_edge(m) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row group of each row, column group of each column, the matrix over groups): rows
    (columns) that are equal everywhere are one group, exactly."""
    m = np.asarray(m, dtype=float)
    key = np.where(np.isfinite(m), m, -1.0)
    _, first_r, rows = np.unique(key, axis=0, return_index=True, return_inverse=True)
    key_r = key[np.sort(first_r)]
    order_r = np.argsort(np.argsort(first_r))
    rows = order_r[rows.ravel()]
    _, first_c, cols = np.unique(key_r, axis=1, return_index=True, return_inverse=True)
    order_c = np.argsort(np.argsort(first_c))
    cols = order_c[cols.ravel()]
    reduced = m[np.sort(first_r)][:, np.sort(first_c)]
    return rows, cols, reduced


def evaluate(inp: SolverInput, choice) -> tuple[float, float]:
    """(objective, peak memory) of a choice."""
    obj = sum(float(c[k]) for c, k in zip(inp.node_costs, choice))
    obj += sum(float(m[choice[a], choice[b]]) for a, b, m in inp.edges)
    peak = max((sum(float(mem[choice[n]]) for n, mem in row) for row in inp.memory_rows),
               default=0.0)
    return obj, peak


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
        raise InfeasibleMemory(inp.memory_budget, _min_peak_brute(inp))
    return Solution(tuple(best[2]), best[0], best[1], True, "brute-force")


def _min_peak_brute(inp: SolverInput) -> float:
    return min(evaluate(inp, c)[1] for c in itertools.product(
        *(range(len(c)) for c in inp.node_costs)))


def _finite_max(a) -> float:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def _scale(inp: SolverInput) -> float:
    """Seconds -> integer units: the largest finite cost maps to about 1e8 units."""
    biggest = max([_finite_max(c) for c in inp.node_costs] +
                  [_finite_max(m) for _, _, m in inp.edges] + [1e-12])
    return 1e8 / biggest


def _build(inp: SolverInput, minimise_memory: bool):
    model = cp_model.CpModel()
    scale = _scale(inp)
    x = [[model.NewBoolVar(f"x{i}_{k}") for k in range(len(c))] for i, c in enumerate(inp.node_costs)]
    for xs in x:
        model.AddExactlyOne(xs)
    objective = []
    # Infinite costs forbid a choice (a node) or a pair of choices (an edge).
    for i, c in enumerate(inp.node_costs):
        for k, v in enumerate(c):
            if not np.isfinite(v):
                model.Add(x[i][k] == 0)
            elif v > 0:
                objective.append(round(float(v) * scale) * x[i][k])
    for e, (a, b, m) in enumerate(inp.edges):
        # Alpa's formulation: e[k,l] picks the pair; its marginals are the two nodes' choices.
        # Its LP relaxation is tight on trees, which keeps CP-SAT's search small. Strategies
        # with equal rows (columns) share one marginal: the edge only sees their layouts.
        rows, cols, m = compress_edge(m)
        ka, kb = m.shape
        ev = [[model.NewBoolVar(f"e{e}_{k}_{l}") for l in range(kb)] for k in range(ka)]
        for k in range(ka):
            model.Add(sum(ev[k]) == sum(x[a][i] for i in np.flatnonzero(rows == k)))
        for l in range(kb):
            model.Add(sum(ev[k][l] for k in range(ka)) ==
                      sum(x[b][j] for j in np.flatnonzero(cols == l)))
        for k in range(ka):
            for l in range(kb):
                v = m[k, l]
                if not np.isfinite(v):
                    model.Add(ev[k][l] == 0)
                elif v > 0:
                    objective.append(round(float(v) * scale) * ev[k][l])

    mem_exprs = []
    for row in inp.memory_rows:
        expr = sum(math.ceil(float(v)) * x[n][k] for n, mem in row for k, v in enumerate(mem) if v > 0)
        mem_exprs.append(expr)
    if minimise_memory:
        bound = int(sum(max(float(np.max(mem)) for _, mem in [t]) for row in inp.memory_rows for t in row)) + 1
        peak = model.NewIntVar(0, max(bound, 1), "peak")
        for expr in mem_exprs:
            model.Add(peak >= expr)
        model.Minimize(peak)
    else:
        if inp.memory_budget is not None:
            for expr in mem_exprs:
                model.Add(expr <= int(inp.memory_budget))
        model.Minimize(sum(objective))
    if inp.hint is not None:
        for i, k in enumerate(inp.hint):
            for kk, var in enumerate(x[i]):
                model.AddHint(var, kk == k)
    return model, x


def _solver(inp: SolverInput):
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.random_seed = inp.seed
    p.num_workers = max(1, inp.workers)
    # One worker and a deterministic time limit give the same plan for the same input; more
    # workers search faster but race (interleave_search would fix that, at 1000x the time).
    p.max_deterministic_time = inp.time_limit_s
    p.max_time_in_seconds = inp.time_limit_s * 4
    # Lean on the LP relaxation: it is tight for these problems (measured: integral on a GPT
    # train step), and level 2 proves optimality in seconds where the default takes minutes.
    p.linearization_level = 2
    return solver


def _lp_relaxation(inp: SolverInput):
    """Solve the LP relaxation with GLOP: (per-node fractional choices, objective) or None."""

    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return None
    # Dual simplex: 8x faster than primal on these problems (measured on a GPT layer, 2x4 mesh).
    lp.SetSolverSpecificParametersAsString("use_dual_simplex: true")
    x = [[lp.NumVar(0.0, 1.0, "") for _ in c] for c in inp.node_costs]
    objective = lp.Objective()
    for i, c in enumerate(inp.node_costs):
        row = lp.Constraint(1.0, 1.0)
        for k, v in enumerate(c):
            row.SetCoefficient(x[i][k], 1.0)
            if not np.isfinite(v):
                x[i][k].SetUb(0.0)
            elif v:
                objective.SetCoefficient(x[i][k], float(v))
    for a, b, m in inp.edges:
        rows, cols, m = compress_edge(m)
        ev = [[lp.NumVar(0.0, 0.0 if not np.isfinite(m[k, l]) else 1.0, "")
               for l in range(m.shape[1])] for k in range(m.shape[0])]
        for k in range(m.shape[0]):
            row = lp.Constraint(0.0, 0.0)
            for i in np.flatnonzero(rows == k):
                row.SetCoefficient(x[a][int(i)], -1.0)
            for l in range(m.shape[1]):
                row.SetCoefficient(ev[k][l], 1.0)
                if np.isfinite(m[k, l]) and m[k, l]:
                    objective.SetCoefficient(ev[k][l], float(m[k, l]))
        for l in range(m.shape[1]):
            row = lp.Constraint(0.0, 0.0)
            for j in np.flatnonzero(cols == l):
                row.SetCoefficient(x[b][int(j)], -1.0)
            for k in range(m.shape[0]):
                row.SetCoefficient(ev[k][l], 1.0)
    if inp.memory_budget is not None:
        for mem_row in inp.memory_rows:
            row = lp.Constraint(-lp.infinity(), float(inp.memory_budget))
            for n, mem in mem_row:
                for k, v in enumerate(mem):
                    row.SetCoefficient(x[n][k], row.GetCoefficient(x[n][k]) + float(v))
    objective.SetMinimization()
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return None
    return [np.array([v.solution_value() for v in xs]) for xs in x], objective.Value()


def solve(inp: SolverInput) -> Solution:
    """The best choice CP-SAT finds within the time limit (optimal if it proves so)."""

    if inp.num_nodes == 0:
        return Solution((), 0.0, 0.0, True, "empty")
    relaxed = _lp_relaxation(inp)
    if relaxed is not None:
        fractions, _ = relaxed
        rounded = tuple(int(np.argmax(f)) for f in fractions)
        if all(f.max() > 1 - 1e-6 for f in fractions):
            # An integral optimum of the relaxation is an optimum of the ILP.
            obj, peak = evaluate(inp, rounded)
            if inp.memory_budget is None or peak <= inp.memory_budget:
                return Solution(rounded, obj, peak, True, "lp-integral")
        inp = dataclasses.replace(inp, hint=rounded)
    model, x = _build(inp, minimise_memory=False)
    solver = _solver(inp)
    status = solver.Solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)
        obj, peak = evaluate(inp, choice)
        return Solution(choice, obj, peak, status == cp_model.OPTIMAL, "cp-sat")
    if status == cp_model.INFEASIBLE and inp.memory_budget is not None:
        raise InfeasibleMemory(inp.memory_budget, min_memory(inp))
    # Unknown within the time limit: fall back to the hint or each node's cheapest choice.
    fallback = inp.hint or tuple(int(np.argmin(c)) for c in inp.node_costs)
    obj, peak = evaluate(inp, fallback)
    if not np.isfinite(obj):
        raise RuntimeError("the ILP found no plan within its time limit and the fallback plan "
                           "is not valid; raise the time limit")
    if inp.memory_budget is not None and peak > inp.memory_budget:
        raise InfeasibleMemory(inp.memory_budget, min_memory(inp))
    return Solution(tuple(fallback), obj, peak, False, "fallback")


def min_memory(inp: SolverInput) -> float:
    """The smallest peak memory (max over rows) that any choice reaches."""

    if not inp.memory_rows:
        return 0.0
    model, x = _build(inp, minimise_memory=True)
    solver = _solver(inp)
    status = solver.Solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)
        return evaluate(inp, choice)[1]
    return float("nan")
