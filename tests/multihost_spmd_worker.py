"""One process of the 2-process SPMD pipeline test in tests/test_multihost_spmd.py (a script).

    python tests/multihost_spmd_worker.py PORT PROCESS_ID OUT.json

Joins a 2 x 4 CPU-device jax.distributed job over gloo; on one (stage=4, data=2) mesh spanning
both processes (stages 0-1 on process 0, 2-3 on process 1) runs a scanned 8-layer MLP's step
as an SPMD pipeline (pipeline=True: 4 stages, 8 micro-batches, GPipe then 1F1B), inputs from this
process's rows with shardplan.global_args, 3 steps against the single-device step; records
the plan, the compiled program's collective-permutes.
"""

import faulthandler
import json
import os
import re
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
ROWS = 8  # rows of the batch per process
WIDTH = 16
LAYERS = 8


def make_step(shardplan):
    def loss_fn(p, x, y):
        def layer(h, w):
            return jnp.tanh(h @ w["kernel"] + w["bias"]), None

        h, _ = jax.lax.scan(layer, x @ p["embed"], p["layers"])
        return jnp.mean((h @ p["head"] - y) ** 2)

    def step(params, x, y):
        loss, grads = shardplan.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), loss

    return step


def initial_params():
    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)

    return {"embed": normal(WIDTH, WIDTH), "head": normal(WIDTH, WIDTH),
            "layers": {"kernel": normal(LAYERS, WIDTH, WIDTH),
                       "bias": np.zeros((LAYERS, WIDTH), np.float32)}}


def global_batch(i):
    rng = np.random.default_rng(100 + i)
    n = ROWS * NUM_PROCESSES
    return (rng.standard_normal((n, WIDTH)).astype(np.float32),
            rng.standard_normal((n, WIDTH)).astype(np.float32))


def reference(step, steps):
    params, losses = initial_params(), []
    with jax.default_device(jax.local_devices()[0]):
        fn = jax.jit(step)
        for i in range(steps):
            params, loss = fn(params, *global_batch(i))
            losses.append(float(loss))
        return jax.tree.map(np.asarray, params), losses


def permute_stages(text, mesh):
    """Per collective-permute: the (source stage, target stage) pairs. The HLO's device ids
    are positions in the program's device assignment: the mesh's devices in order."""
    stage_of = {k: k // mesh.devices.shape[1] for k in range(mesh.devices.size)}
    out = []
    for line in text.splitlines():
        if "collective-permute" in line and "source_target_pairs=" in line:
            body = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line).group(1)
            out.append(sorted({(stage_of[int(a)], stage_of[int(b)])
                               for a, b in re.findall(r"\{(\d+),(\d+)\}", body)}))
    return out


def run(shardplan, hlo_collectives, mesh, devices, me, step_fn, schedule, want, want_losses):
    """3 pipelined steps with `schedule`, from process-local rows: what this process saw."""
    out = {}
    step = shardplan.auto(step_fn, mesh=mesh, hardware="cpu", pipeline=True,
                          num_micro_batches=8, schedule=schedule, time_limit=10.0,
                          deterministic=True)
    params, losses, plan = initial_params(), [], None
    rows = slice(me * ROWS, (me + 1) * ROWS)
    for i in range(3):
        x, y = global_batch(i)
        args = shardplan.global_args(step, params, x[rows], y[rows])
        if plan is None:
            plan = step.plan(*args)
            out["plan_fingerprint"] = shardplan.fingerprint.plan_fingerprint(plan)
            out["pipeline_kind"], out["schedule"] = plan.pipeline_kind, plan.schedule
            ids = [d.id for d in devices]
            out["stage_processes"] = [sorted({devices[ids.index(i)].process_index
                                              for i in st.devices}) for st in plan.stages]
            out["timeline"] = plan.timeline()
            text = step.lower(*args).compile().as_text()
            out["permutes"] = permute_stages(text, mesh)
            out["loop_permute_counts"] = [
                c.count for c in hlo_collectives.parse_collectives(text, 8)
                if c.kind == "collective-permute" and c.in_loop]
        params, loss = step(*args)
        losses.append(float(np.asarray(multihost_utils.process_allgather(loss, tiled=True))))
    got = jax.tree.map(lambda w: np.asarray(multihost_utils.process_allgather(w, tiled=True)),
                       params)
    out["max_param_error"] = max(float(np.max(np.abs(g - w))) for g, w in
                                 zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    out["losses"], out["reference_losses"] = losses, want_losses
    return out


def main(port, me, path):
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACKS_AFTER_S", "100")))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
                               process_id=me)
    import shardplan
    import shardplan.fingerprint
    from shardplan.analysis import hlo_collectives

    out = {"process": me, "devices": len(jax.devices())}
    try:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = jax.sharding.Mesh(np.asarray(devices).reshape(4, 2), ("stage", "data"),
                                 axis_types=(jax.sharding.AxisType.Auto,) * 2)
        step_fn = make_step(shardplan)
        want, want_losses = reference(step_fn, 3)
        for schedule in ("gpipe", "1f1b"):
            out[schedule] = run(shardplan, hlo_collectives, mesh, devices, me, step_fn,
                                schedule, want, want_losses)
    except Exception:  # noqa: BLE001 (reported to the test)
        out["exception"] = traceback.format_exc()
    with open(path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
