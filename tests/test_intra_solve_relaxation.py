"""shardplan.intra.solve.relaxation: the LP relaxation with its memory rows added lazily has the bound
of the LP solved at once, and reduced costs that bound every column's cost of being used."""

import numpy as np
import pytest
from scipy import optimize, sparse

from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import mip, relaxation
from shardplan.intra.solve.types import SolverInput

# Solves limited by their work, not the wall clock: the verdicts hold at any load.
WORK = SolverSettings(time_limit=10, deterministic=True)


def budgeted(seed, n=7, k=4, rows=5):
    """Random costs on odd cycles (a fractional relaxation) where the cheap choices are the
    big ones, under a budget that the LP without memory rows breaks."""
    rng = np.random.default_rng(seed)
    costs = tuple(rng.uniform(0, 1, k) for _ in range(n))
    pairs = sorted({(i, (i + 1) % n) for i in range(n)} | {(0, 2), (3, 5), (1, 4)})
    edges = tuple((min(a, b), max(a, b), rng.uniform(0, 1, (k, k))) for a, b in pairs)
    nbytes = [np.argsort(np.argsort(-c)) * 100.0 + rng.uniform(0, 10, k) for c in costs]
    members = [sorted(rng.choice(n, size=4, replace=False)) for _ in range(rows)]
    memory_rows = tuple(tuple((int(i), nbytes[i]) for i in m) for m in members)
    budget = max(sum(float(nbytes[i].min()) for i in m) for m in members) + 150.0
    return SolverInput(costs, edges, memory_rows=memory_rows, memory_budget=budget,
                       solver=WORK)


def _arrays(inp):
    model, _ = mip._sparse(inp)
    rows, cols, vals = (np.concatenate(t) for t in zip(*model.triplets))
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(model.num_rows, model.num_vars))
    obj, lb, ub = (np.concatenate(a) for a in (model.obj, model.lb, model.ub))
    lazy = np.zeros(model.num_rows, bool)
    lazy[model.budget_rows] = True
    return obj, lb, ub, matrix, np.concatenate(model.rlo), np.concatenate(model.rhi), lazy


@pytest.mark.parametrize("seed", range(6))
def test_lazy_rows_give_the_bound_and_reduced_costs_of_the_whole_lp(seed):
    obj, lb, ub, matrix, rlo, rhi, lazy = _arrays(budgeted(seed))
    whole = relaxation.solve_at_once(obj, lb, ub, matrix, rlo, rhi, WORK, presolve=True)
    lazily = relaxation.solve_lazily(obj, lb, ub, matrix, rlo, rhi, lazy, WORK)
    free = relaxation.solve_at_once(obj, lb, ub, matrix[~lazy], rlo[~lazy], rhi[~lazy], WORK,
                                    presolve=True)
    assert whole.status == lazily.status == free.status == 0
    assert free.fun < whole.fun - 1e-6  # the memory rows bind: some were added
    assert lazily.fun == pytest.approx(whole.fun, rel=1e-9, abs=1e-9)
    assert np.all(matrix[lazy] @ lazily.x <= rhi[lazy] + 1e-6)
    # A column's reduced cost bounds the LP with that column at 1 from below (what the MIP's
    # column fixing relies on)
    eq = rlo == rhi
    for j in np.flatnonzero(lazily.reduced > 1e-6)[:12]:
        lo = lb.copy()
        lo[j] = 1.0
        fixed = optimize.linprog(obj, A_ub=matrix[~eq], b_ub=rhi[~eq], A_eq=matrix[eq],
                                 b_eq=rhi[eq], bounds=np.stack([lo, ub], axis=1),
                                 method="highs")
        if fixed.status == 0:
            assert fixed.fun >= lazily.fun + lazily.reduced[j] - 1e-7


def test_lazy_rows_that_no_plan_keeps_are_infeasible():
    inp = budgeted(0)
    obj, lb, ub, matrix, rlo, rhi, lazy = _arrays(inp)
    rhi = np.where(lazy, 1.0, rhi)  # a budget below every choice's bytes
    assert relaxation.solve_lazily(obj, lb, ub, matrix, rlo, rhi, lazy, WORK).status == 2


def test_without_scipys_highs_binding_the_lp_is_solved_at_once(monkeypatch):
    obj, lb, ub, matrix, rlo, rhi, lazy = _arrays(budgeted(1))
    lazily = relaxation.solve_lazily(obj, lb, ub, matrix, rlo, rhi, lazy, WORK)
    monkeypatch.setattr(relaxation, "_highs", None)
    once = relaxation.solve_lazily(obj, lb, ub, matrix, rlo, rhi, lazy, WORK)
    assert once.status == lazily.status == 0
    assert once.fun == pytest.approx(lazily.fun, rel=1e-9)
