"""The rematerialized candidate: the step with its scanned layers rematerialized
(TracedStep.rematerialized, shardplan.ir.remat), the plan marked with it, and the step a plan
runs. Which of the two steps is planned is the driver's choice (SearchOptions.remat,
shardplan.planning.driver); the choice is the plan's `remat`: running or adopting a plan
rewrites the step as its plan says."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from shardplan.ir.trace import TracedStep
from shardplan.plan import Plan
from shardplan.planning import compiled
from shardplan.planning.job import Job
from shardplan.units import fmt_bytes


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


def job_for(plan: Plan, job: Job) -> Job:
    """The job whose step `plan` runs: `job`, or its step rematerialized where the plan is
    marked remat and the job's step is as written (MaxText's configuration among the expert
    plans, planning.expert_plans)."""
    if not plan.remat or job.traced.remat is not None:
        return job
    return job.replace(traced=traced_for(plan, job.traced))


def compile_as_run(job: Job, name: str, plan: Plan, mesh,
                   compile_one: Callable[[str, Plan], compiled.MeasuredProgram] | None = None,
                   widening: float = 1.0) -> compiled.MeasuredProgram:
    """`plan` of the job's step compiled and priced as it runs: by `compile_one` where it runs
    the job's step (e.g. priced from shallow copies, planning.depth), else the step it runs
    (job_for) compiled in full on `mesh` (`widening`: compiled.measure's)."""
    own = job_for(plan, job)
    if own is job and compile_one is not None:
        return compile_one(name, plan)
    return compiled.measure(own.graph, own.traced, plan, mesh, job.hw, name, job.donated_args,
                            compiled.compute_dtype(own.graph), widening)


def noted(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, notes=(*plan.notes, note))


def marked(plan: Plan, remat: TracedStep, why: str) -> Plan:
    r = remat.remat
    note = (f"scanned layers rematerialized ({why}): {r.pairs} differentiated scan(s) "
            f"rewritten, the backward pass recomputes each layer from its input: "
            f"{fmt_bytes(r.saved_bytes)} of stacked activations dropped, "
            f"{fmt_bytes(r.carry_bytes)} of stacked layer inputs kept (whole arrays, before "
            "sharding)")
    return dataclasses.replace(plan, remat=True, notes=(*plan.notes, note))
