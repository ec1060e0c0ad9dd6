"""What gradient accumulation (shardplan.inter.accumulate) saves and costs, planned: the zoo's
GPT with its layers in one nn.scan (no remat) and adamw, its step accumulated over M
micro-batches and planned by shardplan.auto on the 2x4 mesh of 8 CPU devices; per device, the
plan's estimated peak, the compiled program's peak (memory_analysis), the estimated compute
and communication, and the bytes the compiled program sends (loops counted with their trips).
With --lanes P the gradients are also summed in P partial sums (accumulate's partial_sums).

    .venv/bin/python benchmarks/accumulate_check.py                   # 4 layers, 64 x 64
    .venv/bin/python benchmarks/accumulate_check.py --micro 1,4,16 --lanes 4
"""

from __future__ import annotations

import argparse
import dataclasses
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SHARDPLAN_CACHE", "off")

import jax

jax.config.update("jax_num_cpu_devices", 8)


def main():
    import jax.numpy as jnp
    import optax
    from jax.sharding import AxisType

    import shardplan
    from shardplan.analysis import hlo
    from shardplan.inter import accumulate as acc
    from shardplan.models import base, gpt

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro", default="1,2,4,8", help="numbers of micro-batches M")
    ap.add_argument("--lanes", type=int, default=1, help="partial sums P (1: one sum)")
    a = ap.parse_args()

    cfg = dataclasses.replace(gpt.GPT_SIZES["tiny"], scan_layers=True, remat=False,
                              dropout_rate=0.0, num_layers=a.layers, batch_size=a.batch,
                              seq_len=a.seq)
    model, opt = gpt.GPT(cfg), optax.adamw(1e-3)
    ids = jnp.zeros((a.batch, a.seq), jnp.int32)
    params, opt_state = base.init_state(
        lambda k: model.init({"params": k}, ids, train=False), opt, abstract=True)
    batch = base.example_batch({"input_ids": ((a.batch, a.seq), jnp.int32, cfg.vocab_size),
                                "labels": ((a.batch, a.seq), jnp.int32, cfg.vocab_size)},
                               abstract=True)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], train=False)
        return base.cross_entropy(logits, batch["labels"])

    def step(params, opt_state, batch):
        loss, grads = shardplan.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    args = (params, opt_state, batch)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    print(f"GPT tiny width, {a.layers} scanned layers, batch {a.batch} x seq {a.seq}, adamw, "
          f"2x4 CPU devices, partial sums {a.lanes}; per device:")
    print(f"{'M':>3} {'est peak MiB':>13} {'compiled MiB':>13} {'est compute ms':>15} "
          f"{'est comm ms':>12} {'sent MiB':>9}")
    for m in (int(x) for x in a.micro.split(",")):
        lanes = a.lanes if m > 1 else 1
        planned = shardplan.auto(acc.accumulate(step, m, partial_sums=lanes), mesh=mesh,
                                 cache=False)
        e = planned.plan(*args).estimate
        stats = hlo.analyze(planned.lower(*args).compile())
        print(f"{m:>3} {e.peak_bytes / 2**20:13.2f} {stats.peak_bytes / 2**20:13.2f} "
              f"{e.compute_s * 1e3:15.2f} {e.comm_s * 1e3:12.2f} "
              f"{stats.bytes_sent / 2**20:9.2f}")


if __name__ == "__main__":
    main()
