"""Gradient accumulation (shardplan.inter.accumulate, accumulate_choices): the step run as M
micro-batches equals the plain step (planned on the 2x4 mesh, three optimizer steps, against
one device), for each reduction of the loss; its plan needs less memory as M grows, for about
the same compute; the choices a planning driver tries."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan import _compat
from shardplan.analysis import hlo
from shardplan.grad import _JAX_GRAD, _JAX_VALUE_AND_GRAD
from shardplan.inter import accumulate as acc
from shardplan.inter import accumulate_choices as choices
from shardplan.ir import interpret
from shardplan.ir.trace import trace
from shardplan.models import base, get_model, gpt
from shardplan.strategies.spec import MeshShape


def _adamw_step(loss_fn, opt=None):
    """A step taking its gradient with shardplan.value_and_grad; it also returns the
    gradients' global norm, a tight check of the accumulated gradients themselves."""
    opt = opt or optax.adamw(1e-3, weight_decay=1e-4)

    def step(params, opt_state, *batch):
        loss, grads = shardplan.value_and_grad(loss_fn)(params, *batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return step, opt


def check_three_steps(step, args, mesh, m, *, partial_sums=1, batch_argnums=None, rtol=1e-3,
                      atol=1e-3):
    """Three steps of the plain step on one device and of the step accumulated over `m`
    micro-batches, planned by shardplan on `mesh`, the state fed back: the loss and gradient
    norm equal to f32 rounding, the state to `rtol` and `atol` relative to each array's
    largest entry (Adam turns rounding in a near-zero gradient into an update of the learning
    rate's size)."""
    kw = {} if batch_argnums is None else {"batch_argnums": batch_argnums}
    planned = shardplan.auto(acc.accumulate(step, m, partial_sums=partial_sums, **kw),
                             mesh=mesh, cache=False, **kw)
    single = jax.jit(step)
    a = b = args
    for _ in range(3):
        out_p, out_s = planned(*a), single(*b)
        for x, y in zip(out_p[2:4], out_s[2:4]):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5)
        for x, y in zip(jax.tree.leaves(out_p[:2]), jax.tree.leaves(out_s[:2])):
            y = np.asarray(y)
            np.testing.assert_allclose(np.asarray(x), y, rtol=rtol,
                                       atol=atol * float(np.abs(y).max(initial=0.0)))
        a = (*out_p[:2], *args[2:])
        b = (*out_s[:2], *args[2:])
    return planned.plan(*args)


# --- the three models ---------------------------------------------------------------------------


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(3):
            x = nn.gelu(nn.Dense(64)(x))
        return nn.Dense(8)(x)


@pytest.mark.parametrize("m, partial_sums", [(4, 1), (2, 4)])
def test_linen_mlp_adamw_accumulated_equals_the_plain_step(mesh2x4, m, partial_sums):
    model = LinenMLP()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    step, opt = _adamw_step(loss_fn)
    check_three_steps(step, (params, opt.init(params), x, y), mesh2x4, m,
                      partial_sums=partial_sums)


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 32, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_nnx_model_accumulated_equals_the_plain_step(mesh2x4):
    graphdef, params = nnx.split(NnxNet(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (32, 32))
    y = jax.random.normal(jax.random.key(2), (32, 1))

    def loss_fn(params, x, y):
        return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)

    step, opt = _adamw_step(loss_fn)
    assert choices.infer_reduction(step, (params, opt.init(params), x, y)) == "mean"
    check_three_steps(step, (params, opt.init(params), x, y), mesh2x4, 2)


def test_scanned_transformer_blocks_accumulated_equal_the_plain_step(mesh2x4):
    """The zoo's GPT with its blocks in one nn.scan: the micro-batch scan holds the layer
    scan (and its backward) inside. No biases: the key bias's gradient is zero up to
    rounding, which Adam would turn into updates of the learning rate's size and random
    sign."""
    cfg = dataclasses.replace(gpt.GPT_SIZES["tiny"], scan_layers=True, remat=False,
                              dropout_rate=0.0, num_layers=2, batch_size=8, use_bias=False)
    model, opt = gpt.GPT(cfg), optax.adamw(1e-3, weight_decay=1e-4)
    ids = jnp.zeros((cfg.batch_size, cfg.seq_len), jnp.int32)
    params, opt_state = base.init_state(
        lambda k: model.init({"params": k}, ids, train=False), opt, abstract=False,
        init_std=cfg.init_std)
    batch = base.example_batch({"input_ids": ((8, cfg.seq_len), jnp.int32, cfg.vocab_size),
                                "labels": ((8, cfg.seq_len), jnp.int32, cfg.vocab_size)},
                               abstract=False)

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"], train=False)
        return base.cross_entropy(logits, batch["labels"])

    step, _ = _adamw_step(loss_fn, opt)
    assert choices.infer_reduction(step, (params, opt_state, batch)) == "mean"
    traced = acc.accumulated(step, (params, opt_state, batch), 2)
    scans = [e for e in traced.closed_jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [2]
    inner = [e for e in scans[0].params["jaxpr"].jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in inner] == [2, 2]  # the layers forward and backward
    check_three_steps(step, (params, opt_state, batch), mesh2x4, 2)


# --- the reduction ----------------------------------------------------------------------------


def _linear_step(loss_fn):
    def step(w, x, y, mask):
        loss, g = shardplan.value_and_grad(loss_fn)(w, x, y, mask)
        return w - 0.1 * g, loss

    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((8, 2)), jnp.float32)
    # the micro-batches of 4 (rows k, k + 4) hold 2, 1, 0 and 1 unmasked rows: unequal counts
    mask = jnp.asarray([1, 1, 0, 1, 1, 0, 0, 0], jnp.float32)
    return step, (w, x, y, mask)


def _close(a, b):
    return all(np.allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-7)
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_mean_loss_is_the_mean_of_equal_micro_batch_means():
    step, args = _linear_step(lambda w, x, y, mask: jnp.mean((x @ w - y) ** 2))
    want = jax.jit(step)(*args)
    assert _close(jax.jit(acc.accumulate(step, 4, batch_argnums=(1, 2, 3)))(*args), want)
    # summed as if the loss were a sum: M times too large
    got = jax.jit(acc.accumulate(step, 4, reduction="sum", batch_argnums=(1, 2, 3)))(*args)
    np.testing.assert_allclose(got[1], 4 * want[1], rtol=1e-6)


def test_a_summed_loss_is_the_sum_of_micro_batch_sums():
    step, args = _linear_step(lambda w, x, y, mask: jnp.sum((x @ w - y) ** 2))
    want = jax.jit(step)(*args)
    got = jax.jit(acc.accumulate(step, 4, reduction="sum", batch_argnums=(1, 2, 3)))(*args)
    assert _close(got, want)
    assert not _close(jax.jit(acc.accumulate(step, 4, batch_argnums=(1, 2, 3)))(*args), want)


def _masked_mean(w, x, y, mask):
    per_row = jnp.sum((x @ w - y) ** 2, axis=1)
    return jnp.sum(per_row * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def test_a_masked_mean_is_the_weighted_mean_of_micro_batch_means():
    """A mean over the unmasked rows: each micro-batch's mean is over its own count, so the
    plain mean of micro-batch means is wrong; weighted by the counts it is the batch's."""

    step, args = _linear_step(_masked_mean)
    want = jax.jit(step)(*args)
    count = lambda w, x, y, mask: jnp.sum(mask)
    by_count = acc.accumulate(step, 4, batch_argnums=(1, 2, 3), reduction=count)
    assert _close(jax.jit(by_count)(*args), want)
    lanes = acc.accumulate(step, 2, partial_sums=2, batch_argnums=(1, 2, 3), reduction=count)
    assert _close(jax.jit(lanes)(*args), want)
    assert not _close(jax.jit(acc.accumulate(step, 4, batch_argnums=(1, 2, 3)))(*args), want)


@pytest.mark.parametrize("loss_fn, want", [
    (lambda w, x, y, mask: jnp.mean((x @ w - y) ** 2), "mean"),
    (lambda w, x, y, mask: jnp.mean((x @ w - y) ** 2) + 1e-3 * jnp.sum(w ** 2), "mean"),
    (lambda w, x, y, mask: optax.softmax_cross_entropy(x @ w, jax.nn.softmax(y)).mean(),
     "mean"),
    (lambda w, x, y, mask: jnp.sum((x @ w - y) ** 2), None),           # a sum
    (lambda w, x, y, mask: jnp.sum((x @ w - y) ** 2) / 8.0, None),     # a sum, scaled
    (_masked_mean, None),                                              # over a data count
], ids=["mean", "mean+l2", "cross-entropy", "sum", "scaled-sum", "masked-mean"])
def test_infer_reduction_says_mean_only_for_a_mean_over_the_batch(loss_fn, want):
    step, args = _linear_step(loss_fn)
    assert choices.infer_reduction(step, args, batch_argnums=(1, 2, 3)) == want


def test_aux_outputs_are_reduced_like_the_loss():
    def loss_fn(w, x, y, mask):
        err = (x @ w - y) ** 2
        return jnp.mean(err), {"mean_pred": jnp.mean(x @ w), "err": jnp.mean(err, axis=0)}

    def step(w, x, y, mask):
        (loss, aux), g = shardplan.value_and_grad(loss_fn, has_aux=True)(w, x, y, mask)
        return w - 0.1 * g, loss, aux

    _, args = _linear_step(loss_fn)
    assert _close(jax.jit(acc.accumulate(step, 2))(*args), jax.jit(step)(*args))


@pytest.mark.parametrize("lanes", [1, 2])
def test_each_micro_batch_draws_its_own_random_numbers(lanes):
    """A typed key the loss function reads has the micro-batch's number folded in: the
    accumulated step is the mean over micro-batches k of the loss and gradient on rows
    k, k + M, ... (of each lane's block) with key fold_in(key, k * lanes + lane)."""

    def loss_fn(w, x, key):
        keep = jax.random.bernoulli(key, 0.5, x.shape)
        return jnp.mean(jnp.where(keep, x, 0.0) @ w)

    def step(w, x, key):
        loss, g = shardplan.value_and_grad(loss_fn)(w, x, key)
        return w - 0.1 * g, loss

    w = jnp.ones((4, 2), jnp.float32)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((8, 4)), jnp.float32)
    key = jax.random.key(0)
    m = 2
    blocks = x.reshape(lanes, 8 // lanes, 4)
    parts = [jax.value_and_grad(loss_fn)(w, blocks[j, k::m], jax.random.fold_in(key, k * lanes + j))
             for k in range(m) for j in range(lanes)]
    loss = np.mean([p[0] for p in parts])
    grad = np.mean([p[1] for p in parts], axis=0)
    got = jax.jit(acc.accumulate(step, m, partial_sums=lanes))(w, x, key)
    np.testing.assert_allclose(got[1], loss, rtol=1e-6)
    np.testing.assert_allclose(got[0], w - 0.1 * grad, rtol=1e-6)
    assert not _close(got, jax.jit(acc.accumulate(step, m, partial_sums=lanes))(
        w, x, jax.random.key(1)))


def test_low_precision_gradients_accumulate_in_float32():
    def loss_fn(w, x):
        return jnp.mean((x @ w.astype(jnp.bfloat16)).astype(jnp.float32) ** 2)

    def step(w, x):
        loss, g = shardplan.value_and_grad(loss_fn)(w.astype(jnp.bfloat16), x)
        return w - 0.1 * g.astype(jnp.float32), loss

    w = jnp.ones((4, 2), jnp.float32)
    x = jnp.ones((8, 4), jnp.bfloat16)
    closed = jax.make_jaxpr(acc.accumulate(step, 4))(w, x)
    (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    first, num_carry = _compat.scan_counts(scan.params)
    carry = scan.params["jaxpr"].in_avals[first:first + num_carry]
    # the gradient of the bf16 cast of w is bf16; its accumulator float32
    assert [str(a.dtype) for a in carry] == ["float32"] * len(carry)
    assert acc.accumulator_dtype(jnp.bfloat16) == np.float32
    assert acc.accumulator_dtype(jnp.float64) == np.float64
    np.testing.assert_allclose(jax.jit(acc.accumulate(step, 4))(w, x)[0],
                               jax.jit(step)(w, x)[0], rtol=1e-2)


def test_accumulated_scanned_layers_rematerialize():
    """The layer scan inside the micro-batch scan is found and rewritten by
    TracedStep.rematerialized, and computes the same."""

    def loss_fn(params, x):
        h, _ = jax.lax.scan(lambda h, w: (h + jnp.tanh(h @ w), None), x, params)
        return jnp.mean(h ** 2)

    def step(params, x):
        loss, g = shardplan.value_and_grad(loss_fn)(params, x)
        return params - 0.1 * g, loss

    rng = np.random.default_rng(4)
    args = (jnp.asarray(rng.standard_normal((3, 8, 8)) / 3, jnp.float32),
            jnp.asarray(rng.standard_normal((16, 8)), jnp.float32))
    remat = acc.accumulated(step, args, 4).rematerialized
    assert remat is not None and remat.remat.pairs
    got = jax.jit(lambda *a: interpret.eval_jaxpr(remat.closed_jaxpr, a))(*args)
    assert _close(got, jax.jit(step)(*args))


# --- what the driver calls ---------------------------------------------------------------------


def _mlp(batch):
    step, (w, *_) = _linear_step(lambda w, x, y, mask: jnp.mean((x @ w - y) ** 2))
    return step, (w, jnp.zeros((batch, 4)), jnp.zeros((batch, 2)), jnp.zeros((batch,)))


def test_accumulated_traced_step_keeps_the_steps_inputs_outputs_and_roles():
    step, args = _mlp(8)
    plain, accumulated = trace(step, args), acc.accumulated(step, args, 4)
    for field in ("in_avals", "out_avals", "state_argnums", "arg_leaf_counts", "input_paths"):
        assert getattr(accumulated, field) == getattr(plain, field), field
    assert accumulated.arg_info == plain.arg_info
    (scan,) = [e for e in accumulated.closed_jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.params["length"] == 4
    assert acc.accumulate(step, 1) is step


@pytest.mark.parametrize("batch, mesh, want", [
    (16, (2, 4), [1, 2]),          # every micro-batch split over the 8 devices
    (48, (2, 4), [1, 2, 3, 6]),
    (12, (2, 4), [1, 3]),          # 12 rows split over 4 devices at most
    (7, (2, 4), [1, 7]),           # over none
    (16, MeshShape(("data",), (8,)), [1, 2]),
])
def test_micro_batch_choices(batch, mesh, want):
    step, args = _mlp(batch)
    assert choices.micro_batch_choices(trace(step, args), mesh) == want


def test_micro_batch_choices_on_a_mesh(mesh2x4):
    step, args = _mlp(64)
    assert choices.micro_batch_choices(trace(step, args), mesh2x4) == [1, 2, 4, 8]


def test_batch_arguments_of_two_sizes_are_refused():
    step, (w, x, y, _) = _linear_step(
        lambda w, x, y, mask: jnp.mean(x @ w) + jnp.mean(y) + jnp.mean(mask))
    args = (w, x, y[:4], jnp.ones((8,)))
    with pytest.raises(acc.AccumulationError, match=r"leading dimensions \[4, 8\]"):
        choices.micro_batch_choices(trace(step, args, batch_argnums=(1, 2, 3)), (2, 4),
                                    batch_argnums=(1, 2, 3))
    assert choices.infer_reduction(step, args, batch_argnums=(1, 2, 3)) is None


def test_errors_say_what_to_change():
    step, args = _mlp(6)
    with pytest.raises(acc.AccumulationError, match=r"dimension 6, not divisible by 4"):
        acc.accumulated(step, args, 4)
    made_outside = jax.grad(lambda w, x: jnp.mean(x @ w))  # made once, not in the step
    closed_over = lambda w, x: (w - made_outside(w, x),)
    with pytest.raises(acc.AccumulationError, match="made inside it"):
        acc.accumulated(closed_over, args[:2], 2)
    assert choices.infer_reduction(closed_over, args[:2]) is None
    with pytest.raises(ValueError, match="num_micro_batches=0"):
        acc.accumulate(step, 0)
    with pytest.raises(ValueError, match="reduction='average'"):
        acc.accumulate(step, 2, reduction="average")
    weigh = acc.accumulate(step, 2, reduction=lambda w, x, y, mask: mask)
    with pytest.raises(acc.AccumulationError, match="must return a scalar"):
        jax.eval_shape(weigh, *args)


def test_a_step_written_with_jax_value_and_grad_accumulates(mesh2x4):
    """The zoo's GPT step takes its gradient with jax.value_and_grad, as users write steps:
    accumulation cuts it there (shardplan.grad.routing_jax_gradients), its loss is read as
    a mean over the batch, and 3 accumulated steps planned on 8 devices equal the plain
    step on one; jax's own functions are back in place afterwards."""
    m = get_model("gpt", "tiny", dropout_rate=0.0, optimizer="sgd", batch_size=8)
    assert choices.infer_reduction(m.fn, m.args, state_argnums=m.state_argnums,
                                   batch_argnums=m.batch_argnums) == "mean"
    assert jax.value_and_grad is _JAX_VALUE_AND_GRAD and jax.grad is _JAX_GRAD
    planned = shardplan.auto(acc.accumulate(m.fn, 2, batch_argnums=m.batch_argnums),
                             mesh=mesh2x4, cache=False, state_argnums=m.state_argnums,
                             batch_argnums=m.batch_argnums)
    single = jax.jit(m.fn)
    a = b = m.args
    for _ in range(3):
        out_p, out_s = planned(*a), single(*b)
        np.testing.assert_allclose(np.asarray(out_p[2]), np.asarray(out_s[2]), rtol=1e-5)
        for x, y in zip(jax.tree.leaves(out_p[:2]), jax.tree.leaves(out_s[:2])):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
        a, b = (*out_p[:2], *m.args[2:]), (*out_s[:2], *m.args[2:])


def test_gradients_inside_the_loss_function_stay_jaxs():
    """A jax.grad taken inside the loss function (a gradient penalty) is jax's own while
    the step's jax.value_and_grad is cut: the accumulated step equals the plain step."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2)), jnp.float32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)

    def loss_fn(w, x):
        penalty = jnp.sum(jax.grad(lambda v: jnp.sum(jnp.tanh(x @ v)))(w) ** 2) / x.shape[0]
        return jnp.mean(jnp.tanh(x @ w) ** 2) + penalty

    def step(w, x):
        loss, g = jax.value_and_grad(loss_fn)(w, x)
        return w - 0.1 * g, loss

    got = jax.jit(acc.accumulate(step, 2, reduction="sum"))(w, x)
    want = [jax.value_and_grad(loss_fn)(w, x[k::2]) for k in range(2)]
    np.testing.assert_allclose(got[1], sum(v for v, _ in want), rtol=1e-5)
    np.testing.assert_allclose(got[0], w - 0.1 * sum(g for _, g in want), rtol=1e-5)


# --- planning it -------------------------------------------------------------------------------


def _activation_heavy(batch=2048, width=32, hidden=512, depth=4):
    """Residual MLP blocks, batch large against the weights: activations dominate memory."""
    rng = np.random.default_rng(0)
    params = [{"up": jnp.asarray(rng.standard_normal((width, hidden)) / 8, jnp.float32),
               "down": jnp.asarray(rng.standard_normal((hidden, width)) / 32, jnp.float32)}
              for _ in range(depth)]
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)

    def loss_fn(params, x, y):
        h = x
        for p in params:
            h = h + jnp.tanh(h @ p["up"]) @ p["down"]
        return jnp.mean((h - y) ** 2)

    def step(params, opt_state, x, y):
        loss, grads = shardplan.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt = optax.sgd(1e-2)
    return step, (params, opt.init(params), x, y)


def _compiled_peak(compiled) -> int:
    ma = compiled.memory_analysis()
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
            + ma.temp_size_in_bytes)


def test_peak_memory_falls_as_micro_batches_grow_for_about_the_same_compute(mesh2x4):
    step, args = _activation_heavy()
    estimates, compiled = [], []
    for m in (1, 2, 4):
        planned = shardplan.auto(acc.accumulate(step, m), mesh=mesh2x4, cache=False)
        estimates.append(planned.plan(*args).estimate)
        compiled.append(_compiled_peak(planned.lower(*args).compile()))
    peaks = [e.peak_bytes for e in estimates]
    assert peaks[0] > peaks[1] > peaks[2] and peaks[2] < 0.6 * peaks[0], peaks
    assert compiled[0] > compiled[1] > compiled[2] and compiled[2] < 0.6 * compiled[0], compiled
    # M micro-steps of 1/M the work: the cost model's compute within 15% of the plain step's
    computes = [e.compute_s for e in estimates]
    assert all(abs(c / computes[0] - 1) < 0.15 for c in computes), computes


def test_search_plans_an_accumulated_step_from_abstract_arguments():
    step, args = _activation_heavy()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    plans = [shardplan.search(acc.accumulate(step, m), *abstract, cluster="cpu",
                              mesh_shape=(2, 4)) for m in (1, 4)]
    assert plans[1].estimate.peak_bytes < 0.6 * plans[0].estimate.peak_bytes


def test_partial_sums_matching_the_batch_layout_reduce_the_gradients_once(mesh2x4):
    """Lanes as many as the devices the plan splits the batch over: each device sums its own
    rows' gradients over the micro-batches, reduced once after them, not once per
    micro-batch: fewer bytes sent, by the cost model and in the compiled program."""
    step, args = _activation_heavy()
    one = shardplan.auto(acc.accumulate(step, 4), mesh=mesh2x4, cache=False)
    lanes = choices.partial_sums_for(one.plan(*args).in_specs["[2]"], mesh2x4)
    assert lanes > 1
    per_device = shardplan.auto(acc.accumulate(step, 4, partial_sums=lanes), mesh=mesh2x4,
                                cache=False)
    plans = [s.plan(*args) for s in (one, per_device)]
    assert plans[1].estimate.comm_s < 0.8 * plans[0].estimate.comm_s, plans
    sent = [hlo.analyze(s.lower(*args).compile()).bytes_sent for s in (one, per_device)]
    assert sent[1] < 0.8 * sent[0], sent
    want = jax.jit(step)(*args)
    for x, y in zip(jax.tree.leaves(per_device(*args)), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec, want", [(P(), 1), (P(None, "model"), 1), (P("data"), 2),
                                        (P(("data", "model")), 8), (P("model", None), 4)])
def test_partial_sums_for_a_batch_spec(mesh2x4, spec, want):
    assert choices.partial_sums_for(spec, mesh2x4) == want
    assert choices.partial_sums_for(spec, MeshShape(("data", "model"), (2, 4))) == want
