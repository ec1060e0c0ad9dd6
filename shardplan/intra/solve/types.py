"""What the intra-operator ILP's solvers read and return: the SolverInput (costs, memory rows,
copies, implications, limits), a Solution, and the two ways a search fails (InfeasibleMemory,
SearchTimeout); a choice's objective and peak."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import numpy as np
import scipy.sparse

from shardplan.intra.settings import SolverSettings
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
    variables, and without making a a neighbour of b in presolve
    (intra/combiner/gradient_latency.py: a member that reduces a gradient over some mesh axes
    turns their switch on)."""

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
    least_memory: bool = True
    """Where no plan fits: search for the least memory (least_memory.least), or bound it at
    once (rows.simple_bound; the greedy choices' least found)."""

    def remaining(self) -> float:
        return self.deadline.remaining() if self.deadline is not None else float("inf")

    def row_peaks(self, choice) -> list[float]:
        """Bytes per device at each row's moment under `choice`."""
        offsets, base, rows, row_copies = self.memory_matrices
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
    def memory_matrices(self):
        """The memory terms over (node, choice) columns, node n's choices at offsets[n]...:
        the base as a vector, the rows as a sparse matrix, each row's copies as a 0/1 matrix,
        so that row_peaks is two products, not a sum term by term in Python
        (benchmarks/plan_speed.py's budgeted cases call it once per round)."""
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
        tie-breaks, the experts' seeds): they are made once per set of rows."""
        out = dataclasses.replace(self, **changes)
        if "memory_matrices" in self.__dict__ and not changes.keys() & _MEMORY_FIELDS and [
                len(c) for c in out.node_costs] == [len(c) for c in self.node_costs]:
            out.__dict__["memory_matrices"] = self.memory_matrices
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


def objective(inp: SolverInput, choice) -> float:
    """The cost of `choice`: its nodes' and edges' (infinite where it breaks a row)."""
    if not all(r.holds(choice) for r in inp.implications):
        return float("inf")
    obj = sum(float(c[k]) for c, k in zip(inp.node_costs, choice))
    return obj + sum(float(m[choice[a], choice[b]]) for a, b, m in inp.edges)


def evaluate(inp: SolverInput, choice) -> tuple[float, float]:
    """(objective, peak memory) of a choice."""
    return objective(inp, choice), max(inp.row_peaks(choice), default=0.0)
