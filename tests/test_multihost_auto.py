"""pipeline="auto" under multi-controller JAX: 2 processes x 4 CPU devices (gloo on
127.0.0.1). Process 0 chooses the kind of program (one program, SPMD or MPMD pipeline) and
broadcasts the plan; the plans' fingerprints, which cover the pipeline kind and the stages,
are compared before the first step; an MPMD choice is planned by every process and checked
(tests/multihost_auto_worker.py)."""

import pathlib

import pytest

from tests.test_multihost import launch

WORKER = pathlib.Path(__file__).with_name("multihost_auto_worker.py")
# run: (pipeline kind, stages). The cost model keeps steps this small as one program; the
# worker makes process 0's choice an SPMD or an MPMD pipeline for the other two runs.
KINDS = {"auto scanned": ("", 0), "auto marked": ("", 0), "spmd": ("spmd", 4),
         "mpmd": ("mpmd", 2), "mpmd, hosts": ("mpmd", 2)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(WORKER, tmp_path_factory.mktemp("multihost_auto"), timeout_s=300)


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", list(KINDS))
def test_every_process_runs_the_kind_process_0_chose(results, run):
    for out in results:
        assert out["devices"] == 8
        r = out[run]
        assert (r["pipeline_kind"], r["stages"]) == KINDS[run]
        assert r["losses"] == pytest.approx(r["reference_losses"], rel=1e-5)
        assert r["max_param_error"] is not None and r["max_param_error"] < 1e-5, r
    assert results[0][run]["plan_fingerprint"] == results[1][run]["plan_fingerprint"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, words", [
    ("mpmd, other stages", "number of pipeline stages: 2 vs 4"),
    ("mpmd, one program", "chose one program where process 0 chose an MPMD pipeline")])
def test_a_process_that_chooses_otherwise_is_refused_before_the_first_step(results, case,
                                                                           words):
    for out in results:
        err = out[case]
        assert err is not None, "the step ran though the processes chose differently"
        assert "process 1" in err and words in err, err


@pytest.mark.multiprocess
def test_an_spmd_choice_is_loaded_from_the_cache_the_second_time(results):
    assert results[0]["cached"]["decisions"] == 1  # process 0 decided once, then loaded
    assert results[1]["cached"]["decisions"] == 0  # the others receive the plan
    fps = [fp for out in results for fp in out["cached"]["plan_fingerprints"]]
    assert len(set(fps)) == 1, fps


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["mpmd", "mpmd, hosts"])
def test_the_mpmd_moves_between_processes_are_priced_over_the_inter_host_link(results, run):
    # A device's host is its id // devices_per_host; the CPU devices of process p have ids
    # p * 2048 + k here, so both profiles see the processes as hosts.
    notes = "\n".join(results[0][run]["notes"])
    assert "stage 0 -> 1:" in notes and "by permute over the inter-host link" in notes, notes
    assert "not the profile's hosts" not in notes
