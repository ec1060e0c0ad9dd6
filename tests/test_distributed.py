"""shardplan.distributed on one process: the plan is the planner's; the message that names
how the processes' plans differ. The 2-process behaviour is in tests/test_multihost.py."""

from shardplan import distributed


def test_one_process_plans_as_usual_and_runs_the_mpmd_pipeline():
    assert not distributed.is_multi_controller()
    sentinel = object()
    assert distributed.plan_once("fp", lambda: sentinel) is sentinel


def test_describe_mismatch_names_the_first_differing_spec_or_the_failure():
    def plan(spec):
        return {"mesh": {"names": ["x"], "sizes": [8]},
                "inputs": [{"name": "[0]", "spec": {"dims": [[], []], "partial": []}},
                           {"name": "[1]", "spec": {"dims": spec, "partial": []}}],
                "outputs": [], "constraints": {}, "operand_specs": {}, "stages": []}

    text = distributed.describe_mismatch([plan([["x"], []]), plan([[], ["x"]])], me=1)
    assert "input '[1]': spec P('x', None) vs P(None, 'x')" in text
    assert "process 0 vs process 1, this is process 1" in text
    failed = distributed.describe_mismatch([plan([[], []]), {"error": "ValueError: boom"}])
    assert failed.startswith("process 1 failed before the first step: ValueError: boom")
