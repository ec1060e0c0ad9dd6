"""Search: a traced step -> a Plan. `plan_step` plans one program on a mesh (lift, cost model,
intra-op ILP); `choose` also plans a pipeline (shardplan.inter) and keeps the cheaper. Used
by shardplan.api, shardplan.measure and the CLI; nothing here compiles or runs a program.

Import names from this module (`from shardplan.search import plan_step`): the attribute
`shardplan.search` is the public function shardplan.cluster.search."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardplan.cost import collectives
from shardplan.cost.hardware import HardwareProfile
from shardplan.cost.model import AlphaBetaCost
from shardplan.inter import layer_scan
from shardplan.inter import schedule as schedule_mod
from shardplan.inter import split as split_mod
from shardplan.inter import stages as stages_mod
from shardplan.inter.planner import PipelinePlan, plan_pipeline
from shardplan.inter.stages import Stage
from shardplan.inter.tables import Cluster
from shardplan.intra import hints as hints_mod
from shardplan.intra.options import intra_options
from shardplan.intra.planner import IntraPlan, plan_intra
from shardplan.ir.graph import Graph
from shardplan.ir.lift import LiftOptions, lift
from shardplan.ir.trace import TracedStep, trace
from shardplan.options import DEFAULTS, SearchOptions
from shardplan.plan import OpRow, Plan
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import Deadline, fmt_seconds


def mesh_shapes(n: int, names: Sequence[str] | None = None
                ) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(axis names, sizes) of every 1-D and 2-D factorisation of n devices (axes of size 1
    left out), 1-D first: what `mesh_shape="auto"` plans. `names`: at most two axis names
    (a 1-D mesh takes the last); default devices / (data, model)."""
    shapes = [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0]
    out = []
    for sizes in shapes:
        default = ("devices",) if len(sizes) == 1 else ("data", "model")
        given = tuple(names[-len(sizes):]) if names and len(names) >= len(sizes) else None
        out.append((given or default, sizes))
    return out


def pinned_inputs(traced: TracedStep, mesh_shape: MeshShape,
                  options: SearchOptions) -> dict[int, ShardSpec]:
    """{flat input index: spec} of the inputs the options' hints pin on `mesh_shape`."""
    return dict(hints_mod.fixed_inputs(options.hints, traced.input_paths,
                                       [a.shape for a in traced.in_avals], mesh_shape))


def plan_graph(graph: Graph, traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
               options: SearchOptions, *, ilp_budget: float | None = None, device_mesh=None,
               device_order=None, start: float | None = None, deadline: Deadline | None = None,
               donated: frozenset[int] | None = None,
               fixed_inputs: dict[int, ShardSpec] | None = None) -> tuple[Plan, IntraPlan]:
    """The intra-op plan of the lifted step `graph` on `mesh_shape`, the ILP held to
    `ilp_budget` (default the options' memory budget; the plan reports the options' budget).
    `fixed_inputs` (flat input index -> spec) are pinned besides the hints' pins, which win."""
    start = time.perf_counter() if start is None else start
    cost = AlphaBetaCost(mesh_shape, hw, device_order)
    budget = options.memory_budget if ilp_budget is None else ilp_budget
    hinted = pinned_inputs(traced, mesh_shape, options)
    fixed = {**(fixed_inputs or {}), **hinted}
    intra = plan_intra(graph, mesh_shape, cost, intra_options(options, budget, fixed,
                                                             deadline=deadline, donated=donated))
    ops = tuple(op_rows(graph, cost, intra))
    plan = Plan(
        mesh=mesh_shape, hardware=hw.name,
        input_names=traced.arg_info.input_names, input_specs=intra.input_specs,
        output_names=traced.arg_info.output_names, output_specs=intra.output_specs,
        constraints={v: intra.value_specs[v] for v in sorted(intra.constrained)},
        estimate=intra.estimate, operand_specs=dict(intra.operand_specs),
        memory_budget=options.memory_budget, ops=ops,
        search_s=time.perf_counter() - start, notes=intra.notes + _pinned_note(hinted, traced),
        solver=f"{intra.solver}{' (optimal)' if intra.optimal else ''}, "
               f"{intra.num_choices} choices",
        in_tree=traced.in_tree, out_tree=traced.out_tree, device_mesh=device_mesh)
    return plan, intra


def _pinned_note(fixed, traced: TracedStep) -> tuple[str, ...]:
    if not fixed:
        return ()
    n = len(traced.in_avals)
    return (f"hints pinned {len(fixed)} of {n} inputs; the ILP planned the rest",)


def op_rows(graph: Graph, cost: AlphaBetaCost, intra: IntraPlan) -> list[OpRow]:
    """Each node's compute and communication: its strategy's own collectives, and resharding
    its operands into the layouts it reads (counted at the first node that reads a value in a
    layout: XLA reshards once for all of them)."""
    specs, seen, rows = intra.value_specs, set(), []
    for node in graph.nodes:
        s = intra.node_strategies[node.id]
        c, k = cost.node_time(graph, node, s)
        for v, dst in zip(node.inputs, s.in_specs):
            src = specs.get(v)
            if src is None or src == dst or (v, src, dst) in seen:
                continue
            seen.add((v, src, dst))
            comms = cost.reshard_comms(graph.values[v], src, dst)
            k += node.trips * collectives.comms_time(comms, cost.mesh, cost.links)
        rows.append(OpRow(node.primitive, node.name, s.name, c, k))
    return rows


def plan_step(traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
              options: SearchOptions = DEFAULTS, *, device_mesh=None,
              device_order: Sequence[int] | None = None, deadline: Deadline | None = None,
              donate_argnums: Sequence[int] | None = None) -> tuple[Plan, Graph, IntraPlan]:
    """Plan one program of the traced step on `mesh_shape` priced as `hw`: (the Plan, the
    lifted graph it is for, the intra-op plan). `device_mesh` (a jax Mesh) is kept in the plan
    for its shardings; `device_order` (device ids in mesh order) places the links; `deadline`
    (default: the options' time limit from now) bounds the whole search; `donate_argnums`: the
    arguments the compiled step donates (None: its state, as a plan for a cluster assumes; the
    memory model counts an undonated state output twice)."""
    start = time.perf_counter()
    deadline = deadline or Deadline(options.time_limit)
    graph = lift(traced.closed_jaxpr, traced.arg_info, LiftOptions(while_trips=options.while_trips))
    plan, intra = plan_graph(graph, traced, mesh_shape, hw, options, device_mesh=device_mesh,
                             device_order=device_order, start=start, deadline=deadline,
                             donated=donated_inputs(traced, donate_argnums))
    return plan, graph, intra


def donated_inputs(traced: TracedStep, donate_argnums: Sequence[int] | None):
    """The flat inputs of the arguments `donate_argnums` (None stays None: the state)."""
    if donate_argnums is None:
        return None
    counts = traced.arg_leaf_counts
    return frozenset(j for a in donate_argnums for j in range(sum(counts[:a]), sum(counts[:a + 1])))


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


AUTO_PIPELINE = DEFAULTS.replace(pipeline="auto")


def choose(fn, args: Sequence, mesh, hardware: HardwareProfile,
           options: SearchOptions = AUTO_PIPELINE, *, traced: TracedStep | None = None) -> Choice:
    """Compare the best pipeline of 2 or more stages (shardplan.inter.planner.plan_pipeline)
    with pure intra-op parallelism (one stage on the whole mesh, plan_step) and return the
    cheaper, unless options.pipeline is True (pipeline) or False (intra-op only). `mesh` is a
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
    intra, graph, _ = plan_step(traced, shape, hardware, options.replace(measure=False),
                                device_mesh=mesh if real else None,
                                device_order=list(cluster.device_ids))
    intra_total = intra.estimate.total_s
    if options.pipeline is False:
        text = f"pipeline=False: pure intra-op, estimated step {fmt_seconds(intra_total)}"
        return Choice(False, _with_notes(intra, (text,)), None, intra, text, graph)
    if options.hints:
        text = (f"one stage (pure intra-op, estimated step {fmt_seconds(intra_total)}): "
                "pipelines are not planned with hints")
        return Choice(False, _with_notes(intra, (text,)), None, intra, text, graph)
    try:
        pp = plan_pipeline(fn, args, mesh, hardware, options, min_stages=2,
                           intra_total=intra_total, traced=traced)
    except (split_mod.PipelineSplitError, stages_mod.NoFeasibleStagePlan) as e:
        text = (f"one stage (pure intra-op, estimated step {fmt_seconds(intra_total)}): "
                f"no pipeline was possible: {e}")
        return Choice(False, _with_notes(intra, (text,)), None, intra, text, graph)
    if pp.chosen.total_s < intra_total:
        text = (f"{pp.num_stages} pipeline stages: {fmt_seconds(pp.chosen.total_s)} per step "
                f"against {fmt_seconds(intra_total)} for pure intra-op\n" + pp.explain())
        plan = _with_notes(pipeline_plan(pp, hardware), text.splitlines(), replace=True)
        return Choice(True, plan, pp, intra, text, graph)
    lines = [(f"one stage (pure intra-op): {fmt_seconds(intra_total)} per step, the best "
              f"pipeline takes {fmt_seconds(pp.chosen.total_s)}")]
    lines += [x.replace("  <- chosen", "") for x in pp.explain().splitlines()[
        1 + pp.num_stages:]]
    text = "\n".join(lines)
    return Choice(False, _with_notes(intra, lines), pp, intra, text, graph)


def _with_notes(plan: Plan, notes, replace: bool = False) -> Plan:
    kept = () if replace else tuple(plan.notes)
    return dataclasses.replace(plan, notes=kept + tuple(notes))


# -- SPMD pipelines ------------------------------------------------------------------------------


def default_micro_batches(batch: int, num_stages: int) -> int:
    """The fewest micro-batches, at least 2 per stage, that divide the batch (else the batch)."""
    return next((m for m in range(2 * num_stages, batch + 1) if batch % m == 0), batch)


def _shape_of(mesh) -> MeshShape:
    if isinstance(mesh, MeshShape):
        return mesh
    return MeshShape(("devices",), (int(mesh),)) if isinstance(mesh, int) else MeshShape.of(mesh)


def probe_spmd(fn, args: Sequence, mesh, options: SearchOptions) -> layer_scan.LossTrace | str:
    """The step's loss traced for an SPMD pipeline on `mesh` (stages: options.num_stages, the
    mesh's `stage` axis, or gcd(layers, devices); micro-batches: options.num_micro_batches or
    default_micro_batches), or why it cannot be one. Traces only: every process may ask."""
    shape = _shape_of(mesh)
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


def plan_spmd(fn, args: Sequence, mesh, hardware: HardwareProfile, options: SearchOptions,
              traced: TracedStep) -> Choice | str:
    """The SPMD pipeline of the step (shardplan.emit.spmd) where its loss runs its layers as
    one scan over stacked parameters, or why not. Stages split the scan's layers equally along
    the mesh's `stage` axis; the step's intra-op plan on one stage's devices (the other axes)
    lays out every input, the stacked parameters (and what has their shape: the optimizer's
    moments) split over the stages on their layer dimension."""
    shape = _shape_of(mesh)
    lt = probe_spmd(fn, args, mesh, options)
    if isinstance(lt, str):
        return lt
    S, M, L = lt.num_stages, lt.num_micro_batches, lt.scan.length
    p_names, p_sizes = layer_scan.pipeline_mesh_shape(shape.names, shape.sizes, S)
    rest = [(a, k) for a, k in zip(p_names, p_sizes) if a != layer_scan.STAGE_AXIS]
    if not rest:
        return (f"the mesh has only the {layer_scan.STAGE_AXIS!r} axis: give it a second axis "
                "(of size 1 if need be) for the intra-op plan of a stage")
    sub = MeshShape(tuple(a for a, _ in rest), tuple(k for _, k in rest))
    intra, _, _ = plan_step(traced, sub, hardware, options.replace(pipeline=False, measure=False))
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
    # GPipe: M+S-1 ticks forward and as many backward; 1F1B: M+2S-2 ticks of a forward and a
    # backward that recomputes the forward (B = 2F: 4/3 of a forward and backward)
    scale = ticks / (M * S) * (1.0 if sched == "gpipe" else 4.0 / 3.0)
    e = intra.estimate
    est = dataclasses.replace(e, compute_s=e.compute_s * scale, comm_s=e.comm_s * scale,
                              bubble_fraction=bubble)
    per = dataclasses.replace(est, compute_s=est.compute_s / M, comm_s=est.comm_s / M)
    ids = _stage_devices(mesh, shape, p_names, p_sizes)
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
    estimate = (f"estimate: the step's intra-op plan on one stage's {sub.num_devices} devices "
                f"({' x '.join(f'{a}={k}' for a, k in rest)}), its time scaled by the "
                f"schedule ({scale:.3f}); memory as that plan's (not divided by the stages)")
    notes = (why, how, estimate)
    plan = dataclasses.replace(
        intra, mesh=MeshShape(p_names, p_sizes), input_specs=tuple(ins), output_specs=outs,
        constraints={}, operand_specs={}, estimate=est, stages=stages, notes=notes,
        num_micro_batches=M, schedule=sched, pipeline_kind="spmd", ops=(),
        memory_budget=options.memory_budget)
    return Choice(True, plan, None, intra, "\n".join(notes))


def _stage_devices(mesh, shape: MeshShape, names, sizes) -> list[tuple[int, ...]]:
    """The device ids of each stage (mesh order) of the pipeline mesh `names` x `sizes`."""
    ids = (np.asarray([d.id for d in mesh.devices.flat]) if hasattr(mesh, "devices")
           else np.arange(shape.num_devices)).reshape(sizes)
    ids = np.moveaxis(ids, list(names).index(layer_scan.STAGE_AXIS), 0)
    return [tuple(int(i) for i in row.flat) for row in ids]
