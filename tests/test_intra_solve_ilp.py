"""The CP-SAT ILP against brute force on seeded random problems."""

import numpy as np
import pytest

from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve.brute_force import brute_force
from shardplan.intra.solve.ilp import solve
from shardplan.intra.solve.types import InfeasibleMemory, SolverInput, evaluate

# Solves limited by their work, not the wall clock: the verdicts hold at any load.
WORK = SolverSettings(time_limit=10, deterministic=True)


def random_problem(seed, n=5, k=3, with_memory=False):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, k + 1, size=n)
    costs = tuple(rng.uniform(0, 1, size=s) for s in sizes)
    edges = []
    for b in range(1, n):
        for a in rng.choice(b, size=min(b, 2), replace=False):
            edges.append((int(a), b, rng.uniform(0, 2, size=(sizes[a], sizes[b]))))
    rows, budget = (), None
    if with_memory:
        rows = tuple(tuple((int(i), rng.integers(1, 10, size=sizes[i]).astype(float))
                           for i in rng.choice(n, size=3, replace=False)) for _ in range(2))
        budget = float(rng.uniform(8, 25))
    return SolverInput(costs, tuple(edges), rows, budget, solver=WORK)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("with_memory", [False, True])
def test_ilp_matches_brute_force(seed, with_memory):
    inp = random_problem(seed, with_memory=with_memory)
    try:
        ref = brute_force(inp)
    except InfeasibleMemory as e:
        with pytest.raises(InfeasibleMemory) as got:
            solve(inp)
        assert got.value.min_bytes == pytest.approx(e.min_bytes, rel=1e-6, abs=1)
        return
    sol = solve(inp)
    assert sol.optimal
    assert sol.objective == pytest.approx(ref.objective, rel=1e-5, abs=1e-6)
    if inp.memory_budget is not None:
        assert evaluate(inp, sol.choice)[1] <= inp.memory_budget


def test_same_input_same_plan():
    inp = random_problem(3, n=8, k=4, with_memory=True)
    try:
        a, b = solve(inp), solve(inp)
    except InfeasibleMemory:
        pytest.skip("random budget infeasible")
    assert a.choice == b.choice


def test_infeasible_budget_reports_smallest_memory():
    costs = (np.array([0.0, 1.0]), np.array([0.0, 1.0]))
    rows = ((((0, np.array([8.0, 4.0]))), (1, np.array([8.0, 2.0]))),)
    inp = SolverInput(costs, (), rows, memory_budget=5.0)
    with pytest.raises(InfeasibleMemory, match="smallest any plan needs") as e:
        solve(inp)
    assert e.value.min_bytes == 6.0
    # with room, the memory constraint picks the cheapest choice that fits
    inp = SolverInput(costs, (), rows, memory_budget=10.0)
    assert solve(inp).choice in ((0, 1), (1, 0))
    assert solve(inp).objective == 1.0


def test_compress_edge_is_exact():
    from shardplan.intra.solve.cpsat import compress_edge

    rng = np.random.default_rng(0)
    base = rng.uniform(size=(3, 4))
    m = base[[0, 1, 0, 2, 1]][:, [3, 0, 0, 1, 2, 3]]
    m[0, 0] = m[2, 0] = m[0, 5] = m[2, 5] = np.inf
    rows, cols, reduced = compress_edge(m)
    assert reduced.shape == (3, 4)
    np.testing.assert_array_equal(reduced[rows][:, cols], m)


def test_joint_ties_are_broken_the_same_way_every_run():
    """Chains whose every node may take either of two specs at the same cost, as long as the
    chain agrees (a value split on one dimension or the other): node-by-node canonicalisation
    cannot move a chain, and HiGHS can return either optimum depending on the wall clock (the
    zoo's MoE on 2x4 planned two ways, half and half: tests/test_golden_plans.py). The
    solver's fixed perturbation makes one of them the optimum, the same in every run."""
    agree = np.array([[0.0, 1.0], [1.0, 0.0]])
    costs, edges = [], []
    for _ in range(4):
        base = len(costs)
        costs += [np.full(2, 0.5)] * 3
        edges += [(base + i, base + i + 1, agree) for i in range(2)]
    inp = SolverInput(tuple(costs), tuple(edges), solver=WORK)
    sols = [solve(inp) for _ in range(6)]
    assert len({s.choice for s in sols}) == 1
    assert sols[0].optimal
    assert sols[0].objective == pytest.approx(brute_force(inp).objective)


def test_time_is_kept_for_cp_sat_when_highs_finds_no_plan_that_fits(monkeypatch):
    """Under a budget and a deadline HiGHS has MIP_SHARE of the time; when it finds nothing
    (and no fallback fits) CP-SAT looks for any plan that fits, rows added lazily, instead of
    a SearchTimeout while a plan that fits exists."""
    import dataclasses

    from shardplan.intra.solve import greedy, ilp, mip, rows, types
    from shardplan.units import Deadline

    rng = np.random.default_rng(0)
    n, k = 12, 3
    costs = tuple(rng.uniform(0, 1, size=k) for _ in range(n))
    edges = tuple((i, i + 1, rng.uniform(0, 1, size=(k, k))) for i in range(n - 1))
    # more rows than one round, so they are added lazily; the budget fits the smallest layouts
    memory_rows = tuple(tuple((int(i), np.array([8.0, 4.0, 2.0]))
                              for i in rng.choice(n, 4, False))
                        for _ in range(3 * rows.PER_ROUND))
    inp = SolverInput(costs, edges, memory_rows, 20.0, solver=SolverSettings(time_limit=5),
                      deadline=Deadline(5.0))
    seen = []

    def no_plan(sub):
        seen.append(sub.remaining())
        return "timeout", None

    monkeypatch.setattr(mip, "solve", no_plan)
    monkeypatch.setattr(greedy, "choices", lambda _: [])
    sol = solve(inp)
    assert sol.solver == "cp-sat" and not sol.optimal
    assert evaluate(inp, sol.choice)[1] <= 20.0
    assert seen and max(seen) <= 5.0 * 1.2 * ilp.MIP_SHARE + 1e-6  # 1.2: the grace
    # without a deadline nothing is kept back: HiGHS's timeout is the search's
    with pytest.raises(types.SearchTimeout):
        solve(dataclasses.replace(inp, deadline=None))
    # where a fallback fits, HiGHS has all the time, and the fallback is returned
    seen.clear()
    smallest = (2,) * n
    monkeypatch.setattr(greedy, "choices", lambda _: [smallest])
    sol = solve(dataclasses.replace(inp, deadline=Deadline(5.0)))
    assert sol.solver == "fallback" and sol.choice == smallest
    assert max(seen) > 5.0 * 1.2 * ilp.MIP_SHARE
