"""Planning at real size by the cost model alone: the configs of MaxText's models and slices
(configs/llama2-7b-tpu-v5e-16.yaml, llama2-70b-tpu-v5e-256.yaml, mixtral-8x7b-tpu-v5p-128.yaml)
searched from abstract inputs with measure=False under each config's memory budget, and no
compile (the profile is renamed, so no compile-only TPU devices are made: a TPU compile of
these steps takes minutes). Prints wall and CPU seconds, the plan (remat, accumulation, the
solver's account) and, with --profile, where the time went (pyinstrument, not a dependency).

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python benchmarks/plan_at_size.py [--only NAME ...]
        [--set search.time_limit=300] [--profile DIR]

Targets (issue 31): Llama2-7B on 16 chips < 60 s, Llama2-70B on 256 chips < 120 s.

Measured 2026-11-28 on the shared 2-core machine (load 6 to 8), the budgets of the configs
(15.75 GiB per v5e chip, 95 GiB per v5p chip), --set search.time_limit=300:

  case                 remat   wall (CPU)    plan                          FSDP+remat pinned
  llama2-7b  4x4       true    11 s (4.7 s)  optimal, 3.27 s, 12.21 GiB    3.80 s, 13.00 GiB
  llama2-70b 16x16     true    13 s (6.2 s)  optimal, 17.37 s, 15.60 GiB   21.70 s, 14.16 GiB
  mixtral    8x8       true    15 s (7.9 s)  optimal, 3.02 s, 85.72 GiB    3.81 s, 34.22 GiB
  llama2-7b  4x4       auto   247 s          the same optimal plan (load 9 to 12)

(step times and peaks are the cost model's estimates; nothing was compiled). With remat true
the 7B's 13 s under pyinstrument went to Problem.solver_input (the reshard price of every pair
of strategies on every edge) 6.5 s, the solve 4.3 s (presolve, HiGHS), the strategies 1.1 s,
the trace 0.7 s.

With remat auto (the configs set true) and the default 30 s time limit, 7B took 35 s
(18 s CPU), 70B 37 s, Mixtral 64 s, and each came back with FSDP over the slice
rematerialized, its inputs pinned and evaluated, not searched (the right column): the step
as written fits no chip (7B: at least 191.86 GiB per chip), and the solver spends the time
proving by how much. Where the 247 s of remat auto went (pyinstrument): 197 s in CP-SAT's
least-memory solve of the step as written (intra/solve/ilp.py: solve raises
InfeasibleMemory with least_memory's exact bound where the budget is below the simple
bound), 17 s building its CP-SAT model, 17 s in Problem.solver_input (the reshard price of
every pair of strategies on every edge, both steps), 6 s in the HiGHS MIP that proved the
rematerialized step's plan optimal, 2.5 s strategies, 1 s trace.

After 8fef27e (the step as written only bounded where the rematerialized step follows,
SearchOptions / Job.least_memory), --set search.remat=auto at the default 30 s limit:
llama2-7b 5.8 s wall (5.8 s CPU) and llama2-70b 7.1 s, each the rematerialized step's plan
searched and proven optimal (3.270 s and 17.372 s per step, 12.21 and 15.68 GiB), the same
plans as remat true.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import shardplan
from shardplan.config import load_config
from shardplan.workload import build_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {name: os.path.join(ROOT, "configs", f"{name}.yaml")
         for name in ("llama2-7b-tpu-v5e-16", "llama2-70b-tpu-v5e-256",
                      "mixtral-8x7b-tpu-v5p-128")}


def run(name: str, overrides: list[str], profile_dir: str | None) -> None:
    config = load_config(CASES[name], overrides)
    work = build_workload(config)
    hw = dataclasses.replace(config.profile(), name=f"{config.profile().name} (cost model)")
    options = config.search_options().replace(
        measure=False, pipeline=False, num_micro_batches=None,
        state_argnums=work.state_argnums, batch_argnums=work.batch_argnums)
    (names, sizes), = config.cluster.mesh.candidates()
    profiler = None
    if profile_dir:
        from pyinstrument import Profiler  # optional: only for --profile

        profiler = Profiler(interval=0.01)
        profiler.start()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        plan = shardplan.search(work.fn, *work.args, cluster=hw, mesh_shape=sizes,
                                axis_names=names, options=options)
        outcome = (f"remat={plan.remat} grad_accumulation={plan.grad_accumulation} estimate "
                   f"{plan.estimate.total_s:.3f} s peak {plan.estimate.peak_bytes / 2**30:.2f} "
                   f"GiB; {plan.zero}; {plan.solver}")
    except (shardplan.InfeasibleMemory, shardplan.SearchTimeout) as e:
        plan, outcome = None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name:26s} wall {wall:6.1f} s  cpu {cpu:6.1f} s  {outcome}", flush=True)
    for note in plan.notes if plan is not None else ():
        print(f"    {note}")
    if profiler is not None:
        profiler.stop()
        with open(os.path.join(profile_dir, f"{name}.txt"), "w") as f:
            f.write(profiler.output_text(unicode=False, color=False))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override, as the shardplan command's --set")
    ap.add_argument("--profile", metavar="DIR", help="write a pyinstrument profile per case")
    args = ap.parse_args(argv)
    for name in args.only:
        run(name, args.set, args.profile)


if __name__ == "__main__":
    main()
