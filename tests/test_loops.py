"""Loops are planned, not replicated: models written with nn.scan, nnx.scan, lax.scan over
equinox layers, fori_loop and cond plan on a 2x4 mesh, divide the work (per-device flops of
the compiled plan at most 0.35 of the single-device step's) and equal the single-device step
over three optimizer steps."""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardplan
from shardplan.ir.lift import lift

D, BATCH, SEQ, VOCAB, LAYERS = 64, 16, 16, 128, 4


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def check_planned(step, args, mesh, *, steps=3, max_flops=0.35, rtol=1e-3, atol=1e-3):
    """The planned step equals the single-device step for `steps` optimizer steps (the state
    fed back), and each device does at most `max_flops` of the single-device work. `atol` is
    relative to each array's largest entry: Adam turns rounding in a near-zero gradient into
    an update of the learning rate's size. The solves are limited by their work, not the wall
    clock, so the plan is the same at any load."""
    planned = shardplan.auto(step, mesh=mesh, deterministic=True)
    single = jax.jit(step)
    ratio = (_flops(planned.lower(*args).compile()) / _flops(single.lower(*args).compile()))
    a, b = args, args
    for _ in range(steps):
        out_p, out_s = planned(*a), single(*b)
        for x, y in zip(jax.tree.leaves(out_p), jax.tree.leaves(out_s)):
            y = np.asarray(y)
            np.testing.assert_allclose(np.asarray(x), y, rtol=rtol,
                                       atol=atol * float(np.abs(y).max(initial=0.0)))
        a = (*out_p[:2], *args[2:])
        b = (*out_s[:2], *args[2:])
    assert ratio <= max_flops, f"per-device flops {ratio:.2f} of the single-device step"
    return planned.plan(*args), ratio


def _adam_step(loss_fn, opt=None):
    opt = opt or optax.adamw(1e-3)

    def step(params, opt_state, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt


# --- flax linen: nn.scan(nn.remat(Block)) with attention and dropout -----------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        # no q/k/v biases: the key bias's gradient is zero up to rounding, which Adam would
        # turn into updates of the size of the learning rate and of random sign
        h = nn.SelfAttention(num_heads=4, qkv_features=D, deterministic=False, dropout_rate=0.1,
                             use_bias=False)(h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
        x = x + h
        h = nn.Dense(4 * D)(nn.LayerNorm()(x))
        h = nn.Dropout(0.1, deterministic=False)(nn.gelu(h))
        return x + nn.Dense(D)(h), None


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D)
        x = embed(ids)
        blocks = nn.scan(nn.remat(LinenBlock), variable_axes={"params": 0},
                         split_rngs={"params": True, "dropout": True}, length=LAYERS)
        x, _ = blocks(name="layers")(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _lm_batch():
    ids = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
    return ids, jnp.roll(ids, -1, axis=1)


@pytest.mark.slow  # 30 s; test_nnx_vmap_scan and test_models_scan keep scanned layers in make test
def test_linen_scan_remat_lm(mesh2x4):
    model = LinenLM()
    ids, labels = _lm_batch()
    params = model.init({"params": jax.random.key(0), "dropout": jax.random.key(0)}, ids)

    def loss_fn(params, ids, labels, rng):
        logits = model.apply(params, ids, rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    step, opt = _adam_step(loss_fn)
    args = (params, opt.init(params), ids, labels, jax.random.key(2))
    plan, _ = check_planned(step, args, mesh2x4)
    # the stacked kernels keep their layer dimension whole and are split inside
    kernels = [s for name, s in plan.in_specs.items() if "[0]" in name[:3] and "kernel" in name
               and "layers" in name]
    assert kernels and all(s[0] is None for s in kernels if len(s))
    assert any(len(s) > 1 for s in kernels), kernels


# --- flax NNX: layers made by nnx.vmap, run by nnx.scan -------------------------------------


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return NnxBlock(rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(x, self.blocks))


def test_nnx_vmap_scan(mesh2x4):
    graphdef, params = nnx.split(NnxModel(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (8 * BATCH, D))
    y = jax.random.normal(jax.random.key(2), (8 * BATCH, 1))

    def loss_fn(params, x, y):
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    step, opt = _adam_step(loss_fn)
    check_planned(step, (params, opt.init(params), x, y), mesh2x4)


# --- equinox: stacked layers from eqx.filter_vmap, run by lax.scan --------------------------


class EqxLayer(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, 4 * D, key=k1)
        self.down = eqx.nn.Linear(4 * D, D, key=k2)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def test_equinox_scan_over_stacked_layers(mesh2x4):
    layers = eqx.filter_vmap(EqxLayer)(jax.random.split(jax.random.key(0), LAYERS))
    params, static = eqx.partition(layers, eqx.is_array)
    x = jax.random.normal(jax.random.key(1), (8 * BATCH, D))

    def loss_fn(params, x):
        def body(h, p):
            return jax.vmap(eqx.combine(p, static))(h), None

        h, _ = jax.lax.scan(body, x, params)
        return jnp.mean(h ** 2)

    step, opt = _adam_step(loss_fn)
    check_planned(step, (params, opt.init(params), x), mesh2x4)


# --- fori_loop and cond ----------------------------------------------------------------------


def test_fori_loop_around_a_matmul(mesh2x4):
    w = jax.random.normal(jax.random.key(0), (256, 256)) / 16
    x = jax.random.normal(jax.random.key(1), (512, 256))

    def loss_fn(w, x):
        return jnp.mean(jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ w), x) ** 2)

    step, opt = _adam_step(loss_fn)
    check_planned(step, (w, opt.init(w), x), mesh2x4)


@pytest.mark.parametrize("which", [1.0, -1.0])
def test_cond_between_two_matmuls(mesh2x4, which):
    ws = {"a": jax.random.normal(jax.random.key(0), (256, 256)) / 16,
          "b": jax.random.normal(jax.random.key(3), (256, 256)) / 16}
    x = jax.random.normal(jax.random.key(1), (512, 256))

    def loss_fn(ws, x, flag):
        h = jax.lax.cond(flag > 0, lambda: jnp.tanh(x @ ws["a"]), lambda: jnp.sin(x @ ws["b"]))
        return jnp.mean(h ** 2)

    step, opt = _adam_step(loss_fn)
    check_planned(step, (ws, opt.init(ws), x, jnp.float32(which)), mesh2x4)


# --- the structure the planner sees ---------------------------------------------------------


def test_no_loop_runs_replicated_for_lack_of_a_rule(mesh2x4):
    def f(w, x):
        h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)
        return jax.lax.cond(h.sum() > 0, lambda: h * 2, lambda: h)

    w, x = jnp.ones((64, 64)), jnp.ones((128, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "no sharding rule for scan/cond" would be a warning
        plan = shardplan.auto(f, mesh=mesh2x4).plan(w, x)
    assert plan.input_specs[1].used_axes()


def test_carry_changing_dtype_is_jax_error():
    with pytest.raises(TypeError):
        jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c.astype(jnp.int32), None), x,
                                              None, length=2))(jnp.ones(3))


def test_primitive_without_rule_in_a_body_is_replicated_with_a_warning(mesh2x4):
    def f(x):
        def body(c, _):
            y = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(c.shape, c.dtype), c)
            return jnp.tanh(y @ c), None
        return jax.lax.scan(body, x, None, length=2)[0]

    x = jnp.eye(64)
    with pytest.warns(UserWarning, match="pure_callback"):
        out = shardplan.auto(f, mesh=mesh2x4)(x)
    np.testing.assert_allclose(out, jax.jit(f)(x), rtol=1e-5)


def test_scan_body_planned_once_for_every_layer():
    """Planning cost follows the body, not the trip count."""
    def f(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    small = lift(jax.make_jaxpr(f)(jnp.ones((2, 64, 64)), jnp.ones((8, 64))))
    big = lift(jax.make_jaxpr(f)(jnp.ones((48, 64, 64)), jnp.ones((8, 64))))
    assert len(small.nodes) == len(big.nodes)
    assert big.flops == pytest.approx(24 * small.flops)


def test_coverage_names_what_runs_replicated():
    def f(w, x):
        y = jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), y, w)[0]

    cov = shardplan.coverage(f, jnp.ones((4, 64, 64)), jnp.ones((8, 64)))
    assert [(p, n) for p, n, _ in cov.replicated] == [("pure_callback", 1)]
    assert 0 < cov.replicated_share < 0.01
    assert "pure_callback x1" in str(cov)
    full = shardplan.coverage(lambda w, x: x @ w, jnp.ones((64, 64)), jnp.ones((8, 64)))
    assert not full.replicated and full.replicated_share == 0
