"""Rematerialization as a choice of the search (SearchOptions.remat): plan the step as written
or with its scanned layers rematerialized (shardplan.ir.remat), and the step a plan runs.

"auto" plans the step as written first and, only where no plan of it fits the memory budget
(InfeasibleMemory, or a plan over the budget, as the compiled check of shardplan.fit finds
it), plans the rematerialized step and keeps it if it fits (or needs less). The choice is the
plan's `remat`: running or adopting a plan rewrites the step as its plan says."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

from shardplan import _compat
from shardplan.intra.ilp import InfeasibleMemory
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.plan import Plan
from shardplan.units import Deadline, fmt_bytes


def plan(traced: TracedStep, options: SearchOptions,
         plan_fn: Callable[[TracedStep, SearchOptions], Plan]) -> Plan:
    """The plan `plan_fn` makes of `traced` (under the options it is given) as written or
    rematerialized, as options.remat says (see the module). Pipelines (options.pipeline not
    False) are planned as written. Under "auto" the two plans share options.time_limit: the
    second gets what the first left, at least the grace Deadline allows a running solve."""
    if options.remat is False or options.pipeline is not False or (
            options.remat == "auto" and options.memory_budget is None):
        return plan_fn(traced, options)
    if options.remat is True:
        remat = traced.rematerialized
        if remat is None:
            return _noted(plan_fn(traced, options), "remat=True: no scanned layers to "
                          "rematerialize (no differentiated scan whose residuals the backward "
                          "pass reads); the step is planned as written")
        return _marked(plan_fn(remat, options), remat, "remat=True")
    deadline = Deadline(options.time_limit)
    first, error, caught = _attempt(plan_fn, traced, options)
    fits = first is not None and first.fits() is not False
    remat = None if fits else traced.rematerialized  # the rewrite, only where it may be used
    if fits or remat is None:
        _rewarn(caught)
        if error is not None:
            raise error
        return first
    budget = fmt_bytes(options.memory_budget)
    as_written = (f"needs at least {fmt_bytes(error.min_bytes)}" if error is not None else
                  f"its best plan needs {fmt_bytes(first.estimate.peak_bytes)}")
    rest = options.replace(time_limit=max(deadline.limit_s - deadline.elapsed(),
                                          deadline.grace * deadline.limit_s))
    second, error2, caught2 = _attempt(plan_fn, remat, rest)
    if second is None:
        if first is not None:
            _rewarn(caught)
            return _noted(first, f"remat='auto': the rematerialized step has no plan within "
                          f"{budget} either ({error2}); kept the plan of the step as written")
        error2.add_note(f"shardplan: with the scanned layers rematerialized; as written the "
                        f"step {as_written}")
        raise error2
    if second.fits() is False and first is not None and (
            first.estimate.peak_bytes <= second.estimate.peak_bytes):
        _rewarn(caught)
        return _noted(first, f"remat='auto': the rematerialized step's best plan needs "
                      f"{fmt_bytes(second.estimate.peak_bytes)}, no less; kept the step as written")
    _rewarn(caught2)
    return _marked(second, remat, f"remat='auto': no plan of the step as written fits the "
                   f"memory budget of {budget} per device (it {as_written})")


def traced_for(plan: Plan, traced: TracedStep) -> TracedStep:
    """The step `plan` runs: `traced` rewritten as the plan's `remat` says."""
    if not plan.remat:
        return traced
    remat = traced.rematerialized
    if remat is None:
        raise ValueError("the plan rematerializes the step's scanned layers, but this step has no "
                         "differentiated scan to rewrite (another step?): plan the step again "
                         "(shardplan.auto without plan=, or shardplan.search)")
    return remat


def _attempt(plan_fn, traced: TracedStep, options: SearchOptions):
    """(plan or None, InfeasibleMemory or None, the warnings planning raised, held back)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return plan_fn(traced, options), None, caught
        except InfeasibleMemory as e:
            return None, e, caught


def _rewarn(caught) -> None:
    for w in caught:
        _compat.warn_at_caller(str(w.message), w.category)


def _noted(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def _marked(plan: Plan, remat: TracedStep, why: str) -> Plan:
    r = remat.remat
    note = (f"scanned layers rematerialized ({why}): {r.pairs} differentiated scan(s) "
            f"rewritten, the backward pass recomputes each layer from its input: "
            f"{fmt_bytes(r.saved_bytes)} of stacked activations dropped, "
            f"{fmt_bytes(r.carry_bytes)} of stacked layer inputs kept (whole arrays, before "
            "sharding)")
    return dataclasses.replace(plan, remat=True, notes=(*plan.notes, note))
