"""The LP relaxation of the intra-op MIP (mip.py's arrays), solved by HiGHS: at once through
scipy's linprog, or with some rows added lazily to one HiGHS model that keeps its basis.

Lazily: the LP without the lazy rows is solved, the lazy rows its solution breaks are added,
and HiGHS's dual simplex goes on from the basis it had (the rows added leave that basis dual
feasible), until the solution keeps every row. An optimum of the LP over fewer rows that keeps
them all is an optimum of the whole LP, and its duals, zero on the rows left out, are dual
feasible for it: the bound and the reduced costs are the whole LP's
(tests/test_intra_solve_relaxation.py::test_lazy_rows_give_the_bound_and_reduced_costs_of_the_whole_lp).
The memory rows are lazy: a few dense rows among many sparse ones, they cost HiGHS more
iterations, and dearer ones, than the rest of the LP, and an optimum without them usually
breaks few. HiGHS's presolve stays on here. benchmarks/plan_speed.py times the budgeted
searches this serves.

scipy binds HiGHS's model object only privately (scipy.optimize._highspy); where it is missing
the LP is solved at once (solve_at_once)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from scipy import optimize, sparse

from shardplan.intra.settings import SolverSettings

try:  # scipy's binding of HiGHS (1.15+), private: solve_at_once where it is missing
    from scipy.optimize._highspy import _core as _highs

    _highs.HighsLp, _highs._Highs, _highs.HighsModelStatus.kOptimal  # noqa: B018
except (ImportError, AttributeError):  # pragma: no cover
    _highs = None

# A lazy row counts as kept when its activity exceeds its bound by at most this share of the
# bound (HiGHS's primal feasibility tolerance is 1e-7 on the scaled rows).
ROW_TOLERANCE = 1e-9


class Relaxation(NamedTuple):
    """status 0: solved (x, fun, and each column's reduced cost: 0 where basic); 1: not
    solved in time; 2: infeasible."""

    status: int
    x: np.ndarray | None = None
    fun: float = float("nan")
    reduced: np.ndarray | None = None


def solve_at_once(obj, lb, ub, matrix, rlo, rhi, settings: SolverSettings,
                  remaining: float = math.inf, *, presolve: bool) -> Relaxation:
    """The LP through scipy's linprog (rows equalities or upper bounds), stopped as `settings`
    say (`remaining`: seconds left of the search's deadline)."""
    eq = rlo == rhi
    limit = ({"maxiter": settings.simplex_iterations()} if settings.deterministic
             else {"time_limit": settings.wall_s(remaining)})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
        lp = optimize.linprog(
            obj, A_ub=matrix[~eq], b_ub=rhi[~eq], A_eq=matrix[eq], b_eq=rhi[eq],
            bounds=np.stack([lb, ub], axis=1), method="highs",
            options={**limit, "disp": False, "presolve": presolve})
    if lp.status != 0:
        return Relaxation(2 if lp.status == 2 else 1)
    return Relaxation(0, lp.x, float(lp.fun), lp.lower.marginals + lp.upper.marginals)


def solve_lazily(obj, lb, ub, matrix, rlo, rhi, lazy: np.ndarray, settings: SolverSettings,
                 remaining: Callable[[], float] = lambda: math.inf) -> Relaxation:
    """The LP with the rows in `lazy` (a mask of upper bounds) added as its solutions break
    them (the module's docstring), stopped as `settings` say over all its runs; `remaining()`:
    seconds left of the search's deadline."""
    if _highs is None or not lazy.any():
        return solve_at_once(obj, lb, ub, matrix, rlo, rhi, settings, remaining(), presolve=True)
    matrix = sparse.csr_matrix(matrix)
    first = np.flatnonzero(~lazy)
    cols = matrix[first].tocsc()
    lp = _highs.HighsLp()
    lp.num_col_, lp.num_row_ = cols.shape[1], cols.shape[0]
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = cols.shape[1], cols.shape[0]
    lp.a_matrix_.format_ = _highs.MatrixFormat.kColwise
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = obj, lb, ub
    lp.row_lower_, lp.row_upper_ = rlo[first], rhi[first]
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = (
        cols.indptr, cols.indices, cols.data)
    h = _highs._Highs()
    options = _highs.HighsOptions()
    # presolve for the first solve (HiGHS solves from the basis after rows are added)
    options.presolve, options.output_flag = "on", False
    h.passOptions(options)
    h.passModel(lp)
    waiting = np.flatnonzero(lazy)
    slack = ROW_TOLERANCE * np.maximum(1.0, np.abs(rhi[waiting]))
    iterations = 0  # simplex iterations of the runs so far (HiGHS counts and limits each run)
    while True:
        if settings.deterministic:
            h.setOptionValue("simplex_iteration_limit",
                             max(0, settings.simplex_iterations() - iterations))
        else:
            # HiGHS's time limit is on its run time over every run of the model so far
            h.setOptionValue("time_limit", h.getRunTime() + settings.wall_s(remaining()))
        h.run()
        iterations += h.getInfo().simplex_iteration_count
        status = h.getModelStatus()
        if status == _highs.HighsModelStatus.kInfeasible:
            return Relaxation(2)
        if status != _highs.HighsModelStatus.kOptimal:
            return Relaxation(1)
        x = np.array(h.getSolution().col_value)
        broken = matrix[waiting] @ x > rhi[waiting] + slack
        if not broken.any():
            break
        add = matrix[waiting[broken]]
        h.addRows(len(add.indptr) - 1, rlo[waiting[broken]], rhi[waiting[broken]], add.nnz,
                  add.indptr[:-1].astype(np.int32), add.indices.astype(np.int32), add.data)
        waiting, slack = waiting[~broken], slack[~broken]
    basis = h.getBasis().col_status
    nonbasic = np.array([s in (_highs.HighsBasisStatus.kLower, _highs.HighsBasisStatus.kUpper)
                         for s in basis])
    reduced = np.where(nonbasic, np.array(h.getSolution().col_dual), 0.0)
    return Relaxation(0, x, float(h.getInfo().objective_function_value), reduced)
