"""The exact presolve (dead-end elimination, chains eliminated) against brute force: the
reduced problem's optimum, expanded, is an optimum of the whole, with ties, forbidden choices,
and nodes that memory rows keep."""

import dataclasses
import itertools

import numpy as np
import pytest

from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import presolve
from shardplan.intra.solve.brute_force import brute_force
from shardplan.intra.solve.ilp import solve
from shardplan.intra.solve.types import InfeasibleMemory, SolverInput, evaluate

# Solves limited by their work, not the wall clock: the verdicts hold at any load.
WORK = SolverSettings(time_limit=10, deterministic=True)


def chain_problem(seed, n=8, k=4, with_memory=False, ties=False):
    """Random costs on a chain with a few chords (nodes of degree 1 to 4), some forbidden
    choices, integer costs when `ties` (many equal choices)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, k + 1, size=n)

    def draw(*shape):
        x = rng.integers(0, 3, size=shape).astype(float) if ties else rng.uniform(0, 1, shape)
        x[rng.uniform(size=shape) < 0.08] = np.inf
        return x

    costs = tuple(draw(s) for s in sizes)
    edges = [(b - 1, b, draw(sizes[b - 1], sizes[b])) for b in range(1, n)]
    for _ in range(2):
        a, b = sorted(rng.choice(n, size=2, replace=False))
        edges.append((int(a), int(b), draw(sizes[a], sizes[b])))
    rows, budget = (), None
    if with_memory:
        rows = tuple(tuple((int(i), rng.integers(1, 10, size=sizes[i]).astype(float))
                           for i in rng.choice(n, size=2, replace=False)) for _ in range(2))
        budget = float(rng.uniform(8, 18))
    return SolverInput(costs, tuple(edges), rows, budget, solver=WORK)


def best_expanded(inp):
    """The optimum of the reduced problem by brute force, expanded."""
    reduced = presolve.reduce(inp)
    core = reduced.inp
    best = None
    for choice in itertools.product(*(range(len(c)) for c in core.node_costs)):
        full = reduced.expand(choice)
        obj, peak = evaluate(inp, full)
        if inp.memory_budget is not None and peak > inp.memory_budget:
            continue
        if best is None or obj < best[0]:
            best = (obj, full)
    return reduced, best


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("with_memory", [False, True])
def test_presolve_keeps_an_optimum(seed, ties, with_memory):
    inp = chain_problem(seed, with_memory=with_memory, ties=ties)
    try:
        ref = brute_force(inp)
    except InfeasibleMemory:
        return
    if not np.isfinite(ref.objective):
        return  # every choice forbidden
    reduced, best = best_expanded(inp)
    assert best is not None
    assert best[0] == pytest.approx(ref.objective, rel=1e-9, abs=1e-12)
    if not with_memory:
        # the chain and its chords reduce to a core of at most the chords' ends
        assert reduced.inp.num_nodes <= 4
    sol = solve(inp)
    assert sol.optimal and sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-9)


def test_nodes_in_memory_rows_keep_every_choice():
    inp = chain_problem(1, with_memory=True)
    reduced = presolve.reduce(inp)
    named = {n for row in inp.memory_rows for n, _ in row}
    assert named <= set(reduced.core)
    for n in named:
        assert len(reduced.keep[n]) == len(inp.node_costs[n])


def test_a_dominated_choice_goes_and_a_tree_vanishes():
    # node 1's choice 1 costs more than its choice 0 and its edge row is no cheaper
    costs = (np.array([1.0, 2.0]), np.array([0.0, 5.0]), np.array([3.0, 0.0]))
    edges = ((0, 1, np.array([[0.0, 1.0], [2.0, 2.0]])),
             (1, 2, np.array([[1.0, 0.0], [0.0, 0.0]])))
    inp = SolverInput(costs, edges)
    reduced = presolve.reduce(inp)
    assert reduced.inp.num_nodes == 0  # a chain is solved by elimination alone
    choice = reduced.expand(())
    assert evaluate(inp, choice)[0] == brute_force(inp).objective
    assert choice == brute_force(inp).choice


def test_hint_survives_when_its_choices_do():
    inp = dataclasses.replace(chain_problem(2, n=12), hint=None)
    assert presolve.reduce(inp).inp.hint is None
