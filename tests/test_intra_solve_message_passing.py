"""Message passing (shardplan.intra.solve.message_passing): its bound never above the optimum and
never falling, its plans real plans, exact on a chain, and the plan a MIP whose LP relaxation
was cut short returns; under a memory budget, a plan that keeps it, the budgeted ILP's fallback."""

import itertools

import numpy as np
import pytest

from shardplan.intra import settings
from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import ilp, message_passing, mip
from shardplan.intra.solve.brute_force import brute_force
from shardplan.intra.solve.types import (
    Copy,
    Implication,
    SolverInput,
    evaluate,
    objective,
)

WORK = SolverSettings(time_limit=10, deterministic=True)


def random_problem(seed, n=6, k=3, extra=4):
    """A ring of n nodes with `extra` chords, random costs, some choices and pairs forbidden
    (infinite) and an implication."""
    rng = np.random.default_rng(seed)
    costs = [rng.uniform(0, 1, k) for _ in range(n)]
    costs[1][0] = np.inf
    pairs = {(i, (i + 1) % n) for i in range(n)}
    while len(pairs) < n + extra:
        a, b = sorted(rng.choice(n, 2, replace=False))
        pairs.add((int(a), int(b)))
    edges = []
    for a, b in sorted((min(p), max(p)) for p in pairs):
        m = rng.uniform(0, 2, (k, k))
        m[rng.integers(k), rng.integers(k)] = np.inf
        edges.append((a, b, m))
    rule = Implication(4, np.array([True, False, False]), 2, np.array([False, True, True]))
    return SolverInput(tuple(costs), tuple(edges), solver=WORK, implications=(rule,))


@pytest.mark.parametrize("seed", range(6))
def test_the_bound_is_below_the_optimum_and_the_plan_above_it(seed):
    inp = random_problem(seed)
    best = brute_force(inp).objective
    bounds = []
    for iterations in (1, 5, 20):
        choice, value, bound = message_passing.labelling(inp, iterations)
        assert value == objective(inp, choice)  # a plan, every implication kept
        assert bound <= best + 1e-9 <= value + 2e-9
        bounds.append(bound)
    # more iterations never lower the bound (but by rounding, once it has converged)
    assert all(b >= a - 1e-12 * abs(a) for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_is_solved_exactly(seed):
    """On a chain the LP relaxation is tight and a forward and a backward pass are dynamic
    programming: the optimum, and the bound equal to it."""
    rng = np.random.default_rng(seed)
    n, k = 7, 3
    costs = tuple(rng.uniform(0, 1, k) for _ in range(n))
    edges = tuple((i, i + 1, rng.uniform(0, 1, (k, k))) for i in range(n - 1))
    inp = SolverInput(costs, edges, solver=WORK)
    _, value, bound = message_passing.labelling(inp, 1)
    assert value == pytest.approx(brute_force(inp).objective, rel=1e-12)
    assert bound == pytest.approx(value, rel=1e-9)


def test_a_cut_short_lp_leaves_message_passings_plan(monkeypatch):
    """Where the LP relaxation of a MIP of MESSAGE_COLUMNS columns or more does not end (here
    one simplex iteration is all it gets), mip.solve returns message passing's plan, not the
    MIP's in the time left (before: HiGHS's first incumbent, Gemma 3's 5.5 ms against the
    optimum's 0.400 ms on 2x4 under tpu-v5e)."""
    inp = random_problem(3)
    monkeypatch.setattr(mip, "MESSAGE_COLUMNS", 0)
    monkeypatch.setattr(settings, "SIMPLEX_ITERATIONS_PER_S", 1)
    cut = inp.replace(solver=WORK.replace(time_limit=1.0))
    status, choice = mip.solve(cut)
    expected, value, _ = message_passing.labelling(cut, mip.MESSAGE_ITERATIONS)
    assert (status, choice) == ("feasible", expected)
    assert value == pytest.approx(brute_force(inp).objective, rel=1e-9)
    # a small MIP keeps no time for it, and runs the MIP after its cut-short LP
    monkeypatch.setattr(mip, "MESSAGE_COLUMNS", 10**9)
    assert mip.solve(cut)[0] in ("optimal", "feasible")


def budgeted_problem(seed, n=6, k=3):
    """random_problem with a buffer per node's choice in one of two moments, a reshard copy
    between nodes 0 and 1, and a budget the cheapest plan breaks but some plan keeps."""
    inp = random_problem(seed, n, k)
    rng = np.random.default_rng(seed + 100)
    mem = [rng.uniform(1, 10, k) for _ in range(n)]
    for m, c in zip(mem, inp.node_costs):
        m[int(np.argmin(c))] *= 4  # the cheap choices hold the most
    rows = (tuple((i, mem[i]) for i in range(0, n, 2)), tuple((i, mem[i]) for i in range(1, n, 2)))
    copy = Copy(0, np.arange(k), rng.uniform(1, 5, k), 1, np.arange(k), rng.uniform(1, 5, k))
    inp = inp.replace(memory_rows=rows, copies=(copy,), row_copies=((0,), ()))
    free = brute_force(inp).choice
    least = min(evaluate(inp, c)[1] for c in itertools.product(range(k), repeat=n)
                if np.isfinite(evaluate(inp, c)[0]))
    return inp.replace(memory_budget=(least + evaluate(inp, free)[1]) / 2)


@pytest.mark.parametrize("seed", range(6))
def test_message_passing_under_a_budget_finds_a_plan_that_keeps_it(seed):
    inp = budgeted_problem(seed)
    choice, value = message_passing.fitting(inp, 5)
    obj, peak = evaluate(inp, choice)
    assert peak <= inp.memory_budget and obj == value
    assert value >= brute_force(inp).objective - 1e-9


def test_a_budgeted_ilp_starts_from_message_passings_plan(monkeypatch):
    """On a large problem (here every problem) under a budget, message passing's plan that fits
    is among the fallbacks: the MIP's first incumbent, and the answer where it finds none in
    time (here it gets one branch-and-bound node and one simplex iteration)."""
    inp = budgeted_problem(2)
    fitted, value = message_passing.fitting(inp, ilp.FIT_ITERATIONS)
    monkeypatch.setattr(mip, "MESSAGE_COLUMNS", 0)
    assert any(c == fitted for _, c, _ in ilp._fallbacks(inp))
    monkeypatch.setattr(settings, "SIMPLEX_ITERATIONS_PER_S", 1)
    monkeypatch.setattr(settings, "MIP_NODES_PER_S", 1)
    found = ilp.solve(inp.replace(solver=WORK.replace(time_limit=1.0)))
    assert found.objective <= value + 1e-12
    assert found.peak_memory <= inp.memory_budget
