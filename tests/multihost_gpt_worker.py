"""One process of tests/test_multihost_gpt.py (run as a script).

    python tests/multihost_gpt_worker.py PORT PROCESS_ID OUT.json

Joins a 2 x 4 CPU-device jax.distributed job over gloo; on one (data=2, model=4) mesh spanning
both processes, plans the zoo's tiny GPT train step (Adam) with @shardplan.auto, builds its
inputs from this process's rows of each batch with shardplan.global_args, runs 3 steps
(feeding its outputs back) and compares them with the single-device step. Writes what it saw
to OUT.json.
"""

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

import numpy as np
from jax.experimental import multihost_utils

NUM_PROCESSES = 2
BATCH = 16  # global rows; each process holds 8


def batches(m, steps):
    """The global batches: the model's own, then shifted token ids (same shapes)."""
    batch = m.args[2]
    vocab = m.config.vocab_size
    return [jax.tree.map(lambda a, i=i: (np.asarray(a) + i) % vocab, batch) for i in range(steps)]


def reference(m, steps):
    """The single-device step, `steps` times, on this process's first device."""
    with jax.default_device(jax.local_devices()[0]):
        fn = jax.jit(m.fn)
        params, opt_state, losses = m.args[0], m.args[1], []
        for b in batches(m, steps):
            params, opt_state, loss = fn(params, opt_state, b, m.args[3])
            losses.append(float(loss))
        return [np.asarray(x) for x in jax.tree.leaves(params)], losses


def run(shardplan, m, mesh, me, out):
    step = shardplan.auto(m.fn, mesh=mesh, hardware="cpu", time_limit=20.0, deterministic=True,
                          state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    params, opt_state, losses = m.args[0], m.args[1], []
    rows = slice(me * BATCH // 2, (me + 1) * BATCH // 2)
    for i, b in enumerate(batches(m, 3)):
        local = jax.tree.map(lambda a: a[rows], b)
        args = shardplan.global_args(step, params, opt_state, local, m.args[3])
        if i == 0:
            plan = step.plan(*args)
            out["plan_fingerprint"] = shardplan.fingerprint.plan_fingerprint(plan)
            out["split_state"] = sum(1 for n, s in plan.in_specs.items()
                                     if n.startswith("[0]") and s != jax.sharding.PartitionSpec())
            out["batch_sharding"] = str(jax.tree.leaves(args[2])[0].sharding.spec)
            out["local_rows"] = int(jax.tree.leaves(local)[0].shape[0])
        params, opt_state, loss = step(*args)
        losses.append(float(np.asarray(multihost_utils.process_allgather(loss, tiled=True))))
    got = [np.asarray(multihost_utils.process_allgather(x, tiled=True))
           for x in jax.tree.leaves(params)]
    want, want_losses = reference(m, 3)
    out["max_param_error"] = max(float(np.max(np.abs(g - w))) for g, w in zip(got, want))
    out["losses"], out["reference_losses"] = losses, want_losses


def main(port, me, path):
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACKS_AFTER_S", "100")))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
                               process_id=me)
    import shardplan
    import shardplan.fingerprint
    from shardplan.models import get_model

    out = {"process": me, "devices": len(jax.devices())}
    try:
        m = get_model("gpt", "tiny", dropout_rate=0.0, batch_size=BATCH)
        mesh = jax.make_mesh((2, 4), ("data", "model"),
                             axis_types=(jax.sharding.AxisType.Auto,) * 2)
        run(shardplan, m, mesh, me, out)
    except Exception:  # noqa: BLE001 (reported to the test)
        out["exception"] = traceback.format_exc()
    with open(path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
