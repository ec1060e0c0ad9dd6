"""The memory model against the TPU compiler: each model's searched plan and expert plans on
compile-only TPU v5e chips (2x4), the estimate set against the TPU compiler's heap peak
(memory_analysis' peak_memory_in_bytes, what it refuses programs by: analysis/hlo.py). Needs libtpu (`pip install "jax[tpu]==<jax>"`).

    .venv/bin/python benchmarks/memory_tpu.py                     # the investigation's cases
    .venv/bin/python benchmarks/memory_tpu.py --cases gpt-256 --experts fsdp --top 12

--top N prints the N largest buffers the model holds at its peak (to read beside the TPU
compiler's buffer assignment: XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# compile-only devices run nothing: other processes may hold libtpu at once
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# name -> (model, size, overrides): bf16 as users write them (bf16 params and activations or
# f32 params with bf16 compute; the optimizer's state in the params' dtype or f32)
CASES = {
    "gpt-128": ("gpt", "tiny", {"dtype": "bfloat16", "hidden": 128, "ffn_dim": 512,
                                "seq_len": 64}),
    "gpt-512": ("gpt", "tiny", {
        "dtype": "bfloat16", "hidden": 512, "num_layers": 2, "num_heads": 8, "ffn_dim": 2048,
        "seq_len": 256, "vocab_size": 8192, "batch_size": 16}),
    "gpt-1024": ("gpt", "tiny", {
        "dtype": "bfloat16", "hidden": 1024, "num_layers": 4, "num_heads": 16, "ffn_dim": 4096,
        "seq_len": 512, "vocab_size": 16384, "batch_size": 16}),
    "gpt-mixed": ("gpt", "tiny", {
        "dtype": "bfloat16", "param_dtype": "float32", "hidden": 512, "num_layers": 2,
        "num_heads": 8, "ffn_dim": 2048, "seq_len": 256, "vocab_size": 8192, "batch_size": 16}),
    "llama-512": ("gpt", "llama-tiny", {
        "dtype": "bfloat16", "hidden": 512, "num_layers": 2, "num_heads": 8, "ffn_dim": 1408,
        "seq_len": 256, "vocab_size": 8192, "batch_size": 16}),
    "bert-512": ("bert", "tiny", {
        "dtype": "bfloat16", "hidden": 512, "num_layers": 2, "num_heads": 8, "ffn_dim": 2048,
        "seq_len": 256, "vocab_size": 8192, "batch_size": 16}),
    "moe-512": ("moe", "tiny", {
        "dtype": "bfloat16", "hidden": 512, "num_layers": 2, "num_heads": 8, "ffn_dim": 1024,
        "seq_len": 256, "vocab_size": 8192, "batch_size": 16}),
    "mlp-4096": ("mlp", "tiny", {
        "dtype": "bfloat16", "width": 4096, "num_layers": 4, "batch_size": 8192}),
    "mlp-mixed": ("mlp", "tiny", {
        "dtype": "bfloat16", "param_dtype": "float32", "width": 4096, "num_layers": 4,
        "batch_size": 8192}),
}


def run_case(name, model, size, overrides, experts, top, mesh_shape=(2, 4), verbose=False,
             cache=None):
    from shardplan.analysis import targets
    from shardplan.cost.hardware import get_profile
    from shardplan.ir.trace import trace
    from shardplan.models import get_model
    from shardplan.options import DEFAULTS
    from shardplan.planning import compiled
    from shardplan.planning.expert_plans import expert_plans
    from shardplan.planning.intra_op import plan_step
    from shardplan.planning.job import Job
    from shardplan.strategies.spec import MeshShape

    hw = get_profile("tpu-v5e")
    ms = MeshShape(("data", "model"), mesh_shape)
    mesh = targets.tpu_mesh(hw, ms)
    batch = overrides.pop("batch_size", None)
    m = get_model(model, size, abstract=True, batch_size=batch, **overrides)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    seen = []
    if top:  # the last peak the planner evaluated: the searched plan's
        from shardplan.intra import estimate as estimate_mod

        own = estimate_mod.peak_bytes

        def peak_bytes(problem, chosen):
            seen[:] = [(problem, chosen)]
            return own(problem, chosen)

        estimate_mod.peak_bytes = peak_bytes
    plan, graph, _ = plan_step(traced, ms, hw, DEFAULTS, device_mesh=mesh)
    if top:
        estimate_mod.peak_bytes = own
    plans = {"searched": plan}
    if experts:
        job = Job.make(traced, ms, hw, DEFAULTS, device_mesh=mesh)
        for k, p in expert_plans(job, plan, deadline=60.0).items():
            if experts == "all" or k in experts.split(","):
                plans[k] = p
    rows = []
    for k, p in plans.items():
        t = time.perf_counter()
        key = f"{name} {k} {p.input_specs} {p.constraints}"
        if cache is not None and key in cache:
            got = cache[key]
        else:
            lowered = compiled.lower_plan(graph, traced, p, mesh, m.state_argnums)
            mem = lowered.compile().memory_analysis()
            if verbose:
                print(f"  {mem}")
            got = peak(mem)
            if cache is not None:
                cache[key] = got
        est = p.estimate.peak_bytes
        rows.append((name, k, est, got))
        print(f"{name:10s} {k:14s} est {est / 2**20:9.2f} MiB  tpu {got / 2**20:9.2f} MiB  "
              f"ratio {est / got:5.3f}  ({time.perf_counter() - t:.0f} s)", flush=True)
        if top and k == "searched":
            _top(*seen[0], top)
    return rows


def peak(mem) -> int:
    """memory_analysis' peak per device: the TPU compiler's heap peak (as
    shardplan.analysis.hlo.analyze reads it on TPU)."""
    return int(mem.peak_memory_in_bytes)


def _top(problem, chosen, n):
    import numpy as np

    model = problem.memory()
    choice = {r: next(k for k, t in enumerate(problem.strategies[r]) if t is chosen[r])
              for r in problem.roots}
    items = model.live(choice)

    starts = np.array([a for a, _, _, _ in items])
    ends = np.array([b for _, b, _, _ in items])
    sizes = np.array([s for _, _, s, _ in items])
    change = np.zeros(int(ends.max()) + 2)
    np.add.at(change, starts.astype(int), sizes)
    np.add.at(change, ends.astype(int) + 1, -sizes)
    at = int(np.cumsum(change).argmax())
    live = sorted((s, w, a, b) for a, b, s, w in items if a <= at <= b and s > 0)[::-1]
    print(f"  peak at {at}/{len(model.pos)}: {sum(s for s, *_ in live) / 2**20:.2f} MiB "
          f"in {len(live)} buffers")
    for s, w, a, b in live[:n]:
        print(f"    {s / 2**20:8.2f} MiB  [{a:4d},{b:4d}]  {w}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="gpt-512,llama-512,moe-512,mlp-1024")
    ap.add_argument("--experts", default="fsdp", help="comma list, 'all' or ''")
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="memory_analysis' fields")
    ap.add_argument("--cache", help="a JSON file of compiled peaks by plan: a plan compiled "
                                    "before is not compiled again")
    args = ap.parse_args(argv)
    cache = None
    if args.cache:
        cache = {}
        if os.path.exists(args.cache):
            with open(args.cache) as f:
                cache = json.load(f)
    rows = []
    for name in args.cases.split(","):
        model, size, overrides = CASES[name]
        rows += run_case(name, model, size, dict(overrides), args.experts, args.top,
                         verbose=args.verbose, cache=cache)
        if cache is not None:
            with open(args.cache, "w") as f:
                json.dump(cache, f)
    worst = max(abs(e / g - 1) for _, _, e, g in rows)
    print(f"worst |estimate / compiled - 1| = {worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
