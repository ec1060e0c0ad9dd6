"""The searched plan alone against every expert plan, each compiled by XLA on CPU devices and
priced by one profile (`shardplan.auto(..., measure=True)` keeps every candidate in
`Plan.candidates`), with each one's estimate beside its compiled price.

    .venv/bin/python benchmarks/vs_experts.py gpt gpt2-124m a100-80gb 8 2x4
    .venv/bin/python benchmarks/vs_experts.py gpt gpt2-124m a100-80gb 2x4 --time-limit 300
    .venv/bin/python benchmarks/vs_experts.py gpt gpt2-124m a100-80gb 8x8   # 64 CPU devices

The expert plans are completed by the ILP within the search's time limit; on a loaded machine
a completion that runs out of it falls back to the expert's input shardings alone (XLA
propagating the rest), which prices far worse: give a long --time-limit for a fair baseline.
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

MESHES = {"8": ((8,), ("devices",)), "2x4": ((2, 4), ("data", "model")),
          "8x8": ((8, 8), ("data", "model"))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("size")
    ap.add_argument("profile")
    ap.add_argument("meshes", nargs="+", choices=sorted(MESHES))
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices",
                      max(math.prod(MESHES[m][0]) for m in args.meshes))
    import shardplan
    from shardplan.models import get_model

    for mesh_name in args.meshes:
        shape, names = MESHES[mesh_name]
        mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
        m = get_model(args.model, args.size, abstract=args.size != "tiny")
        start = time.perf_counter()
        step = shardplan.auto(m.fn, mesh=mesh, hardware=args.profile,
                              state_argnums=m.state_argnums, batch_argnums=m.batch_argnums,
                              donate_argnums=m.state_argnums, measure=True,
                              time_limit=args.time_limit, cache=False)
        plan = step.plan(*m.args)
        print(f"== {args.model} {args.size} on {mesh_name}, {args.profile} "
              f"({time.perf_counter() - start:.0f} s); solver: {plan.solver}")
        for c in plan.candidates:
            if c.priced is None:
                print(f"  {c.name}: did not compile ({c.error})")
                continue
            p, e = c.priced, c.plan.estimate
            # an expert plan of input shardings only (XLA lays out the rest) has no estimate
            said = (f"estimate {e.total_s * 1e3:8.3f} ms (comm {e.comm_s * 1e3:.3f}, "
                    f"{e.comm_bytes / 2**20:.1f} MiB)" if c.plan.ops
                    else "no estimate (input shardings only: XLA lays out the rest)")
            print(f"  {c.name:28s} compiled {p.total_s * 1e3:8.3f} ms (compute "
                  f"{p.compute_s * 1e3:.3f}, comm {p.comm_s * 1e3:.3f}, "
                  f"{p.bytes_sent / 2**20:.1f} MiB sent) | {said}")
        ours = [c.priced.total_s for c in plan.candidates
                if c.priced is not None and c.name == "searched"]
        experts = [c.priced.total_s for c in plan.candidates
                   if c.priced is not None and not c.name.startswith("searched")]
        if ours and experts:
            print(f"  searched / best expert = {ours[0] / min(experts):.3f}", flush=True)


if __name__ == "__main__":
    main()
