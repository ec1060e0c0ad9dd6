"""What auto / search accept and check: their arguments, a given plan against the step and
mesh it is to run on, keyword arguments to the planned step; and that a planned step compiles
once per input signature."""

import dataclasses
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplan
from shardplan.strategies.spec import ShardSpec
from tests.conftest import auto_mesh


def small_step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * g, loss


def other_step(w, x):  # another learning rate: the same graph
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.2 * g, loss


def tanh_step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w)))(w)
    return w - 0.1 * g, loss


W, X = jnp.ones((16, 16)), jnp.ones((32, 16))


@pytest.fixture(scope="module")
def plan2x4():
    return shardplan.auto(small_step, mesh=auto_mesh((2, 4), ("data", "model"))).plan(W, X)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mesh": "x"}, TypeError, "mesh must be a jax.sharding.Mesh"),
    ({"hardware": 123}, TypeError, "hardware must be a profile name"),
    ({"hardware": "tpu-v9"}, ValueError, "unknown hardware profile 'tpu-v9'"),
    ({"donate_argnums": "0"}, TypeError, "donate_argnums must be an int or a tuple"),
    ({"plan": 3}, TypeError, "plan must be a shardplan.Plan"),
    ({"options": {"time_limit": 1}}, TypeError, "options must be a shardplan.SearchOptions"),
    ({"time_limt": 1}, TypeError, "unknown option.*time_limt.*time_limit"),
])
def test_auto_arguments_name_what_is_allowed(kwargs, error, match):
    with pytest.raises(error, match=match):
        shardplan.auto(small_step, **kwargs)


def test_a_mesh_passed_as_the_function_says_to_pass_it_by_keyword(mesh8):
    with pytest.raises(TypeError, match="got a Mesh: pass the mesh by keyword"):
        shardplan.auto(mesh8)
    with pytest.raises(TypeError, match="got a Mesh"):
        shardplan.search(mesh8)


@pytest.mark.parametrize("kwargs, match", [
    ({"cluster": 3, "num_devices": 8}, "cluster must be a profile name"),
    ({"mesh_shape": (2, 0)}, "mesh_shape must be a tuple of positive ints"),
    ({"mesh_shape": "8"}, "mesh_shape must be a tuple of positive ints"),
    ({"mesh_shape": (2, 4), "axis_names": ("a", "a")}, "axis_names must be a tuple of distinct"),
    ({"num_devices": 0}, "num_devices must be a positive int"),
])
def test_search_arguments_name_what_is_allowed(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        shardplan.search(small_step, W, X, **kwargs)


def test_donate_argnums_int_as_jax_jit_takes_it(mesh8):
    step = shardplan.auto(small_step, mesh=mesh8, donate_argnums=0)
    assert step.donate_argnums == (0,)
    with pytest.raises(ValueError, match="donate_argnums has 5, but the step is called with 2"):
        shardplan.auto(small_step, mesh=mesh8, donate_argnums=5).plan(W, X)


def test_keyword_arguments_are_bound_as_jax_jit_binds_them(mesh8):
    step = shardplan.auto(small_step, mesh=mesh8)
    np.testing.assert_allclose(step(W, x=X)[1], small_step(W, X)[1], rtol=1e-6)
    np.testing.assert_allclose(step(w=W, x=X)[1], small_step(W, X)[1], rtol=1e-6)
    with pytest.raises(TypeError, match="small_step: missing a required argument: 'x'"):
        step(W, y=X)

    def kw_only(w, *, x):
        return small_step(w, x)

    with pytest.raises(TypeError, match="cannot pass x by keyword.*by position"):
        shardplan.auto(kw_only, mesh=mesh8)(W, x=X)


# -- a given plan, checked ----------------------------------------------------------------


def test_a_plan_for_other_shapes_raises(plan2x4):
    mesh = auto_mesh((2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="made for other inputs.*plan the step again"):
        shardplan.auto(small_step, mesh=mesh, plan=plan2x4).plan(W, jnp.ones((64, 16)))
    with pytest.raises(ValueError, match="made for other inputs"):
        shardplan.auto(small_step, mesh=mesh, plan=plan2x4).plan(W.astype(jnp.bfloat16),
                                                                 X.astype(jnp.bfloat16))


def test_a_plan_for_another_function_warns_at_the_callers_line(plan2x4):
    mesh = auto_mesh((2, 4), ("data", "model"))
    step = shardplan.auto(other_step, mesh=mesh, plan=plan2x4)
    with pytest.warns(UserWarning, match="different function") as record:
        step.plan(W, X)
    assert record[0].filename == __file__
    step = shardplan.auto(tanh_step, mesh=mesh, plan=plan2x4)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="for a different function"):
        step.plan(W, X)


@pytest.mark.parametrize("shape, names", [((2, 4), ("model", "data")), ((4, 2), ("data", "model")),
                                          ((8,), ("data",))])
def test_a_plan_for_another_mesh_raises(plan2x4, shape, names):
    step = shardplan.auto(small_step, mesh=auto_mesh(shape, names), plan=plan2x4)
    with pytest.raises(ValueError, match="plan is for mesh data=2 x model=4"):
        step.plan(W, X)


@pytest.mark.parametrize("edit, match", [
    (lambda p: {"input_specs": (ShardSpec(((), (), ())),) + p.input_specs[1:]},
     "has 3 dimensions, the value has 2"),
    (lambda p: {"constraints": {10**6: ShardSpec(((),))}}, "constrains value 1000000"),
    (lambda p: {"operand_specs": {(10**6, 0): (ShardSpec(((),)),)}}, "node 1000000"),
])
def test_a_plan_that_cannot_apply_raises(plan2x4, edit, match):
    bad = dataclasses.replace(plan2x4, **edit(plan2x4))
    step = shardplan.auto(small_step, mesh=auto_mesh((2, 4), ("data", "model")), plan=bad)
    with pytest.raises(ValueError, match=match):
        step.plan(W, X)


def test_a_spec_axis_not_on_the_mesh_raises(plan2x4):
    bad = dataclasses.replace(plan2x4, input_specs=(ShardSpec((("pipe",), ())),)
                              + plan2x4.input_specs[1:], fingerprint=None)
    step = shardplan.auto(small_step, mesh=auto_mesh((2, 4), ("data", "model")), plan=bad)
    with pytest.raises(ValueError, match=r"uses mesh axes \['pipe'\]"):
        step.plan(W, X)


# -- compiled once ------------------------------------------------------------------------


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(32)(x)))


def test_a_planned_step_compiles_once_with_its_outputs_fed_back(mesh8):
    model, tx = MLP(), optax.adam(1e-3)
    x, y = jnp.ones((16, 8)), jnp.zeros((16, 8))
    params = model.init(jax.random.key(0), x)
    opt = tx.init(params)

    def train_step(params, opt, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    compiles = []

    def listener(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    step = shardplan.auto(train_step, mesh=mesh8, donate_argnums=(0, 1))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(3):
            params, opt, loss = step(params, opt, x, y)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 1, compiles
    assert np.isfinite(loss)


def test_the_no_rule_warning_points_at_the_caller_once_when_measured(mesh8, monkeypatch):
    import dataclasses

    from shardplan.planning import compiled

    real = compiled.measure

    def over_budget(*args, **kwargs):  # the searched plan compiles over the budget: re-planned
        got = real(*args, **kwargs)
        if got.name != "searched" or got.priced is None:
            return got
        return dataclasses.replace(got, priced=dataclasses.replace(got.priced,
                                                                   peak_bytes=2**40))

    monkeypatch.setattr(compiled, "measure", over_budget)

    def step(w, x):
        y = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return w - 0.1 * jnp.mean(y @ w), jnp.sum(y)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        shardplan.auto(step, mesh=mesh8, measure=True, memory_budget="1GiB").plan(W, X)
    rule = [w for w in record if "no sharding rule" in str(w.message)]
    assert len(rule) == 1, [str(w.message) for w in rule]
    assert rule[0].filename == __file__
