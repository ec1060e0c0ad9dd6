"""The CP-SAT model of an intra-op SolverInput: variables, the edge pairs (Alpa's
formulation), the memory rows, solver parameters. shardplan.intra.solve.ilp drives it (the least
memory; the cost when HiGHS is missing); shardplan.intra.solve.mip writes the same model for
linear solvers."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from ortools.sat.python import cp_model

from shardplan import progress
from shardplan.intra.solve.types import SolverInput


def compress_edge(m, row_keys=None, col_keys=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row group of each row, column group of each column, the matrix over groups): rows
    (columns) that are equal everywhere, and in `row_keys[k]` (`col_keys[l]`), are one
    group, exactly."""
    m = np.asarray(m, dtype=float)
    key = np.where(np.isfinite(m), m, -1.0)
    rkey = key if row_keys is None else np.hstack([key, row_keys])
    _, first_r, rows = np.unique(rkey, axis=0, return_index=True, return_inverse=True)
    key_r = key[np.sort(first_r)]
    order_r = np.argsort(np.argsort(first_r))
    rows = order_r[rows.ravel()]
    ckey = key_r if col_keys is None else np.vstack([key_r, np.asarray(col_keys).T])
    _, first_c, cols = np.unique(ckey, axis=1, return_index=True, return_inverse=True)
    order_c = np.argsort(np.argsort(first_c))
    cols = order_c[cols.ravel()]
    reduced = m[np.sort(first_r)][:, np.sort(first_c)]
    return rows, cols, reduced


@dataclasses.dataclass(frozen=True)
class _Pair:
    """An edge's matrix over groups of choices, and the copies on the same two nodes (each a
    matrix of bytes over the same groups): one set of pair variables serves both."""

    a: int
    b: int
    rows: np.ndarray
    cols: np.ndarray
    cost: np.ndarray
    copies: tuple[tuple[int, np.ndarray], ...]


def pairs(inp: SolverInput) -> list[_Pair]:
    """The edges, then pairs of nodes that only copies join, each compressed once."""
    on: dict[tuple[int, int], list[int]] = {}
    for j, c in enumerate(inp.copies):
        on.setdefault((c.a, c.b), []).append(j)
    edges = [(a, b, m) for a, b, m in inp.edges]
    have = {(a, b) for a, b, _ in edges}
    for (a, b) in sorted(on):
        if (a, b) not in have:
            edges.append((a, b, np.zeros((len(inp.node_costs[a]), len(inp.node_costs[b])))))
            have.add((a, b))
    out = []
    for a, b, m in edges:
        js = on.pop((a, b), [])
        if not js:
            rows, cols, reduced = compress_edge(m)
            out.append(_Pair(a, b, rows, cols, reduced, ()))
            continue
        cs = [inp.copies[j] for j in js]
        rk = np.stack([v for c in cs for v in (c.key_a, c.bytes_a)], axis=1)
        ck = np.stack([v for c in cs for v in (c.key_b, c.bytes_b)], axis=1)
        rows, cols, reduced = compress_edge(m, rk, ck)
        fr = [int(np.flatnonzero(rows == g)[0]) for g in range(reduced.shape[0])]
        fc = [int(np.flatnonzero(cols == g)[0]) for g in range(reduced.shape[1])]
        sizes = tuple((j, np.array([[c.size(k, l) for l in fc] for k in fr]))
                      for j, c in zip(js, cs))
        out.append(_Pair(a, b, rows, cols, reduced, sizes))
    return out


def _finite_max(a) -> float:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    return float(a.max()) if a.size else 0.0


def scale_of(inp: SolverInput) -> float:
    """Seconds -> integer units: the largest finite cost maps to about 1e8 units."""
    biggest = max([_finite_max(c) for c in inp.node_costs] +
                  [_finite_max(m) for _, _, m in inp.edges] + [1e-12])
    return 1e8 / biggest


def build_model(inp: SolverInput, minimise_memory: bool):
    model = cp_model.CpModel()
    scale = scale_of(inp)
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
    copy_terms: dict[int, tuple[list, list]] = {}
    for e, pair in enumerate(pairs(inp)):
        # Alpa's formulation: e[k,l] picks the pair; its marginals are the two nodes' choices.
        # Its LP relaxation is tight on trees, which keeps CP-SAT's search small. Strategies
        # with equal rows (columns) share one marginal: the edge only sees their layouts.
        # A reshard's copy is a sum over the same pair variables.
        a, b, rows, cols, m = pair.a, pair.b, pair.rows, pair.cols, pair.cost
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
        for j, size in pair.copies:
            vs, cs = copy_terms.setdefault(j, ([], []))
            for k in range(ka):
                for l in range(kb):
                    if size[k, l] > 0:
                        vs.append(ev[k][l])
                        cs.append(math.ceil(size[k, l]))

    for r in inp.implications:
        if not np.any(r.when):
            continue
        model.Add(sum(x[r.a][k] for k in np.flatnonzero(r.when)) <=
                  sum(x[r.b][l] for l in np.flatnonzero(r.allowed)))
    mem_exprs = _memory_exprs(model, inp, x, copy_terms)
    if minimise_memory:
        peak = model.NewIntVar(0, _memory_bound(inp), "peak")
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


def _memory_bound(inp: SolverInput) -> int:
    """More bytes than any choice can need."""
    total = sum(float(np.max(mem)) for _, mem in inp.memory_base)
    total += sum(float(np.max(mem)) for row in inp.memory_rows for _, mem in row)
    total += sum(float(np.max(c.bytes_a) + np.max(c.bytes_b)) for c in inp.copies)
    return int(total) + 1


def _weighted(terms, x):
    """[(vars, coefficients)] of a row's (node, bytes per choice) terms."""
    vs, cs = [], []
    for n, mem in terms:
        for k, v in enumerate(mem):
            if v > 0:
                vs.append(x[n][k])
                cs.append(math.ceil(float(v)))
    return vs, cs


def _memory_exprs(model, inp: SolverInput, x, copy_terms) -> list:
    """One expression per memory row: the base, the row's buffers, the copies alive then.
    The base and each copy are one variable, shared by the rows."""
    if not inp.memory_rows and not inp.memory_base:
        return []
    bound = _memory_bound(inp)
    base_vs, base_cs = _weighted(inp.memory_base, x)
    base = model.NewIntVar(0, bound, "mem_base")
    model.Add(base == cp_model.LinearExpr.WeightedSum(base_vs, base_cs))
    copy_vars = []
    for j in range(len(inp.copies)):
        vs, cs = copy_terms.get(j, ([], []))
        size = model.NewIntVar(0, bound, f"copy{j}")
        model.Add(size == cp_model.LinearExpr.WeightedSum(vs, cs))
        copy_vars.append(size)
    exprs = []
    rows = inp.memory_rows or (((),) if inp.memory_base else ())
    for r, row in enumerate(rows):
        vs, cs = _weighted(row, x)
        vs.append(base)
        cs.append(1)
        for j in (inp.row_copies[r] if r < len(inp.row_copies) else ()):
            vs.append(copy_vars[j])
            cs.append(1)
        exprs.append(cp_model.LinearExpr.WeightedSum(vs, cs))
    return exprs


def solver_for(inp: SolverInput):
    solver = cp_model.CpSolver()
    p = solver.parameters
    settings = inp.solver
    p.random_seed = settings.solver_seed
    p.num_workers = max(1, settings.workers)
    # One worker and a deterministic time limit give the same plan for the same input; more
    # workers search faster but race (interleave_search would fix that, at many times the time).
    # The wall clock bounds it too unless the solve is limited by its work alone.
    p.max_deterministic_time = settings.time_limit
    if not settings.deterministic:
        p.max_time_in_seconds = max(0.01, min(settings.time_limit * 4, inp.remaining()))
    # Lean on the LP relaxation: it is tight for these problems (often integral: mip.py), and
    # level 2 uses it to prove optimality where the default level searches far longer.
    p.linearization_level = 2
    return solver



class _Told(cp_model.CpSolverSolutionCallback):
    """Tells `reporter` each solution's objective and the bound, divided by `per_unit`."""

    def __init__(self, reporter: progress.Reporter, what: str, unit: str, per_unit: float):
        super().__init__()
        self._reporter, self._what, self._unit, self._per_unit = reporter, what, unit, per_unit

    def on_solution_callback(self) -> None:
        self._reporter.solver(progress.SolverUpdate(
            "CP-SAT", self._what, self.ObjectiveValue() / self._per_unit,
            self.BestObjectiveBound() / self._per_unit, self._unit))


def solve(solver, model, inp: SolverInput, what: str, *, minimise_memory: bool):
    """solver.Solve(model), each solution it finds told to inp.solver.progress (in bytes when
    `minimise_memory`, else in seconds)."""
    reporter = inp.solver.progress
    if reporter is progress.SILENT:
        return solver.Solve(model)
    per_unit = 1.0 if minimise_memory else float(scale_of(inp))
    return solver.Solve(model, _Told(reporter, what, "B" if minimise_memory else "s", per_unit))
