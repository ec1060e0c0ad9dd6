"""Implication rows (ilp.Implication: a member's choices in `when` force another's into
`allowed`, as intra/combiner/gradient_latency.py turns a switch on) against the infinite-entry edges they replace and
brute force: presolve keeps or settles them exactly, HiGHS and CP-SAT forbid what they forbid,
and the ways back (canonical, greedy) never break one."""

import dataclasses
import itertools

import numpy as np
import pytest
from ortools.sat.python import cp_model

from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import cpsat, greedy, mip, presolve
from shardplan.intra.solve.brute_force import brute_force
from shardplan.intra.solve.ilp import solve
from shardplan.intra.solve.types import Implication, SolverInput, evaluate

# Solves limited by their work, not the wall clock: the verdicts hold at any load.
WORK = SolverSettings(time_limit=10, deterministic=True)

ON = np.array([False, True])


def as_edges(inp: SolverInput) -> SolverInput:
    """The same problem with each row written as an edge of infinite entries (as combiner/gradient_latency.py did)."""
    rows = tuple((r.a, r.b, np.where(r.when[:, None] & ~r.allowed[None, :], np.inf, 0.0))
                 for r in inp.implications)
    return dataclasses.replace(inp, implications=(), edges=inp.edges + rows)


def switch_problem(seed, n=7, k=4, switches=2, ties=False):
    """A chain with a chord, and `switches` two-choice switches (off free, on dear) that some members'
    choices turn on."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, k + 1, size=n)

    def draw(*shape):
        return rng.integers(0, 3, size=shape).astype(float) if ties else rng.uniform(0, 1, shape)

    costs = [draw(s) for s in sizes]
    edges = [(b - 1, b, draw(sizes[b - 1], sizes[b])) for b in range(1, n)]
    a, b = sorted(rng.choice(n, size=2, replace=False))
    edges.append((int(a), int(b), draw(sizes[a], sizes[b])))
    rows = []
    for h in range(switches):
        costs.append(np.array([0.0, float(rng.uniform(0.2, 1.5))]))
        for m in rng.choice(n, size=3, replace=False):
            when = rng.uniform(size=sizes[m]) < 0.5
            rows.append(Implication(int(m), when, n + h, ON))
    return SolverInput(tuple(costs), tuple(edges), solver=WORK,
                       implications=tuple(rows))


def test_evaluate_prices_a_broken_row_infinite():
    inp = SolverInput((np.array([0.0, 1.0]), np.array([0.0, 5.0])),
                      implications=(Implication(0, np.array([True, False]), 1, ON),))
    assert evaluate(inp, (0, 0))[0] == np.inf
    assert evaluate(inp, (0, 1))[0] == 5.0
    assert evaluate(inp, (1, 0))[0] == 1.0


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("ties", [False, True])
def test_rows_solve_as_their_edges_do(seed, ties):
    inp = switch_problem(seed, ties=ties)
    ref = brute_force(inp)
    assert ref.objective == pytest.approx(brute_force(as_edges(inp)).objective, abs=1e-12)
    reduced = presolve.reduce(inp)
    core = reduced.inp
    best = min(evaluate(inp, reduced.expand(c))[0]
               for c in itertools.product(*(range(len(c)) for c in core.node_costs)))
    assert best == pytest.approx(ref.objective, rel=1e-9, abs=1e-12)
    sol = solve(inp)
    assert sol.optimal and sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-9)
    assert all(r.holds(sol.choice) for r in inp.implications)


def _solve_cpsat(inp):
    model, x = cpsat.build_model(inp, minimise_memory=False)
    solver = cpsat.solver_for(inp)
    assert solver.Solve(model) == cp_model.OPTIMAL
    return tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)


def test_highs_and_cpsat_forbid_reducing_with_the_switch_off():
    # member 0's choice 0 is cheapest but turns the switch on (5): choice 1 and the switch off win;
    # without the row, choice 0 with the switch off would (0)
    inp = SolverInput((np.array([0.0, 1.0, 3.0]), np.array([0.0, 5.0])),
                      implications=(Implication(0, np.array([True, False, False]), 1, ON),))
    for status_choice in (mip.solve(inp), ("optimal", _solve_cpsat(inp))):
        assert status_choice == ("optimal", (1, 0))
    cheap_switch = dataclasses.replace(inp, node_costs=(inp.node_costs[0], np.array([0.0, 0.5])))
    assert mip.solve(cheap_switch) == ("optimal", (0, 1))
    assert _solve_cpsat(cheap_switch) == (0, 1)


def test_presolve_keeps_the_row_of_a_member_in_the_core():
    # member 2 has three neighbours: it stays, and so does its row, renumbered
    rng = np.random.default_rng(0)
    costs = tuple(rng.uniform(0, 1, 3) for _ in range(4)) + (np.array([0.0, 0.3]),)
    edges = tuple((i, 2, rng.uniform(0, 1, (3, 3))) for i in (0, 1, 3))
    edges += ((0, 1, rng.uniform(0, 1, (3, 3))), (1, 3, rng.uniform(0, 1, (3, 3))),
              (0, 3, rng.uniform(0, 1, (3, 3))))
    # choice 0 of member 2 is free of cost and of the row's edges' reach: the row matters
    costs = costs[:2] + (np.array([0.0, 0.6, 0.6]),) + costs[3:]
    inp = SolverInput(costs, edges, implications=(
        Implication(2, np.array([True, False, False]), 4, ON),))
    reduced = presolve.reduce(inp)
    assert 2 in reduced.core and 4 in reduced.core
    (row,) = reduced.inp.implications
    assert (reduced.core[row.a], reduced.core[row.b]) == (2, 4)
    assert len(row.when) == len(reduced.inp.node_costs[row.a])
    assert solve(inp).objective == pytest.approx(brute_force(inp).objective)


def test_presolve_settles_rows_it_can():
    # member 0 has one choice, and it turns the switch on: the switch is forced on, no row is left;
    # member 1's free choice is as cheap as its reducing one whatever node 2 does: it drops
    # its row and keeps the free choice
    costs = (np.array([1.0]), np.array([0.0, 0.0]), np.array([0.0, 1.0]), np.array([0.0, 0.7]),
             np.array([0.0, 0.9]))
    edges = ((1, 2, np.array([[0.0, 1.0], [0.0, 1.0]])),)
    rows = (Implication(0, np.array([True]), 3, ON),
            Implication(1, np.array([False, True]), 4, ON))
    inp = SolverInput(costs, edges, implications=rows)
    reduced = presolve.reduce(inp)
    assert reduced.inp.implications == ()
    choice = reduced.expand(tuple(0 for _ in reduced.inp.node_costs))
    assert choice[3] == 1 and choice[1] == 0 and choice[4] == 0
    assert evaluate(inp, choice)[0] == brute_force(inp).objective


def test_canonical_and_greedy_keep_the_rows():
    # member 0's choices tie; moving it to its first (choice 0) would break the row with the
    # switch off, so canonical leaves it; greedy turns the switch on where a member reduces
    inp = SolverInput((np.array([1.0, 1.0]), np.array([0.0, 0.0, 2.0]), np.array([0.0, 0.5])),
                      edges=((0, 1, np.zeros((2, 3))),),
                      implications=(Implication(0, np.array([True, False]), 2, ON),
                                    Implication(1, np.array([True, False, False]), 2, ON)))
    assert presolve.canonical(inp, (1, 1, 0)) == (1, 1, 0)
    assert presolve.canonical(inp, (1, 0, 1)) == (0, 0, 1)
    for choice in greedy.choices(inp):
        assert all(r.holds(choice) for r in inp.implications)
