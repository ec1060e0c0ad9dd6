"""A GPT train step planned multi-controller: 2 processes x 4 CPU devices (gloo on 127.0.0.1),
one (data=2, model=4) mesh over both, inputs built from each process's rows of the batch
(tests/multihost_gpt_worker.py)."""

import pathlib

import pytest

from tests.test_multihost import launch

WORKER = pathlib.Path(__file__).with_name("multihost_gpt_worker.py")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(WORKER, tmp_path_factory.mktemp("multihost_gpt"), timeout_s=240)


@pytest.mark.multiprocess
def test_planned_gpt_across_two_processes_equals_one_device(results):
    for out in results:
        assert out["devices"] == 8 and out["local_rows"] == 8
        # the batch is split across the processes (each feeds its own rows)
        assert out["batch_sharding"] != "PartitionSpec()", out["batch_sharding"]
        assert out["max_param_error"] < 1e-4, out
        assert out["losses"] == pytest.approx(out["reference_losses"], rel=1e-4)
    assert results[0]["plan_fingerprint"] == results[1]["plan_fingerprint"]
