"""How much better than an expert plan can any plan be? The floor of a step on N devices: the
single-device program compiled by XLA and priced by the profile, divided by N, with no
communication. Every plan, SPMD or pipelined, prices at least this (the priced work of a step
is flops, dot operand/result bytes and argument/result bytes, and each element of them is
computed, read or held by at least one device: summed over devices they are at least the
single-device program's, so the busiest device holds at least 1/N of them), and the best expert
plan prices at most data parallel's. So floor / data parallel bounds from below what
searched / best expert can reach: no plan gets under it.

    .venv/bin/python benchmarks/floor.py --models gpt:gpt2-124m bert:base --meshes 8 2x4
    .venv/bin/python benchmarks/floor.py --configs configs/bench/*.yaml --bench bench-out/bench.csv

With `--configs`, the floor of each config (its model, batch, dtype, mesh and profile) against
the searched plan and the best expert that `make bench` compiled and priced (its bench.csv):
floor / best expert is the lowest searched / best any plan could reach there.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

MESHES = {"8": ((8,), ("devices",)), "2x4": ((2, 4), ("data", "model")),
          "8x8": ((8, 8), ("data", "model"))}
ZOO = ("gpt:gpt2-124m", "gpt:gpt2-355m", "bert:base", "bert:large", "vit:b16", "moe:380m",
       "wresnet:250m", "llama:7b")


def priced(compiled, mesh, hw, dtype):
    from shardplan.analysis import hlo, targets
    from shardplan.analysis.price import price
    from shardplan.planning import compiled as compiled_mod
    from shardplan.strategies.spec import MeshShape

    stats = targets.on_target(hlo.analyze(compiled), mesh, hw, 1.0)
    return price(stats, MeshShape.of(mesh), compiled_mod.device_grid(mesh), hw, dtype)


def single_device(fn, args, state_argnums, hw, dtype):
    """The step compiled for one device and priced by the profile."""
    from shardplan.planning import compiled as compiled_mod

    one = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,),
                        devices=jax.devices()[:1])
    compiled = compiled_mod.compile_for_analysis(jax.jit(fn, donate_argnums=state_argnums)
                                            .lower(*args))
    return priced(compiled, one, hw, dtype)


def floor_and_dp(name: str, size: str, mesh_name: str, profile: str):
    from shardplan import baselines
    from shardplan.cost.hardware import get_profile
    from shardplan.models import get_model
    from shardplan.planning import compiled as compiled_mod

    hw = get_profile(profile)
    m = get_model(name, size, abstract=True)
    dtype = "float32" if m.config.dtype == "float32" else "bfloat16"
    whole = single_device(m.fn, m.args, m.state_argnums, hw, dtype)
    shape, names = MESHES[mesh_name]
    n = math.prod(shape)
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:n])
    ins, outs = baselines.baseline_shardings("data_parallel", m, mesh)
    lowered = jax.jit(m.fn, in_shardings=ins, out_shardings=outs,
                      donate_argnums=m.state_argnums).lower(*m.args)
    dp = priced(compiled_mod.compile_for_analysis(lowered), mesh, hw, dtype)
    return whole.compute_s / n, dp


def config_floors(paths, bench_csv):
    """Per config: the floor against what bench.csv says the searched plan and the best
    expert that fits took."""
    from shardplan.config import load_config
    from shardplan.workload import build_workload

    bench = {}
    if bench_csv:
        with open(bench_csv) as f:
            bench = {row["config"]: row for row in csv.DictReader(f)}
    print("| config | floor ms | best expert ms | searched ms | floor / best | searched / best |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for path in paths:
        config = load_config(path)
        work = build_workload(config)
        n = config.cluster.mesh.num_devices
        dtype = "float32" if work.dtype == "float32" else "bfloat16"
        floor = single_device(work.fn, work.args, work.state_argnums, config.profile(),
                              dtype).compute_s / n
        name = os.path.splitext(os.path.basename(path))[0]
        row = bench.get(name)
        if row is None or not row["searched_over_best"]:
            print(f"| {name} | {floor * 1e3:.3f} | | | | |", flush=True)
            continue
        searched = float(row["searched_s"])
        best = searched / float(row["searched_over_best"])
        ratios.append(floor / best)
        print(f"| {name} | {floor * 1e3:.3f} | {best * 1e3:.3f} | {searched * 1e3:.3f} | "
              f"{ratios[-1]:.3f} | {row['searched_over_best']} |", flush=True)
    if ratios:
        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"geometric mean of floor / best expert: {geo:.3f} over {len(ratios)} configs "
              "(no plan's searched / best can be lower)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(ZOO), help="name:size")
    ap.add_argument("--meshes", nargs="+", default=["8", "2x4"], choices=sorted(MESHES))
    ap.add_argument("--profile", default="a100-80gb")
    ap.add_argument("--configs", nargs="+", help="config YAMLs instead of --models/--meshes")
    ap.add_argument("--bench", help="make bench's bench.csv, for the searched and best times")
    args = ap.parse_args(argv)
    if args.configs:
        config_floors(args.configs, args.bench)
        return
    jax.config.update("jax_num_cpu_devices", max(math.prod(MESHES[m][0]) for m in args.meshes))
    print("| model | mesh | floor ms | data parallel ms (compute, comm) | floor / data parallel |")
    print("|---|---|---|---|---|")
    ratios = []
    for spec in args.models:
        name, size = spec.split(":")
        for mesh_name in args.meshes:
            start = time.perf_counter()
            floor, dp = floor_and_dp(name, size, mesh_name, args.profile)
            ratios.append(floor / dp.total_s)
            print(f"| {name} {size} | {mesh_name} | {floor * 1e3:.3f} | {dp.total_s * 1e3:.3f} "
                  f"({dp.compute_s * 1e3:.3f}, {dp.comm_s * 1e3:.3f}) | {ratios[-1]:.3f} | "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"geometric mean of floor / data parallel: {geo:.3f} over {len(ratios)} cases "
          "(no plan's searched / best expert can be lower)")


if __name__ == "__main__":
    main()
