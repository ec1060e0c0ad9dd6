"""Alpa's MLP expectations (its test suite's 6-layer flax MLP with biases and Adam on 4
devices): large batch and narrow layers give data parallel; small batch and wide layers give
Megatron's alternating column / row split, with one all-reduce of an activation per layer
boundary and nothing else."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import shardplan
from shardplan.analysis import hlo

LAYERS = 6


class MLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = nn.Dense(self.hidden)(x)
            if i < LAYERS - 1:
                x = nn.relu(x)
        return x


def _step(batch, hidden):
    model, opt = MLP(hidden), optax.adam(1e-3)
    x = jax.ShapeDtypeStruct((batch, hidden), jnp.float32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.ones((batch, hidden))))
    opt_state = jax.eval_shape(opt.init, params)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, x, x)


@pytest.fixture
def mesh4():
    return jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])


def _plan_and_compile(step, args, mesh):
    auto = shardplan.auto(step, mesh=mesh, hardware="a100-80gb")
    plan = auto.plan(*args)
    return plan, hlo.analyze(auto.lower(*args).compile()).formed()


def _kernel_specs(plan):
    specs = {}
    for name, spec in plan.in_specs.items():
        m = re.match(r"\[0\]\['params'\]\['Dense_(\d)'\]\['kernel'\]", name)
        if m:
            specs[int(m.group(1))] = tuple(spec) + (None,) * (2 - len(spec))
    return [specs[i] for i in range(LAYERS)]


def test_small_batch_wide_layers_is_megatron(mesh4):
    batch, hidden = 16, 1024
    plan, stats = _plan_and_compile(*_step(batch, hidden), mesh4)
    kernels = _kernel_specs(plan)
    column, row = (None, "x"), ("x", None)
    assert kernels == [column, row] * (LAYERS // 2), kernels
    # one all-reduce of a [batch, hidden] activation after each row-parallel layer in the
    # forward pass and each column-parallel layer's input gradient in the backward pass
    kinds = stats.by_kind()
    assert set(kinds) == {"all-reduce"}, kinds
    count, sent = kinds["all-reduce"]
    assert count == LAYERS - 1
    ring = 2 * (4 - 1) / 4
    assert sent == pytest.approx((LAYERS - 1) * batch * hidden * 4 * ring, rel=1e-3)


def test_large_batch_narrow_layers_is_data_parallel(mesh4):
    batch, hidden = 16384, 256
    plan, stats = _plan_and_compile(*_step(batch, hidden), mesh4)
    assert tuple(plan.in_specs["[2]"]) == ("x",)
    # the layers run data parallel: no kernel split on a feature dimension in the dots, and
    # the step sends what one all-reduce of the gradients sends (as a reduce-scatter of the
    # gradients and all-gathers of the sharded state, ZeRO's way, or as the all-reduce)
    grads = LAYERS * (hidden * hidden + hidden) * 4
    assert stats.bytes_sent <= 1.01 * 2 * (4 - 1) / 4 * grads
    assert plan.estimate.comm_bytes == pytest.approx(stats.bytes_sent, rel=0.02)
