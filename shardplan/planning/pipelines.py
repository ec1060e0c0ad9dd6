"""The pipeline candidates: the SPMD pipeline (the loss's layers one scan over stacked
parameters, stages along a `stage` mesh axis: shardplan.planning.spmd_pipeline assembles its
plan) and the MPMD pipeline of unequal stages on submeshes (shardplan.inter.planner), each
against one program on the whole mesh (shardplan.planning.intra_op), by the cost model:
`choose` keeps the cheapest or the kind the options ask for."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from shardplan.cost.hardware import HardwareProfile
from shardplan.inter import layer_scan, spmd_cost
from shardplan.inter import split as split_mod
from shardplan.inter import stages as stages_mod
from shardplan.inter.planner import PipelinePlan, plan_pipeline
from shardplan.inter.tables import Cluster
from shardplan.ir.graph import Role
from shardplan.ir.trace import TracedStep, trace
from shardplan.options import DEFAULTS, SearchOptions
from shardplan.plan import Plan
from shardplan.planning import spmd_pipeline
from shardplan.planning.intra_op import plan_graph, plan_step
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import fmt_seconds


def pipeline_plan(pp: PipelinePlan, hw: HardwareProfile) -> Plan:
    """The Plan of a planned pipeline (its stages, estimate and specs of the step's inputs)."""
    traced = pp.split.traced
    return Plan(
        mesh=pp.mesh, hardware=hw.name, input_names=traced.arg_info.input_names,
        input_specs=pp.input_specs, output_names=traced.arg_info.output_names,
        output_specs=pp.output_specs, constraints={}, estimate=pp.estimate,
        memory_budget=pp.memory_budget, stages=pp.stages, search_s=pp.search_s,
        solver=pp.solver, notes=pp.notes, num_micro_batches=pp.num_micro_batches,
        schedule=pp.schedule, in_tree=traced.in_tree, out_tree=traced.out_tree,
        device_mesh=None, pipeline_kind="mpmd")


@dataclasses.dataclass(frozen=True, eq=False)
class Choice:
    """Pipeline or not: the plan to run, the pipeline if chosen, and why."""

    pipelined: bool
    plan: Plan
    pipeline: PipelinePlan | None
    intra: Plan | None
    explanation: str
    intra_graph: Any = None
    """The lifted step the intra-op plan is for (what shardplan.emit.jit.emit_jit runs)."""
    spmd: Any = None
    """The SPMD pipeline's cost (shardplan.inter.spmd_cost.SpmdCost) when one was planned."""
    spmd_plan: Plan | None = None
    """The SPMD pipeline's plan when one was planned, chosen or not."""


AUTO_PIPELINE = DEFAULTS.replace(pipeline="auto")


def choose(fn, args: Sequence, mesh, hardware: HardwareProfile,
           options: SearchOptions = AUTO_PIPELINE, *, traced: TracedStep | None = None) -> Choice:
    """Compare the SPMD pipeline (plan_spmd, where the layers are one scan) and the best MPMD
    pipeline of 2 or more stages (shardplan.inter.planner.plan_pipeline) with pure intra-op
    parallelism (one stage on the whole mesh, intra_op.plan_graph) by the cost model and return the
    cheapest (the SPMD pipeline first when it beats intra-op), unless options.pipeline is True
    / "spmd" / "mpmd" (pipeline) or False (intra-op only); the notes say why. `mesh` is a
    jax Mesh, or a MeshShape or device count to plan without devices."""
    cluster = Cluster.of(mesh, hardware)
    if traced is None:
        traced = trace(fn, tuple(args), options.state_argnums, options.batch_argnums)
    why = f"pipeline={options.pipeline!r}: MPMD pipeline (one program per stage)"
    if options.pipeline in (True, "spmd"):
        spmd = plan_spmd(fn, args, mesh, hardware, options, traced)
        if isinstance(spmd, Choice):
            return spmd
        if options.pipeline == "spmd":
            raise ValueError(f"pipeline='spmd': no SPMD pipeline: {spmd}; use pipeline=True "
                             "(MPMD stages where the layers are not one scan) or False")
        why = (f"pipeline=True: MPMD pipeline (one program per stage, unequal stages allowed), "
               f"not SPMD: {spmd}")
    if options.pipeline in (True, "mpmd"):
        pp = plan_pipeline(fn, args, mesh, hardware, options,
                           min_stages=2 if options.num_stages is None else 1, traced=traced)
        text = why + "\n" + pp.explain()
        return Choice(True, _with_notes(pipeline_plan(pp, hardware), text.splitlines(),
                                        replace=True), pp, None, text)
    real = not isinstance(mesh, (MeshShape, int))
    shape = MeshShape.of(mesh) if real else (mesh if isinstance(mesh, MeshShape) else
                                             MeshShape(("devices",), (cluster.num_devices,)))
    intra_job = Job.make(traced, shape, hardware, options.replace(measure=False),
                         device_mesh=mesh if real else None)
    intra_job = intra_job.replace(device_order=tuple(cluster.device_ids))
    intra, _ = plan_graph(intra_job)
    graph = intra_job.graph
    intra_total = intra.estimate.total_s
    if options.pipeline is False:
        text = f"pipeline=False: pure intra-op, estimated step {fmt_seconds(intra_total)}"
        return Choice(False, _with_notes(intra, (text,)), None, intra, text, graph)
    if options.hints:
        text = (f"one stage (pure intra-op, estimated step {fmt_seconds(intra_total)}): "
                "pipelines are not planned with hints")
        return Choice(False, _with_notes(intra, (text,)), None, intra, text, graph)
    spmd = plan_spmd(fn, args, mesh, hardware, options, traced)
    if isinstance(spmd, Choice) and spmd.plan.estimate.total_s < intra_total:
        text = (f"SPMD pipeline of {len(spmd.plan.stages)} stages: "
                f"{fmt_seconds(spmd.plan.estimate.total_s)} per step against "
                f"{fmt_seconds(intra_total)} for pure intra-op (cost model)\n" + spmd.explanation)
        plan = _with_notes(spmd.plan, text.splitlines(), replace=True)
        return dataclasses.replace(spmd, plan=plan, intra=intra, explanation=text,
                                   intra_graph=graph, spmd_plan=plan)
    spmd_line = (f"the SPMD pipeline takes {fmt_seconds(spmd.plan.estimate.total_s)} "
                 f"({spmd.plan.notes[-1]})" if isinstance(spmd, Choice)
                 else f"no SPMD pipeline: {spmd}")
    extra = {"spmd": spmd.spmd, "spmd_plan": spmd.plan} if isinstance(spmd, Choice) else {}
    try:
        pp = plan_pipeline(fn, args, mesh, hardware, options, min_stages=2,
                           intra_total=intra_total, traced=traced)
    except (split_mod.PipelineSplitError, stages_mod.NoFeasibleStagePlan) as e:
        text = (f"one stage (pure intra-op, estimated step {fmt_seconds(intra_total)}): "
                f"no MPMD pipeline was possible: {e}; {spmd_line}")
        return Choice(False, _with_notes(intra, (text,)), None, intra, text, graph, **extra)
    if pp.chosen.total_s < intra_total:
        text = (f"{pp.num_stages} pipeline stages: {fmt_seconds(pp.chosen.total_s)} per step "
                f"against {fmt_seconds(intra_total)} for pure intra-op; {spmd_line}\n"
                + pp.explain())
        plan = _with_notes(pipeline_plan(pp, hardware), text.splitlines(), replace=True)
        return Choice(True, plan, pp, intra, text, graph, **extra)
    lines = [(f"one stage (pure intra-op): {fmt_seconds(intra_total)} per step, the best "
              f"MPMD pipeline takes {fmt_seconds(pp.chosen.total_s)}; {spmd_line}")]
    lines += [x.replace("  <- chosen", "") for x in pp.explain().splitlines()[
        1 + pp.num_stages:]]
    text = "\n".join(lines)
    return Choice(False, _with_notes(intra, lines), pp, intra, text, graph, **extra)


def _with_notes(plan: Plan, notes, replace: bool = False) -> Plan:
    kept = () if replace else tuple(plan.notes)
    return dataclasses.replace(plan, notes=kept + tuple(notes))


# -- SPMD pipelines (the assembly in shardplan.planning.spmd_pipeline) -------------------------------


def plan_spmd(fn, args: Sequence, mesh, hardware: HardwareProfile, options: SearchOptions,
              traced: TracedStep) -> Choice | str:
    """The SPMD pipeline of the step (shardplan.emit.spmd) where its loss runs its layers as
    one scan over stacked parameters, or why not: the step planned on one stage's devices at
    full batch and on one micro-batch (the stage program), assembled by
    shardplan.spmd_pipeline.spmd_plan."""
    lt = spmd_pipeline.probe_spmd(fn, args, mesh, options)
    if isinstance(lt, str):
        return lt
    sub = spmd_pipeline.stage_submesh(mesh, lt)
    if isinstance(sub, str):
        return sub
    intra, graph, intra_plan = plan_step(traced, sub, hardware,
                                         options.replace(pipeline=False, measure=False),
                                         combine_gradients=False)
    full = spmd_cost.Priced(graph, intra_plan, intra.ops)
    stage = _micro_step(fn, traced, lt, sub, hardware, options, intra.input_specs)
    plan, cost = spmd_pipeline.spmd_plan(intra, full, stage, lt, mesh, hardware, options, traced)
    return Choice(True, plan, None, intra, "\n".join(plan.notes), spmd=cost, spmd_plan=plan)


def _micro_step(fn, traced: TracedStep, lt: layer_scan.LossTrace, sub: MeshShape,
                hw: HardwareProfile, options: SearchOptions,
                state_specs: Sequence[ShardSpec]) -> spmd_cost.Priced | None:
    """The step on one micro-batch planned on one stage's devices with the state laid out as
    the full step's plan lays it out: the stage program's cost and its carry's layout. None if
    it does not trace or plan (the estimate then scales the full step's layers)."""
    o = options.replace(pipeline=False, measure=False, memory_budget=None)
    roles = traced.arg_info.roles
    try:
        micro = trace(fn, tuple(spmd_pipeline.micro_args(traced, lt)), options.state_argnums,
                      options.batch_argnums)
        job = Job.make(micro, sub, hw, o)
        fixed = {i: s for i, (s, r) in enumerate(zip(state_specs, roles)) if r == Role.STATE}
        plan, intra = plan_graph(job, fixed_inputs=fixed, combine_gradients=False)
        graph = job.graph
    except Exception:  # noqa: BLE001 - the estimate falls back to the full step's layers / M
        return None
    return spmd_cost.Priced(graph, intra, plan.ops)
