"""A model's own sharding constraints, planned (issue 32): tests/test_model_constraints.py's
MaxText-style NNX decoder (scanned layers, full remat, checkpoint_name, constraints from
logical axis rules) at a cut-down qwen3's width, on the 2x4 mesh of 8 CPU devices. For the
model built for one device (its constraints re-placed), built for the user's mesh (read as
hints) and with model_constraints="ignore": the plan's estimated communication against the
compiled program's (bytes each device sends), the compiled peak; and data parallel compiled
(the model's constraints dropped, XLA's propagation from replicated state and a split batch).

    .venv/bin/python benchmarks/constraints_check.py                  # width 256, vocab 4096
    .venv/bin/python benchmarks/constraints_check.py --embed 64 --vocab 256
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("SHARDPLAN_CACHE", "off")

import jax

jax.config.update("jax_num_cpu_devices", 8)


def main():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import shardplan
    import tests.test_model_constraints as models
    from shardplan.cost.hardware import get_profile
    from shardplan.ir import constraints, interpret
    from shardplan.ir.graph import Role
    from shardplan.ir.lift import lift
    from shardplan.ir.trace import trace
    from shardplan.planning import compiled
    from shardplan.strategies.spec import MeshShape

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embed", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--mlp", type=int, default=768)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    models.EMBED, models.VOCAB, models.MLP, models.SEQ = args.embed, args.vocab, args.mlp, args.seq
    models.HEAD_DIM = args.embed // models.HEADS
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shape, hw = MeshShape.of(mesh), get_profile("cpu")

    def planned(name, step, step_args, **options):
        auto = shardplan.auto(step, mesh=mesh, **options)
        plan = auto.plan(*step_args)
        _, priced = compiled.compile_and_price(auto.lower(*step_args), mesh, shape, hw, "float32")
        est = plan.estimate.comm_bytes
        print(f"{name}: estimate {est / 1e6:.2f} MB, compiled {priced.bytes_sent / 1e6:.2f} MB "
              f"({est / priced.bytes_sent:.3f}), compiled peak {priced.peak_bytes / 1e6:.2f} MB, "
              f"priced {priced.total_s * 1e3:.2f} ms")
        return plan

    def data_parallel(step, step_args):
        traced = trace(step, step_args)
        graph = lift(traced.closed_jaxpr, traced.arg_info)
        ins = [NamedSharding(mesh, P(("data", "model")) if r == Role.BATCH else P())
               for r in traced.arg_info.roles]
        outs = [NamedSharding(mesh, P()) for _ in traced.out_avals]
        fn = jax.jit(lambda *a: interpret.run(graph, a, identity=constraints.is_constraint),
                     in_shardings=ins, out_shardings=outs)
        _, priced = compiled.compile_and_price(fn.lower(*traced.in_avals), mesh, shape, hw,
                                              "float32")
        print(f"data parallel: compiled {priced.bytes_sent / 1e6:.2f} MB, compiled peak "
              f"{priced.peak_bytes / 1e6:.2f} MB, priced {priced.total_s * 1e3:.2f} ms")

    one = models.maxtext_nnx(models._one_device_mesh())
    plan = planned("built for one device (re-placed)", *one)
    print("\n".join(n for n in plan.notes if "constraint" in n or n.startswith("  ")))
    users = models.maxtext_nnx(mesh)
    plan = planned("built for the user's mesh (hints)", *users)
    print("\n".join(n for n in plan.notes if "constraint" in n or n.startswith("  ")))
    planned("built for the user's mesh, model_constraints='ignore'", *users,
            model_constraints="ignore")
    data_parallel(*one)


if __name__ == "__main__":
    main()
