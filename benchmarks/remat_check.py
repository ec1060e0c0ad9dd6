"""What rematerializing a scanned model's layers (shardplan.ir.remat) costs and saves, as
compiled: the zoo's GPT / Llama with `scan_layers=True, remat=False` (nn.scan, no checkpoint),
its train step as written and rewritten, each jitted on one device (temp bytes and flops of
`memory_analysis()` / `cost_analysis()`), then planned by shardplan.auto on 8 CPU devices
with remat=False and remat=True (the compiled program's peak and flops per device).

    .venv/bin/python benchmarks/remat_check.py                         # gpt tiny, 4 layers
    .venv/bin/python benchmarks/remat_check.py --model llama --layers 8 --batch 32
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)


def main():
    from jax.extend import core as jcore
    from jax.sharding import AxisType

    import shardplan
    from shardplan import _compat
    from shardplan.ir import remat
    from shardplan.models import get_model
    from shardplan.units import fmt_bytes

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    m = get_model(a.model, a.size, scan_layers=True, remat=False, num_layers=a.layers,
                  dropout_rate=0.0, batch_size=a.batch)
    closed = jax.make_jaxpr(m.fn)(*m.args)
    r = remat.rematerialize(closed)
    print(f"{a.model} {a.size}, {a.layers} layers, batch {a.batch}: {r.pairs} scan pair(s) "
          f"rewritten, {fmt_bytes(r.saved_bytes)} of stacked residuals dropped, "
          f"{fmt_bytes(r.carry_bytes)} of stacked layer inputs kept")
    flat = jax.tree.leaves(m.args)
    rows = []
    for name, cj in (("as written", closed), ("rematerialized", r.closed_jaxpr)):
        c = jax.jit(jcore.jaxpr_as_fun(cj)).lower(*flat).compile()
        rows.append((name, c.memory_analysis().temp_size_in_bytes,
                     _compat.cost_analysis(c)["flops"]))
    print("one device:")
    for name, temp, flops in rows:
        print(f"  {name:15s} temp {temp:>12,d} B  flops {flops:>14,.0f}")
    print(f"  temp x{rows[1][1] / rows[0][1]:.3f}, flops x{rows[1][2] / rows[0][2]:.3f}")

    mesh = jax.make_mesh((8,), ("devices",), axis_types=(AxisType.Auto,))
    print("planned by shardplan.auto on 8 devices (per device):")
    for flag in (False, True):
        step = shardplan.auto(m.fn, mesh=mesh, remat=flag, donate_argnums=(0, 1), cache=False)
        plan = step.plan(*m.args)
        c = step.lower(*m.args).compile()
        ma = c.memory_analysis()
        peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                + ma.temp_size_in_bytes)
        print(f"  remat={flag!s:5s} plan.remat={plan.remat!s:5s} temp {ma.temp_size_in_bytes:>12,d} B"
              f"  peak {peak:>12,d} B  flops {_compat.cost_analysis(c)['flops']:>14,.0f}"
              f"  (model: peak {plan.estimate.peak_bytes:,.0f} B,"
              f" compute {plan.estimate.compute_s * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
