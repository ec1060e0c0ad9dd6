"""The SPMD pipeline under multi-controller JAX: 2 processes x 4 CPU devices (gloo on
127.0.0.1), a (stage=4, data=2) mesh over both, a scanned 8-layer MLP pipelined in 4 stages
of 8 micro-batches (tests/multihost_spmd_worker.py)."""

import pathlib

import pytest

from tests.test_multihost import launch

WORKER = pathlib.Path(__file__).with_name("multihost_spmd_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(WORKER, tmp_path_factory.mktemp("multihost_spmd"))


TICKS = {"gpipe": [11, 11], "1f1b": [14, 14]}  # GPipe M+S-1 each way; 1F1B one loop M+2S-2
RATIO = {"gpipe": "(S-1)/(M+S-1) = 3/11", "1f1b": "(2S-2)/(M+2S-2) = 6/14"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_spmd_pipeline_across_two_processes_equals_one_device(results, schedule):
    for out in results:
        assert out["devices"] == 8
        run = out[schedule]
        assert run["pipeline_kind"] == "spmd" and run["schedule"] == schedule
        assert run["max_param_error"] < 1e-5, run
        assert run["losses"] == pytest.approx(run["reference_losses"], rel=1e-5)
        # stages 0-1 on process 0, 2-3 on process 1: the activations cross hosts
        assert run["stage_processes"] == [[0], [0], [1], [1]]
        assert RATIO[schedule] in run["timeline"]
    assert results[0][schedule]["plan_fingerprint"] == results[1][schedule]["plan_fingerprint"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_program_runs_the_schedule_s_collective_permutes(results, schedule):
    for out in results:
        run = out[schedule]
        assert run["loop_permute_counts"] == TICKS[schedule]
        assert [[0, 1], [1, 2], [2, 3]] in run["permutes"]
        assert [[1, 0], [2, 1], [3, 2]] in run["permutes"]


@pytest.mark.multiprocess
def test_the_mpmd_runtime_is_still_refused(results):
    for out in results:
        assert "multi-controller" in out["mpmd_error"] and "SPMD pipeline" in out["mpmd_error"]
