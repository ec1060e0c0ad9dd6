"""Measured selection: compile the searched plan and the expert plans with XLA, price each
program with the hardware profile, keep the cheapest that fits.

The ILP searches with the cost model, and a cost model is not the compiler: XLA fuses,
reorders and picks collectives of its own, and where the two disagree the model's optimum can
compile to a slower program than a hand-written data-parallel step (measured: GPT-2 1.5B on
8 A100s, 1.57x before this stage). Compiling a handful of candidates and pricing what XLA
really emitted (`analysis/price.py`: compiled flops per device, the collectives of the
partitioned HLO over the profile's links, `compiled.memory_analysis()`) makes the kept plan
never slower than the expert plans it was compared with, as priced, whatever the model got
wrong; the model still finds the plans no expert would write.

An expert candidate is what an expert writes by hand: the input shardings of data parallel,
FSDP or Megatron (`intra/experts.py`, the same specs the ILP is seeded with); data parallel's
intermediates are XLA's propagation, and a plan that splits the state has its intermediates
laid out by the ILP with those inputs pinned (`expert_plans`: FSDP gathers each weight where
it is read, Megatron splits the activations with its weights).

`plan_measured` is shardplan.search.plan_step followed by this selection.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from shardplan import replan as replan_mod
from shardplan.analysis import hlo, targets
from shardplan.analysis.price import PricedStep, price
from shardplan.cost.hardware import HardwareProfile
from shardplan.emit import spmd
from shardplan.emit.jit import emit_jit
from shardplan.intra import experts, liveness
from shardplan.intra.ilp import InfeasibleMemory, SearchTimeout
from shardplan.intra.planner import IntraPlan
from shardplan.ir.graph import Graph, Role
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.plan import Estimate, Plan
from shardplan.search import (
    Choice,
    choose,
    donated_inputs,
    pinned_inputs,
    plan_graph,
    plan_step,
)
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import Deadline, fmt_bytes, fmt_seconds

# Only the partitioned HLO, its buffer assignment and cost analysis are read from the
# compiled programs, never run: LLVM's optimisations of the CPU code are wasted time. These
# options leave flops, memory and collectives unchanged (checked on GPT-2 124M, 2x4 two_d)
# and make compiling about 1.5-3x faster.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# Another candidate replaces the searched plan only when it is cheaper by more than this.
MARGIN = 1e-3


def compile_for_analysis(lowered):
    """lowered.compile() with the fast options (plain compile if this XLA does not know them)."""
    try:
        return lowered.compile(compiler_options=FAST_COMPILE)
    except RuntimeError as e:
        if "compile option" not in str(e):
            raise
        return lowered.compile()


@dataclasses.dataclass(frozen=True)
class MeasuredProgram:
    """One plan's program compiled and priced: the plan, what XLA made of it, why it failed."""

    name: str
    plan: Plan
    priced: PricedStep | None = None
    error: str = ""
    stats: hlo.ProgramStats | None = None  # the compiled program's collectives, flops, memory
    extrapolated: str = ""  # how `priced` was extrapolated from shallower copies (shardplan.depth)
    refused_bytes: float = 0.0
    """What the program needs per device when the compiler refused it for want of memory (the
    TPU compiler past HBM: targets.hbm_refusal); 0 otherwise."""

    def fits(self, budget: float | None) -> bool:
        return self.priced is not None and (budget is None or self.priced.peak_bytes <= budget)

    @property
    def peak_bytes(self) -> float | None:
        """The compiled peak per device, or what the compiler said it needs when it refused
        the program for want of memory; None when neither is known."""
        if self.priced is not None:
            return self.priced.peak_bytes
        return self.refused_bytes or None


def compute_dtype(graph: Graph) -> str:
    """The dtype most of the step's flops run in (the dtype its compute is priced at)."""
    flops: dict[str, float] = {}
    for node in graph.nodes:
        if node.outputs and node.flops:
            d = str(graph.values[node.outputs[0]].dtype)
            flops[d] = flops.get(d, 0.0) + node.flops
    return max(flops, key=flops.get) if flops else "float32"


def expert_plans(graph: Graph, plan: Plan,
                 pinned: Mapping[int, ShardSpec] | None = None,
                 complete: Callable[[dict[int, ShardSpec]], Plan] | None = None
                 ) -> dict[str, Plan]:
    """The expert plans for this step as Plans: their input specs (but the `pinned` inputs'
    specs, which hints fix), state outputs tied to their inputs.

    As an expert writes them: data parallel is its input shardings (XLA's propagation does
    what the expert would: activations split on the batch, gradients all-reduced). A plan
    that splits the state is more than its inputs: with `complete` (the ILP with those inputs
    pinned, see `completer`) every intermediate is laid out as the planner would under them:
    FSDP gathers each weight where it is read and reduce-scatters its gradient instead of
    XLA carrying the weights' split into the activations, Megatron splits its activations
    with its weights (and the vocabulary with the embedding). Without `complete`, or when
    the completion fails (time limit, memory), the inputs only, the other outputs
    replicated, XLA propagating the rest."""
    out = {}
    pinned = pinned or {}
    for name, fixed in experts.expert_inputs(graph, plan.mesh).items():
        inputs = tuple(pinned.get(i, fixed[i]) for i in range(len(graph.inputs)))
        splits = experts.splits_state(inputs, graph.input_roles)
        written = _complete(complete if splits else None, dict(enumerate(inputs)))
        if written is not None:
            out[name] = dataclasses.replace(
                written, notes=(), solver=f"{name} (the expert's input shardings"
                f"{', hints pinned' if pinned else ''}; the ILP lays out the rest)")
            continue
        outputs = tuple(inputs[tie] if tie is not None else
                        ShardSpec.replicated(graph.values[v].ndim)
                        for v, tie in zip(graph.outputs, graph.output_ties))
        state = sum(graph.values[v].nbytes / s.num_shards(plan.mesh)
                    for v, s, r in zip(graph.inputs, inputs, graph.input_roles) if r == Role.STATE)
        out[name] = dataclasses.replace(
            plan, input_specs=inputs, output_specs=outputs, constraints={}, operand_specs={},
            ops=(), notes=(), estimate=Estimate(0.0, 0.0, 0.0, state),
            solver=f"{name} (the expert's input shardings{', hints pinned' if pinned else ''}; "
                   "XLA propagates the rest)")
    return out


def _complete(complete, fixed: dict[int, ShardSpec]) -> Plan | None:
    if complete is None:
        return None
    try:
        with warnings.catch_warnings():  # the searched plan has warned about the same graph
            warnings.simplefilter("ignore")
            return complete(fixed)
    except (InfeasibleMemory, SearchTimeout):
        return None


def completer(graph: Graph, traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
              options: SearchOptions, deadline: Deadline | float, **where
              ) -> Callable[[dict[int, ShardSpec]], Plan]:
    """fixed inputs -> the plan the ILP completes around them (no memory budget: an expert
    plan is what it is; the measured selection judges its compiled peak), within `deadline`
    or, given seconds, that many each (a search that used up a shared one left FSDP on
    gpt-6.7b 8x8 its inputs alone: 2.48 s priced); `where`: plan_graph's keywords."""
    free = dataclasses.replace(options, memory_budget=None)

    def complete(fixed: dict[int, ShardSpec]) -> Plan:
        own = Deadline(deadline) if isinstance(deadline, (int, float)) else deadline
        return plan_graph(graph, traced, mesh_shape, hw, free, deadline=own,
                          fixed_inputs=fixed, **where)[0]

    return complete


def device_grid(mesh) -> np.ndarray:
    """The device ids of `mesh` in its shape (where each collective's links are)."""
    return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)


def compile_and_price(lowered, mesh, mesh_shape: MeshShape, hw: HardwareProfile, dtype: str,
                      widening: float = 1.0) -> tuple[hlo.ProgramStats, PricedStep]:
    """A lowered program compiled by XLA on `mesh` (never run), analysed and priced as `hw`
    runs it, compute at `dtype`'s peak. `widening` (intra.liveness.cpu_widening of the step): on CPU
    devices standing in for a GPU or TPU, the share of the temporaries the target holds."""
    stats = targets.on_target(analyzed(lowered, mesh), mesh, hw, widening)
    return stats, price(stats, mesh_shape, device_grid(mesh), hw, dtype)


# Programs compiled in this process, by their text and devices: a re-plan that comes back to a
# plan already compiled (or two candidates that lower to one program) is not compiled again,
# which on the TPU compiler saves minutes (tests/test_measure.py::test_a_program_is_compiled_once).
_COMPILED: dict[tuple[str, tuple[int, ...], str], hlo.ProgramStats] = {}
_COMPILED_MAX = 64


def analyzed(lowered, mesh) -> hlo.ProgramStats:
    """hlo.analyze of `lowered` compiled on `mesh`'s devices, once per program and devices."""
    devices = np.asarray(mesh.devices).flat
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(),
           tuple(int(d.id) for d in devices), np.asarray(mesh.devices).flat[0].device_kind)
    if key not in _COMPILED:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # donating abstract args warns
            stats = hlo.analyze(compile_for_analysis(lowered))
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[key] = stats
    return _COMPILED[key]


def lower_plan(graph: Graph, traced: TracedStep, plan: Plan, mesh,
               donate_argnums: Sequence[int] = ()):
    """The plan's step lowered on `mesh` for the traced (abstract) arguments."""
    jitted, _, _ = emit_jit(graph, mesh, traced.in_tree, traced.out_tree, plan.input_specs,
                            plan.output_specs, plan.constraints, plan.operand_specs,
                            tuple(donate_argnums))
    args = jax.tree_util.tree_unflatten(traced.in_tree, list(traced.in_avals))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donating abstract args warns
        return jitted.lower(*args)


def measure(graph: Graph, traced: TracedStep, plan: Plan, mesh, hw: HardwareProfile, name: str,
            donate_argnums: Sequence[int] = (), dtype: str | None = None,
            widening: float = 1.0) -> MeasuredProgram:
    """Compile and price one plan (`widening`: compile_and_price's); a failure to compile is
    recorded, not raised."""
    try:
        stats, priced = compile_and_price(lower_plan(graph, traced, plan, mesh, donate_argnums),
                                          mesh, plan.mesh, hw, dtype or compute_dtype(graph),
                                          widening)
    except Exception as e:  # noqa: BLE001 - one candidate failing must not sink the others
        refused = targets.hbm_refusal(str(e))
        return MeasuredProgram(name, plan, None,
                               f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
                               refused_bytes=refused[0] if refused else 0.0)
    return MeasuredProgram(name, plan, priced, stats=stats)


def measured_estimate(c: MeasuredProgram) -> Estimate:
    p = c.priced
    return Estimate(p.compute_s, p.comm_s, p.peak_bytes, c.plan.estimate.state_bytes,
                    p.bytes_sent)


def select(graph: Graph, traced, plan: Plan, mesh, hw: HardwareProfile, *,
           memory_budget: float | None = None, donate_argnums: Sequence[int] = (),
           pinned: Mapping[int, ShardSpec] | None = None,
           replan: Callable[[float], Plan] | None = None,
           complete: Callable[[dict[int, ShardSpec]], Plan] | None = None,
           progress: Callable[[str], Any] | None = None,
           compile_one: Callable[[str, Plan], MeasuredProgram] | None = None,
           compiler: targets.Compiler | None = None
           ) -> tuple[Plan, tuple[MeasuredProgram, ...]]:
    """Compile the searched plan and every expert plan on `mesh`, keep the cheapest priced
    program that fits `memory_budget` (compiled peak bytes per device). The searched plan is
    kept unless another is cheaper by more than MARGIN; when nothing fits, the one that needs
    the least memory is kept. The expert plans keep the `pinned` inputs' specs (hints). The
    kept plan's estimate becomes the measured one and its notes list every candidate.

    The memory model misses some of XLA's temporaries, so a searched plan can compile over a
    budget it fitted by the estimate: then `replan(budget)` (the ILP under another budget) is
    asked again with the budget scaled by estimate / compiled peak, up to
    replan.RECALIBRATIONS times, and each re-plan is a candidate too. `complete` lays out the expert plans'
    intermediates (expert_plans). `compile_one(name, plan)` compiles and prices a candidate
    instead of `measure` (shardplan.depth: from shallower copies of a deep step); `compiler`:
    which compiler `mesh`'s devices stand for (targets.compile_mesh), named in the notes."""
    dtype = compute_dtype(graph)
    widening = liveness.cpu_widening(graph) if targets.widens(mesh, hw) else 1.0

    def run(name, p):
        if progress is not None:
            progress(f"compiling and pricing the {name} plan")
        if compile_one is not None:
            return compile_one(name, p)
        return measure(graph, traced, p, mesh, hw, name, donate_argnums, dtype, widening)

    candidates = [run("searched", plan)]
    stopped = replan_mod.recalibrate(candidates, run, memory_budget, replan)
    for name, p in expert_plans(graph, plan, pinned, complete).items():
        candidates.append(run(name, p))
    priced = [c for c in candidates if c.priced is not None]
    if not priced:
        return plan, tuple(candidates)
    best = _cheapest(priced, memory_budget)
    fits = any(c.fits(memory_budget) for c in priced)
    judge = compiler.describe() if compiler is not None else "XLA"
    note = (_note(candidates, hw, memory_budget, judge) + stopped
            + _kept_note(best, fits, memory_budget) + _widening_note(widening))
    solver = (best.plan.solver if best.name.startswith("searched")
              else f"{best.plan.solver}; searched: {plan.solver}")
    kept = dataclasses.replace(best.plan, estimate=measured_estimate(best),
                               model_estimate=best.plan.estimate,
                               notes=(*plan.notes, note), solver=solver,
                               search_s=plan.search_s, candidates=tuple(candidates),
                               compiled_by=judge)
    return kept, tuple(candidates)


def _cheapest(priced: list[MeasuredProgram], memory_budget: float | None) -> MeasuredProgram:
    """The cheapest program that fits (a searched one unless another wins by MARGIN), else
    the one that needs the least memory."""
    fitting = [c for c in priced if c.fits(memory_budget)]
    if not fitting:
        return min(priced, key=lambda c: c.priced.peak_bytes)
    best = min(fitting, key=lambda c: c.priced.total_s)
    searched = [c for c in fitting if c.name.startswith("searched")]
    if searched:
        ours = min(searched, key=lambda c: c.priced.total_s)
        if ours.priced.total_s <= best.priced.total_s * (1 + MARGIN):
            best = ours
    return best


def _note(candidates: Sequence[MeasuredProgram], hw: HardwareProfile,
          memory_budget: float | None, judge: str = "XLA") -> str:
    """The kept plan's note: every candidate's price (or why it did not compile)."""
    lines = []
    for c in candidates:
        if c.priced is None:
            lines.append(f"{c.name}: did not compile ({c.error})")
            continue
        p = c.priced
        fit = "" if c.fits(memory_budget) else " (over the budget)"
        how = f" ({c.extrapolated})" if c.extrapolated else ""
        lines.append(f"{c.name} {fmt_seconds(p.total_s)} (compute {fmt_seconds(p.compute_s)}, "
                     f"comm {fmt_seconds(p.comm_s)}), peak {fmt_bytes(p.peak_bytes)}{fit}{how}")
    return f"measured (compiled by {judge}, priced as {hw.name}): " + "; ".join(lines)


def _widening_note(widening: float) -> str:
    if widening >= 1.0:
        return ""
    return (f"; peaks as the target holds them: compiled on CPU, whose XLA computes bf16/f16 "
            f"through f32 buffers, the temporaries counted x{widening:.2f} (the memory "
            "model's ratio of the step's intermediates at their own widths to them widened: "
            "a model, not a measurement)")


def _kept_note(best: MeasuredProgram, fitting: bool, memory_budget: float | None) -> str:
    note = f"; kept {best.name}"
    if not fitting and memory_budget is not None:
        note += (f": no compiled program fits {fmt_bytes(memory_budget)} per device, this one "
                 "needs the least")
        # Never returned as fitting: its estimate is the compiled peak, over the budget.
        warnings.warn(f"shardplan: no plan compiles within the memory budget of "
                      f"{fmt_bytes(memory_budget)} per device; the plan returned needs "
                      f"{fmt_bytes(best.priced.peak_bytes)} (see plan.notes)", stacklevel=4)
    return note


def plan_measured(traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
                  options: SearchOptions, *, device_mesh=None,
                  device_order: Sequence[int] | None = None,
                  donate_argnums: Sequence[int] | None = None) -> tuple[Plan, Graph, IntraPlan]:
    """shardplan.search.plan_step, then (with options.measure) the measured selection on
    `device_mesh`, or on CPU devices standing in for the cluster; one deadline for both."""
    start = time.perf_counter()
    deadline = Deadline(options.time_limit)
    plan, graph, intra = plan_step(traced, mesh_shape, hw, options, device_mesh=device_mesh,
                                   device_order=device_order, deadline=deadline,
                                   donate_argnums=donate_argnums)
    if options.measure:
        plan = select_measured(traced, graph, plan, mesh_shape, hw, options, deadline=deadline,
                               start=start, device_mesh=device_mesh, device_order=device_order,
                               donate_argnums=donate_argnums)
    return plan, graph, intra


def select_measured(traced: TracedStep, graph: Graph, plan: Plan, mesh_shape: MeshShape,
                    hw: HardwareProfile, options: SearchOptions, *, deadline: Deadline,
                    start: float | None = None, device_mesh=None,
                    device_order: Sequence[int] | None = None,
                    donate_argnums: Sequence[int] | None = None,
                    compile_one: Callable[[str, Plan], MeasuredProgram] | None = None,
                    progress: Callable[[str], Any] | None = None,
                    completion_s: float | None = None) -> Plan:
    """The measured selection (`select`) of the searched `plan` of the lifted step `graph`:
    re-plans and expert completions by the ILP within `deadline` (each completion within
    `completion_s` where given), on `device_mesh` or CPU devices standing in for the
    cluster; `compile_one`: select's."""

    def replan(ilp_budget: float) -> Plan:
        with warnings.catch_warnings():  # the first plan has warned about the same graph
            warnings.simplefilter("ignore")
            return plan_graph(graph, traced, mesh_shape, hw, options, ilp_budget=ilp_budget,
                              device_mesh=device_mesh, device_order=device_order, start=start,
                              deadline=deadline,
                              donated=donated_inputs(traced, donate_argnums))[0]

    mesh, compiler = targets.compile_mesh(hw, mesh_shape, device_mesh)
    complete = completer(graph, traced, mesh_shape, hw, options,
                         deadline if completion_s is None else completion_s,
                         device_mesh=device_mesh, device_order=device_order,
                         donated=donated_inputs(traced, donate_argnums))
    plan, _ = select(graph, traced, plan, mesh, hw, memory_budget=options.memory_budget,
                     donate_argnums=traced.state_argnums, replan=replan, complete=complete,
                     pinned=pinned_inputs(traced, mesh_shape, options), progress=progress,
                     compile_one=compile_one, compiler=compiler)
    return dataclasses.replace(plan, search_s=time.perf_counter() - (start or time.perf_counter()),
                               device_mesh=device_mesh)


# -- pipelines as compiled ------------------------------------------------------------------------


def lower_spmd(fn, args: Sequence, plan: Plan, mesh, donate_argnums: Sequence[int] = ()):
    """The SPMD pipeline plan's one program (shardplan.emit.spmd) lowered on `mesh` (which
    has the plan's pipeline axes, or is laid out as them) for `args` (arrays or abstract):
    (lowered, the pipeline mesh)."""
    pmesh = spmd.pipeline_mesh(mesh, len(plan.stages))
    jitted, _ = spmd.emit_plan(fn, plan, pmesh, donate_argnums)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donating abstract args warns
        return jitted.lower(*abstract), pmesh


def price_spmd(fn, args: Sequence, plan: Plan, mesh, hw: HardwareProfile, dtype: str,
               donate_argnums: Sequence[int] = (), widening: float = 1.0
               ) -> tuple[hlo.ProgramStats, PricedStep]:
    """The SPMD pipeline plan's program compiled on `mesh` (never run) and priced as `hw`
    runs it: the loop of ticks at its trip count (hlo.analyze)."""
    lowered, pmesh = lower_spmd(fn, args, plan, mesh, donate_argnums)
    return compile_and_price(lowered, pmesh, plan.mesh, hw, dtype, widening)


def choose_measured(fn, args: Sequence, mesh, hw: HardwareProfile, options: SearchOptions,
                    traced: TracedStep, donate_argnums: Sequence[int] = ()) -> Choice:
    """shardplan.search.choose, then, where it planned an SPMD pipeline and options.measure,
    the SPMD program and the intra-op plan's program compiled on `mesh` (or CPU devices
    standing in for it) and priced by `hw`: the cheaper as priced is kept, both prices in
    the notes (a pipeline is judged as compiled, like an intra-op plan)."""
    choice = choose(fn, args, mesh, hw, options, traced=traced)
    if (not options.measure or choice.spmd_plan is None or choice.intra is None
            or (choice.pipelined and choice.plan.pipeline_kind == "mpmd")):
        return choice
    real = isinstance(mesh, jax.sharding.Mesh)
    shape = MeshShape.of(mesh) if real else choice.intra.mesh
    devices, compiler = targets.compile_mesh(hw, shape, mesh if real else None)
    graph = choice.intra_graph
    dtype = compute_dtype(graph)
    widening = liveness.cpu_widening(graph) if targets.widens(devices, hw) else 1.0
    intra = measure(graph, traced, choice.intra, devices, hw, "intra-op", donate_argnums, dtype,
                    widening)
    try:
        _, spmd_priced = price_spmd(fn, args, choice.spmd_plan, devices, hw, dtype,
                                    donate_argnums, widening)
    except Exception as e:  # noqa: BLE001 - the intra-op plan stands
        note = (f"measured: the SPMD pipeline did not compile ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160]}); kept the cost model's choice")
        return dataclasses.replace(choice, plan=dataclasses.replace(
            choice.plan, notes=(*choice.plan.notes, note)))
    if intra.priced is None:
        return choice
    a, b = intra.priced.total_s, spmd_priced.total_s
    pick_spmd = b < a
    line = (f"measured (compiled by {compiler.describe()}, priced as {hw.name}): SPMD pipeline {fmt_seconds(b)} "
            f"(model {fmt_seconds(choice.spmd_plan.estimate.total_s)}), peak "
            f"{fmt_bytes(spmd_priced.peak_bytes)}; intra-op {fmt_seconds(a)} (model "
            f"{fmt_seconds(choice.intra.estimate.total_s)}), peak "
            f"{fmt_bytes(intra.priced.peak_bytes)}; kept the "
            f"{'SPMD pipeline' if pick_spmd else 'intra-op plan'}")
    base = choice.spmd_plan if pick_spmd else choice.intra
    priced = spmd_priced if pick_spmd else intra.priced
    kept = dataclasses.replace(
        base, estimate=Estimate(priced.compute_s, priced.comm_s, priced.peak_bytes,
                                base.estimate.state_bytes, priced.bytes_sent,
                                base.estimate.bubble_fraction),
        model_estimate=base.estimate, notes=(*base.notes, line),
        compiled_by=compiler.describe())
    return dataclasses.replace(choice, pipelined=pick_spmd, plan=kept,
                               pipeline=None if pick_spmd else choice.pipeline,
                               explanation=choice.explanation + "\n" + line)
