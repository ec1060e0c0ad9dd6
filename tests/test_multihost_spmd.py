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


@pytest.mark.multiprocess
def test_spmd_pipeline_across_two_processes_equals_one_device(results):
    for out in results:
        assert out["devices"] == 8
        assert out["pipeline_kind"] == "spmd"
        assert out["max_param_error"] < 1e-5, out
        assert out["losses"] == pytest.approx(out["reference_losses"], rel=1e-5)
        # stages 0-1 on process 0, 2-3 on process 1: the activations cross hosts
        assert out["stage_processes"] == [[0], [0], [1], [1]]
        assert "(S-1)/(M+S-1) = 3/11" in out["timeline"]
    assert results[0]["plan_fingerprint"] == results[1]["plan_fingerprint"]


@pytest.mark.multiprocess
def test_the_program_runs_the_schedule_s_collective_permutes(results):
    for out in results:
        assert out["loop_permute_counts"] == [11, 11]  # M + S - 1 ticks, forward and backward
        assert [[0, 1], [1, 2], [2, 3]] in out["permutes"]
        assert [[1, 0], [2, 1], [3, 2]] in out["permutes"]


@pytest.mark.multiprocess
def test_the_mpmd_runtime_is_still_refused(results):
    for out in results:
        assert "multi-controller" in out["mpmd_error"] and "SPMD pipeline" in out["mpmd_error"]
