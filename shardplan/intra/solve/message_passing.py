"""A plan for the intra-op ILP by sequential message passing (SRMP: Kolmogorov's sequential
tree-reweighted message passing, "A new look at reweighted message passing", 2015), for when
HiGHS's LP relaxation does not end in time (mip.solve).

The ILP without memory rows is a pairwise energy: a cost per node's choice, a matrix per edge,
an implication an edge of infinite entries. Message passing reparameterizes it, moving cost
between each node and its edges so that every plan's energy stays the same: node by node in
order, every incident edge's least cost per choice is collected into the node, then a share of
the node's cost is handed on to its edges toward later nodes; forward, then backward. The sum
of every node's and edge's least cost is a lower bound of any plan (the LP relaxation's dual
objective at that point) that never falls; after each pass the nodes, chosen in order each the
cheapest given the nodes chosen before it, then improved by best responses
(presolve.improved), give a plan.

It is no proof: the bound approaches the LP's from below, slowly. It is a plan near the optimum
in a few seconds where the LP takes half a minute: Gemma 3 cut to 2 layers on 2x4 under the
tpu-v5e profile, whose core of 392 nodes and 219k pair columns HiGHS's dual simplex solves in
25-35 s (its optimum integral, 0.400 ms), gets a plan of 0.409 ms after 10 iterations (0.7 s)
and of 0.401 ms after 30; the greedy choices cost 2.10 ms
(tests/test_intra_solve_message_passing.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from shardplan.intra.solve import presolve, types
from shardplan.intra.solve.types import SolverInput

# Iterations (a forward and a backward pass each) between two plans read off the messages.
ROUND = 5


class _Energy:
    """The SolverInput as a pairwise energy in arrays that message passing changes in place:
    node costs, edge matrices [a's choice, b's choice] with a before b, each node's edges."""

    def __init__(self, inp: SolverInput, extra=()):
        """`extra`: more (a, b, matrix) edges, after the input's and its implications'."""
        edges = [(a, b, np.asarray(m, float)) for a, b, m in inp.edges]
        for r in inp.implications:
            when, allowed = np.asarray(r.when, bool), np.asarray(r.allowed, bool)
            edges.append((r.a, r.b, np.where(when[:, None] & ~allowed[None, :], np.inf, 0.0)))
        self.first_extra = len(edges)
        edges += [(a, b, np.asarray(m, float)) for a, b, m in extra]
        nodes = [np.asarray(c, float) for c in inp.node_costs]
        # An infinite cost as a finite one above any plan's: the bound stays a bound (of an
        # energy no dearer), and the arithmetic stays finite.
        total = sum(_finite_max(c) for c in nodes) + sum(_finite_max(m) for _, _, m in edges)
        big = 10.0 * total + 1.0
        self.nodes = [np.where(np.isfinite(c), c, big) for c in nodes]
        self._given = [a < b for a, b, _ in edges]  # as given, or transposed to a < b
        self.edges = [(a, b, np.where(np.isfinite(m), m, big)) if a < b
                      else (b, a, np.where(np.isfinite(m), m, big).T) for a, b, m in edges]
        self.incident: list[list[int]] = [[] for _ in nodes]
        for k, (a, b, _) in enumerate(self.edges):
            self.incident[a].append(k)
            self.incident[b].append(k)

    def bound(self) -> float:
        return (sum(float(c.min()) for c in self.nodes if c.size)
                + sum(float(m.min()) for _, _, m in self.edges if m.size))

    def sweep(self, forward: bool) -> None:
        """One pass over the nodes: each collects its edges' least costs, then hands an
        even share of its cost to the edges toward the nodes after it in this pass."""
        order = range(len(self.nodes)) if forward else range(len(self.nodes) - 1, -1, -1)
        for i in order:
            cost = self.nodes[i]
            if not cost.size:
                continue
            onward = []
            for k in self.incident[i]:
                a, b, m = self.edges[k]
                if a == i:
                    least = m.min(axis=1)
                    m -= least[:, None]
                else:
                    least = m.min(axis=0)
                    m -= least[None, :]
                cost += least
                other = b if a == i else a
                if (other > i) == forward:
                    onward.append(k)
            share = 1.0 / max(len(onward), len(self.incident[i]) - len(onward), 1)
            for k in onward:
                a, _, m = self.edges[k]
                if a == i:
                    m += share * cost[:, None]
                else:
                    m += share * cost[None, :]
            cost *= 1.0 - share * len(onward)

    def add(self, nodes: list[np.ndarray], extra: list[np.ndarray]) -> None:
        """Each node's choices cost `nodes` more, each extra edge's pairs `extra` more: the
        messages so far stay a reparameterization of the new energy, and go on from there."""
        for cost, more in zip(self.nodes, nodes):
            cost += more
        for k, more in enumerate(extra):
            m = self.edges[self.first_extra + k][2]
            m += more if self._given[self.first_extra + k] else more.T

    def passes(self, iterations: int) -> None:
        for _ in range(iterations):
            self.sweep(forward=True)
            self.sweep(forward=False)

    def decode(self) -> tuple[int, ...]:
        """Node by node, the cheapest choice given the nodes chosen before it."""
        choice: list[int] = []
        for i, cost in enumerate(self.nodes):
            score = cost.copy()
            for k in self.incident[i]:
                a, b, m = self.edges[k]
                if b == i:  # a < i: chosen already
                    score += m[choice[a], :]
            choice.append(int(np.argmin(score)))
        return tuple(choice)


def _copy_bytes(c: types.Copy) -> np.ndarray:
    """A copy's bytes for each pair of its members' choices (Copy.size, as a matrix)."""
    differ = np.asarray(c.key_a)[:, None] != np.asarray(c.key_b)[None, :]
    grown = np.asarray(c.bytes_a, float)[:, None] + np.asarray(c.bytes_b, float)[None, :]
    return np.where(differ, np.maximum(grown, 0.0), 0.0)


def _finite_max(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(np.abs(a).max()) if a.size else 0.0


def labelling(inp: SolverInput, iterations: int,
              remaining: Callable[[], float] = lambda: math.inf
              ) -> tuple[tuple[int, ...] | None, float, float]:
    """(the cheapest plan found, its objective, the lower bound reached) after at most
    `iterations` iterations of message passing, fewer when `remaining()` (seconds) runs out;
    (None, inf, bound) when no plan found keeps every implication."""
    energy = _Energy(inp)
    best: tuple[float, tuple[int, ...] | None] = (math.inf, None)
    done = 0
    while done < iterations:
        energy.passes(min(ROUND, iterations - done))
        done += ROUND
        choice = presolve.improved(inp, energy.decode())
        value = types.objective(inp, choice)
        if value < best[0]:
            best = (value, choice)
        if remaining() <= 0:
            break
    return best[1], best[0], energy.bound()


# Under a memory budget (fitting): the weights of memory tried, each this many times the last,
# from where a byte costs what the dearest choice does over the largest buffer, and then the
# halvings (geometric) between the dearest weight whose plan broke the budget and the least
# whose plan kept it.
GROWTH = 10.0
WEIGHTS = 8
HALVINGS = 4


def fitting(inp: SolverInput, iterations: int,
            remaining: Callable[[], float] = lambda: math.inf
            ) -> tuple[tuple[int, ...] | None, float]:
    """Under `inp.memory_budget`: (the cheapest plan found that fits, its objective), or
    (None, inf). Message passing on each choice's cost plus w times the most bytes it holds in
    any moment (a Lagrangian weight of memory, as greedy.choices weighs it): w = 0 first, then
    growing until a plan fits, then halved geometrically between the last that broke the
    budget and the first that kept it; a reshard's copy weighs its bytes on the pair of choices
    that make it. Each weight's plan is decoded after `iterations` iterations, the messages
    carried from one weight to the next; best responses under the weighted costs keep memory
    weighed. `remaining()`: seconds left, checked between weights."""
    budget = inp.memory_budget
    offsets, base, rows, _ = inp.memory_matrices
    held = np.maximum(base, rows.max(axis=0).toarray().ravel()) if rows.shape[0] else base
    held = [held[offsets[n]:offsets[n + 1]] for n in range(inp.num_nodes)]
    copies = [(c.a, c.b, _copy_bytes(c)) for c in inp.copies]
    dearest = max([_finite_max(np.asarray(c, float)) for c in inp.node_costs] + [1e-12])
    unit = dearest / max([float(h.max()) for h in held if h.size]
                         + [float(m.max()) for _, _, m in copies if m.size] + [1.0])
    energy = _Energy(inp, [(a, b, np.zeros_like(m)) for a, b, m in copies])
    best: tuple[float, tuple[int, ...] | None] = (math.inf, None)
    weight = 0.0

    def plan_at(w: float) -> bool:
        """Whether the plan at memory weight `w` fits (the cheapest kept in `best`)."""
        nonlocal best, weight
        energy.add([(w - weight) * h for h in held], [(w - weight) * m for _, _, m in copies])
        weight = w
        energy.passes(iterations)
        weighted = inp.replace(
            node_costs=tuple(np.asarray(c, float) + w * h for c, h in zip(inp.node_costs, held)),
            edges=(*inp.edges, *((a, b, w * m) for a, b, m in copies)))
        choice = presolve.improved(weighted, energy.decode())
        value, peak = types.evaluate(inp, choice)
        if not (math.isfinite(value) and peak <= budget):
            return False
        if value < best[0]:
            best = (value, choice)
        return True

    if plan_at(0.0):
        return best[1], best[0]
    low, high = 0.0, unit
    for _ in range(WEIGHTS):
        if remaining() <= 0:
            return best[1], best[0]
        if plan_at(high):
            break
        low, high = high, high * GROWTH
    else:
        return best[1], best[0]
    for _ in range(HALVINGS):
        if remaining() <= 0:
            break
        middle = math.sqrt(low * high) if low > 0 else high / GROWTH
        if plan_at(middle):
            high = middle
        else:
            low = middle
    return best[1], best[0]
