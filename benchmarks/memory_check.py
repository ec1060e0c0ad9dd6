"""Does a plan said to fit its memory budget fit once XLA compiles it?

For zoo models at test size on 8 and 2x4 CPU devices: the least memory any plan needs (as the
planner reports it), data parallel's compiled peak, and three budgets between the two. Each
budget is planned (`shardplan.auto(..., memory_budget=b)`), compiled, and the compiled peak
(`memory_analysis()`: argument + output + temp - alias per device) set against the plan's
estimate (to be within TOLERANCE) and the budget. Under a budget on devices the planner
compiles its plan to check it (shardplan.planning.select): the estimate is then the compiled program's, and
`compiled/model` sets the compiled peak against the memory model's own estimate. To see where the memory model and XLA
differ, compile with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" and read XLA's live
set with benchmarks/xla_live.py DIR (from the buffers' intervals: the dump's own "Live ranges at
N (peak)" is not memory_analysis' peak); the rest of memory_analysis' temp is the heap's gaps.

    .venv/bin/python benchmarks/memory_check.py                 # mlp gpt bert llama moe vit
    .venv/bin/python benchmarks/memory_check.py --models mlp --meshes 2x4 --measure
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

MESHES = {"8": ((8,), ("devices",)), "2x4": ((2, 4), ("data", "model"))}
FRACTIONS = (0.1, 0.4, 0.7)  # where in [reported minimum, data parallel's peak] to budget
TOLERANCE = 0.10  # the estimate is to be within this of the compiled peak


def _mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _auto(step, mesh, budget, measure=False, time_limit=30.0):
    import shardplan

    return shardplan.auto(step.fn, mesh=mesh, memory_budget=budget,
                          donate_argnums=step.state_argnums, state_argnums=step.state_argnums,
                          batch_argnums=step.batch_argnums, hardware="cpu", measure=measure,
                          time_limit=time_limit, cache=False)


def compiled_peak(auto_step, args) -> int:
    from shardplan.analysis import hlo
    from shardplan.planning import compiled

    return hlo.analyze(compiled.compile_for_analysis(auto_step.lower(*args))).peak_bytes


def data_parallel_peak(step, mesh) -> int:
    """The compiled peak of the data-parallel expert plan (state replicated, batch split)."""
    from shardplan.analysis import hlo
    from shardplan.cost.hardware import get_profile
    from shardplan.ir.trace import trace
    from shardplan.options import DEFAULTS
    from shardplan.planning import compiled
    from shardplan.planning.expert_plans import expert_plans
    from shardplan.planning.intra_op import plan_graph
    from shardplan.planning.job import Job
    from shardplan.strategies.spec import MeshShape

    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    job = Job.make(traced, MeshShape.of(mesh), get_profile("cpu"), DEFAULTS, device_mesh=mesh)
    graph, plan = job.graph, plan_graph(job)[0]
    dp = expert_plans(job, plan, complete=False)["data_parallel"]
    lowered = compiled.lower_plan(graph, traced, dp, mesh, step.state_argnums)
    return hlo.analyze(compiled.compile_for_analysis(lowered)).peak_bytes


def reported_minimum(step, mesh) -> float:
    """The least memory the planner says any plan needs (InfeasibleMemory.min_bytes under a
    1-byte budget), with time to prove it. Unproven, the least a plan it found needs
    (InfeasibleMemory.found_bytes): a budget between the lower bound and that may fit no plan
    (the search then ends in SearchTimeout, rightly: it can neither find one nor prove none)."""
    import shardplan

    try:
        try:
            _auto(step, mesh, 1, time_limit=30.0).plan(*step.args)
        except shardplan.SearchTimeout:  # a loaded machine: GPT on 2x4 ran out of its 30 s
            _auto(step, mesh, 1, time_limit=120.0).plan(*step.args)
    except shardplan.InfeasibleMemory as e:
        if e.exact:
            return e.min_bytes
        print(f"({step.name}: the least memory was not proven: between {e.min_bytes:.0f} and "
              f"{e.found_bytes:.0f}, which a plan found needs)", file=sys.stderr)
        return e.found_bytes if math.isfinite(e.found_bytes) else e.min_bytes
    raise AssertionError("a 1-byte budget fitted")


def said_to_fit(plan, budget) -> bool:
    """Whether the plan is returned as fitting: its estimate within the budget."""
    return plan.estimate.peak_bytes <= budget


def check(model: str, mesh_name: str, measure: bool = False):
    import shardplan
    from shardplan import models

    step = models.get_model(model, abstract=True)
    mesh = _mesh(mesh_name)
    try:
        low = reported_minimum(step, mesh)
    except shardplan.SearchTimeout as e:  # neither a plan nor a proof: no budgets to set
        print(f"({step.name} on {mesh_name}: no least memory reported: {e})", file=sys.stderr)
        return []
    high = data_parallel_peak(step, mesh)
    rows = []
    for f in FRACTIONS:
        # 1% above the least: CP-SAT rounds the rows, a budget a few bytes above can time out
        budget = int(max(low * 1.01, low + f * max(high - low, 0.0)))
        t = time.perf_counter()
        auto_step = _auto(step, mesh, budget, measure=measure)
        try:
            plan = auto_step.plan(*step.args)
        except Exception as e:  # noqa: BLE001 - report the row, go on
            rows.append({"model": model, "mesh": mesh_name, "budget": budget,
                         "estimate": float("nan"), "peak": float("nan"), "fits": None,
                         "seconds": time.perf_counter() - t,
                         "min": low, "dp": high, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        peak = compiled_peak(auto_step, step.args)
        rows.append({"model": model, "mesh": mesh_name, "budget": budget,
                     "estimate": plan.estimate.peak_bytes, "peak": peak,
                     "model_peak": (plan.model_estimate or plan.estimate).peak_bytes,
                     "fits": peak <= budget, "said": said_to_fit(plan, budget),
                     "min": low, "dp": high,
                     "seconds": time.perf_counter() - t})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "gpt", "bert", "llama", "moe", "vit"])
    parser.add_argument("--meshes", nargs="*", default=list(MESHES))
    parser.add_argument("--measure", action="store_true", help="plan with measure=True")
    args = parser.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    from shardplan.units import fmt_bytes

    print(f"measure={args.measure}")
    print("| model | mesh | budget | estimate | compiled | compiled/budget | compiled/estimate "
          "| compiled/model | said to fit | fits | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bad = 0
    for model in args.models:
        for mesh_name in args.meshes:
            for r in check(model, mesh_name, args.measure):
                if r["fits"] is None:
                    print(f"| {r['model']} | {r['mesh']} | {fmt_bytes(r['budget'])} | "
                          f"{r['error']} | | | | | | | {r['seconds']:.1f} |", flush=True)
                    continue
                off = abs(r["peak"] / r["estimate"] - 1) > TOLERANCE
                bad += (r["said"] and not r["fits"]) + off
                print(f"| {r['model']} | {r['mesh']} | {fmt_bytes(r['budget'])} | "
                      f"{fmt_bytes(r['estimate'])} | {fmt_bytes(r['peak'])} | "
                      f"{r['peak'] / r['budget']:.3f} | {r['peak'] / r['estimate']:.3f}"
                      f"{' (off)' if off else ''} | {r['peak'] / r['model_peak']:.3f} | "
                      f"{'yes' if r['said'] else 'no'} | "
                      f"{'yes' if r['fits'] else 'NO'} | {r['seconds']:.1f} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
