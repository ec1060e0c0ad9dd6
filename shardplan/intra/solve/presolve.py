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

Implication rows (types.Implication) take part as the edges of infinite entries they stand for
in the first, and are settled where they can be: a row that always or never applies goes
(forcing its other node, or nothing), a node with one choice settles its rows, and a node named
only as a row's `a` is eliminated when a choice no row names serves its neighbours as well as
any (it keeps those choices only); a node that stays in a row otherwise stays in the core.

Both keep an optimum: the core's optimum, expanded back (each eliminated node at its best given
its neighbours, in reverse order), is an optimum of the whole problem. Layers are chains of such
nodes, so a transformer layer's ILP keeps a fraction of its nodes
(tests/test_intra_solve_presolve.py::test_presolve_keeps_an_optimum checks the expansion).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.intra.solve.types import SolverInput

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


class _Core:
    """The problem as presolve shrinks it: each node's choices left (original indices) and
    their costs, the edges between live nodes, the implication rows left."""

    def __init__(self, inp: SolverInput):
        n = inp.num_nodes
        self.frozen = _frozen(inp)
        self.keep = [np.flatnonzero(np.isfinite(c)) if i not in self.frozen
                     and np.isfinite(c).any() else np.arange(len(c))
                     for i, c in enumerate(inp.node_costs)]
        self.cost = [np.asarray(c, dtype=float)[k] for c, k in zip(inp.node_costs, self.keep)]
        self.nb: list[dict[int, np.ndarray]] = [{} for _ in range(n)]  # [i's choice, j's]
        for a, b, m in inp.edges:
            m = np.asarray(m, dtype=float)[np.ix_(self.keep[a], self.keep[b])]
            if a == b:
                self.cost[a] = self.cost[a] + np.diagonal(m)
                continue
            self.nb[a][b] = self.nb[a][b] + m if b in self.nb[a] else m
            self.nb[b][a] = self.nb[a][b].T
        # rows[r] = [a, when, b, allowed, the row given] over the choices left, None once dropped
        self.rows: list[list | None] = []
        self.rows_of: list[set[int]] = [set() for _ in range(n)]
        for r in inp.implications:
            self.rows_of[r.a].add(len(self.rows))
            self.rows_of[r.b].add(len(self.rows))
            self.rows.append([r.a, np.asarray(r.when, bool)[self.keep[r.a]], r.b,
                              np.asarray(r.allowed, bool)[self.keep[r.b]], r])

    def partners(self, j: int) -> list[int]:
        return sorted({x for r in self.rows_of[j] for x in (self.rows[r][0], self.rows[r][2])}
                      - {j})

    def virtual(self, j: int) -> list[np.ndarray]:
        """j's rows as the edges they stand for (infinite where they forbid a pair)."""
        out = []
        for r in sorted(self.rows_of[j]):
            a, when, _, allowed, _ = self.rows[r]
            m = when[:, None] & ~allowed[None, :]
            out.append(np.where(m if a == j else m.T, np.inf, 0.0))
        return out

    def restrict(self, j: int, live: np.ndarray) -> list[int]:
        """Keep j's choices in `live` (a frozen node's others get an infinite cost); the
        nodes touched."""
        if live.all() or not live.any():
            return []
        if j in self.frozen:
            self.cost[j] = np.where(live, self.cost[j], np.inf)
            return []
        self.keep[j], self.cost[j] = self.keep[j][live], self.cost[j][live]
        for i in self.nb[j]:
            self.nb[j][i] = self.nb[j][i][live]
            self.nb[i][j] = self.nb[j][i].T
        for r in self.rows_of[j]:
            row = self.rows[r]
            if row[0] == j:
                row[1] = row[1][live]
            else:
                row[3] = row[3][live]
        return list(self.nb[j]) + self.partners(j)

    def settle(self, j: int) -> list[int]:
        """Drop j's rows that forbid nothing or always apply (forcing their other node); the
        nodes touched."""
        touched = []
        for r in sorted(self.rows_of[j]):
            a, when, b, allowed, _ = self.rows[r]
            if when.any() and not allowed.all():
                if not allowed.any() and not when.all():
                    touched += self.restrict(a, ~when)
                elif when.all() and allowed.any():
                    touched += self.restrict(b, allowed)
                else:
                    continue
            self.rows[r] = None
            self.rows_of[a].discard(r)
            self.rows_of[b].discard(r)
            touched += [a, b]
        return touched

    def free_of_rows(self, j: int, nbs: list[int]) -> list[int]:
        """Drop j's rows when j, in them only as their `a`, can take a choice none of them
        names at no cost to its 0-2 neighbours whatever they choose: j keeps those choices
        only. (Otherwise j stays in the core: what it leaves its neighbours would depend on the
        rows' other nodes.) The nodes touched."""
        if any(self.rows[r][2] == j for r in self.rows_of[j]):
            return []
        free = ~np.any([self.rows[r][1] for r in self.rows_of[j]], axis=0)
        if not free.any():
            return []
        full = _series(self.cost[j], [self.nb[j][i] for i in nbs])
        part = _series(self.cost[j][free], [self.nb[j][i][free] for i in nbs])
        if not np.array_equal(full, part):
            return []
        return self.restrict(j, free) + self.settle(j)


def _series(cost: np.ndarray, mats: list[np.ndarray]) -> np.ndarray:
    """What eliminating a node with these costs and matrices leaves its 0-2 neighbours."""
    if not mats:
        return np.min(cost, keepdims=True)
    if len(mats) == 1:
        return np.min(mats[0].T + cost[None, :], axis=1)
    return np.min(mats[0].T[:, :, None] + cost[None, :, None] + mats[1][None, :, :], axis=1)


def reduce(inp: SolverInput) -> Reduced:
    """The core of `inp` (see the module's docstring) and how to expand its choices."""
    n = inp.num_nodes
    st = _Core(inp)
    keep, cost, nb, frozen = st.keep, st.cost, st.nb, st.frozen
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
        touched = st.settle(j)
        if len(cost[j]) > 1:
            dead = _dominated(cost[j], [nb[j][i] for i in sorted(nb[j])] + st.virtual(j), tol)
            if dead.any() and not dead.all():
                touched += st.restrict(j, ~dead)
                touched += st.settle(j)
        nbs = sorted(nb[j])
        if st.rows_of[j] and len(nbs) <= 2 and len(cost[j]) > 1:
            touched += st.free_of_rows(j, nbs)
        if not st.rows_of[j] and (len(cost[j]) == 1 or len(nbs) <= 2):
            mats = tuple(nb[j][i] for i in nbs)
            if len(cost[j]) == 1:
                for i, m in zip(nbs, mats):
                    cost[i] = cost[i] + m[0]
            elif len(nbs) == 1:
                i = nbs[0]
                cost[i] = cost[i] + _series(cost[j], list(mats))
            elif len(nbs) == 2:
                i, h = nbs
                m = _series(cost[j], list(mats))
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
    rows = tuple(given._replace(a=index[a], when=when, b=index[b], allowed=allowed)
                 for a, when, b, allowed, given in (r for r in st.rows if r is not None))
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
        copies=tuple(c._replace(a=index[c.a], b=index[c.b]) for c in inp.copies),
        implications=rows)
    return Reduced(reduced, core, tuple(keep), tuple(steps))


def canonical(inp: SolverInput, choice, rounds: int = 20) -> tuple[int, ...]:
    """The same-cost choice that takes, node by node, the first of its equal choices given its
    neighbours' (repeated until none moves). A solver may return any of several optima: this
    maps those that differ by such ties to one, so that the plan does not depend on the
    solver's path. Without a memory budget only (a move could overflow a row)."""
    if inp.memory_budget is not None:
        return tuple(choice)
    return _moves(inp, choice, rounds, lambda score, k, tol: min(
        k, int(np.flatnonzero(score <= score[k] + tol)[0])))


def improved(inp: SolverInput, choice, rounds: int = 50) -> tuple[int, ...]:
    """`choice` after best responses: node by node, the cheapest choice given its neighbours'
    (no row broken, memory not weighed), repeated until none moves: a cheap plan near it."""
    return _moves(inp, choice, rounds, lambda score, k, tol: int(np.argmin(score))
                  if score.min() < score[k] - tol else k)


def _moves(inp: SolverInput, choice, rounds: int, move) -> tuple[int, ...]:
    """Visit the nodes in turn, each moving to `move(its score per choice given the others,
    its choice, tolerance)`, until a round moves none (or `rounds` rounds)."""
    adj: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(inp.num_nodes)]
    for a, b, m in inp.edges:
        adj[a].append((b, np.asarray(m)))
        adj[b].append((a, np.asarray(m).T))
    finite = [abs(x) for c in inp.node_costs for x in np.asarray(c)[np.isfinite(c)]]
    tol = TIE * max(finite, default=1.0)
    rows_of: list[list] = [[] for _ in range(inp.num_nodes)]
    for r in inp.implications:
        rows_of[r.a].append(r)
        rows_of[r.b].append(r)
    choice = list(choice)
    for _ in range(rounds):
        moved = False
        for i, c in enumerate(inp.node_costs):
            score = np.asarray(c, dtype=float).copy()
            for j, m in adj[i]:
                score = score + m[:, choice[j]]
            for r in rows_of[i]:  # no move may break a row
                if r.a == i and not r.allowed[choice[r.b]]:
                    score = np.where(r.when, np.inf, score)
                if r.b == i and r.when[choice[r.a]]:
                    score = np.where(r.allowed, score, np.inf)
            k = move(score, choice[i], tol)
            if k != choice[i]:
                choice[i], moved = k, True
        if not moved:
            break
    return tuple(choice)
