"""Planning time of the cases issue 10 and issue 12 set targets for, from abstract inputs with
`shardplan.search(measure=False)`: wall and CPU seconds (the machine is shared: compare CPU
seconds between runs under different load), whether the plan is proven optimal, its estimate.

    PYTHONPATH=. JAX_PLATFORMS=cpu .venv/bin/python benchmarks/plan_speed.py [--only NAME ...]

The garbage collector is paused while planning (shardplan.gcpause): on the unrolled
gpt2-1.5b on 8x8, ten full collections took 2.0 of 11.7 CPU seconds (gc.callbacks), the peak
memory the same paused (615 against 618 MB), about 0.3 M objects left in cycles for the
collector's next run.

Targets: gpt2-1.5b scanned on 8x8 under 10 s and within 1.5x of 2 layers; unrolled under 10 s;
llama-7b on 8x8 under 20 s; gpt2-124m on 2x4 in seconds.
"""

from __future__ import annotations

import argparse
import time

import shardplan
from shardplan.models import get_model

# name: (model, size, overrides, mesh, cluster, batch size)
CASES = {
    "gpt2-1.5b-scan-2L-8x8": ("gpt", "gpt2-1.5b", {"scan_layers": True, "num_layers": 2},
                              (8, 8), "a100-80gb", None),
    "gpt2-1.5b-scan-48L-8x8": ("gpt", "gpt2-1.5b", {"scan_layers": True}, (8, 8),
                               "a100-80gb", None),
    "gpt2-1.5b-unrolled-8x8": ("gpt", "gpt2-1.5b", {}, (8, 8), "a100-80gb", None),
    "llama-7b-8x8": ("llama", "7b", {"dtype": "bfloat16", "param_dtype": "float32"}, (8, 8),
                     "h100-80gb", 64),
    "gpt2-124m-2x4": ("gpt", "gpt2-124m", {}, (2, 4), "a100-80gb", 32),
}


def run(name: str) -> None:
    model, size, overrides, mesh, cluster, batch = CASES[name]
    step = get_model(model, size, abstract=True, batch_size=batch, **overrides)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = shardplan.search(step.fn, *step.args, cluster=cluster, mesh_shape=mesh,
                            axis_names=("data", "model"), measure=False,
                            state_argnums=step.state_argnums, batch_argnums=step.batch_argnums)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"{name:24s} wall {wall:6.2f} s  cpu {cpu:6.2f} s  estimate "
          f"{plan.estimate.total_s * 1e3:9.3f} ms  {plan.solver}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=list(CASES), choices=list(CASES))
    for name in ap.parse_args(argv).only:
        run(name)


if __name__ == "__main__":
    main()
