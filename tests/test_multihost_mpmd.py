"""The MPMD pipeline runtime under multi-controller JAX: 2 processes x 4 CPU devices (gloo on
127.0.0.1), one 2 x 4 mesh over both, a 4-block MLP of unequal widths with stage marks
pipelined in 2 stages (one per process) and 4 (two per process), GPipe and 1F1B
(tests/multihost_mpmd_worker.py). Values crossing processes move through collective
programs (shardplan.emit.transfer), which are also checked alone."""

import pathlib

import pytest

from tests.test_multihost import launch

WORKER = pathlib.Path(__file__).with_name("multihost_mpmd_worker.py")
RUNS = ["2-gpipe", "2-1f1b", "4-gpipe", "4-1f1b"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(WORKER, tmp_path_factory.mktemp("multihost_mpmd"), timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RUNS)
def test_mpmd_pipeline_across_two_processes_equals_one_device(results, run):
    stages = int(run.split("-")[0])
    held = []
    for out in results:
        assert out["devices"] == 8
        r = out[run]
        assert r["pipeline_kind"] == "mpmd" and r["schedule"] == run.split("-")[1]
        assert r["stage_processes"] == ([[0], [1]] if stages == 2 else [[0], [0], [1], [1]])
        # every process read the loss (replicated on every device) and checked the
        # parameter shards it holds
        assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)
        assert r["max_param_error"] is not None and r["max_param_error"] < 1e-5, r
        held.append(r["params_held"])
    assert sum(held) == 8 and all(held), held  # 4 blocks x (kernel, bias), on both processes
    assert results[0][run]["plan_fingerprint"] == results[1][run]["plan_fingerprint"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", RUNS)
def test_the_plan_gives_each_input_its_stage_sharding(results, run):
    for out in results:
        r = out[run]
        assert r["inputs_on_their_stage"]  # global_args built them where plan.in_shardings says
        assert r["input_devices"] == [8 // int(run.split("-")[0])]  # one stage's submesh each


@pytest.mark.multiprocess
def test_values_cross_processes_in_collective_programs(results):
    want = {"same shape, other spec": "permute", "other shape": "scatter",
            "booleans, back": "scatter", "source on both processes": "scatter"}
    for name, program in want.items():
        errors = [out["moves"][name]["error"] for out in results]
        assert any(e is not None for e in errors), name  # some process holds the destination
        assert all(e is None or e == 0 for e in errors), (name, errors)
        assert all(program in out["moves"][name]["programs"] for out in results), name
