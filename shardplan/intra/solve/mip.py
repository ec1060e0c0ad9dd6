"""The intra-op SolverInput as a mixed-integer linear program, solved by HiGHS (through scipy:
branch and cut on the LP relaxation). The model is cpsat.py's (Alpa's
edge pairs, the memory rows); here the pair variables stay continuous: with the node choices
integral, each pair's row and column sums make them integral too.

The MIP proves what CP-SAT, in the same time, does not: the LP bound of these problems is tight
and HiGHS closes it at the root with cuts (benchmarks/plan_speed.py reports whether each plan
is proven optimal)."""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy import optimize, sparse

from shardplan import progress
from shardplan.intra.solve import cpsat, message_passing, presolve, relaxation, types
from shardplan.intra.solve.types import SolverInput

# Relative gap at which HiGHS stops and calls its plan optimal (its default is 1e-4: a plan
# 0.01% dearer than the best would pass as optimal). 0: HiGHS's absolute gap alone (1e-6 of
# units where the dearest cost is 1e4), fine enough for the inputs' tie-breaks (problem.py).
MIP_GAP = 0.0

# HiGHS does not return the same optimum on every run where several tie (its path depends on the
# wall clock, with threads=1 too). presolve.canonical maps ties node by node, not ties that
# several nodes must leave together (a chain of values split on another dimension). So each
# choice's cost gets a fixed pseudo-random share of PERTURB of the dearest cost (a nanosecond
# where it is 10 ms), keyed on its node and choice in the problem as given, before presolve
# (ilp.solve): equal plans no longer tie, and every exact reduction keeps the one optimum, so a
# change to presolve (or a run) does not flip a tie.
PERTURB = 1e-7


def _uniform(node: int, choices: int) -> np.ndarray:
    """A fixed number in [0, 1) per choice of `node`: SplitMix64's mix of (node, choice)."""
    z = (np.uint64(node) << np.uint64(32)) + np.arange(choices, dtype=np.uint64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(float) * 2.0 ** -53


def perturbed(inp: SolverInput) -> SolverInput:
    """`inp` with PERTURB's tie-breaks added to its node costs."""
    step = PERTURB * 1e8 / cpsat.scale_of(inp)
    return inp.replace(node_costs=tuple(
        np.asarray(c, float) + step * _uniform(i, len(c)) for i, c in enumerate(inp.node_costs)))


# How far from 0 or 1 a choice variable of the LP relaxation may be and count as integral
# (HiGHS's own integrality tolerance).
INTEGRAL = 1e-6


class _Sparse:
    """The MIP as arrays: variable bounds and objective, rows as (row, column, value) triplets
    with their bounds. The node choices are the first `num_x` variables."""

    def __init__(self):
        self.lb, self.ub, self.obj, self.triplets, self.rlo, self.rhi = [], [], [], [], [], []
        self.num_vars = self.num_rows = 0
        self.num_01 = 0  # the first num_01 variables are 0 or 1 in every plan (choices, pairs)
        self.budget_rows: list[int] = []  # the memory rows (each sum within the budget)

    def variables(self, lb, ub, obj) -> np.ndarray:
        n = len(lb)
        self.lb.append(np.asarray(lb, float))
        self.ub.append(np.asarray(ub, float))
        self.obj.append(np.asarray(obj, float))
        self.num_vars += n
        return np.arange(self.num_vars - n, self.num_vars)

    def rows(self, lo, hi) -> np.ndarray:
        n = len(lo)
        self.rlo.append(np.asarray(lo, float))
        self.rhi.append(np.asarray(hi, float))
        self.num_rows += n
        return np.arange(self.num_rows - n, self.num_rows)

    def terms(self, rows, cols, vals) -> None:
        rows, cols = np.asarray(rows), np.asarray(cols)
        self.triplets.append((rows, cols, np.broadcast_to(np.asarray(vals, float), rows.shape)))


def unit_of(inp: SolverInput) -> float:
    """Seconds -> the MIP's units: the dearest cost is 1e4 units."""
    return 1e-4 * cpsat.scale_of(inp)


def _sparse(inp: SolverInput) -> tuple[_Sparse, list[np.ndarray]]:
    """The model of `inp` as arrays: (the model, each node's choice variables)."""
    unit = unit_of(inp)
    model = _Sparse()
    x = []
    for c in inp.node_costs:
        c = np.asarray(c, float)
        finite = np.isfinite(c)
        obj = np.where(finite, c, 0.0) * unit
        xs = model.variables(np.zeros(len(c)), finite, obj)
        model.terms(np.full(len(c), model.rows([1.0], [1.0])[0]), xs, 1.0)
        x.append(xs)
    copy_terms: dict[int, list] = {}
    for pair in cpsat.pairs(inp):
        m = pair.cost
        ka, kb = m.shape
        # A variable per finite pair only: an infinite one is a pair no choice may take (as a
        # variable fixed at 0 it still cost HiGHS's LP a column: 13% of a GPT layer's).
        fr, fc = np.nonzero(np.isfinite(m))
        e = model.variables(np.zeros(len(fr)), np.ones(len(fr)), m[fr, fc] * unit)
        # Each group of the pair's rows (columns) sums to its node's choices in the group.
        r = model.rows(np.zeros(ka), np.zeros(ka))
        model.terms(r[fr], e, 1.0)
        model.terms(r[pair.rows], x[pair.a], -1.0)
        r = model.rows(np.zeros(kb), np.zeros(kb))
        model.terms(r[fc], e, 1.0)
        model.terms(r[pair.cols], x[pair.b], -1.0)
        for j, size in pair.copies:
            copy_terms.setdefault(j, []).append((e, size[fr, fc]))
    for r in inp.implications:  # sum of a's choices in `when` <= sum of b's in `allowed`
        row = model.rows([-np.inf], [0.0])[0]
        a, b = x[r.a][np.asarray(r.when, bool)], x[r.b][np.asarray(r.allowed, bool)]
        model.terms(np.full(len(a), row), a, 1.0)
        model.terms(np.full(len(b), row), b, -1.0)
    model.num_01 = model.num_vars
    if _budgeted(inp):
        _sparse_memory(model, inp, x, copy_terms)
    return model, x


def _budgeted(inp: SolverInput) -> bool:
    return inp.memory_budget is not None and bool(inp.memory_rows or inp.memory_base)


def _sparse_memory(model: _Sparse, inp: SolverInput, x, copy_terms) -> None:
    """The memory rows: a variable for the base and for each copy, a row per moment."""
    def add(row, terms):
        for n, mem in terms:
            model.terms(np.full(len(mem), row), x[n], np.asarray(mem, float))

    base = model.variables([0.0], [np.inf], [0.0])[0]
    row = model.rows([0.0], [0.0])[0]
    model.terms([row], [base], -1.0)
    add(row, inp.memory_base)
    sizes = model.variables(np.zeros(len(inp.copies)), np.full(len(inp.copies), np.inf),
                            np.zeros(len(inp.copies)))
    for j, var in enumerate(sizes):
        row = model.rows([0.0], [0.0])[0]
        model.terms([row], [var], -1.0)
        for e, size in copy_terms.get(j, ()):
            model.terms(np.full(len(e), row), e, size)
    mem_rows = inp.memory_rows or (((),) if inp.memory_base else ())
    for r, terms in enumerate(mem_rows):
        row = model.rows([-np.inf], [float(inp.memory_budget)])[0]
        model.budget_rows.append(int(row))
        model.terms([row], [base], 1.0)
        add(row, terms)
        copies = inp.row_copies[r] if r < len(inp.row_copies) else ()
        model.terms(np.full(len(copies), row), sizes[list(copies)], 1.0)


def solve(inp: SolverInput):
    """Solve the MIP with HiGHS (scipy.optimize.milp: the model goes to HiGHS as arrays, where
    OR-Tools' wrapper of it spent as long again copying a GPT layer's model in):
    ('optimal' | 'feasible', choice), ('infeasible', None) when no choice fits the memory rows
    (proven), or ('timeout', None). HiGHS stops at the wall clock, or where `inp.solver` is
    deterministic at its simplex iterations and nodes (settings.SolverSettings: HiGHS has no
    deterministic clock): a solve cut short by the clock may differ between runs; one that
    ends is the same.

    Where every choice fits (no memory rows), the LP relaxation is solved first: Alpa's edge
    pairs make it integral on most of these problems, and an integral LP optimum is the MIP's,
    proven, without the MIP's presolve and root. A fractional one (frustrated cycles
    of layouts, as on the scanned GPT-2 1.5B on 8x8: values half split on one axis, half on
    the other) bounds the MIP from below: with a plan found near it (presolve.improved), the
    columns whose reduced cost lifts that bound above the plan's cost are in no optimum, and
    the MIP over the rest is a fraction of the whole, with the same optimum
    (tests/test_intra_solve_mip.py::test_a_fractional_relaxation_is_finished_on_fewer_columns).
    Under a memory budget the LP keeps its memory rows, and the gap is guessed where
    no plan near it is known to fit (_within_budget)."""
    model, x = _sparse(inp)
    if inp.remaining() <= 0:
        return "timeout", None
    rows, cols, vals = (np.concatenate(t) for t in zip(*model.triplets))
    matrix = sparse.csr_matrix((vals, (rows, cols)), shape=(model.num_rows, model.num_vars))
    obj, lb, ub = (np.concatenate(a) for a in (model.obj, model.lb, model.ub))
    rlo, rhi = np.concatenate(model.rlo), np.concatenate(model.rhi)
    num_x = sum(len(xs) for xs in x)
    integrality = np.zeros(model.num_vars)
    integrality[:num_x] = 1

    def run(options, keep=None):
        """The MIP (over the columns in `keep`), its solution spread over every column."""
        options = {**inp.solver.highs_mip(inp.remaining()), "disp": False, **options}
        keep = np.ones(model.num_vars, bool) if keep is None else keep
        with warnings.catch_warnings():
            # scipy warns of the HiGHS options it does not list, and passes them on
            warnings.filterwarnings("ignore", "Unrecognized options", RuntimeWarning)
            res = optimize.milp(
                obj[keep], integrality=integrality[keep],
                bounds=optimize.Bounds(lb[keep], ub[keep]),
                constraints=optimize.LinearConstraint(matrix[:, keep], rlo, rhi),
                options=options)
        full = None
        if res.x is not None:
            full = np.zeros(model.num_vars)
            full[keep] = res.x
        _tell(inp, "MIP", res.fun if res.x is not None else None,
              getattr(res, "mip_dual_bound", None))
        return res.status, full

    def choice_of(sol):
        return tuple(int(np.argmax(sol[xs])) for xs in x)

    options = {"mip_rel_gap": MIP_GAP}
    if _budgeted(inp):
        lazy = np.zeros(model.num_rows, bool)
        lazy[model.budget_rows] = True
        lp = relaxation.solve_lazily(obj, lb, ub, matrix, rlo, rhi, lazy, inp.solver,
                                     inp.remaining)
        _tell_lp(inp, lp, num_x)
        found = _within_budget(inp, lp, lambda keep: run(options, keep), obj, num_x,
                               model.num_01, choice_of)
        if found is not None:
            return found
    elif not inp.memory_rows and not inp.memory_base:
        kept = _kept_for_messages(inp, model.num_vars)
        lp = _relaxation(inp, obj, lb, ub, matrix, rlo, rhi, inp.remaining() - kept)
        lp = lp if lp.status == 0 else None
        _tell_lp(inp, lp, num_x)
        if lp is not None and np.all(np.minimum(lp.x[:num_x], 1 - lp.x[:num_x]) <= INTEGRAL):
            return "optimal", choice_of(lp.x)
        if lp is None and kept:
            # The LP did not end in time: message passing's plan, in the time kept for it
            return _passed(inp)
        if inp.remaining() <= 0:
            return "timeout", None
        # Every choice is feasible: the feasibility-jump heuristic's first plan only delays
        # the root LP (10% of the unrolled GPT-2 1.5B core's solve).
        options["mip_heuristic_run_feasibility_jump"] = False
        near = None if lp is None else presolve.improved(inp, choice_of(lp.x))
        upper = np.inf if near is None else types.objective(inp, near) * unit_of(inp)
        if np.isfinite(upper):
            # A column whose reduced cost lifts the LP's bound above `near`'s cost (with a
            # margin for HiGHS's tolerances) is in no optimum.
            status, sol = run(options,
                              lp.fun + lp.reduced <= upper + 1e-6 * max(1.0, abs(upper)))
            if status == 0:
                return "optimal", choice_of(sol)
            if inp.remaining() <= 0:
                return "feasible", near
    status, sol = run(options)
    if status == 2:
        return "infeasible", None
    if sol is None:
        return "timeout", None
    return ("optimal" if status == 0 else "feasible"), choice_of(sol)


def _tell(inp: SolverInput, what: str, incumbent, bound) -> None:
    """A HiGHS solve's incumbent and bound (the MIP's units) told to inp.solver.progress in
    seconds. scipy's milp runs HiGHS without its callbacks: one update per solve."""
    unit = unit_of(inp)
    seconds = [None if v is None or not np.isfinite(v) else float(v) / unit
               for v in (incumbent, bound)]
    inp.solver.progress.solver(progress.SolverUpdate("HiGHS", what, *seconds))


def _tell_lp(inp: SolverInput, lp, num_x: int) -> None:
    """The LP relaxation's bound told, and its solution as the incumbent where its choices
    are integral (then a plan, and the MIP's optimum)."""
    if lp is None or lp.status != 0:
        return
    integral = np.all(np.minimum(lp.x[:num_x], 1 - lp.x[:num_x]) <= INTEGRAL)
    _tell(inp, "LP relaxation", lp.fun if integral else None, lp.fun)


def _relaxation(inp: SolverInput, obj, lb, ub, matrix, rlo, rhi,
                remaining: float) -> relaxation.Relaxation:
    """The LP relaxation without memory rows, HiGHS's presolve off: presolve.py has reduced
    these cores already, and HiGHS's removes little more than it costs (benchmarks/plan_speed.py
    times the cases). With memory rows the LP is solved lazily (relaxation.solve_lazily)."""
    return relaxation.solve_at_once(obj, lb, ub, matrix, rlo, rhi, inp.solver, remaining,
                                    presolve=False)


# Where the MIP has this many columns or more and no memory rows, a share of the time left is
# kept from the LP relaxation for message passing's plan should the LP not end in time
# (message_passing.py): at most MESSAGE_SHARE of it, and MESSAGE_ITERATIONS iterations.
# Gemma 3 cut to 2 layers on 2x4 under tpu-v5e (219k columns, an LP of 25-35 s) got 30
# iterations in 1.3 s: a plan of 0.401 ms against the LP's optimum of 0.400 ms, where HiGHS's
# MIP in the seconds left after the LP's cut-short run found 5.5 ms
# (tests/test_intra_solve_message_passing.py::test_a_cut_short_lp_leaves_message_passings_plan).
MESSAGE_COLUMNS = 50_000
MESSAGE_SHARE = 0.1
MESSAGE_ITERATIONS = 30


def _kept_for_messages(inp: SolverInput, columns: int) -> float:
    """Seconds kept from the LP for message passing: none for a small MIP. Where the solve is
    limited by its work (deterministic) or has no deadline, the LP keeps all of its own limit
    and message passing runs its iterations after it: a token second, not none, says so."""
    if columns < MESSAGE_COLUMNS:
        return 0.0
    if inp.solver.deterministic or not math.isfinite(inp.remaining()):
        return math.ulp(0.0)  # message passing runs its iterations after a cut-short LP
    return MESSAGE_SHARE * min(inp.remaining(), inp.solver.time_limit)


def _passed(inp: SolverInput):
    """Message passing's plan (message_passing.labelling), told as the incumbent: ('feasible',
    choice), or ('timeout', None) when it found none that keeps every implication."""
    with progress.phase(inp.solver.progress, "message passing"):
        choice, value, bound = message_passing.labelling(
            inp, MESSAGE_ITERATIONS,
            (lambda: math.inf) if inp.solver.deterministic else inp.remaining)
    if choice is None:
        return "timeout", None
    unit = unit_of(inp)
    _tell(inp, "message passing", value * unit, bound * unit)
    return "feasible", choice


# Under a memory budget: guesses of how far above the LP relaxation's bound the MIP's optimum
# lies, as shares of the bound, tried in turn (_within_budget): the budgeted optimum lies close
# above the bound, and the MIP over the columns a small guess keeps is a fraction of the whole
# that proves it (benchmarks/plan_speed.py's budgeted cases).
GAPS = (1e-3, 5e-3, 2.5e-2)


def _within_budget(inp: SolverInput, lp, run, obj, num_x: int, num_01: int, choice_of):
    """The budgeted MIP by its LP relaxation `lp` (memory rows and all), or None for the whole
    MIP. A column whose reduced cost lifts the bound above a value is in no plan that costs at
    most that much: for each guess of the gap (GAPS), the MIP over the columns within it; a
    plan it finds within the guess is optimal, proven. Past a plan that fits (the rounded LP,
    its best responses, the hint, or a guess's plan), the MIP over the columns within that
    plan's cost is the last step: its optimum is the whole MIP's. Only the choices and pairs
    (0 or 1 in every plan) are fixed, never the memory's continuous sizes. `run(keep)`: the
    MIP over the columns in `keep` as (scipy status, solution over every column)."""
    if lp.status == 2:
        return "infeasible", None
    if lp.status != 0:
        return None
    if np.all(np.minimum(lp.x[:num_x], 1 - lp.x[:num_x]) <= INTEGRAL):
        return "optimal", choice_of(lp.x)
    unit, scale = unit_of(inp), max(1.0, abs(lp.fun))
    reduced = lp.reduced
    best = None  # (cost in MIP units, choice) of the cheapest plan found that fits

    def offer(choice):
        nonlocal best
        if choice is None or max(inp.row_peaks(choice), default=0.0) > inp.memory_budget:
            return
        value = types.objective(inp, choice) * unit
        if np.isfinite(value) and (best is None or value < best[0]):
            best = (value, tuple(choice))

    rounded = choice_of(lp.x)
    for choice in (rounded, presolve.improved(inp, rounded), inp.hint):
        offer(choice)

    def keep(upper):
        mask = lp.fun + reduced <= upper + 1e-6 * scale
        mask[num_01:] = True
        return mask

    for gap in GAPS:
        upper = lp.fun + gap * scale
        if best is not None and upper >= best[0]:
            break
        status, sol = run(keep(upper))
        if sol is not None:
            if status == 0 and float(obj @ sol) <= upper + 1e-6 * scale:
                return "optimal", choice_of(sol)
            offer(choice_of(sol))
            # A plan within the last guess: the MIP within its cost proves the optimum, and a
            # guess below it could not (it would search for a cheaper plan and find none)
            if best is not None and best[0] <= lp.fun + GAPS[-1] * scale:
                break
        if inp.remaining() <= 0:
            return ("feasible", best[1]) if best else ("timeout", None)
    if best is None:
        return None
    status, sol = run(keep(best[0]))
    if status == 0:
        return "optimal", choice_of(sol)
    if sol is not None:
        offer(choice_of(sol))
    return "feasible", best[1]
