"""shardplan.global_inputs on one process: the global inputs are placed as the plan says,
and the helpers that decide how (pure functions) on hand-made layouts. The 2-process
behaviour is in tests/test_multihost.py."""

import jax
import numpy as np
import pytest

import shardplan
from shardplan import global_inputs
from shardplan.plan_file import plan_from_dict
from tests.test_api import assert_tree_close, mlp_args, mlp_step


def test_global_args_places_every_leaf_as_the_plan_says(mesh2x4):
    params, x, y = mlp_args(batch=64, width=128, layers=3)
    step = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=False)
    args = global_inputs.global_args(step, [np.asarray(w) for w in params], np.asarray(x),
                                     np.asarray(y))
    plan = step.plan(*args)
    for got, want in zip(jax.tree_util.tree_leaves(args), jax.tree_util.tree_leaves(plan.in_shardings)):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    assert_tree_close(args, (params, x, y))
    assert_tree_close(step(*args), mlp_step(params, x, y), rtol=2e-4, atol=2e-5)
    # With a plan, say which arguments are this process's rows.
    again = global_inputs.global_args(plan, params, x, y, local_argnums=(1, 2))
    assert_tree_close(again, args)
    with pytest.raises(ValueError, match="local_argnums"):
        global_inputs.global_args(plan, params, x, y)


def test_global_args_traces_the_step_once_per_signature(mesh2x4, monkeypatch):
    params, x, y = mlp_args(batch=64, width=128, layers=3)
    step = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=False)
    traced = []
    real = global_inputs.trace
    monkeypatch.setattr(global_inputs, "trace", lambda *a, **k: traced.append(1) or real(*a, **k))
    params, _ = step(*global_inputs.global_args(step, params, x, y))
    for _ in range(2):  # a training loop: the params are the step's global outputs
        params, _ = step(*global_inputs.global_args(step, params, x, y))
    assert len(traced) == 1


def test_global_shapes_multiply_the_local_rows_only():
    shapes = global_inputs.global_shapes((np.zeros((3, 4)), np.zeros((5, 2)), np.float32(1)),
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
    assert global_inputs.covers_block(indices, (16, 4), *block) is fits


def _marked_mlp_step(params, x, y):
    def loss_fn(p):
        h = x
        for k, w in enumerate(p):
            h = jax.numpy.tanh(h @ w)
            if k < len(p) - 1:
                h = shardplan.stage_boundary(h)
        return jax.numpy.mean((h - y) ** 2)

    loss, grads = shardplan.value_and_grad(loss_fn)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], loss


def test_an_mpmd_plan_gives_each_input_its_stage_sharding(mesh2x4):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal((16, 16)).astype(np.float32) / 4 for _ in range(4)]
    x, y = (rng.standard_normal((8, 16)).astype(np.float32) for _ in range(2))
    step = shardplan.auto(_marked_mlp_step, mesh=mesh2x4, hardware="cpu", pipeline="mpmd",
                          num_stages=2, num_micro_batches=2, cache=False)
    args = global_inputs.global_args(step, params, x, y)
    plan = step.plan(*args)
    assert plan.pipeline_kind == "mpmd"
    stage_devices = [set(st.devices) for st in plan.stages]
    shardings = jax.tree_util.tree_leaves(plan.in_shardings)
    for got, want in zip(jax.tree_util.tree_leaves(args), shardings):
        assert got.sharding.is_equivalent_to(want, got.ndim)
        assert {d.id for d in want.device_set} in stage_devices
    # the state comes back where it went in: the next step moves nothing
    new_params, loss = step(*args)
    for got, want in zip(new_params, jax.tree_util.tree_leaves(plan.in_shardings[0])):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    want_params, want_loss = jax.jit(_marked_mlp_step)(params, x, y)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_tree_close(new_params, want_params, rtol=1e-5, atol=1e-6)
    # a plan file cannot say where the stages' submeshes are
    with pytest.raises(ValueError, match="step.plan"):
        _ = plan_from_dict(plan.to_dict()).in_shardings
