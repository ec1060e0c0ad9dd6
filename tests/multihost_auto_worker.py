"""One process of the 2-process pipeline="auto" test in tests/test_multihost_auto.py (a script).

    python tests/multihost_auto_worker.py PORT PROCESS_ID OUT.json

Joins a 2 x 4 CPU-device jax.distributed job over gloo and runs steps with pipeline="auto":
process 0 chooses the kind of program and broadcasts the plan, every process checks it.
Runs: "auto scanned" and "auto marked" (auto's own choice, one program, for a scanned 8-layer
MLP on a (stage=4, data=2) mesh and a stage-marked 4-block MLP on a 2 x 4 mesh); "spmd" and
"mpmd" (process 0's choice made an SPMD pipeline of the scanned MLP / an MPMD pipeline of 2
stages of the marked MLP, with the "cpu" profile and with one whose hosts of 4 devices are
the processes, by wrapping shardplan.planning.driver.choose_program, the chooser auto
calls: the cost model does not pick a pipeline for steps this small); each 3 steps from process-local rows with
shardplan.global_args against the single-device step. Then two MPMD choices that process 1
makes differently from process 0 (4 stages; one program): both processes must raise
PlanMismatchError before the first step. Last, an SPMD choice planned twice through one plan
cache: process 0 decides once, then loads the plan.
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

from tests import multihost_mpmd_worker as marked  # a 4-block MLP with stage marks
from tests import multihost_spmd_worker as scanned  # a scanned 8-layer MLP

NUM_PROCESSES = 2
# run: (model, mesh, the options process 0 / process 1 decide with, or None for auto's own
# choice; the hardware profile: "hosts" = 4 devices per host, the processes)
RUNS = {
    "auto scanned": (scanned, "stage", None, "cpu"),
    "auto marked": (marked, "grid", None, "cpu"),
    "spmd": (scanned, "stage", [{"pipeline": "spmd"}] * 2, "cpu"),
    "mpmd": (marked, "grid", [{"pipeline": "mpmd", "num_stages": 2}] * 2, "cpu"),
    "mpmd, hosts": (marked, "grid", [{"pipeline": "mpmd", "num_stages": 2}] * 2, "hosts"),
}
MISMATCHES = {
    "mpmd, other stages": [{"pipeline": "mpmd", "num_stages": 2},
                           {"pipeline": "mpmd", "num_stages": 4}],
    "mpmd, one program": [{"pipeline": "mpmd", "num_stages": 2}, {"pipeline": False}],
}


def meshes(devices):
    auto = (jax.sharding.AxisType.Auto,) * 2
    return {"stage": jax.sharding.Mesh(np.asarray(devices).reshape(4, 2), ("stage", "data"),
                                       axis_types=auto),
            "grid": jax.sharding.Mesh(np.asarray(devices).reshape(2, 4), ("data", "model"),
                                      axis_types=auto)}


def deciding(original, me, decide):
    """shardplan.planning.driver.choose_program (`original`) deciding with this process's
    options (or as it is)."""
    if decide is None:
        return original

    def choose(job):
        return original(job.replace(options=job.options.replace(measure=False, **decide[me])))

    return choose


def read_loss(loss):
    if loss.is_fully_addressable:
        return float(np.asarray(loss))
    return float(np.asarray(multihost_utils.process_allgather(loss, tiled=True)))


def run(shardplan, me, model, mesh, hardware):
    """3 steps with pipeline="auto": what this process saw."""
    from shardplan.cost.hardware import HardwareProfile

    step_fn = model.make_step(shardplan)
    want, want_losses = model.reference(step_fn, 3)
    if hardware == "hosts":  # hosts of 4 devices: the processes
        hardware = HardwareProfile.two_level(4, intra_bandwidth=1e10, inter_bandwidth=1e9)
    step = shardplan.auto(step_fn, mesh=mesh, hardware=hardware, pipeline="auto",
                          num_micro_batches=8 if model is scanned else 4, time_limit=10.0,
                          deterministic=True)
    rows = slice(me * model.ROWS, (me + 1) * model.ROWS)
    params, losses, out = model.initial_params(), [], {}
    for i in range(3):
        x, y = model.global_batch(i)
        args = shardplan.global_args(step, params, x[rows], y[rows])
        if i == 0:
            plan = step.plan(*args)
            out["plan_fingerprint"] = shardplan.fingerprint.plan_fingerprint(plan)
            out["pipeline_kind"], out["stages"] = plan.pipeline_kind, len(plan.stages)
            out["notes"] = list(plan.notes)
        params, loss = step(*args)
        losses.append(read_loss(loss))
    errors = [float(np.max(np.abs(np.asarray(s.data) - ref[s.index])))
              for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want))
              for s in got.addressable_shards]
    out["max_param_error"] = max(errors) if errors else None
    out["losses"], out["reference_losses"] = losses, want_losses
    return out


def mismatch(shardplan, me, mesh):
    """pipeline="auto" where process 1 decides otherwise than process 0: the error."""
    step = shardplan.auto(marked.make_step(shardplan), mesh=mesh, hardware="cpu",
                          pipeline="auto", num_micro_batches=4, time_limit=10.0, deterministic=True)
    rows = slice(me * marked.ROWS, (me + 1) * marked.ROWS)
    x, y = marked.global_batch(0)
    try:
        step(*shardplan.global_args(step, marked.initial_params(), x[rows], y[rows]))
    except shardplan.PlanMismatchError as e:
        return str(e)
    return None


def cached(shardplan, me, mesh, original, directory):
    """pipeline="auto" choosing the SPMD pipeline, twice, through one plan cache: how often
    this process decided, and the two plans' fingerprints."""
    calls = []
    choose = deciding(original, me, [{"pipeline": "spmd"}] * 2)
    shardplan.planning.driver.choose_program = lambda job: calls.append(1) or choose(job)
    step_fn = scanned.make_step(shardplan)
    rows = slice(me * scanned.ROWS, (me + 1) * scanned.ROWS)
    x, y = scanned.global_batch(0)
    fps = []
    for _ in range(2):
        step = shardplan.auto(step_fn, mesh=mesh, hardware="cpu", pipeline="auto",
                              num_micro_batches=8, time_limit=10.0, deterministic=True,
                              cache=directory)
        args = shardplan.global_args(step, scanned.initial_params(), x[rows], y[rows])
        fps.append(shardplan.fingerprint.plan_fingerprint(step.plan(*args)))
        jax.block_until_ready(step(*args))
    return {"decisions": len(calls), "plan_fingerprints": fps}


def main(port, me, path):
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACKS_AFTER_S", "100")))
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
                               process_id=me)
    import shardplan
    import shardplan.fingerprint
    import shardplan.planning.driver

    out = {"process": me, "devices": len(jax.devices())}
    original = shardplan.planning.driver.choose_program
    try:
        by_name = meshes(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        for name, (model, mesh, decide, hardware) in RUNS.items():
            print(f"run {name}", flush=True)
            shardplan.planning.driver.choose_program = deciding(original, me, decide)
            out[name] = run(shardplan, me, model, by_name[mesh], hardware)
        for name, decide in MISMATCHES.items():
            print(f"mismatch {name}", flush=True)
            shardplan.planning.driver.choose_program = deciding(original, me, decide)
            out[name] = mismatch(shardplan, me, by_name["grid"])
        print("cached", flush=True)
        out["cached"] = cached(shardplan, me, by_name["stage"], original,
                               os.path.join(os.path.dirname(path), "cache"))
    except Exception:  # noqa: BLE001 (reported to the test)
        out["exception"] = traceback.format_exc()
    finally:
        shardplan.planning.driver.choose_program = original
    with open(path, "w") as f:
        json.dump(out, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
