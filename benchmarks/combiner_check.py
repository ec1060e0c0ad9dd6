"""Does the estimate's all-reduce combiner (shardplan/intra/combiner/xla.py) follow XLA's? For zoo
models on 8 and 2x4 CPU devices: the all-reduces the searched plan runs one by one, the
combined ones the estimate expects, and those in the compiled program (with their operand
bytes), and the plan's predicted communication time against the compiled program's.

    .venv/bin/python benchmarks/combiner_check.py                     # test size, cpu
    .venv/bin/python benchmarks/combiner_check.py --models gpt --size gpt2-124m --profiles a100-80gb
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

MESHES = {"8": ((8,), ("devices",)), "2x4": ((2, 4), ("data", "model"))}


def check(name: str, size: str, mesh_name: str, profile: str):
    from shardplan.cost.hardware import get_profile
    from shardplan.ir.trace import trace
    from shardplan.models import get_model
    from shardplan.options import DEFAULTS
    from shardplan.planning import compiled
    from shardplan.planning.intra_op import plan_step
    from shardplan.strategies.spec import MeshShape

    shape, names = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    m = get_model(name, size, abstract=True)
    hw = get_profile(profile)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    options = DEFAULTS.replace(state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    plan, graph, intra = plan_step(traced, MeshShape.of(mesh), hw, options, device_mesh=mesh,
                                   donate_argnums=m.state_argnums)
    lowered = compiled.lower_plan(graph, traced, plan, mesh, m.state_argnums)
    stats, priced = compiled.compile_and_price(lowered, mesh, plan.mesh, hw,
                                              compiled.compute_dtype(graph))
    if hw.forms_reduce_scatter:
        stats = stats.formed()
    ops = [op for op in stats.collectives if op.kind in ("all-reduce", "reduce-scatter")]
    alone = sum(1 for _, c in intra.comms if c.kind in ("all-reduce", "reduce-scatter"))
    combined = list(intra.combined)  # all-reduces, and reduce-scatters formed of them
    return (alone, sum(x.trips for x in combined), sum(op.count for op in ops),
            sum(x.nbytes * x.trips for x in combined), sum(op.nbytes * op.count for op in ops),
            plan.estimate.comm_s, priced.comm_s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt", "bert", "moe", "wresnet",
                                                     "vit", "llama"])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--meshes", nargs="+", default=["8", "2x4"])
    ap.add_argument("--profiles", nargs="+", default=["cpu"])
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", 8)
    print("| model | mesh | profile | reductions alone | combined pred/compiled | "
          "their bytes pred/compiled | comm pred/compiled |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        for mesh in args.meshes:
            for profile in args.profiles:
                try:
                    r = check(name, args.size, mesh, profile)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"| {name} | {mesh} | {profile} | {type(e).__name__}: {e} ||||")
                    continue

                def ratio(a, b):
                    return f"{a / b:.3f}" if b else ("1.000" if not a else "inf")

                print(f"| {name} | {mesh} | {profile} | {r[0]} | {r[1]:g} / {r[2]} | "
                      f"{ratio(r[3], r[4])} ({r[4] / 2**20:.2f} MiB) | {ratio(r[5], r[6])} |",
                      flush=True)


if __name__ == "__main__":
    main()
