"""A plan compiled by the target's compiler (analysis.targets: compile-only TPU devices, or
CPU devices standing in) and priced by the hardware profile: what XLA really emitted
(`analysis/price.py`: compiled flops per device, the collectives of the partitioned HLO over
the profile's links, `compiled.memory_analysis()`). Programs are compiled, never run."""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from collections.abc import Sequence

import jax
import numpy as np

from shardplan.analysis import hlo, targets
from shardplan.analysis.price import PricedStep, price
from shardplan.cost.hardware import HardwareProfile
from shardplan.emit import spmd
from shardplan.emit.jit import emit_jit
from shardplan.ir.graph import Graph
from shardplan.ir.trace import TracedStep
from shardplan.plan import Estimate, Plan
from shardplan.strategies.spec import MeshShape

# Only the partitioned HLO, its buffer assignment and cost analysis are read from the
# compiled programs, never run: LLVM's optimisations of the CPU code are wasted time. These
# options leave the HLO, its buffers and cost analysis as a full compile makes them
# (tests/test_planning_compiled.py::test_fast_compile_reads_the_program_a_full_compile_makes).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

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
    extrapolated: str = ""  # how `priced` was extrapolated from shallower copies (shardplan.planning.depth)
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


def device_grid(mesh) -> np.ndarray:
    """The device ids of `mesh` in its shape (where each collective's links are)."""
    return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)


def compile_and_price(lowered, mesh, mesh_shape: MeshShape, hw: HardwareProfile, dtype: str,
                      widening: float = 1.0) -> tuple[hlo.ProgramStats, PricedStep]:
    """A lowered program compiled by XLA on `mesh` (never run), analysed and priced as `hw`
    runs it, compute at `dtype`'s peak. `widening` (intra.memory.liveness.cpu_widening of the step): on CPU
    devices standing in for a GPU or TPU, the share of the temporaries the target holds."""
    stats = targets.on_target(analyzed(lowered, mesh), mesh, hw, widening)
    return stats, price(stats, mesh_shape, device_grid(mesh), hw, dtype)


# Programs compiled in this process, by their text and devices: a re-plan that comes back to a
# plan already compiled (or two candidates that lower to one program) is not compiled again,
# which on the TPU compiler saves minutes (tests/test_targets.py::test_a_program_is_compiled_once).
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


