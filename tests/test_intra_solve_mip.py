"""The MIP of shardplan.intra.solve.mip: ties broken the same way whatever presolve does, and a
fractional LP relaxation finished by a MIP over the columns its reduced costs leave, proven
optimal against brute force."""

import numpy as np
import pytest
from scipy import optimize

from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import mip, presolve
from shardplan.intra.solve.brute_force import brute_force
from shardplan.intra.solve.ilp import solve
from shardplan.intra.solve.types import SolverInput, evaluate

# Solves limited by their work, not the wall clock: the verdicts hold at any load.
WORK = SolverSettings(time_limit=10, deterministic=True)


def _unreduced(inp):
    """A presolve that reduces nothing."""
    return presolve.Reduced(inp, tuple(range(inp.num_nodes)),
                            tuple(np.arange(len(c)) for c in inp.node_costs), ())


def tie_problem(ring, tail):
    """A ring of `ring` nodes after a chain of `tail` nodes hanging off it: every node takes
    either of two choices at the same cost as long as its neighbours agree (two optima, all
    first or all second); presolve leaves the ring's two nodes of degree 3."""
    agree = np.array([[0.0, 1.0], [1.0, 0.0]])
    edges = [(tail + i, tail + (i + 1) % ring) for i in range(ring)]
    edges += [(i, i + 1) for i in range(tail - 1)] + [(tail - 1, tail), (0, tail + 1)]
    edges = sorted((min(a, b), max(a, b)) for a, b in edges)
    return SolverInput((np.full(2, 0.5),) * (ring + tail),
                       tuple((a, b, agree) for a, b in edges), solver=WORK)


def test_a_presolve_change_leaves_the_tie_broken_as_it_was(monkeypatch):
    """The tie-break is keyed on the node and choice as given, not as presolve left them: the
    same plan with presolve reducing nothing (before, it was drawn per node of the core, and
    the first case flipped)."""
    cases = [tie_problem(ring, tail) for ring in (3, 4, 5) for tail in (2, 3, 5)]
    plans = [solve(inp).choice for inp in cases]
    for inp, plan in zip(cases, plans):
        assert presolve.reduce(inp).inp.num_nodes < inp.num_nodes
        assert evaluate(inp, plan)[0] == brute_force(inp).objective
    monkeypatch.setattr(presolve, "reduce", _unreduced)
    assert [solve(inp).choice for inp in cases] == plans


def frustrated(seed, n=7, k=4):
    """Random costs on a graph of odd cycles where two cheap choices of each node would
    rather differ from their neighbours' (a little: no plan can on an odd cycle, so the LP
    relaxation is fractional, each node half one, half the other) and the other choices are
    dear (their reduced costs rule them out)."""
    rng = np.random.default_rng(seed)
    costs = tuple(np.concatenate([rng.uniform(0, 0.01, 2), 5 + rng.uniform(0, 1, k - 2)])
                  for _ in range(n))
    pairs = {(i, (i + 1) % n) for i in range(n)} | {(0, 2), (3, 5), (1, 4)}
    edges = []
    for a, b in sorted((min(p), max(p)) for p in pairs):
        m = rng.uniform(0, 1, (k, k))
        m[:2, :2] = [[0.02, 0.0], [0.0, 0.02]]
        edges.append((a, b, m))
    return SolverInput(costs, tuple(edges), solver=WORK)


@pytest.mark.parametrize("seed", range(8))
def test_a_fractional_relaxation_is_finished_on_fewer_columns(seed, monkeypatch):
    inp = mip.perturbed(frustrated(seed))
    model, _ = mip._sparse(inp)
    calls = []
    real = optimize.milp

    def spy(c, *args, **kwargs):
        calls.append(len(c))
        return real(c, *args, **kwargs)

    monkeypatch.setattr(optimize, "milp", spy)
    status, choice = mip.solve(inp)
    assert status == "optimal"
    assert evaluate(inp, choice)[0] == pytest.approx(brute_force(inp).objective, rel=1e-12)
    # the relaxation was fractional, and one MIP over part of the columns proved the optimum
    assert len(calls) == 1 and calls[0] < model.num_vars
