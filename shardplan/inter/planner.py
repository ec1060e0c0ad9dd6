"""Pipeline planning: the choice of stages, micro-batches and submeshes by Alpa's stage DP over
the cost tables of shardplan.inter.tables, and the PipelinePlan that explains it (run by
shardplan.emit.pipeline, turned into a Plan by shardplan.search)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardplan.cost.estimate import Estimate
from shardplan.cost.hardware import HardwareProfile
from shardplan.inter import schedule as schedule_mod
from shardplan.inter import split as split_mod
from shardplan.inter import stage_io, transfer_cost
from shardplan.inter import stages as stages_mod
from shardplan.inter import submesh as submesh_mod
from shardplan.inter.stages import Stage, device_span
from shardplan.inter.submesh import STAGE_AXES
from shardplan.inter.tables import Cluster, CostTables, Tables, build_tables
from shardplan.intra.options import intra_options
from shardplan.ir.trace import TracedStep, trace
from shardplan.options import DEFAULTS, SearchOptions
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import fmt_bytes, fmt_seconds

# -- pipeline options ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineOption:
    """One way to cut the step into pipeline stages, and its estimated time per step."""

    label: str
    num_stages: int
    num_micro_batches: int
    total_s: float
    stages: tuple[tuple[int, int, tuple[int, int]], ...] = ()
    """(first layer, last layer, submesh shape) of each stage; empty for pure intra-op."""


def _option(tables: Tables, plan: stages_mod.StagePlan, label: str, hw: HardwareProfile
               ) -> PipelineOption:
    full = tuple((i, j, tables.shapes[m]) for i, j, m in plan.stages)
    update = max(tables.update_s(hw, (i, j), m) for i, j, m in plan.stages)
    return PipelineOption(label, plan.num_stages, tables.split.num_micro_batches,
                     plan.total_latency + update, full)


def equal_shape(cluster: Cluster, k: int) -> tuple[int, int] | None:
    """The submesh shape of k equal stages, if Alpa's shapes have one of N / k devices."""
    n = cluster.num_devices
    if k < 1 or n % k:
        return None
    size = n // k
    for shape in cluster.shapes():
        if shape[0] * shape[1] == size:
            return shape
    return None


def _solve(tables: Tables, shape_idx: Sequence[int] | None) -> stages_mod.StagePlan | None:
    """The DP over the given shape indices; the plan's submesh indices are mapped back to
    indices into tables.shapes. None when nothing fits."""
    try:
        plan = stages_mod.solve_stages(tables.problem(shape_idx))
    except stages_mod.NoFeasibleStagePlan:
        return None
    if shape_idx is None:
        return plan
    stages = tuple((i, j, shape_idx[m]) for i, j, m in plan.stages)
    return stages_mod.StagePlan(stages, plan.total_latency, plan.t_max)


def uniform_option(tables: Tables, cluster: Cluster, k: int, hw: HardwareProfile
                      ) -> PipelineOption | None:
    """k stages of L / k consecutive layers each on equal submeshes (a hand-made split)."""
    L = len(tables.layers)
    shape = equal_shape(cluster, k)
    if shape is None or L % k or shape not in tables.shapes:
        return None
    m = tables.shapes.index(shape)
    if not np.isfinite(tables.costs[0][m].time_s):
        return None
    per = L // k
    plan = stages_mod.plan_of(tables.problem([m]),
                              tuple((q * per, q * per + per - 1, 0) for q in range(k)))
    plan = stages_mod.StagePlan(tuple((i, j, m) for i, j, _ in plan.stages), plan.total_latency,
                                plan.t_max)
    return _option(tables, plan, f"{k} stages, {per} layers each (uniform)", hw)


# -- the pipeline plan --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PipelinePlan:
    """A planned pipeline: its stages and estimate, how it was chosen, and what
    shardplan.emit.pipeline needs to run it (the split step, each stage's inputs and specs)."""

    split: split_mod.SplitStep
    ios: tuple[stage_io.StageIO, ...]
    specs: tuple[dict, ...]
    """Per stage: forward value id -> ShardSpec of the stage's inputs on its submesh."""
    stage_times: tuple[tuple[float, float], ...]
    """Per stage (forward, backward) seconds of one micro-batch (BACKWARD_PER_FORWARD apart)."""
    schedule: str
    chosen: PipelineOption
    alternatives: tuple[PipelineOption, ...]
    notes: tuple[str, ...]
    stages: tuple[Stage, ...]
    estimate: Estimate
    """Of the whole step: the stages' latency over the micro-batches, the update, the bubble."""
    input_specs: tuple[ShardSpec, ...]
    output_specs: tuple[ShardSpec, ...]
    mesh: MeshShape
    memory_budget: float | None
    solver: str
    search_s: float
    device_mesh: Any = None
    """The jax Mesh the stages' devices come from, when planned on one."""

    @property
    def num_stages(self) -> int:
        return len(self.ios)

    @property
    def num_micro_batches(self) -> int:
        return self.split.num_micro_batches

    def explain(self) -> str:
        """Why this many stages: the chosen plan and the alternatives' estimated step times."""
        return "\n".join(self.notes)


def _stage_layouts(tables: Tables, option: PipelineOption, cluster: Cluster, schedule: str,
                   hw: HardwareProfile
                   ) -> tuple[list[dict[int, ShardSpec]], list[Stage], list[tuple]]:
    """Each stage's input specs (from its layers' plans), its Stage (devices, estimate) and
    the moves into it (activations in, gradients back: shardplan.inter.transfer_cost, priced
    where the stages sit; the DP priced them without knowing where their neighbours are)."""
    ranges = [(i, j) for i, j, _ in option.stages]
    shapes = [sh for _, _, sh in option.stages]
    positions = submesh_mod.assign_submeshes(shapes, cluster.num_hosts, cluster.per_host)
    B = tables.split.num_micro_batches
    specs, stages, moves = [], [], []
    for q, ((i, j), sh, pos) in enumerate(zip(ranges, shapes, positions)):
        m = tables.shapes.index(sh)
        spec: dict[int, ShardSpec] = {}
        for layer in range(i, j + 1):
            lio, lc = tables.ios[layer], tables.costs[layer][m]
            for v, s in zip((*lio.diff_in, *lio.const_in), lc.input_specs):
                spec.setdefault(v, s)
        specs.append(spec)
        comp = sum(tables.costs[k][m].compute_s for k in range(i, j + 1))
        devices = tuple(cluster.device_ids[p] for p in pos)
        comm = sum(tables.costs[k][m].comm_s for k in range(i, j + 1))
        if q > 0:
            nbytes = tables.in_bytes[i] if tables.in_bytes else 0.0
            pair = transfer_cost.boundary(nbytes, stages[-1].devices, stages[-1].submesh_shape,
                                          devices, sh, hw)
            moves.append((q, nbytes, *pair))
            comm += sum(mv.seconds for mv in pair)
        state = sum(tables.costs[k][m].state_bytes for k in range(i, j + 1))
        act = sum(tables.costs[k][m].act_bytes for k in range(i, j + 1))
        in_flight = min(len(ranges) - q, B) if schedule == "1f1b" else B
        peak = state * tables.state_factor + in_flight * act
        stages.append(Stage((i, j), tuple(sh), devices, Estimate(comp, comm, peak, state)))
    return specs, stages, moves


def priced(tables: Tables, option: PipelineOption, cluster: Cluster, hw: HardwareProfile,
           schedule: str) -> PipelineOption:
    """`option` with its step time from its stages where they sit: the DP's layer costs, the
    moves between stages priced by shardplan.inter.transfer_cost, the update."""
    if option.num_stages < 2:
        return option
    _, stages, _ = _stage_layouts(tables, option, cluster, schedule, hw)
    t = [s.estimate.total_s for s in stages]
    update = max(tables.update_s(hw, (i, j), tables.shapes.index(sh))
                 for i, j, sh in option.stages)
    B = tables.split.num_micro_batches
    return dataclasses.replace(option, total_s=math.fsum(t) + (B - 1) * max(t) + update)


def _step_estimate(option: PipelineOption, stages: Sequence[Stage], B: int) -> Estimate:
    """The step: T = sum(t_i) + (B - 1) * max(t_i) plus the update; its bubble fraction."""
    t = [s.estimate.total_s for s in stages]
    S = len(stages)
    worst = int(np.argmax(t))
    latency = math.fsum(t) + (B - 1) * t[worst]
    update = option.total_s - latency
    compute = math.fsum(s.estimate.compute_s for s in stages) + \
        (B - 1) * stages[worst].estimate.compute_s + update
    bubble = 1.0 - B * math.fsum(t) / (S * latency) if S > 1 and latency > 0 else 0.0
    return Estimate(compute, option.total_s - compute, max(s.estimate.peak_bytes for s in stages),
                    max(s.estimate.state_bytes for s in stages), 0.0, bubble)


def _assemble(tables: Tables, option: PipelineOption, cluster: Cluster, hw: HardwareProfile,
              schedule: str, alternatives: Sequence[PipelineOption], mesh, start: float,
              intra_total: float | None, num_ilps: int) -> PipelinePlan:
    split = tables.split
    ranges = [(i, j) for i, j, _ in option.stages]
    ios = stage_io.stage_ios(split, stage_io.merge_groups(tables.layers, ranges))
    B = split.num_micro_batches
    specs, stages, moves = _stage_layouts(tables, option, cluster, schedule, hw)
    estimate = _step_estimate(option, stages, B)
    input_specs, output_specs = _io_specs(split, ios, specs)
    notes = _explain(option, alternatives, stages, cluster, hw, schedule, B,
                     estimate.bubble_fraction, intra_total)
    notes[1 + len(stages):1 + len(stages)] = _move_notes(moves, hw, mesh)
    mesh_shape = (mesh if isinstance(mesh, MeshShape) else
                  MeshShape.of(mesh) if mesh is not None and not isinstance(mesh, int) else
                  MeshShape(STAGE_AXES, (cluster.num_hosts, cluster.per_host)))
    return PipelinePlan(
        split, ios, tuple(specs), tuple(schedule_mod.split_stage_time(s.estimate.total_s)
                                        for s in stages),
        schedule, option, tuple(alternatives), tuple(notes), tuple(stages), estimate,
        input_specs, output_specs, mesh_shape,
        None if not np.isfinite(tables.memory_budget) else tables.memory_budget,
        f"stage DP over {len(tables.layers)} layers ({num_ilps} layer ILPs), {schedule}",
        time.perf_counter() - start, None if isinstance(mesh, (MeshShape, int)) else mesh)


def _move_notes(moves, hw: HardwareProfile, mesh=None) -> list[str]:
    """What the moves between stages cost, and over which link; whether the profile's hosts
    are the processes of a multi-controller mesh."""
    if not moves:
        return []
    lines = [(f"  moves between stages (collective programs, also across processes; "
             f"{hw.devices_per_host} devices per host in profile {hw.name}):")]
    devices = list(np.asarray(mesh.devices).flat) if hasattr(mesh, "devices") else []
    processes = {getattr(d, "process_index", 0) for d in devices}
    if len(processes) > 1 and transfer_cost.hosts_differ_from_processes(hw, devices):
        lines.append(f"    (the mesh spans {len(processes)} processes whose devices are not "
                     f"the profile's hosts of {hw.devices_per_host}: moves between processes "
                     "may be priced over the intra-host link; give a profile whose "
                     "devices_per_host is the devices per process)")
    for q, nbytes, fwd, bwd in moves:
        link = (f"inter-host link {fmt_bytes(hw.inter_host.bandwidth)}/s" if fwd.inter_host
                else f"intra-host link {fmt_bytes(hw.intra_host.bandwidth)}/s")
        lines.append(f"    stage {q - 1} -> {q}: {fmt_bytes(nbytes)} per micro-batch by "
                     f"{fwd.program} over the {link}: {fmt_seconds(fwd.seconds)} forward, "
                     f"{fmt_seconds(bwd.seconds)} back ({bwd.program})")
    return lines


def _io_specs(split: split_mod.SplitStep, ios, specs) -> tuple[tuple, tuple]:
    """Each step input's spec on the first stage that holds it (replicated unless it is a
    differentiated parameter); tied outputs as their inputs, others replicated."""
    n = split.num_inputs
    out = [None] * n
    for io, spec in zip(ios, specs):
        for d in io.diff_in:
            if d in split.diff_values:
                src = split.diff_sources[split.diff_values.index(d)]
                if src is not None and out[src] is None and d in spec:
                    out[src] = spec[d]
    ins = tuple(out[i] or ShardSpec.replicated(len(a.shape))
                for i, a in enumerate(split.traced.in_avals))
    outs = tuple(ins[t] if t is not None else ShardSpec.replicated(len(a.shape))
                 for t, a in zip(split.traced.arg_info.ties, split.traced.out_avals))
    return ins, outs


def _explain(cand: PipelineOption, alternatives, stages, cluster: Cluster, hw: HardwareProfile,
             schedule: str, B: int, bubble: float, intra_total: float | None) -> list[str]:
    lines = [(f"pipeline: {cand.num_stages} stage(s) x {B} micro-batches ({schedule}) on "
              f"{cluster.num_hosts} host(s) x {cluster.per_host} devices, estimated step "
              f"{fmt_seconds(cand.total_s)}, bubble {bubble:.0%}")]
    for q, s in enumerate(stages):
        lines.append(f"  stage {q}: layers {s.layers[0]}-{s.layers[1]} on "
                     f"{'x'.join(map(str, s.submesh_shape))} (devices {device_span(s.devices)}), "
                     f"{fmt_seconds(s.estimate.total_s)} per micro-batch, memory "
                     f"{fmt_bytes(s.estimate.peak_bytes)} per device")
    lines.append("alternatives (estimated step time; the least is chosen):")
    rows = list(alternatives)
    if intra_total is not None:
        rows.append(PipelineOption("1 stage, pure intra-op on the whole mesh (full-step ILP)", 1, 1,
                              intra_total))
    for c in sorted(rows, key=lambda c: (c.total_s, c.label)):
        mark = "  <- chosen" if c is cand or c == cand else ""
        lines.append(f"  {c.label}: {fmt_seconds(c.total_s)}{mark}")
    fast, slow = hw.intra_host.bandwidth, hw.inter_host.bandwidth
    if cluster.num_hosts > 1 and slow < fast:
        lines.append(f"links: {fmt_bytes(fast)}/s within a host, {fmt_bytes(slow)}/s between "
                     "hosts: stages on separate hosts send only activations between hosts, "
                     "where intra-op parallelism across hosts all-reduces gradients or "
                     "activations over the slow link")
    else:
        lines.append(f"links: {fmt_bytes(hw.intra_host.bandwidth)}/s everywhere: stages pay a "
                     "pipeline bubble that intra-op parallelism over all devices does not")
    return lines


# -- entry points ---------------------------------------------------------------------------------


def _micro_batch_candidates(split_probe: split_mod.SplitStep, num: int | None) -> list[int]:
    if num is not None:
        return [int(num)]
    micro = split_probe.micro_leaves
    if not micro:
        return [1]
    batch = split_probe.traced.in_avals[micro[0]].shape[0]
    found = [b for b in (2, 4, 8, 16) if b <= batch and batch % b == 0]
    return found[-2:] or [1]


def plan_pipeline(fn, args: Sequence, mesh, hardware: HardwareProfile,
                  options: SearchOptions = DEFAULTS, *, min_stages: int = 1,
                  intra_total: float | None = None,
                  traced: TracedStep | None = None) -> PipelinePlan:
    """Plan `fn(*args)` (arrays or ShapeDtypeStructs) as a pipeline on `mesh` (a jax Mesh to
    run it, or a MeshShape / device count to plan only).

    Of `options`: num_stages forces this many stages on equal submeshes (default: Alpa's DP
    chooses the stages and their submeshes, at least `min_stages`); num_micro_batches defaults
    to the better of the two largest powers of two up to 16 that divide the batch;
    num_layers is how many layers the loss function is clustered into (default min(8, ...),
    or the user's stage_boundary marks); memory_budget defaults to the profile's memory.

    Args:
      intra_total: the pure intra-op step time, listed among the alternatives if given.
      traced: the step already traced by shardplan.ir.trace.trace (else traced here).
    """
    start = time.perf_counter()
    cluster = Cluster.of(mesh, hardware)
    num_stages = options.num_stages
    if num_stages is not None and equal_shape(cluster, int(num_stages)) is None:
        raise ValueError(f"num_stages={num_stages} does not split {cluster.num_devices} devices "
                         f"({cluster.num_hosts} hosts x {cluster.per_host}) into equal submeshes "
                         f"of Alpa's shapes {cluster.shapes()}; choose a divisor")
    if traced is None:
        traced = trace(fn, tuple(args), options.state_argnums, options.batch_argnums)

    def split_into(B: int) -> split_mod.SplitStep:
        return split_mod.split_step(fn, args, num_micro_batches=B,
                                    state_argnums=options.state_argnums,
                                    batch_argnums=options.batch_argnums, traced=traced)

    probe = split_into(1)
    budget = hardware.memory_bytes if options.memory_budget is None else options.memory_budget
    tables_cache = CostTables(hardware, cluster,
                              intra_options(options, compiler=hardware.backend))
    best: tuple[PipelineOption, Tables] | None = None
    alternatives: list[PipelineOption] = []
    for B in _micro_batch_candidates(probe, options.num_micro_batches):
        split = probe if B == 1 else split_into(B)
        tables, found = _options_of(split, cluster, tables_cache, hardware, budget, options)
        alternatives += found
        for c in found:
            if c.num_stages >= min_stages and (best is None or c.total_s < best[0].total_s):
                best = (c, tables)
    if best is None:
        raise stages_mod.NoFeasibleStagePlan(
            f"no pipeline of at least {min_stages} stage(s) fits {fmt_bytes(budget)} per device "
            f"on {cluster.num_devices} devices; raise memory_budget or add devices")
    return _assemble(best[1], best[0], cluster, hardware, options.schedule, alternatives, mesh,
                     start, intra_total, tables_cache.num_ilps)


def _options_of(split: split_mod.SplitStep, cluster: Cluster, tables_cache: CostTables,
                hardware: HardwareProfile, budget: float, options: SearchOptions
                ) -> tuple[Tables, list[PipelineOption]]:
    """The cost tables of one split (one micro-batch count) and its pipeline options: k
    stages on equal submeshes for every k that has them (or the forced num_stages), and the
    stages and submeshes the DP chooses freely."""
    B, num_stages = split.num_micro_batches, options.num_stages
    L = options.num_layers
    if L is None and not split.boundaries:
        L = min(len(split.body), max(8, 2 * cluster.num_hosts))
    layers = stage_io.layer_groups(split, L)
    if num_stages is not None:
        if num_stages > len(layers):
            raise ValueError(f"num_stages={num_stages} exceeds the {len(layers)} layers; "
                             "pass num_layers >= num_stages")
        counts = [int(num_stages)]
        shapes = [equal_shape(cluster, int(num_stages))]
    else:
        counts = [k for k in range(1, min(len(layers), cluster.num_devices) + 1)
                  if equal_shape(cluster, k) is not None]
        shapes = None
    tables = build_tables(split, layers, tables_cache, hardware, budget, shapes,
                          gpipe=options.schedule == "gpipe")
    found = []
    for k in counts:
        m = tables.shapes.index(equal_shape(cluster, k))
        plan = _solve(tables, [m])
        if plan is not None:
            found.append(_option(tables, plan, f"{k} stage(s) on equal submeshes, "
                                 f"{B} micro-batches", hardware))
    if num_stages is None:
        plan = _solve(tables, None)
        free = None if plan is None else _option(tables, plan, "", hardware)
        if free is not None and all(c.stages != free.stages for c in found):
            shapes_used = "+".join("x".join(map(str, sh)) for _, _, sh in free.stages)
            found.append(dataclasses.replace(free, label=(
                f"{plan.num_stages} stage(s) chosen by the DP ({shapes_used}), "
                f"{B} micro-batches")))
    return tables, [priced(tables, c, cluster, hardware, options.schedule) for c in found]
