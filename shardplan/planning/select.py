"""A plan said to fit its memory budget, checked once compiled.

The memory model (intra/memory.py) follows XLA's buffers closely but not exactly: where the
compiled program keeps what the model does not see (an operand XLA gathers in another way than
the plan's strategy, its heap's gaps), a plan it fitted can compile over the budget. When a
budget is given and the step's devices are at hand, the searched plan is compiled (never run)
and its peak read (`memory_analysis()`); over the budget, the ILP plans again under a budget
scaled by estimate / compiled peak (shardplan.replan.recalibrate), and the first plan that
compiles within the budget is kept. Its estimate is then the compiled program's, priced as
measure=True prices it (the model's stays in `model_estimate`). With measure=True the measured selection does this and
more; without devices (shardplan.search on a cluster), or when the time limit ran out before
the check, the model alone judges the budget (and the notes say so)."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

from shardplan import measure
from shardplan import replan as replan_mod
from shardplan.analysis import targets
from shardplan.cost.hardware import HardwareProfile
from shardplan.intra import liveness
from shardplan.intra.ilp import SearchTimeout
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.plan import Plan
from shardplan.search import donated_inputs, plan_graph
from shardplan.strategies.spec import MeshShape
from shardplan.units import Deadline, fmt_bytes

# The share of the time limit the search gets when the check follows it.
CHECK_SHARE = 0.8


def plan_checked(traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
                 options: SearchOptions, *, device_mesh,
                 device_order: Sequence[int] | None = None,
                 donate_argnums: Sequence[int] | None = None) -> Plan:
    """shardplan.measure.plan_measured on `device_mesh`; then, without options.measure and
    under a memory budget, the plan compiled and held to the budget (see the module)."""
    # One deadline for the plan, the check and the re-plans (the time limit bounds them all);
    # under a budget the search gets CHECK_SHARE of it, the rest is the check's.
    deadline = Deadline(options.time_limit)
    checks = options.memory_budget is not None and not options.measure
    search = options.replace(time_limit=CHECK_SHARE * options.time_limit) if checks else options
    try:
        plan, graph, _ = measure.plan_measured(traced, mesh_shape, hw, search,
                                               device_mesh=device_mesh, device_order=device_order,
                                               donate_argnums=donate_argnums)
    except SearchTimeout as e:
        if search is options:
            raise
        raise SearchTimeout(options.time_limit, f"the search had {e.time_limit_s:g} s of it, "
                            "the compiled check of the memory the rest") from None
    budget = options.memory_budget
    if not checks or plan.stages:
        return plan
    if deadline.expired():
        note = (f"memory not checked once compiled: the time limit ({options.time_limit:g} s) "
                "ran out; the estimate is the memory model's")
        return dataclasses.replace(plan, notes=(*plan.notes, note))
    start = time.perf_counter()
    mesh, compiler = targets.compile_mesh(hw, mesh_shape, device_mesh)
    widening = (liveness.cpu_widening(graph) if targets.widens(mesh, hw) else 1.0)
    dtype = measure.compute_dtype(graph)

    # compiled with the donation the step will run with (None: the state, as the model counts)
    donate = traced.state_argnums if donate_argnums is None else tuple(donate_argnums)

    def run(name, p):
        return measure.measure(graph, traced, p, mesh, hw, name, donate, dtype, widening)

    compile_s = 0.0  # how long a check's compile took: a re-plan leaves time for its own

    def replan(ilp_budget: float) -> Plan:
        # The re-plan and the compile of its plan end by the time limit (a re-plan given what
        # remained of it, then compiled, ran a 30 s limit to 46-73 s on 2x4).
        left = deadline.limit_s - deadline.elapsed() - compile_s
        if left <= 0:
            raise SearchTimeout(options.time_limit, "no time left to re-plan and compile")
        with warnings.catch_warnings():  # the first plan has warned about the same graph
            warnings.simplefilter("ignore")
            return plan_graph(graph, traced, mesh_shape, hw, options, ilp_budget=ilp_budget,
                              device_mesh=device_mesh, device_order=device_order,
                              deadline=Deadline(left, grace=0.0),
                              donated=donated_inputs(traced, donate_argnums))[0]

    candidates = [run("searched", plan)]
    compile_s = time.perf_counter() - start
    stopped = replan_mod.recalibrate(candidates, run, budget, replan)
    priced = [c for c in candidates if c.priced is not None]
    refused = [c for c in candidates if c.priced is None and c.refused_bytes]
    if not priced and refused:  # the compiler refused every plan for want of memory
        least = min(refused, key=lambda c: c.refused_bytes)
        warnings.warn(f"shardplan: no plan compiles within the memory budget of "
                      f"{fmt_bytes(budget)} per device: {compiler.describe()} refused each "
                      f"for want of memory (the least needs {fmt_bytes(least.refused_bytes)})",
                      stacklevel=3)
        return dataclasses.replace(
            least.plan, model_estimate=least.plan.estimate, compiled_by=compiler.describe(),
            estimate=dataclasses.replace(least.plan.estimate, peak_bytes=least.refused_bytes),
            notes=(*least.plan.notes, (f"memory checked once compiled ({compiler.describe()}): "
                   f"refused for want of memory, {least.error}{stopped}")))
    if not priced:  # nothing compiled: the model's word stands, and the notes say why
        return dataclasses.replace(plan, notes=(
            *plan.notes, f"memory not checked once compiled: {candidates[0].error}"))
    fitting = [c for c in priced if c.fits(budget)]
    kept = fitting[0] if fitting else min(priced, key=lambda c: c.priced.peak_bytes)
    lines = "; ".join(f"{c.name}: estimate {fmt_bytes(c.plan.estimate.peak_bytes)}, compiled "
                      f"{fmt_bytes(c.priced.peak_bytes)}" for c in priced)
    note = (f"memory checked once compiled ({compiler.describe()}: its memory_analysis, "
            f"{time.perf_counter() - start:.1f} s): {lines}{stopped}; kept {kept.name}")
    if not fitting:
        note += f": no plan compiled within {fmt_bytes(budget)} per device, this one needs the least"
        # Never returned as fitting: its estimate is the compiled peak, over the budget.
        warnings.warn(f"shardplan: no plan compiles within the memory budget of "
                      f"{fmt_bytes(budget)} per device; the plan returned needs "
                      f"{fmt_bytes(kept.priced.peak_bytes)} (see plan.notes)", stacklevel=3)
    return dataclasses.replace(kept.plan, estimate=measure.measured_estimate(kept),
                               model_estimate=kept.plan.estimate,
                               notes=(*kept.plan.notes, note), compiled_by=compiler.describe(),
                               search_s=plan.search_s + time.perf_counter() - start)
