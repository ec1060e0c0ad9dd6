"""Does the cost model agree with the compiled program? For zoo models on 8 and 2x4 CPU
devices: the plan's predicted communication bytes and step time (compute, communication)
against the compiled program priced by the same profile (shardplan.analysis.price).

    .venv/bin/python benchmarks/model_check.py                        # test size, a100 + cpu
    .venv/bin/python benchmarks/model_check.py --models gpt --size gpt2-124m --meshes 2x4
    .venv/bin/python benchmarks/model_check.py --models bert --size base --meshes 8x8  # 64 CPU devices

The zoo at real sizes under a100-80gb (2026-11-27, session 16: the pricer counts what a dot
fusion's dots read and write, analysis/hlo_bytes.py; one `--models M --size S --meshes 8 2x4
--profiles a100-80gb` per model, default batches), predicted / compiled:

    model          mesh  bytes  (compiled MiB)  compute  comm   step
    gpt2-124m      8     1.000  (830.73)        0.998    1.000  0.999
    gpt2-124m      2x4   1.000  (787.86)        0.996    1.000  0.997
    gpt2-355m      8     1.000  (2368.70)       0.998    1.000  0.999
    gpt2-355m      2x4   1.000  (1987.28)       0.996    1.001  0.997
    bert base      8     1.000  (732.40)        0.999    1.000  0.999
    bert base      2x4   0.999  (468.38)        0.999    0.999  0.999
    bert large     8     1.000  (2238.47)       0.999    1.000  0.999
    bert large     2x4   1.000  (1359.31)       0.999    1.000  1.000
    vit b16        8     1.000  (408.62)        1.000    1.000  1.000
    vit b16        2x4   1.000  (250.37)        1.000    1.000  1.000
    moe 380m       8     0.957  (830.86)        1.019    0.979  1.011
    moe 380m       2x4   1.000  (487.73)        1.004    0.996  1.003
    wresnet 250m   8     1.000  (523.61)        0.997    1.000  0.999
    wresnet 250m   2x4   0.985  (1808.59)       0.996    0.970  0.975
    llama 7b       8     1.000  (43738.11)      1.000    1.000  1.000
    llama 7b       2x4   1.000  (30280.32)      1.000    1.000  1.000

Before, XLA:CPU's dot fusions counted the elementwise work fused after a dot with its own
operands (a softmax's gradient reading the probabilities): compute 0.984 on BERT, 0.988 on
llama, 0.993 on ViT. Llama's attention at 2048 tokens: the fusion of `dO @ v.T` with the
softmax's gradient read 1.14 GB against the dot's own 0.60 GB.

Why only contractions' traffic is priced (GPT-2 124M on 8 CPU devices): XLA:CPU's `bytes
accessed` was 44 GB per device against 16 GB for one fusion per run of fusible ops, so the
CPU's elementwise traffic would misprice an accelerator's. The cost model's flops on the
same step: 8.905e11 against cost_analysis()'s 8.93e11.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

MESHES = {"8": ((8,), ("devices",)), "2x4": ((2, 4), ("data", "model")),
          "8x8": ((8, 8), ("data", "model"))}


def check(name: str, size: str, mesh_name: str, profile: str, batch: int | None):
    import shardplan
    from shardplan.cost.hardware import get_profile
    from shardplan.models import get_model
    from shardplan.planning import compiled

    shape, names = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
    kw = {} if batch is None else {"batch_size": batch}
    m = get_model(name, size, abstract=size != "tiny", **kw)
    step = shardplan.auto(m.fn, mesh=mesh, hardware=profile, state_argnums=m.state_argnums,
                          batch_argnums=m.batch_argnums, donate_argnums=m.state_argnums)
    plan = step.plan(*m.args)
    hw = get_profile(profile)
    _, priced = compiled.compile_and_price(step.lower(*m.args), mesh, plan.mesh, hw,
                                          "float32" if m.config.dtype == "float32" else "bfloat16")
    e = plan.estimate
    return (e.comm_bytes, priced.bytes_sent, e.compute_s, priced.compute_s, e.comm_s,
            priced.comm_s, e.total_s, priced.total_s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt", "bert", "moe", "wresnet",
                                                     "vit", "llama"])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--meshes", nargs="+", default=["8", "2x4"])
    ap.add_argument("--profiles", nargs="+", default=["a100-80gb", "cpu"])
    ap.add_argument("--batch", type=int, default=None)
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices",
                      max(math.prod(MESHES[m][0]) for m in args.meshes))
    print("| model | mesh | profile | bytes pred/compiled | compute pred/compiled | "
          "comm pred/compiled | step pred/compiled |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        for mesh in args.meshes:
            for profile in args.profiles:
                try:
                    r = check(name, args.size, mesh, profile, args.batch)
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"| {name} | {mesh} | {profile} | {type(e).__name__}: {e} |||||")
                    continue

                def ratio(a, b):
                    return f"{a / b:.3f}" if b else ("1.000" if not a else "inf")

                print(f"| {name} | {mesh} | {profile} | {ratio(r[0], r[1])} ({r[1] / 2**20:.2f} "
                      f"MiB) | {ratio(r[2], r[3])} | {ratio(r[4], r[5])} | "
                      f"{ratio(r[6], r[7])} |", flush=True)


if __name__ == "__main__":
    main()
