"""Planning time of a scanned model against its trip count: a scanned 48-layer GPT-2 1.5B and
the same model cut to 2 layers, planned on an 8x8 mesh of A100s from abstract inputs.

A scanned body is planned once for every layer, so the two should take about the same time
(target: 48 layers within 1.5x of 2 layers, and under 10 s).

    .venv/bin/python benchmarks/loops_bench.py [--layers 48] [--size gpt2-1.5b] [--repeat 1]
    .venv/bin/python -m cProfile -s cumtime benchmarks/loops_bench.py | head -60
"""

from __future__ import annotations

import argparse
import time

import shardplan
from shardplan.models import get_model


def plan_time(size: str, num_layers: int | None, mesh_shape, cluster: str) -> tuple[float, object]:
    overrides = {} if num_layers is None else {"num_layers": num_layers}
    step = get_model("gpt", size, abstract=True, scan_layers=True, **overrides)
    start = time.perf_counter()
    plan = shardplan.search(step.fn, *step.args, cluster=cluster, mesh_shape=mesh_shape,
                            measure=False, state_argnums=step.state_argnums,
                            batch_argnums=step.batch_argnums)
    return time.perf_counter() - start, plan


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="gpt2-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="default: the size's own (48)")
    ap.add_argument("--small", type=int, default=2, help="layers of the cut model")
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--cluster", default="a100-80gb")
    ap.add_argument("--repeat", type=int, default=1, help="best of N runs each")
    args = ap.parse_args(argv)
    mesh_shape = tuple(int(s) for s in args.mesh.split("x"))
    results = {}
    for label, layers in (("small", args.small), ("full", args.layers)):
        best, plan = min((plan_time(args.size, layers, mesh_shape, args.cluster)
                          for _ in range(args.repeat)), key=lambda r: r[0])
        results[label] = best
        n = layers if layers is not None else "all"
        print(f"{args.size} scanned, {n} layers, mesh {args.mesh}: {best:.2f} s "
              f"(search_s {plan.search_s:.2f} s, {plan.solver}, estimate "
              f"{plan.estimate.total_s * 1e3:.1f} ms/step)")
    ratio = results["full"] / results["small"]
    print(f"ratio full/small: {ratio:.2f}x (target <= 1.5x); full under 10 s: "
          f"{'yes' if results['full'] < 10 else 'no'}")


if __name__ == "__main__":
    main()
