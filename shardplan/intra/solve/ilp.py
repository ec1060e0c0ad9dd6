"""The intra-operator ILP: one strategy per node, minimising node and edge costs under a
per-device memory budget (as in Alpa, section 4.2), reduced exactly (presolve.py), then solved
as a MIP with HiGHS (mip.py; CP-SAT where HiGHS is missing) and, for the least memory,
with CP-SAT (cpsat.py)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import numpy as np
import scipy.sparse
from ortools.sat.python import cp_model

from shardplan import progress
from shardplan.intra.settings import SolverSettings
from shardplan.intra.solve import cpsat, mip, presolve
from shardplan.units import Deadline, fmt_bytes


class Copy(NamedTuple):
    """A buffer that exists only when two members' layouts of one value differ (a reshard's
    copy): bytes_a[k] + bytes_b[l] when key_a[k] != key_b[l], else nothing; never less than
    nothing (a copy that grows one buffer to another's size: bytes_a < 0). Keys name layouts;
    equal keys have equal bytes."""

    a: int
    key_a: np.ndarray
    bytes_a: np.ndarray
    b: int
    key_b: np.ndarray
    bytes_b: np.ndarray

    def size(self, k: int, l: int) -> float:
        if self.key_a[k] == self.key_b[l]:
            return 0.0
        return max(0.0, float(self.bytes_a[k] + self.bytes_b[l]))


class Implication(NamedTuple):
    """A choice of member a in `when` forces member b to one in `allowed` (a row of the ILP:
    sum of a's choices in `when` <= sum of b's in `allowed`). The same as an edge with an
    infinite cost at [k, l] for k in `when`, l not in `allowed`, without the edge's pair
    variables, and without making a a neighbour of b in presolve (intra/combiner/gradient_latency.py: a member
    that reduces a gradient over some mesh axes turns their hub on)."""

    a: int
    when: np.ndarray
    b: int
    allowed: np.ndarray

    def holds(self, choice) -> bool:
        return not self.when[choice[self.a]] or bool(self.allowed[choice[self.b]])


_MEMORY_FIELDS = {"memory_rows", "memory_base", "copies", "row_copies"}


@dataclasses.dataclass(frozen=True, eq=False)
class SolverInput:
    """Everything the solver sees. Costs are in seconds, memory in bytes per device.

    node_costs[i][k]: cost of node i choosing strategy k.
    edges: (a, b, C) with C[k, l] the cost when a chooses k and b chooses l.
    memory_rows: each row is a list of (node, bytes per strategy) whose sum, plus
      memory_base and the copies row_copies names, must stay within memory_budget; a row is
      one moment of the step with the buffers alive then.
    memory_base: (node, bytes per strategy) of the buffers alive at every moment.
    copies, row_copies: reshard copies (Copy) and, per row, the indices of those alive then.
    implications: rows that forbid some pairs of two nodes' choices (Implication).
    hint: a known feasible choice (for example all replicated) to start the search from.
    solver: each solve's limits, seed and workers (settings.SolverSettings).
    deadline: the wall clock the whole search must end by (None where the solves are limited
      by their work: the same plan for the same input at any load).
    """

    node_costs: tuple[np.ndarray, ...]
    edges: tuple[tuple[int, int, np.ndarray], ...] = ()
    memory_rows: tuple[tuple[tuple[int, np.ndarray], ...], ...] = ()
    memory_budget: float | None = None
    solver: SolverSettings = dataclasses.field(default_factory=SolverSettings)
    hint: tuple[int, ...] | None = None
    memory_base: tuple[tuple[int, np.ndarray], ...] = ()
    copies: tuple[Copy, ...] = ()
    row_copies: tuple[tuple[int, ...], ...] = ()
    deadline: Deadline | None = None
    implications: tuple[Implication, ...] = ()

    def remaining(self) -> float:
        return self.deadline.remaining() if self.deadline is not None else float("inf")

    def row_peaks(self, choice) -> list[float]:
        """Bytes per device at each row's moment under `choice`."""
        offsets, base, rows, row_copies = self._memory_matrices
        cols = offsets[:-1] + np.asarray(choice, dtype=np.int64)
        fixed = float(base[cols].sum())
        if not self.memory_rows:
            return [fixed] if self.memory_base else []
        picked = np.zeros(offsets[-1])
        picked[cols] = 1.0
        total = rows @ picked + fixed
        if row_copies is not None:
            sizes = np.array([c.size(choice[c.a], choice[c.b]) for c in self.copies])
            total = total + row_copies @ sizes
        return total.tolist()

    @functools.cached_property
    def _memory_matrices(self):
        """The memory terms over (node, choice) columns, node n's choices at offsets[n]...:
        the base as a vector, the rows as a sparse matrix, each row's copies as a 0/1 matrix,
        so that row_peaks is two products (summed term by term in Python, a 48-layer GPT's
        rows took 46 of the 106 s its budgeted search ran)."""
        offsets = np.concatenate([[0], np.cumsum([len(c) for c in self.node_costs])]).astype(
            np.int64)
        base = np.zeros(offsets[-1])
        for n, mem in self.memory_base:
            base[offsets[n]:offsets[n + 1]] += mem
        terms = [t for row in self.memory_rows for t in row]
        lens = np.array([len(mem) for _, mem in terms], dtype=np.int64)
        starts = offsets[np.array([n for n, _ in terms], dtype=np.int64)] if terms else lens
        cols = (np.repeat(starts, lens) + np.arange(int(lens.sum()))
                - np.repeat(np.cumsum(lens) - lens, lens))
        vals = np.concatenate([np.asarray(mem, dtype=float) for _, mem in terms]) if terms else (
            np.zeros(0))
        per_row = np.array([sum(len(mem) for _, mem in row) for row in self.memory_rows],
                           dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(per_row)])
        rows = scipy.sparse.csr_matrix((vals, cols, indptr),
                                       shape=(len(self.memory_rows), offsets[-1]))
        row_copies = None
        if self.copies and self.row_copies:
            named = [np.asarray(js, dtype=np.int64) for js in self.row_copies]
            counts = np.array([len(js) for js in named], dtype=np.int64)
            row_copies = scipy.sparse.csr_matrix(
                (np.ones(int(counts.sum())), np.concatenate(named),
                 np.concatenate([[0], np.cumsum(counts)])),
                shape=(len(self.memory_rows), len(self.copies)))
        return offsets, base, rows, row_copies

    def replace(self, **changes) -> SolverInput:
        """dataclasses.replace, keeping the memory matrices where only costs change (the
        tie-breaks, the experts' seeds: Llama 7B on 2x4 under 80 GB made them 5 times, 1 s each)."""
        out = dataclasses.replace(self, **changes)
        if "_memory_matrices" in self.__dict__ and not changes.keys() & _MEMORY_FIELDS and [
                len(c) for c in out.node_costs] == [len(c) for c in self.node_costs]:
            out.__dict__["_memory_matrices"] = self._memory_matrices
        return out

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)


@dataclasses.dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    objective: float
    peak_memory: float
    optimal: bool
    solver: str


class InfeasibleMemory(Exception):
    """No strategy choice fits the memory budget (proven); `min_bytes` is the least any choice
    needs, or, when `exact` is False, a lower bound of it (the search for the least ran out of
    time: every plan needs more than the budget, and at least min_bytes); `found_bytes` is
    the least a plan found by that search needs (nan if none was: the least lies in
    [min_bytes, found_bytes])."""

    def __init__(self, budget: float, min_bytes: float, exact: bool = True, margin: float = 0.0,
                 found_bytes: float = float("nan")):
        self.budget, self.min_bytes, self.exact = budget, min_bytes, exact
        self.found_bytes = min_bytes if exact else found_bytes
        found = ("" if exact or not math.isfinite(found_bytes)
                 else f", and a plan that needs {fmt_bytes(found_bytes)} was found")
        need = (f"the smallest any plan needs is {fmt_bytes(min_bytes)} per device" if exact
                else f"every plan needs more than the budget (at least "
                     f"{fmt_bytes(max(min_bytes, budget))} per device; the search for the "
                     f"least ran out of time{found})")
        if margin:
            need += f" (the memory model's estimate, its activations with a margin of {margin:.0%})"
        super().__init__(
            f"no plan fits the memory budget of {fmt_bytes(budget)} per device; {need}. Raise "
            "the budget, use more devices, or shrink the model or batch")


class SearchTimeout(RuntimeError):
    """The time limit ran out before any plan that fits the budget was found (one may exist)."""

    def __init__(self, time_limit_s: float, what: str = ""):
        self.time_limit_s = time_limit_s
        super().__init__(
            f"the time limit of {time_limit_s:g} s ran out before a plan that fits was found"
            f"{': ' + what if what else ''}; raise time_limit (a plan may exist: this is not "
            "a proof that none fits)")


def evaluate(inp: SolverInput, choice) -> tuple[float, float]:
    """(objective, peak memory) of a choice."""
    return presolve.objective(inp, choice), max(inp.row_peaks(choice), default=0.0)


def brute_force(inp: SolverInput) -> Solution:
    """Try every choice: the reference the ILP is tested against on tiny problems."""
    best = None
    for choice in itertools.product(*(range(len(c)) for c in inp.node_costs)):
        obj, peak = evaluate(inp, choice)
        if inp.memory_budget is not None and peak > inp.memory_budget:
            continue
        if best is None or obj < best[0] - 1e-12:
            best = (obj, peak, choice)
    if best is None:
        raise InfeasibleMemory(inp.memory_budget, _min_peak_brute(inp))
    return Solution(tuple(best[2]), best[0], best[1], True, "brute-force")


def _min_peak_brute(inp: SolverInput) -> float:
    return min(evaluate(inp, c)[1] for c in itertools.product(
        *(range(len(c)) for c in inp.node_costs)))


ROWS_PER_ROUND = 8
# Under a memory budget and a deadline, where no fallback (the hint, the greedy choices) fits:
# HiGHS's share of the time; the rest is kept for CP-SAT to find any plan that fits if HiGHS
# found none (solve, _any_fitting).
MIP_SHARE = 0.7


def _restrict(inp: SolverInput, active) -> SolverInput:
    """The same problem with only the memory rows in `active` (and the copies they name)."""
    active = sorted(active)
    named = [np.asarray(inp.row_copies[r], dtype=np.int64) for r in active] if (
        inp.row_copies) else []
    used = np.unique(np.concatenate(named)) if named else np.zeros(0, np.int64)
    return dataclasses.replace(
        inp, memory_rows=tuple(inp.memory_rows[r] for r in active),
        row_copies=tuple(np.searchsorted(used, js) for js in named),
        copies=tuple(inp.copies[j] for j in used))


def _top_rows(inp: SolverInput, choice, above: float = -1.0, skip=()) -> list[int]:
    peaks = np.asarray(inp.row_peaks(choice)[:len(inp.memory_rows)])
    order = [int(r) for r in np.argsort(-peaks, kind="stable")
             if peaks[r] > above and int(r) not in skip]
    return order[:ROWS_PER_ROUND]


def _first_rows(inp: SolverInput) -> set[int]:
    """The rows that peak under all-first choices (replicated) and under each node's
    smallest: where the step's memory piles up, whatever the plan."""
    first = set(_top_rows(inp, inp.hint or tuple(0 for _ in inp.node_costs)))
    last = {n: mem for n, mem in inp.memory_base + tuple(t for row in inp.memory_rows
                                                         for t in row)}
    smallest = [int(np.argmin(last[n])) if n in last else 0 for n in range(inp.num_nodes)]
    return first | set(_top_rows(inp, tuple(smallest)))


class _Infeasible(Exception):
    pass


def solve(inp: SolverInput) -> Solution:
    """The best choice the solver finds within the time limit (optimal if it proves so).

    The problem is first reduced exactly (shardplan.intra.solve.presolve: dominated choices and
    chains go). Memory rows are added lazily: solve with the rows where memory piles up,
    evaluate every row at the solution, add the rows it overflows, again until none does. A
    subset of the rows has fewer constraints, so its optimum that fits every row is the
    optimum, and its infeasibility proves the whole problem's."""
    if inp.num_nodes == 0:
        return Solution((), 0.0, 0.0, True, "empty")
    budget = inp.memory_budget
    whole, fits = inp, None
    if budget is not None and budget < _simple_bound(inp):
        # Below what every node at its smallest holds: no plan fits, no search needed (HiGHS's
        # lazy LP spent a 1-byte budget's time limit on the MoE at test size on 2x4 proving it)
        value, exact, least = least_memory(inp)
        raise InfeasibleMemory(budget, value, exact, found_bytes=least)
    if budget is not None and (inp.deadline is not None or inp.solver.deterministic):
        fits = _fallbacks(inp)
    kept = fits == []
    if kept and inp.deadline is not None:
        # No fallback fits: HiGHS gets most of the time, the rest is kept for CP-SAT to find
        # any plan that fits (a fallback that fits leaves HiGHS all of it: gpt-6.7b on 8x8,
        # 80 GB, found its plan after 70% of the 30 s)
        inp = inp.replace(deadline=Deadline(inp.deadline.remaining() * MIP_SHARE, grace=0.0))
    perturbed = mip.perturbed(inp)
    lazy = budget is not None and len(inp.memory_rows) > ROWS_PER_ROUND
    active = _first_rows(inp) if lazy else set(range(len(inp.memory_rows)))
    # the cheapest fallback that fits bounds the MIP's search from above (mip.py)
    hint = min(fits)[1] if fits else inp.hint
    reporter, rounds = inp.solver.progress, 0
    while True:
        # Presolve sees the active rows only: a node no active row names is eliminated as
        # without a budget (gpt-6.7b on 8x8, 80 GB: a core of 456 nodes, not 730)
        sub = _restrict(perturbed, active) if lazy else perturbed
        rounds += 1
        try:
            with progress.phase(reporter, "presolve"):
                reduced = presolve.reduce(dataclasses.replace(sub, hint=hint))
            with progress.phase(reporter, f"MIP (HiGHS), {len(active)} memory rows" if lazy
                                else "MIP (HiGHS)", rounds if lazy else None):
                found = _solve_rows(reduced.inp)
        except _Infeasible:
            value, exact, least = least_memory(whole)
            raise InfeasibleMemory(budget, value, exact, found_bytes=least) from None
        if found is None:
            break
        choice = reduced.expand(found.choice)
        obj, peak = evaluate(inp, choice)
        over = _top_rows(inp, choice, budget, active) if lazy else []
        if not over:
            return Solution(choice, obj, peak, found.optimal, found.solver)
        active |= set(over)
        hint = None
        if inp.remaining() <= 0:
            break
    # Out of time: the cheapest of the hint and the greedy choices that fits.
    fits = _fallbacks(inp) if fits is None else fits
    if fits:
        obj, choice, peak = min(fits)
        return Solution(choice, obj, peak, False, "fallback")
    if kept and (found := _any_fitting(whole, active if lazy else None)):
        return found
    limit = inp.deadline.limit_s if inp.deadline is not None else inp.solver.time_limit
    raise SearchTimeout(limit, "the ILP found no plan that fits within its time limit")


def without_memory(inp: SolverInput) -> SolverInput:
    """The same problem with no memory budget (nor rows): a relaxation of it, and the
    fast one to solve (presolve eliminates what no row names, the LP is often integral)."""
    return dataclasses.replace(inp, memory_budget=None, memory_rows=(), memory_base=(),
                               copies=(), row_copies=())


def _fallbacks(inp: SolverInput) -> list[tuple[float, tuple[int, ...], float]]:
    """(objective, choice, peak) of the hint and the greedy choices that fit the budget."""
    fits = []
    for fallback in (inp.hint, *greedy_choices(inp)):
        if fallback is None:
            continue
        obj, peak = evaluate(inp, fallback)
        if np.isfinite(obj) and (inp.memory_budget is None or peak <= inp.memory_budget):
            fits.append((obj, tuple(fallback), peak))
    return fits


def _any_fitting(inp: SolverInput, active: set[int] | None) -> Solution | None:
    """A plan that fits the budget, found by CP-SAT in the time kept from HiGHS (which can spend
    it all on a tight budget finding none: llama at test size on 8 devices, 30 s, a budget
    1.25x the least found), rows added lazily as in solve; None if none is found in time."""
    while inp.remaining() > 0:
        sub = _restrict(inp, active) if active is not None else inp
        model, x = cpsat.build_model(sub, minimise_memory=False)
        solver = cpsat.solver_for(sub)
        if cpsat.solve(solver, model, sub, "any plan that fits",
                       minimise_memory=False) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        choice = tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)
        obj, peak = evaluate(inp, choice)
        over = _top_rows(inp, choice, inp.memory_budget, active) if active is not None else []
        if not over and np.isfinite(obj) and peak <= inp.memory_budget:
            return Solution(choice, obj, peak, False, "cp-sat")
        if not over:
            return None
        active = active | set(over)
    return None


def greedy_choices(inp: SolverInput) -> list[tuple[int, ...]]:
    """Cheap choices for when the search ran out of time: node by node, the cheapest given the
    nodes already chosen (edges to them included), with memory weighed not at all, some, and
    above all (then each node takes its smallest layout that costs least)."""
    offsets, base, rows, _ = inp._memory_matrices
    if rows.shape[0]:
        # the most a choice weighs in any row, or in the base (rows' bytes are never negative)
        base = np.maximum(base, rows.max(axis=0).toarray().ravel())
    mem = [base[offsets[n]:offsets[n + 1]] for n in range(inp.num_nodes)]
    adj: dict[int, list[tuple[int, np.ndarray]]] = {}
    for a, b, m in inp.edges:
        # oriented [this node's choice, the other's]
        adj.setdefault(b, []).append((a, np.asarray(m).T))
        adj.setdefault(a, []).append((b, np.asarray(m)))
    forced: dict[int, list[Implication]] = {}
    for r in inp.implications:
        forced.setdefault(max(r.a, r.b), []).append(r)
    biggest = max([float(np.max(m)) for m in mem] + [1.0])
    scale = max([float(np.max(np.where(np.isfinite(c), c, 0))) for c in inp.node_costs] + [1e-12])
    out = []
    for weight in (0.0, scale / biggest, 1e6 * scale / biggest):
        choice: list[int] = []
        for i, c in enumerate(inp.node_costs):
            score = np.asarray(c, dtype=float) + weight * mem[i]
            for j, m in adj.get(i, ()):
                if j < i:
                    score = score + m[:, choice[j]]
            for r in forced.get(i, ()):  # rows whose other member is chosen
                if r.a == i and not r.allowed[choice[r.b]]:
                    score = np.where(r.when, np.inf, score)
                elif r.b == i and r.when[choice[r.a]]:
                    score = np.where(r.allowed, score, np.inf)
            choice.append(int(np.argmin(np.where(np.isnan(score), np.inf, score))))
        out.append(tuple(choice))
    return out


def _solve_rows(inp: SolverInput) -> Solution | None:
    """The MIP (HiGHS) with the rows of `inp`: a Solution (objective and peak not yet
    evaluated), None when the time ran out first, or _Infeasible when no choice fits them."""
    if inp.num_nodes == 0:
        return Solution((), 0.0, 0.0, True, "presolve")
    if inp.remaining() <= 0:
        return None
    status, choice = mip.solve(inp)
    if choice is not None and status == "optimal":
        choice = presolve.canonical(inp, choice)
    if status == "infeasible" and inp.memory_budget is not None:
        raise _Infeasible()
    if choice is None:
        return None
    return Solution(choice, 0.0, 0.0, status == "optimal", "highs")


def min_memory_bound(inp: SolverInput) -> tuple[float, bool]:
    """(the smallest peak memory any choice reaches, True) or, when the search for it ran out
    of time, (a lower bound of it, False). Rows are added lazily, as in solve."""
    value, exact, _ = least_memory(inp)
    return value, exact


def least_memory(inp: SolverInput) -> tuple[float, bool, float]:
    """min_memory_bound's (value, proven), and the least peak of a choice the search found
    (every row evaluated: a plan that needs this much exists)."""
    if not inp.memory_rows and not inp.memory_base:
        return 0.0, True, 0.0
    with progress.phase(inp.solver.progress, "least memory (CP-SAT)"):
        return _least_memory(inp)


def _least_memory(inp: SolverInput) -> tuple[float, bool, float]:
    lazy = len(inp.memory_rows) > ROWS_PER_ROUND
    active = _first_rows(inp) if lazy else set(range(len(inp.memory_rows)))
    floor = _simple_bound(inp)
    # the greedy choices (the last weighs memory above all) bound the least from above even
    # when the solver finds nothing in its time
    found = min(evaluate(inp, c)[1] for c in greedy_choices(inp))
    while True:
        value, exact, choice = _min_rows(_restrict(inp, active) if lazy else inp)
        if choice is None:
            return max(value, floor), False, found
        peak = evaluate(inp, choice)[1]
        found = min(found, peak)
        over = _top_rows(inp, choice, value + 0.5, active) if lazy else []
        if not over:
            # Optimal over a subset of the rows and fitting them all: optimal.
            return (peak, True, peak) if exact else (max(value, floor), False, found)
        active |= set(over)
        if inp.remaining() <= 0:
            return max(value, floor), False, found


def _simple_bound(inp: SolverInput) -> float:
    """A lower bound of any choice's peak: each row with every node at its smallest."""
    base = sum(float(np.min(mem)) for _, mem in inp.memory_base)
    rows = [sum(float(np.min(mem)) for _, mem in row) for row in inp.memory_rows]
    return base + max(rows, default=0.0)


def _min_rows(inp: SolverInput) -> tuple[float, bool, tuple[int, ...] | None]:
    """(least peak over the rows of inp or a lower bound, proven, a choice reaching it)."""
    model, x = cpsat.build_model(inp, minimise_memory=True)
    solver = cpsat.solver_for(inp)
    status = cpsat.solve(solver, model, inp, "least memory", minimise_memory=True)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        choice = tuple(next(k for k, v in enumerate(xs) if solver.BooleanValue(v)) for xs in x)
        if status == cp_model.OPTIMAL:
            return evaluate(inp, choice)[1], True, choice
        return float(solver.BestObjectiveBound()), False, choice
    return 0.0, False, None


def min_memory(inp: SolverInput) -> float:
    """The smallest peak memory (max over rows) that any choice reaches (nan if not proven
    within the time limit)."""
    value, exact = min_memory_bound(inp)
    return value if exact else float("nan")
