"""shardplan.distributed on one process: the plan is the planner's, the global inputs are
placed by the plan, and the helpers that decide how (pure functions) on hand-made layouts.
The 2-process behaviour is in tests/test_multihost.py."""

import jax
import numpy as np
import pytest

import shardplan
from shardplan import distributed
from tests.test_api import assert_tree_close, mlp_args, mlp_step


def test_one_process_plans_as_usual_and_runs_the_mpmd_pipeline():
    assert not distributed.is_multi_controller()
    sentinel = object()
    assert distributed.plan_once("fp", lambda: sentinel) is sentinel
    distributed.refuse_mpmd_pipeline()  # no error on one process


def test_global_args_places_every_leaf_as_the_plan_says(mesh2x4):
    params, x, y = mlp_args(batch=64, width=128, layers=3)
    step = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=False)
    args = distributed.global_args(step, [np.asarray(w) for w in params], np.asarray(x),
                                   np.asarray(y))
    plan = step.plan(*args)
    for got, want in zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(plan.in_shardings)):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    assert_tree_close(args, (params, x, y))
    assert_tree_close(step(*args), mlp_step(params, x, y), rtol=2e-4, atol=2e-5)
    # With a plan, say which arguments are this process's rows.
    again = distributed.global_args(plan, params, x, y, local_argnums=(1, 2))
    assert_tree_close(again, args)
    with pytest.raises(ValueError, match="local_argnums"):
        distributed.global_args(plan, params, x, y)


def test_global_args_traces_the_step_once_per_signature(mesh2x4, monkeypatch):
    params, x, y = mlp_args(batch=64, width=128, layers=3)
    step = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=False)
    traced = []
    real = distributed.trace
    monkeypatch.setattr(distributed, "trace", lambda *a, **k: traced.append(1) or real(*a, **k))
    params, _ = step(*distributed.global_args(step, params, x, y))
    for _ in range(2):  # a training loop: the params are the step's global outputs
        params, _ = step(*distributed.global_args(step, params, x, y))
    assert len(traced) == 1


def test_global_shapes_multiply_the_local_rows_only():
    shapes = distributed.global_shapes((np.zeros((3, 4)), np.zeros((5, 2)), np.float32(1)),
                                       local_argnums=(1, 2))
    n = jax.process_count()
    assert [s.shape for s in shapes] == [(3, 4), (5 * n, 2), ()]


def _rows(a, b, cols=None):
    return (slice(a, b), slice(None) if cols is None else slice(*cols))


@pytest.mark.parametrize("indices, block, fits", [
    ([_rows(0, 4), _rows(4, 8)], (0, 8), True),                       # rows split in-process
    ([_rows(0, 8, (0, 2)), _rows(0, 8, (2, 4))], (0, 8), True),       # columns split in-process
    ([_rows(8, 16)], (0, 8), False),                                   # another process's rows
    ([_rows(0, 16)], (0, 8), False),                                   # replicated over processes
    ([_rows(0, 8, (0, 2))], (0, 8), False),                            # columns across processes
])
def test_covers_block(indices, block, fits):
    assert distributed.covers_block(indices, (16, 4), *block) is fits


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
