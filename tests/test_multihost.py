"""Multi-controller runs: 2 processes x 4 CPU devices (jax.distributed over gloo on 127.0.0.1)
and one 2 x 4 mesh spanning both. One launch of tests/multihost_worker.py serves every test
here; a hang fails the launch at its timeout instead of hanging the suite."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
ROOT = WORKER.parent.parent
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(worker: pathlib.Path, tmp: pathlib.Path, timeout_s: int = TIMEOUT_S) -> list[dict]:
    """Run `worker` as 2 processes (PORT PROCESS_ID OUT.json); what each saw, by index."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
           "WORKER_STACKS_AFTER_S": str(timeout_s - 20)}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(worker), str(port), str(i),
                               str(tmp / f"out{i}.json")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout_s)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [p.communicate()[0][-3000:] for p in procs]
        pytest.fail(f"the 2-process job did not finish in {timeout_s} s (a hang?):\n"
                    + "\n".join(f"process {i}:\n{t}" for i, t in enumerate(tails)))
    outs = []
    for i, (p, log) in enumerate(zip(procs, logs)):
        path = tmp / f"out{i}.json"
        assert path.exists(), f"process {i} exited {p.returncode} without results:\n{log[-4000:]}"
        out = json.loads(path.read_text())
        assert "exception" not in out, f"process {i}:\n{out['exception']}\n{log[-2000:]}"
        outs.append(out)
    return outs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """What each of the two processes saw, by process index."""
    return launch(WORKER, tmp_path_factory.mktemp("multihost"))


@pytest.mark.multiprocess
def test_planned_step_from_process_local_data_equals_one_device(results):
    for out in results:
        assert (out["process_count"], out["devices"], out["local_devices"]) == (2, 8, 4)
        assert out["max_param_error"] < 1e-5, out
        assert out["losses"] == pytest.approx(out["reference_losses"], rel=1e-5)
    # Both processes ran the same plan (process 0 planned it and broadcast it), one that
    # shards the step over both processes' devices.
    print("plan fingerprints:", [out["plan_fingerprint"] for out in results])
    assert results[0]["plan_fingerprint"] == results[1]["plan_fingerprint"]
    assert any(spec != "P()" for spec in results[0]["in_specs"].values()), results[0]
    assert results[0]["in_specs"] == results[1]["in_specs"]


@pytest.mark.multiprocess
def test_a_plan_that_differs_in_one_process_is_refused_before_the_first_step(results):
    changed = results[1]["changed_input"]
    for out in results:
        err = out["different_plan_error"]
        assert err is not None, "the step ran with different plans in the two processes"
        assert "different plans" in err and f"input {changed!r}" in err, err


@pytest.mark.multiprocess
def test_the_mpmd_pipeline_refuses_multi_controller_and_names_the_spmd_pipeline(results):
    for out in results:
        err = out["pipeline_error"]
        assert err is not None
        assert "multi-controller" in err and "SPMD pipeline" in err, err
        assert "device_put" in err and "pipeline=False" in err, err
        assert out["auto_pipeline_stages"] == 0  # pipeline="auto": one program


@pytest.mark.multiprocess
def test_a_planning_failure_in_process_0_raises_in_every_process(results):
    assert results[0]["failed_plan_error"].startswith("InfeasibleMemory"), results[0]
    err = results[1]["failed_plan_error"]
    assert err.startswith("PlanMismatchError") and "process 0 failed to plan" in err, err
    assert "InfeasibleMemory" in err, err


@pytest.mark.multiprocess
def test_the_default_mesh_puts_the_hosts_on_the_first_axis(results):
    for out in results:
        assert out["default_mesh"] == {"hosts": 2, "devices": 4}
        assert out["default_mesh_error"] < 1e-5, out
