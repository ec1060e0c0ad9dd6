"""The planning driver: a Job in, the Plan to run out. shardplan.api, shardplan.cluster and
the CLI call it; everything below it returns values and calls nothing back.

One program (`plan_program`): the step as written, with its scanned layers rematerialized
(SearchOptions.remat) or run as micro-batches whose gradients are accumulated
(SearchOptions.grad_accumulation), each planned by the ILP (planning.intra_op) and judged as
compiled (planning.select: the compiled check of the budget, the measured selection). Pipelines
(`choose_program`): the SPMD and MPMD pipelines against one program (planning.pipelines),
judged as compiled with measure."""

from __future__ import annotations

import math
import warnings

from shardplan import _compat, progress
from shardplan.intra.solve.types import InfeasibleMemory, SearchTimeout
from shardplan.plan import Plan
from shardplan.planning import accumulation, remat, select
from shardplan.planning.intra_op import plan_graph
from shardplan.planning.job import Job
from shardplan.planning.pipelines import Choice, choose
from shardplan.units import Deadline, fmt_bytes


def plan_program(job: Job) -> Plan:
    """One program of the job's step (options.pipeline is False): as written or rematerialized
    (`with_remat`), and run as M micro-batches as options.grad_accumulation says: an int M
    always; "auto" only where no plan of the step without it fits the memory budget, then
    the fewest micro-batches whose plan fits (accumulation.choices), the least memory found
    kept when none does. Every candidate shares the job's deadline: each gets what the
    others left, at least the grace a running solve is allowed; a later candidate's ILP
    starts from the inputs of the step's plan as a whole (`_warm_inputs`)."""
    o = job.options
    m = o.grad_accumulation
    if m != "auto":
        if m == 1:
            return with_remat(job)
        return accumulation.marked(with_remat(accumulation.job_for(job, m)), m,
                                   f"grad_accumulation={m}")
    if o.memory_budget is None:
        return with_remat(job)
    ms, why_not = accumulation.choices(job)
    first, error, caught = _attempt(with_remat, job.replace(least_memory=not ms))
    if first is not None and first.fits() is not False:
        _rewarn(caught)
        return remat.noted(first, "grad_accumulation='auto': not accumulated, the step as a "
                                  "whole fits the memory budget")
    tried = []
    for i, k in enumerate(ms):
        with progress.phase(job.progress, f"gradients accumulated over {k} micro-batches",
                            i + 1, len(ms)):
            job_k = accumulation.job_for(job, k)
            job_k = job_k.replace(warm_inputs=_warm_inputs(first, job, job_k))
            plan, err, caught_k = _attempt(with_remat, _rest(job_k))
        if plan is not None and plan.fits() is not False:
            _rewarn(caught_k)
            return accumulation.marked(plan, k, f"grad_accumulation='auto': no plan of the step "
                                       f"as a whole fits the memory budget of "
                                       f"{fmt_bytes(o.memory_budget)} per device")
        tried.append((k, plan, err, caught_k))
        if job.deadline.expired():
            break
    least = [(p.estimate.peak_bytes, k, p, c) for k, p, _, c in tried if p is not None]
    if first is not None:
        least.append((first.estimate.peak_bytes, 1, first, caught))
    if not least:  # no candidate has a plan within the budget: the least any needs
        _rewarn(caught)
        k, least_error = min([(1, error), *((k, e) for k, _, e, _ in tried)],
                             key=lambda t: _least_found(t[1]))
        if tried:
            least_error.add_note(
                f"shardplan: planned as a whole and with the gradients accumulated over "
                f"{', '.join(str(k) for k, *_ in tried)} micro-batches; the least memory is "
                + ("the step's as a whole" if k == 1 else f"with {k} micro-batches"))
        elif why_not:
            least_error.add_note(f"shardplan: gradient accumulation was not tried: {why_not}")
        raise least_error
    _, k, plan, kept_warnings = min(least, key=lambda t: t[0])
    _rewarn(kept_warnings)
    if k == 1:
        why = (f"nor with the gradients accumulated over "
               f"{', '.join(str(k) for k, *_ in tried)} micro-batches" if tried
               else f"gradient accumulation was not tried: {why_not}")
        return remat.noted(plan, f"grad_accumulation='auto': {why}; kept the step as a whole, "
                           "which needs the least memory found")
    return accumulation.marked(plan, k, "grad_accumulation='auto': no plan fits the memory "
                               "budget; this one needs the least memory found")


def _warm_inputs(plan: Plan | None, job: Job, later: Job) -> dict | None:
    """The specs `plan` (of `job`'s step) gave the inputs that `later`'s step has alike (the
    same flat index, shape and dtype): the ILP's starting point for `later`
    (IntraOptions.warm_inputs)."""
    if plan is None or plan.stages:
        return None
    ours, theirs = job.traced.in_avals, later.traced.in_avals
    if len(ours) != len(theirs) or len(plan.input_specs) != len(ours):
        return None
    return {i: spec for i, (a, b, spec) in enumerate(zip(ours, theirs, plan.input_specs))
            if a.shape == b.shape and a.dtype == b.dtype}


def with_remat(job: Job) -> Plan:
    """The job's step as written or rematerialized as options.remat says: False plans the step
    as written, True the rematerialized step (as written where it has no scanned layers to
    rematerialize), "auto" the step as written and, only where no plan of it fits the memory
    budget (InfeasibleMemory, or a plan over the budget once compiled), the rematerialized
    step too, kept if it fits (or needs less)."""
    o = job.options
    if o.remat is False or (o.remat == "auto" and o.memory_budget is None):
        return judged(job)
    rewritten = job.traced.rematerialized
    if o.remat is True:
        if rewritten is None:
            return remat.noted(judged(job), "remat=True: no scanned layers to rematerialize (no "
                               "differentiated scan whose residuals the backward pass reads); "
                               "the step is planned as written")
        return remat.marked(judged(job.replace(traced=rewritten)), rewritten, "remat=True")
    first, error, caught = _attempt(judged, job if rewritten is None
                                    else job.replace(least_memory=False))
    if (first is not None and first.fits() is not False) or rewritten is None:
        _rewarn(caught)
        if error is not None:
            raise error
        return first
    budget = fmt_bytes(o.memory_budget)
    as_written = (f"needs at least {fmt_bytes(error.min_bytes)}" if error is not None else
                  f"its best plan needs {fmt_bytes(first.estimate.peak_bytes)}")
    with progress.phase(job.progress, "the step with its scanned layers rematerialized"):
        later = job.replace(traced=rewritten)
        later = later.replace(warm_inputs=_warm_inputs(first, job, later))
        second, error2, caught2 = _attempt(judged, _rest(later))
    if second is None:
        if first is not None:
            _rewarn(caught)
            return remat.noted(first, f"remat='auto': the rematerialized step has no plan "
                               f"within {budget} either ({error2}); kept the plan of the step "
                               "as written")
        error2.add_note(f"shardplan: with the scanned layers rematerialized; as written the "
                        f"step {as_written}")
        raise error2
    if second.fits() is False and first is not None and (
            first.estimate.peak_bytes <= second.estimate.peak_bytes):
        _rewarn(caught)
        return remat.noted(first, f"remat='auto': the rematerialized step's best plan needs "
                           f"{fmt_bytes(second.estimate.peak_bytes)}, no less; kept the step "
                           "as written")
    _rewarn(caught2)
    return remat.marked(second, rewritten, f"remat='auto': no plan of the step as written "
                        f"fits the memory budget of {budget} per device (it {as_written})")


def _rest(job: Job) -> Job:
    """The job with what remains of its deadline (at least the grace a running solve is
    allowed) as its time limit: a later candidate of the same search."""
    d = job.deadline
    rest = max(d.limit_s - d.elapsed(), d.grace * d.limit_s)
    return job.replace(options=job.options.replace(time_limit=rest),
                       deadline=Deadline(rest, d.grace))


def judged(job: Job, **select_options) -> Plan:
    """The job's step planned by the ILP and judged as compiled (planning.select, which
    `select_options` are passed to)."""
    search = select.search_job(job)
    try:
        plan, _ = plan_graph(search)
    except SearchTimeout as e:
        if search is job:
            raise
        raise SearchTimeout(job.options.time_limit, f"the search had {e.time_limit_s:g} s of "
                            "it, the compiled check of the memory the rest") from None
    return select.select(job, plan, **select_options)


def choose_program(job: Job) -> Choice:
    """Pipeline or not (planning.pipelines.choose on the job's devices, or its mesh shape
    without devices), judged as compiled with options.measure (planning.select)."""
    mesh = job.device_mesh if job.device_mesh is not None else job.mesh
    choice = choose(job.fn, job.args, mesh, job.hw, job.options, traced=job.traced)
    return select.select_choice(job, choice)


def _least_found(e: InfeasibleMemory) -> float:
    """The least memory a plan found needs (exact, or the least found by a search that ran out
    or was not made), else the lower bound."""
    return e.found_bytes if math.isfinite(e.found_bytes) else e.min_bytes


def _attempt(plan_fn, job: Job):
    """(plan_fn(job) or None, InfeasibleMemory or None, the warnings planning raised, held
    back)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return plan_fn(job), None, caught
        except InfeasibleMemory as e:
            return None, e, caught


def _rewarn(caught) -> None:
    for w in caught:
        _compat.warn_at_caller(str(w.message), w.category)
