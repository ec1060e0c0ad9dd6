"""One process of the 2-process tests in tests/test_multihost.py (run as a script).

    python tests/multihost_worker.py PORT PROCESS_ID OUT.json

Joins a 2 x 4 CPU-device jax.distributed job over gloo, then on one 2 x 4 mesh spanning both
processes: (a) plans a small MLP train step with @shardplan.auto, builds its inputs from this
process's rows of the batch with shardplan.global_args, runs 3 steps and compares them with
the single-device step; (b) runs the step with a plan= whose spec differs in process 1 and
records the error; (c) records the error of pipeline=True on a step without
shardplan.value_and_grad; (d) records the errors when
process 0 fails to plan; (e) runs a bare @shardplan.auto on its default mesh. Writes what it saw to OUT.json.
"""

import dataclasses
import faulthandler
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
from jax.experimental import multihost_utils

NUM_PROCESSES = 2
ROWS = 64  # rows of the batch per process
WIDTH = 128
LAYERS = 3


def mlp_step(params, x, y):
    def loss_fn(p):
        h = x
        for i, w in enumerate(p):
            h = h @ w
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], loss


def initial_params():
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            for _ in range(LAYERS)]


def global_batch(i):
    rng = np.random.default_rng(100 + i)
    n = ROWS * NUM_PROCESSES
    return (rng.standard_normal((n, WIDTH)).astype(np.float32),
            rng.standard_normal((n, WIDTH)).astype(np.float32))


def reference(steps):
    """The single-device step, `steps` times, on this process's first device."""
    params, losses = initial_params(), []
    with jax.default_device(jax.local_devices()[0]):
        step = jax.jit(mlp_step)
        for i in range(steps):
            params, loss = step(params, *global_batch(i))
            losses.append(float(loss))
        return [np.asarray(w) for w in params], losses


def run_same_plan(shardplan, mesh, me, out):
    """(a): 3 planned steps from process-local data equal the single-device steps."""
    step = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", time_limit=10.0, deterministic=True)
    params = initial_params()
    losses, plan = [], None
    for i in range(3):
        x, y = global_batch(i)
        rows = slice(me * ROWS, (me + 1) * ROWS)
        args = shardplan.global_args(step, params, x[rows], y[rows])
        if plan is None:
            plan = step.plan(*args)
            out["plan_fingerprint"] = shardplan.fingerprint.plan_fingerprint(plan)
            out["in_specs"] = {k: str(v) for k, v in plan.in_specs.items()}
            out["x_sharding"] = str(args[1].sharding.spec)
        params, loss = step(*args)
        losses.append(float(np.asarray(multihost_utils.process_allgather(loss, tiled=True))))
    got = [np.asarray(multihost_utils.process_allgather(w, tiled=True)) for w in params]
    want, want_losses = reference(3)
    out["max_param_error"] = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    out["losses"], out["reference_losses"] = losses, want_losses
    return step, plan, args


def run_different_plan(shardplan, mesh, me, plan, args, out):
    """(b): a plan= that differs by one spec in process 1 is refused before the first step."""
    if me == 1:
        k = next(i for i, s in enumerate(plan.input_specs) if any(s.dims))
        replicated = dataclasses.replace(plan.input_specs[k], dims=((),) * len(
            plan.input_specs[k].dims))
        specs = plan.input_specs[:k] + (replicated,) + plan.input_specs[k + 1:]
        plan = dataclasses.replace(plan, input_specs=specs)
        out["changed_input"] = plan.input_names[k]
    step = shardplan.auto(mlp_step, mesh=mesh, plan=plan)
    try:
        step(*args)
        out["different_plan_error"] = None
    except shardplan.PlanMismatchError as e:
        out["different_plan_error"] = str(e)


def run_pipeline(shardplan, mesh, args, out):
    """(c): pipeline=True on a step whose gradient is jax's (no loss for the pipeline planner
    to find) fails alike in both processes, without a hang; pipeline="auto" plans one
    program. (The MPMD pipeline itself: tests/test_multihost_mpmd.py.)"""
    try:
        shardplan.auto(mlp_step, mesh=mesh, pipeline=True)(*args)
        out["pipeline_error"] = None
    except ValueError as e:
        out["pipeline_error"] = f"{type(e).__name__}: {e}"
    step = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", pipeline="auto")
    jax.block_until_ready(step(*args))
    out["auto_pipeline_stages"] = len(step.plan(*args).stages)


def run_failed_plan(shardplan, mesh, args, out):
    """(d): process 0 fails to plan (no plan fits 1 KiB): every process raises, none hangs."""
    try:
        shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", memory_budget=1024)(*args)
        out["failed_plan_error"] = None
    except (shardplan.InfeasibleMemory, shardplan.PlanMismatchError) as e:
        out["failed_plan_error"] = f"{type(e).__name__}: {e}"


def run_default_mesh(shardplan, me, out):
    """(e): bare @shardplan.auto spans both processes, hosts along the first axis."""
    step = shardplan.auto(mlp_step)
    x, y = global_batch(0)
    rows = slice(me * ROWS, (me + 1) * ROWS)
    params, _ = step(*shardplan.global_args(step, initial_params(), x[rows], y[rows]))
    out["default_mesh"] = {str(k): int(v) for k, v in step.mesh.shape.items()}
    got = [np.asarray(multihost_utils.process_allgather(w, tiled=True)) for w in params]
    want, _ = reference(1)
    out["default_mesh_error"] = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))


def main(port, me, path):
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACKS_AFTER_S", "100")))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
                               process_id=me)
    import shardplan
    import shardplan.distributed
    import shardplan.fingerprint

    out = {"process": me, "process_count": jax.process_count(),
           "devices": len(jax.devices()), "local_devices": len(jax.local_devices())}
    try:
        mesh = jax.make_mesh((2, 4), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        print('scenario a', flush=True)
        _, plan, args = run_same_plan(shardplan, mesh, me, out)
        print('scenario b', flush=True)
        run_different_plan(shardplan, mesh, me, plan, args, out)
        print('scenario c', flush=True)
        run_pipeline(shardplan, mesh, args, out)
        print('scenario d', flush=True)
        run_failed_plan(shardplan, mesh, args, out)
        print('scenario e', flush=True)
        run_default_mesh(shardplan, me, out)
    except Exception:  # noqa: BLE001 (reported to the test)
        out["exception"] = traceback.format_exc()
    with open(path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
