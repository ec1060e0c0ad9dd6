"""One process of the 2-process MPMD pipeline test in tests/test_multihost_mpmd.py (a script).

    python tests/multihost_mpmd_worker.py PORT PROCESS_ID OUT.json

Joins a 2 x 4 CPU-device jax.distributed job over gloo; on one 2 x 4 mesh spanning both
processes runs a 4-block MLP of unequal widths with stage marks (shardplan.stage_boundary)
as an MPMD pipeline (pipeline=True: one program per stage on its submesh) of 2 stages (one
per process) and of 4 (two per process), GPipe and 1F1B, inputs from this process's rows
with shardplan.global_args on the plan's stage shardings, 3 steps against the single-device
step. Each process checks the parameter shards it holds; the loss is readable everywhere.
"""

import faulthandler
import itertools
import json
import os
import sys
import traceback

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["SHARDPLAN_CACHE"] = "off"

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import jax.numpy as jnp
import numpy as np

NUM_PROCESSES = 2
ROWS = 8  # rows of the batch per process
WIDTHS = (16, 32, 64, 32, 16)  # 4 blocks of unequal cost: MPMD, not the SPMD pipeline
RUNS = [(2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")]


def make_step(shardplan):
    def loss_fn(p, x, y):
        h = x
        for k, w in enumerate(p):
            h = jnp.tanh(h @ w["kernel"] + w["bias"])
            if k < len(p) - 1:
                h = shardplan.stage_boundary(h)
        return jnp.mean((h - y) ** 2)

    def step(params, x, y):
        loss, grads = shardplan.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


def initial_params():
    rng = np.random.default_rng(0)
    return [{"kernel": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
             "bias": np.full((b,), 0.01, np.float32)} for a, b in itertools.pairwise(WIDTHS)]


def global_batch(i):
    rng = np.random.default_rng(100 + i)
    n = ROWS * NUM_PROCESSES
    return (rng.standard_normal((n, WIDTHS[0])).astype(np.float32),
            rng.standard_normal((n, WIDTHS[-1])).astype(np.float32))


def reference(step, steps):
    params, losses = initial_params(), []
    with jax.default_device(jax.local_devices()[0]):
        fn = jax.jit(step)
        for i in range(steps):
            params, loss = fn(params, *global_batch(i))
            losses.append(float(loss))
        return jax.tree.map(np.asarray, params), losses


def run(shardplan, mesh, me, step_fn, num_stages, schedule, want, want_losses):
    """3 pipelined steps: what this process saw."""
    out = {}
    step = shardplan.auto(step_fn, mesh=mesh, hardware="cpu", pipeline=True,
                          num_stages=num_stages, num_micro_batches=4, schedule=schedule,
                          time_limit=10.0, deterministic=True)
    params, losses, plan = initial_params(), [], None
    rows = slice(me * ROWS, (me + 1) * ROWS)
    for i in range(3):
        x, y = global_batch(i)
        args = shardplan.global_args(step, params, x[rows], y[rows])
        if plan is None:
            plan = step.plan(*args)
            out["plan_fingerprint"] = shardplan.fingerprint.plan_fingerprint(plan)
            out["pipeline_kind"], out["schedule"] = plan.pipeline_kind, plan.schedule
            by_id = {d.id: d.process_index for d in jax.devices()}
            out["stage_processes"] = [sorted({by_id[i] for i in st.devices})
                                      for st in plan.stages]
            # the plan says where each input goes; global_args put them there
            shardings = jax.tree.leaves(plan.in_shardings)
            out["inputs_on_their_stage"] = all(
                a.sharding.is_equivalent_to(s, a.ndim)
                for a, s in zip(jax.tree.leaves(args), shardings))
            out["input_devices"] = sorted({len(s.device_set) for s in shardings})
        params, loss = step(*args)
        losses.append(float(np.asarray(loss)))  # replicated on every device: any process
    errors, held = [], 0
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        for shard in got.addressable_shards:
            errors.append(float(np.max(np.abs(np.asarray(shard.data) - ref[shard.index]))))
        held += bool(got.addressable_shards)
    out["max_param_error"] = max(errors) if errors else None
    out["params_held"] = held
    out["losses"], out["reference_losses"] = losses, want_losses
    return out


def check_moves(me):
    """shardplan.emit.transfer on its own: values moved between submeshes of the two
    processes (and one spanning both), across layouts and mesh shapes; per move, the largest
    error in the destination shards this process holds (None: it holds none) and the
    transfer program used."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardplan.emit import transfer

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    auto = (jax.sharding.AxisType.Auto,) * 2

    def mesh(idx, shape):
        return Mesh(np.asarray([devices[i] for i in idx]).reshape(shape), ("host", "device"),
                    axis_types=auto)

    value = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    cases = {  # name: (source mesh, source spec, destination mesh, destination spec, value)
        "same shape, other spec": (mesh([0, 1], (1, 2)), P("device"), mesh([4, 5], (1, 2)),
                                   P(None, "device"), value),
        "other shape": (mesh([0, 1], (1, 2)), P(None, "device"), mesh([4, 5, 6, 7], (2, 2)),
                        P("host", "device"), value),
        "booleans, back": (mesh([6, 7], (2, 1)), P("host"), mesh([2, 3], (1, 2)),
                           P("device"), value > 10),
        "source on both processes": (mesh([0, 1, 4, 5], (2, 2)), P("host", "device"),
                                     mesh([2, 3], (1, 2)), P(None, "device"), value),
    }
    out = {}
    for name, (src, sspec, dst, dspec, v) in cases.items():
        mover = transfer.Mover()
        x = transfer.from_host(v, NamedSharding(src, sspec))
        y = mover.move(x, x.sharding, NamedSharding(dst, dspec), v.shape, v.dtype)
        errs = [float(np.max(np.abs(np.asarray(s.data, np.float32) - v[s.index])))
                for s in y.addressable_shards]
        out[name] = {"error": max(errs) if errs else None,
                     "programs": sorted({k[0] for k in mover._programs})}
    return out


def main(port, me, path):
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACKS_AFTER_S", "100")))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
                               process_id=me)
    import shardplan
    import shardplan.fingerprint

    out = {"process": me, "devices": len(jax.devices())}
    try:
        mesh = jax.make_mesh((2, 4), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        step_fn = make_step(shardplan)
        want, want_losses = reference(step_fn, 3)
        out["moves"] = check_moves(me)
        for num_stages, schedule in RUNS:
            print(f"run {num_stages} {schedule}", flush=True)
            out[f"{num_stages}-{schedule}"] = run(shardplan, mesh, me, step_fn, num_stages,
                                                  schedule, want, want_losses)
    except Exception:  # noqa: BLE001 (reported to the test)
        out["exception"] = traceback.format_exc()
    with open(path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
