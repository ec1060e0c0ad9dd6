"""Exact reductions of an intra-op SolverInput before the solver sees it, and the way back.

Two reductions, repeated until neither applies, on the nodes no memory term names (with a
budget, a node in a memory row keeps every choice and its place):

- dead-end elimination (Goldstein's criterion): choice a of node i goes when another choice b
  costs no more whatever the neighbours choose: c[b] - c[a] + sum_j max_l (M_j[b, l] -
  M_j[a, l]) <= 0. Strictly dominated choices are in no optimum; of two equal ones the first
  stays.
- variable elimination: a node with one choice left moves its edges into its neighbours' costs;
  a node with one neighbour adds min_l (M[k, l] + c[l]) to it; a node with two neighbours i, h
  becomes the edge min_l (M_i[k, l] + c[l] + M_h[l, m]) (series reduction, as in dynamic
  programming on a chain). What stays is the core of nodes of degree three or more.

Both keep an optimum: the core's optimum, expanded back (each eliminated node at its best given
its neighbours, in reverse order), is an optimum of the whole problem. Layers are chains of such
nodes, so a transformer layer's ILP shrinks about 3x in nodes (GPT-2 1.5B on 8x8: 522 -> 157).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: ilp imports this module
    from shardplan.intra.ilp import SolverInput

# Relative tolerance for two choices to cost the same (float sums of the same costs in another
# order); a tie keeps the first choice.
TIE = 1e-9
# An infinite cost in comparisons (inf - inf is nan): larger than any sum of finite costs.
_BIG = 1e200


@dataclasses.dataclass(frozen=True, eq=False)
class Reduced:
    """The reduced problem and what expands its choices back to the original's."""

    inp: SolverInput
    core: tuple[int, ...]  # original node of each reduced node
    keep: tuple[np.ndarray, ...]  # per original node: its original choices still allowed
    # Eliminated nodes in order: (node, its choices then (original indices), its costs then,
    # neighbours, their choices then, matrices [node's choice, neighbour's choice]).
    steps: tuple[tuple, ...]

    def expand(self, choice) -> tuple[int, ...]:
        """The original problem's choice (original strategy indices) of a reduced choice."""
        out = {n: int(self.keep[n][k]) for n, k in zip(self.core, choice)}
        for n, own, cost, nbs, theirs, mats in reversed(self.steps):
            score = cost.copy()
            for j, cols, m in zip(nbs, theirs, mats):
                # A neighbour may have lost choices since: its pick is among those it had.
                score = score + m[:, int(np.flatnonzero(cols == out[j])[0])]
            out[n] = int(own[int(np.argmin(score))])
        return tuple(out[n] for n in range(len(self.keep)))

    @property
    def identity(self) -> bool:
        return not self.steps and all(len(k) == len(c) for k, c in
                                      zip(self.keep, self.inp.node_costs))


def _frozen(inp: SolverInput) -> set[int]:
    """Nodes a memory term names: they keep their choices (a choice's bytes are not compared)."""
    if inp.memory_budget is None:
        return set()
    out = {n for n, _ in inp.memory_base}
    out |= {n for row in inp.memory_rows for n, _ in row}
    out |= {n for c in inp.copies for n in (c.a, c.b)}
    return out


def _dominated(cost: np.ndarray, mats: list[np.ndarray], tol: float) -> np.ndarray:
    """Mask of choices that Goldstein's criterion removes (of equals, the first stays)."""
    c = np.where(np.isfinite(cost), cost, _BIG)
    d = c[:, None] - c[None, :]  # d[b, a]: what b costs more than a, at worst
    for m in mats:
        m = np.where(np.isfinite(m), m, _BIG)
        d = d + (m[:, None, :] - m[None, :, :]).max(axis=-1)
    np.fill_diagonal(d, np.inf)
    dead = (d < -tol).any(axis=0)
    # Strictly dominated choices are in no optimum: all go at once. Among ties, in order, a
    # choice goes when one still kept is as good (so the first of equals stays).
    ties = np.flatnonzero(~dead & (d <= tol).any(axis=0))
    for a in ties:
        if (~dead & (d[:, a] <= tol)).any():
            dead[a] = True
    return dead


def reduce(inp: SolverInput) -> Reduced:
    """The core of `inp` (see the module's docstring) and how to expand its choices."""
    n = inp.num_nodes
    frozen = _frozen(inp)
    keep = [np.flatnonzero(np.isfinite(c)) if i not in frozen and np.isfinite(c).any()
            else np.arange(len(c)) for i, c in enumerate(inp.node_costs)]
    cost = [np.asarray(c, dtype=float)[k] for c, k in zip(inp.node_costs, keep)]
    nb: list[dict[int, np.ndarray]] = [{} for _ in range(n)]  # nb[i][j]: [i's choice, j's]
    for a, b, m in inp.edges:
        m = np.asarray(m, dtype=float)[np.ix_(keep[a], keep[b])]
        if a == b:
            cost[a] = cost[a] + np.diagonal(m)
            continue
        nb[a][b] = nb[a][b] + m if b in nb[a] else m
        nb[b][a] = nb[a][b].T
    finite = [abs(x) for c in cost for x in c[np.isfinite(c)]]
    tol = TIE * max(finite, default=1.0)
    alive = [True] * n
    steps = []
    queue, queued = list(range(n)), set(range(n))
    while queue:
        j = queue.pop(0)
        queued.discard(j)
        if not alive[j] or j in frozen:
            continue
        touched = []
        if len(cost[j]) > 1:
            dead = _dominated(cost[j], [nb[j][i] for i in sorted(nb[j])], tol)
            if dead.any() and not dead.all():
                live = ~dead
                keep[j], cost[j] = keep[j][live], cost[j][live]
                for i in nb[j]:
                    nb[j][i] = nb[j][i][live]
                    nb[i][j] = nb[j][i].T
                touched += list(nb[j])
        nbs = sorted(nb[j])
        if len(cost[j]) == 1 or len(nbs) <= 2:
            mats = tuple(nb[j][i] for i in nbs)
            if len(cost[j]) == 1:
                for i, m in zip(nbs, mats):
                    cost[i] = cost[i] + m[0]
            elif len(nbs) == 1:
                i = nbs[0]
                cost[i] = cost[i] + np.min(mats[0].T + cost[j][None, :], axis=1)
            elif len(nbs) == 2:
                i, h = nbs
                m = np.min(mats[0].T[:, :, None] + cost[j][None, :, None]
                           + mats[1][None, :, :], axis=1)
                nb[i][h] = nb[i][h] + m if h in nb[i] else m
                nb[h][i] = nb[i][h].T
            for i in nbs:
                del nb[i][j]
            steps.append((j, keep[j], cost[j], tuple(nbs), tuple(keep[i] for i in nbs),
                          mats))
            nb[j] = {}
            alive[j] = False
            touched += nbs
        for i in touched:
            if alive[i] and i not in queued:
                queue.append(i)
                queued.add(i)
    core = tuple(i for i in range(n) if alive[i])
    index = {i: r for r, i in enumerate(core)}
    edges = tuple((index[a], index[b], nb[a][b]) for a in core for b in sorted(nb[a]) if a < b)
    hint = None
    if inp.hint is not None:
        local = [np.flatnonzero(keep[i] == inp.hint[i]) for i in core]
        if all(len(x) for x in local):
            hint = tuple(int(x[0]) for x in local)

    def terms(row):
        return tuple((index[m], mem) for m, mem in row)

    reduced = dataclasses.replace(
        inp, node_costs=tuple(cost[i] for i in core), edges=edges, hint=hint,
        memory_base=terms(inp.memory_base),
        memory_rows=tuple(terms(row) for row in inp.memory_rows),
        copies=tuple(c._replace(a=index[c.a], b=index[c.b]) for c in inp.copies))
    return Reduced(reduced, core, tuple(keep), tuple(steps))


def canonical(inp: SolverInput, choice, rounds: int = 20) -> tuple[int, ...]:
    """The same-cost choice that takes, node by node, the first of its equal choices given its
    neighbours' (repeated until none moves). A solver may return any of several optima: this
    maps those that differ by such ties to one, so that the plan does not depend on the
    solver's path. Without a memory budget only (a move could overflow a row)."""
    if inp.memory_budget is not None:
        return tuple(choice)
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(inp.num_nodes)]
    for a, b, m in inp.edges:
        adj[a].append((b, np.asarray(m)))
        adj[b].append((a, np.asarray(m).T))
    finite = [abs(x) for c in inp.node_costs for x in np.asarray(c)[np.isfinite(c)]]
    tol = TIE * max(finite, default=1.0)
    choice = list(choice)
    for _ in range(rounds):
        moved = False
        for i, c in enumerate(inp.node_costs):
            score = np.asarray(c, dtype=float).copy()
            for j, m in adj[i]:
                score = score + m[:, choice[j]]
            first = int(np.flatnonzero(score <= score[choice[i]] + tol)[0])
            if first < choice[i]:
                choice[i], moved = first, True
        if not moved:
            break
    return tuple(choice)
