"""The accumulated candidate: the step run as M micro-batches (shardplan.inter.accumulate: the
loss and gradient a scan over micro-batches, the gradients summed, the update once), the plan
marked with M, and the step a plan runs. Which M is planned is the driver's choice
(SearchOptions.grad_accumulation, shardplan.planning.driver)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from shardplan.inter import accumulate, accumulate_choices
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.plan import Plan
from shardplan.planning import remat
from shardplan.planning.job import Job


def choices(job: Job) -> tuple[list[int], str]:
    """(the micro-batch counts above 1 worth planning, fewest first: each keeps the batch
    split over as many devices as the whole batch is; why there are none, or ""). Only a
    loss that is a mean over the batch is accumulated by itself: its micro-batches' mean is
    the step's (inter.accumulate_choices.infer_reduction)."""
    if job.fn is None or job.args is None:
        return [], "the step as written is not at hand (a plan adopted from a file)"
    o = job.options
    try:
        reduction = accumulate_choices.infer_reduction(
            job.fn, job.args, state_argnums=o.state_argnums, batch_argnums=o.batch_argnums)
    except accumulate.AccumulationError as e:
        return [], str(e)
    except Exception as e:  # noqa: BLE001 - a probe of the step: it is planned as a whole
        # (notebooks/02: a step whose gradient is jax.value_and_grad, traced again for the
        # split, fails inside the user's code)
        return [], f"the step could not be cut at its gradient ({type(e).__name__}: {e})"
    if reduction != "mean":
        return [], ("its loss is not seen to be a mean over the batch; pass "
                    "grad_accumulation=M to accumulate a mean loss anyway")
    ms = [m for m in accumulate_choices.micro_batch_choices(job.traced, job.mesh,
                                                              o.batch_argnums) if m > 1]
    return ms, "" if ms else "no micro-batch count keeps the batch split over the mesh"


def accumulated(fn: Callable, args: Sequence, m: int, options: SearchOptions) -> TracedStep:
    """The traced step of `fn` run as `m` micro-batches of a mean loss; a ValueError that says
    what to change when it cannot be (inter.accumulate.AccumulationError)."""
    return accumulate.accumulated(fn, args, m, reduction="mean",
                                  state_argnums=options.state_argnums,
                                  batch_argnums=options.batch_argnums)


def job_for(job: Job, m: int) -> Job:
    """The job of the step run as `m` micro-batches."""
    if job.fn is None or job.args is None:
        raise ValueError(f"grad_accumulation={m}: the step as written is needed to accumulate "
                         "it (shardplan.auto or shardplan.search plan it)")
    return job.replace(traced=accumulated(job.fn, job.args, m, job.options))


def marked(plan: Plan, m: int, why: str) -> Plan:
    note = (f"gradients accumulated over {m} micro-batches ({why}): the loss and gradient run "
            f"as a scan over {m} micro-batches of 1/{m} of the batch, their gradients summed, "
            "the update once; activations are held for one micro-batch at a time")
    return dataclasses.replace(plan, grad_accumulation=m, notes=(*plan.notes, note))


def step_for(plan: Plan, traced: TracedStep, fn: Callable, args: Sequence,
             options: SearchOptions) -> TracedStep:
    """The step `plan` runs: `traced` (the trace of fn on args) accumulated and rematerialized
    as the plan says."""
    if plan.grad_accumulation > 1:
        traced = accumulated(fn, args, plan.grad_accumulation, options)
    return remat.traced_for(plan, traced)
