"""Search: a traced step -> a Plan. `plan_step` plans one program on a mesh (lift, cost model,
intra-op ILP); `choose` also plans a pipeline (shardplan.inter) and keeps the cheaper. Used
by shardplan.api, shardplan.measure and the CLI; nothing here compiles or runs a program.

Import names from this module (`from shardplan.search import plan_step`): the attribute
`shardplan.search` is the public function shardplan.cluster.search."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from shardplan import spmd_search
from shardplan.cost import collectives
from shardplan.cost.hardware import HardwareProfile
from shardplan.cost.model import AlphaBetaCost
from shardplan.inter import layer_scan, spmd_cost
from shardplan.inter import split as split_mod
from shardplan.inter import stages as stages_mod
from shardplan.inter.planner import PipelinePlan, plan_pipeline
from shardplan.inter.tables import Cluster
from shardplan.intra import hints as hints_mod
from shardplan.intra.options import intra_options
from shardplan.intra.planner import IntraPlan, plan_intra
from shardplan.ir.graph import Graph, Role
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
               fixed_inputs: dict[int, ShardSpec] | None = None,
               combine_gradients: bool | None = None) -> tuple[Plan, IntraPlan]:
    """The intra-op plan of the lifted step `graph` on `mesh_shape`, the ILP held to
    `ilp_budget` (default the options' memory budget; the plan reports the options' budget).
    `fixed_inputs` (flat input index -> spec) are pinned besides the hints' pins, which win;
    `combine_gradients`: IntraOptions' (None: its default; False for an SPMD pipeline's stage
    programs)."""
    start = time.perf_counter() if start is None else start
    cost = AlphaBetaCost(mesh_shape, hw, device_order)
    budget = options.memory_budget if ilp_budget is None else ilp_budget
    hinted = pinned_inputs(traced, mesh_shape, options)
    fixed = {**(fixed_inputs or {}), **hinted}
    intra = plan_intra(graph, mesh_shape, cost, intra_options(
        options, budget, fixed, deadline=deadline, donated=donated,
        combine_gradients=combine_gradients, compiler=hw.backend))
    ops = tuple(op_rows(graph, cost, intra))
    plan = Plan(
        mesh=mesh_shape, hardware=hw.name,
        input_names=traced.arg_info.input_names, input_specs=intra.input_specs,
        output_names=traced.arg_info.output_names, output_specs=intra.output_specs,
        constraints={v: intra.made_specs.get(v, intra.value_specs[v])
                     for v in sorted(intra.constrained)},
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
    producer = {v: node.id for node in graph.nodes for v in node.outputs}

    def trips_at(node_id: int | None, side: str) -> float:
        # a loop's entry reads, and its exit writes, a value of the enclosing level: resharded
        # as often as the rarer side runs (intra.problem.Problem.edge_trips)
        if node_id is None:
            return 1.0
        node = graph.nodes[node_id]
        trips = node.trips
        if node.loop is not None and node_id in getattr(graph.loops[node.loop], side):
            trips /= graph.loops[node.loop].trips
        return trips

    for node in graph.nodes:
        s = intra.node_strategies[node.id]
        c, k = cost.node_time(graph, node, s)
        for v, dst in zip(node.inputs, s.in_specs):
            src = specs.get(v)
            if src is None or src == dst or (v, src, dst) in seen:
                continue
            seen.add((v, src, dst))
            comms = cost.reshard_comms(graph.values[v], src, dst)
            trips = min(trips_at(node.id, "enter"), trips_at(producer.get(v), "leave"))
            k += trips * collectives.comms_time(comms, cost.mesh, cost.links)
        rows.append(OpRow(node.primitive, node.name, s.name, c, k))
    # what a loop body hands its next iteration, resharded into the carry's layout (as the
    # ILP prices it: intra.problem), on the carry's loop_carry row
    for src, carry, trips in graph.carry_edges():
        a, b = specs.get(src), specs.get(carry)
        if a is None or b is None or a == b or carry not in producer:
            continue
        comms = cost.reshard_comms(graph.values[src], a, b)
        row = rows[producer[carry]]
        rows[producer[carry]] = dataclasses.replace(
            row, comm_s=row.comm_s + trips * collectives.comms_time(comms, cost.mesh, cost.links))
    return rows


def plan_step(traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
              options: SearchOptions = DEFAULTS, *, device_mesh=None,
              device_order: Sequence[int] | None = None, deadline: Deadline | None = None,
              donate_argnums: Sequence[int] | None = None,
              combine_gradients: bool | None = None) -> tuple[Plan, Graph, IntraPlan]:
    """Plan one program of the traced step on `mesh_shape` priced as `hw`: (the Plan, the
    lifted graph it is for, the intra-op plan). `device_mesh` (a jax Mesh) is kept in the plan
    for its shardings; `device_order` (device ids in mesh order) places the links; `deadline`
    (default: the options' time limit from now) bounds the whole search; `donate_argnums`: the
    arguments the compiled step donates (None: its state, as a plan for a cluster assumes; the
    memory model counts an undonated state output twice); `combine_gradients`: plan_graph's."""
    start = time.perf_counter()
    deadline = deadline or Deadline(options.time_limit)
    graph = lift(traced.closed_jaxpr, traced.arg_info, LiftOptions(while_trips=options.while_trips))
    plan, intra = plan_graph(graph, traced, mesh_shape, hw, options, device_mesh=device_mesh,
                             device_order=device_order, start=start, deadline=deadline,
                             donated=donated_inputs(traced, donate_argnums),
                             combine_gradients=combine_gradients)
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
    spmd: Any = None
    """The SPMD pipeline's cost (shardplan.inter.spmd_cost.SpmdCost) when one was planned."""
    spmd_plan: Plan | None = None
    """The SPMD pipeline's plan when one was planned, chosen or not."""


AUTO_PIPELINE = DEFAULTS.replace(pipeline="auto")


def choose(fn, args: Sequence, mesh, hardware: HardwareProfile,
           options: SearchOptions = AUTO_PIPELINE, *, traced: TracedStep | None = None) -> Choice:
    """Compare the SPMD pipeline (plan_spmd, where the layers are one scan) and the best MPMD
    pipeline of 2 or more stages (shardplan.inter.planner.plan_pipeline) with pure intra-op
    parallelism (one stage on the whole mesh, plan_step) by the cost model and return the
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


# -- SPMD pipelines (the assembly in shardplan.spmd_search) ----------------------------------------


def plan_spmd(fn, args: Sequence, mesh, hardware: HardwareProfile, options: SearchOptions,
              traced: TracedStep) -> Choice | str:
    """The SPMD pipeline of the step (shardplan.emit.spmd) where its loss runs its layers as
    one scan over stacked parameters, or why not: the step planned on one stage's devices at
    full batch and on one micro-batch (the stage program), assembled by
    shardplan.spmd_search.spmd_plan."""
    lt = spmd_search.probe_spmd(fn, args, mesh, options)
    if isinstance(lt, str):
        return lt
    sub = spmd_search.stage_submesh(mesh, lt)
    if isinstance(sub, str):
        return sub
    intra, graph, intra_plan = plan_step(traced, sub, hardware,
                                         options.replace(pipeline=False, measure=False),
                                         combine_gradients=False)
    full = spmd_cost.Priced(graph, intra_plan, intra.ops)
    stage = _micro_step(fn, traced, lt, sub, hardware, options, intra.input_specs)
    plan, cost = spmd_search.spmd_plan(intra, full, stage, lt, mesh, hardware, options, traced)
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
        micro = trace(fn, tuple(spmd_search.micro_args(traced, lt)), options.state_argnums,
                      options.batch_argnums)
        graph = lift(micro.closed_jaxpr, micro.arg_info, LiftOptions(while_trips=o.while_trips))
        fixed = {i: s for i, (s, r) in enumerate(zip(state_specs, roles)) if r == Role.STATE}
        plan, intra = plan_graph(graph, micro, sub, hw, o, fixed_inputs=fixed,
                                 combine_gradients=False)
    except Exception:  # noqa: BLE001 - the estimate falls back to the full step's layers / M
        return None
    return spmd_cost.Priced(graph, intra, plan.ops)
