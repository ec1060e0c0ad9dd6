"""SPMD pipeline planning (shardplan.emit.spmd runs what this plans): whether the step's loss
runs its layers as one scan an SPMD pipeline can cut (`probe_spmd`), the stage mesh, and the
pipeline's Plan assembled from the two intra-op plans on one stage's devices that
shardplan.planning.pipelines.plan_spmd makes (the step at full batch, the step on one micro-batch) with
the schedule's cost (shardplan.inter.spmd_cost). Nothing here runs the ILP or compiles."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

from shardplan.cost.hardware import HardwareProfile
from shardplan.inter import layer_scan, spmd_cost, spmd_specs, stage_body
from shardplan.inter import schedule as schedule_mod
from shardplan.inter.stages import Stage
from shardplan.ir.graph import Role
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.plan import Plan
from shardplan.strategies.spec import MeshShape, ShardSpec


def default_micro_batches(batch: int, num_stages: int) -> int:
    """The fewest micro-batches, at least 2 per stage, that divide the batch (else the batch)."""
    return next((m for m in range(2 * num_stages, batch + 1) if batch % m == 0), batch)


def shape_of(mesh) -> MeshShape:
    """The MeshShape of a jax Mesh, a MeshShape or a device count (one `devices` axis)."""
    if isinstance(mesh, MeshShape):
        return mesh
    return MeshShape(("devices",), (int(mesh),)) if isinstance(mesh, int) else MeshShape.of(mesh)


def probe_spmd(fn, args: Sequence, mesh, options: SearchOptions) -> layer_scan.LossTrace | str:
    """The step's loss traced for an SPMD pipeline on `mesh` (stages: options.num_stages, the
    mesh's `stage` axis, or gcd(layers, devices); micro-batches: options.num_micro_batches or
    default_micro_batches), or why it cannot be one. Traces only: every process may ask."""
    shape = shape_of(mesh)
    n, names = shape.num_devices, tuple(shape.names)

    def pick(scan):
        S = options.num_stages or (shape.sizes[names.index(layer_scan.STAGE_AXIS)]
                                   if layer_scan.STAGE_AXIS in names else math.gcd(scan.length, n))
        if S < 2:
            raise ValueError(f"no stage count of 2 or more divides both the {scan.length} layers "
                             f"and the {n} devices; pass num_stages=")
        M = options.num_micro_batches or default_micro_batches(scan.batch or 1, S)
        return S, M

    lt = layer_scan.probe_step(fn, args, pick)
    if isinstance(lt, str) or lt.obstacle is not None:
        return lt if isinstance(lt, str) else lt.obstacle
    try:
        layer_scan.pipeline_mesh_shape(shape.names, shape.sizes, lt.num_stages)
    except ValueError as e:
        return str(e)
    return lt


def stage_submesh(mesh, lt: layer_scan.LossTrace) -> MeshShape | str:
    """The mesh of one stage's devices (the pipeline mesh without its stage axis), on which
    the step's intra-op plans are made, or why there is none."""
    shape = shape_of(mesh)
    names, sizes = layer_scan.pipeline_mesh_shape(shape.names, shape.sizes, lt.num_stages)
    rest = [(a, k) for a, k in zip(names, sizes) if a != layer_scan.STAGE_AXIS]
    if not rest:
        return (f"the mesh has only the {layer_scan.STAGE_AXIS!r} axis: give it a second axis "
                "(of size 1 if need be) for the intra-op plan of a stage")
    return MeshShape(tuple(a for a, _ in rest), tuple(k for _, k in rest))


def micro_args(traced: TracedStep, lt: layer_scan.LossTrace):
    """The step's arguments (abstract) on one micro-batch: its batch inputs' rows cut by M."""
    B, M = lt.scan.batch, lt.num_micro_batches
    cut = [jax.ShapeDtypeStruct((B // M, *a.shape[1:]), a.dtype)
           if r == Role.BATCH and tuple(a.shape[:1]) == (B,) else a
           for a, r in zip(traced.in_avals, traced.arg_info.roles)]
    return jax.tree_util.tree_unflatten(traced.in_tree, cut)


def spmd_plan(intra: Plan, full: spmd_cost.Priced, stage: spmd_cost.Priced | None,
              lt: layer_scan.LossTrace, mesh, hardware: HardwareProfile,
              options: SearchOptions, traced: TracedStep) -> tuple[Plan, spmd_cost.SpmdCost]:
    """The SPMD pipeline's Plan and cost from the intra-op plan of the step on one stage's
    devices (`intra`, `full`: at full batch) and of the step on one micro-batch (`stage`, or
    None). Stages split the scan's layers equally along the pipeline mesh's `stage` axis; the
    stacked parameters (and what has their shape: the optimizer's moments) split over the
    stages on their layer dimension, every other input laid out as `intra` lays it out; the
    plan's `constraints` are the specs of the scan's carries (by position) that the stage body
    holds them in, its `operand_specs` ((equation of the scan's body, operand) -> (spec,)) the
    layouts a layer reads its operands in (spmd_specs.body_operand_specs), and under negative
    keys (stage_body.post_key) those of the head and loss after the scan (1F1B, which runs
    them every tick: spmd_specs.post_operand_specs of the micro-batch plan). The estimate: the
    stage program under the cost model with the schedule's ticks and the permutes
    (shardplan.inter.spmd_cost)."""
    shape = shape_of(mesh)
    S, M, L = lt.num_stages, lt.num_micro_batches, lt.scan.length
    p_names, p_sizes = layer_scan.pipeline_mesh_shape(shape.names, shape.sizes, S)
    stacked = {s for s in lt.scan.xs_shapes if s and s[0] == L}
    ins = []
    for spec, aval in zip(intra.input_specs, traced.in_avals):
        if tuple(aval.shape) in stacked:
            spec = ShardSpec(((layer_scan.STAGE_AXIS,), *spec.dims[1:]), spec.partial)
        ins.append(spec)
    ties = traced.arg_info.ties
    outs = tuple(ins[t] if t is not None else o for t, o in zip(ties, intra.output_specs))
    sched = options.schedule
    bubble = schedule_mod.bubble_fraction(S, M, sched, "spmd")
    ticks = M + S - 1 if sched == "gpipe" else M + 2 * S - 2
    ids = stage_devices(mesh, shape, p_names, p_sizes)
    pmesh = MeshShape(p_names, p_sizes)
    carries = spmd_cost.carry_specs(stage, lt) if stage is not None else None
    inside = spmd_specs.body_operand_specs(stage, lt) if stage is not None else {}
    # the layers' backward in the plan's layouts, the stacked parameters kept where it slices
    # them: autodiff of the forward's layouts would reduce whole weights' gradients every
    # layer and tick (benchmarks/pipeline_bench.py --spmd)
    back = (spmd_specs.body_backward_specs(stage, lt, inside)
            if stage is not None and inside else {})
    # 1F1B runs the head and loss every tick inside its loop: in the micro-batch plan's
    # layouts (tests/test_inter_spmd_cost.py::test_1f1b_runs_the_head_every_tick_in_the_stage_plans_layouts);
    # GPipe runs them once at full batch outside, in XLA's own layouts, which price as well
    # or better (benchmarks/pipeline_bench.py --spmd)
    head = (spmd_specs.post_operand_specs(stage, lt)
            if sched == "1f1b" and stage is not None else {})
    inside.update({(stage_body.post_key(i), j): spec for (i, j), spec in head.items()})
    inside.update({(stage_body.backward_key(i), j): spec for (i, j), spec in back.items()})
    if back:  # where the backward keeps the stacked parameters (held so before the ticks)
        inside.update({(stage_body.stacked_key(k), 0): spec
                       for k, spec in spmd_specs.stacked_specs(stage, lt).items()})
    cost = spmd_cost.spmd_cost(full, stage, lt, pmesh, hardware,
                               pipeline_order(mesh, shape, p_sizes), sched)
    est = dataclasses.replace(cost.estimate, bubble_fraction=bubble)
    # a stage's estimate: one micro-batch through its layers, forward and backward, and its
    # two permutes (as the MPMD stages' estimates are: the latency of one micro-batch)
    per = dataclasses.replace(est, compute_s=cost.forward_s + cost.backward_s,
                              comm_s=cost.permute_s / ticks)
    sub = intra.mesh
    stages = tuple(Stage((s * L // S, (s + 1) * L // S - 1), sub.sizes, ids[s], per)
                   for s in range(S))
    how = (f"GPipe: {M} micro-batches, {ticks} ticks forward and as many backward (JAX's "
           f"autodiff through the loop), bubble (S-1)/(M+S-1) = {S - 1}/{ticks} = {bubble:.1%}"
           if sched == "gpipe" else
           f"1F1B: {M} micro-batches, one loop of {ticks} ticks, each stage running a forward "
           f"and a backward (jax.vjp, its forward recomputed from the kept input) of different "
           f"micro-batches per tick, at most {min(M, 2 * S - 1)} inputs kept per stage; bubble "
           f"(2S-2)/(M+2S-2) = {2 * S - 2}/{ticks} = {bubble:.1%}")
    why = (f"pipeline={options.pipeline!r}: SPMD pipeline: the loss runs its {L} layers as "
           f"one scan over stacked parameters, so {S} equal stages of {L // S} layers run in "
           f"one program (shard_map over {layer_scan.STAGE_AXIS!r}, ppermute between stages; "
           f"embedding, head and update outside it on every device)")
    estimate = cost.explain(sched, ticks) + (f"; {cost.flops / 1e9:.4g} GFLOP per device"
                                             if cost.found else "")
    plan = dataclasses.replace(
        intra, mesh=pmesh, input_specs=tuple(ins), output_specs=outs,
        constraints=dict(enumerate(carries or ())),
        operand_specs={k: (spec,) for k, spec in sorted(inside.items())}, estimate=est,
        stages=stages, notes=(why, how, estimate), num_micro_batches=M, schedule=sched,
        pipeline_kind="spmd", ops=(), memory_budget=options.memory_budget)
    return plan, cost


def pipeline_order(mesh, shape: MeshShape, sizes) -> list[int]:
    """The device ids of the pipeline mesh in its row-major order."""
    ids = (np.asarray([d.id for d in mesh.devices.flat]) if hasattr(mesh, "devices")
           else np.arange(shape.num_devices))
    return [int(i) for i in ids.reshape(sizes).flat]


def stage_devices(mesh, shape: MeshShape, names, sizes) -> list[tuple[int, ...]]:
    """The device ids of each stage (mesh order) of the pipeline mesh `names` x `sizes`."""
    ids = (np.asarray([d.id for d in mesh.devices.flat]) if hasattr(mesh, "devices")
           else np.arange(shape.num_devices)).reshape(sizes)
    ids = np.moveaxis(ids, list(names).index(layer_scan.STAGE_AXIS), 0)
    return [tuple(int(i) for i in row.flat) for row in ids]
