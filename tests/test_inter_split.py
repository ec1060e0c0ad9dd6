"""Splitting a step at its gradient call: the forward graph, stages that compose to the loss
and its gradients, layers at stage_boundary marks, and the update split per stage."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardplan.grad import stage_boundary, value_and_grad
from shardplan.inter import split as sp
from shardplan.inter import stage_io
from shardplan.inter import update as update_mod
from shardplan.models import base
from shardplan.models.mlp import MLP, MLPConfig


def mlp_step(num_layers=8, width=16, batch=8, optimizer=None, abstract=False, cast=False,
             return_grads=False):
    """A plain train step on the zoo's MLP written with shardplan.value_and_grad + optax;
    sgd with momentum by default (linear in the gradients, so comparisons stay tight)."""
    model = MLP(MLPConfig(num_layers=num_layers, width=width, batch_size=batch))
    opt = optimizer or optax.sgd(1e-2, momentum=0.9)
    shapes = jax.eval_shape(lambda k: model.init(k, jnp.zeros((batch, width))),
                            jax.random.PRNGKey(0))["params"]
    rng = np.random.default_rng(1)
    if abstract:
        params, opt_state = shapes, jax.eval_shape(opt.init, shapes)
        data = {k: jax.ShapeDtypeStruct((batch, width), jnp.float32) for k in ("x", "y")}
    else:
        params = base.host_init(shapes, seed=0)
        opt_state = opt.init(params)
        data = {k: jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
                for k in ("x", "y")}

    def loss_fn(p, batch):
        pred = model.apply({"params": p}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    def step(params, opt_state, batch):
        p = jax.tree.map(lambda w: w * 2.0, params) if cast else params
        loss, grads = value_and_grad(loss_fn)(p, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        out = (optax.apply_updates(params, updates), opt_state, loss)
        return (*out, grads) if return_grads else out

    return step, (params, opt_state, data), loss_fn


def test_forward_graph_and_update_of_an_mlp():
    step, args, _ = mlp_step()
    s = sp.split_step(step, args, num_micro_batches=4)
    g = s.forward
    assert g.primitive_counts()["dot_general"] == 8
    assert sum(g.nodes[n].primitive == "dot_general" for n in s.body) == 8
    assert len(s.diff_values) == 16 and all(src is not None for src in s.diff_sources)
    assert [g.values[g.inputs[i]].shape for i in s.micro_leaves] == [(2, 16), (2, 16)]
    assert g.values[s.loss_value].shape == ()
    assert len(s.update.outputs) == len(jax.tree.leaves(jax.eval_shape(step, *args)))


def _run_stages(s, ios, leaves, m):
    """Run the stage functions one after another on micro-batch m."""
    g = s.forward
    b = g.values[g.inputs[s.micro_leaves[0]]].shape[0]
    env = {}
    for i, v in enumerate(g.inputs):
        x = leaves[i]
        env[v] = x[m * b:(m + 1) * b] if i in s.micro_leaves else x
    for d, src in zip(s.diff_values, s.diff_sources):
        env[d] = leaves[src]
    for io in ios:
        fn = stage_io.stage_function(s, io)
        f, o = fn([env[v] for v in io.diff_in], [env[v] for v in io.const_in])
        env.update(zip(stage_io.float_outs(s, io), f))
        env.update(zip(stage_io.other_outs(s, io), o))
    return env[s.loss_value]


@pytest.mark.parametrize("num_stages", [1, 3])
def test_stages_compose_to_the_loss(num_stages):
    step, args, loss_fn = mlp_step()
    s = sp.split_step(step, args, num_micro_batches=2)
    layers = stage_io.layer_groups(s, 6)
    bounds = np.linspace(0, 6, num_stages + 1).astype(int)
    ranges = [(a, b - 1) for a, b in itertools.pairwise(bounds)]
    ios = stage_io.stage_ios(s, stage_io.merge_groups(layers, ranges))
    leaves = jax.tree.leaves(args)
    params, _, data = args
    for m in range(2):
        want = loss_fn(params, {k: v[m * 4:(m + 1) * 4] for k, v in data.items()})
        np.testing.assert_allclose(_run_stages(s, ios, leaves, m), want, rtol=1e-6)


def test_forward_backward_of_the_whole_body_is_jax_grad():
    step, args, loss_fn = mlp_step()
    s = sp.split_step(step, args, num_micro_batches=1)
    (io,) = stage_io.stage_ios(s, [s.body])
    leaves = jax.tree.leaves(args)
    env = {v: leaves[i] for i, v in enumerate(s.forward.inputs)}
    env.update({d: leaves[src] for d, src in zip(s.diff_values, s.diff_sources)})
    outs, _, grads = stage_io.forward_backward(s, io)(
        [env[v] for v in io.diff_in], [env[v] for v in io.const_in], [jnp.float32(1.0)])
    want_loss, want = jax.value_and_grad(loss_fn)(args[0], args[2])
    np.testing.assert_allclose(outs[0], want_loss, rtol=1e-6)
    by_value = dict(zip(io.diff_in, grads))
    for d, w in zip(s.diff_values, jax.tree.leaves(want)):
        np.testing.assert_allclose(by_value[d], w, rtol=1e-5, atol=1e-7)


def test_computed_differentiated_arguments_are_prepared_per_stage():
    step, args, _ = mlp_step(cast=True)
    s = sp.split_step(step, args)
    assert all(src is None for src in s.diff_sources)
    ios = stage_io.stage_ios(s, stage_io.layer_groups(s, 4))
    for io in ios:  # each stage prepares (w * 2.0) the parameters it reads, and only those
        reads = [v for v in io.diff_in if v in s.diff_values]
        muls = [n for n in io.prep if s.forward.nodes[n].primitive == "mul"]
        assert len(muls) == len(reads)


def test_stage_boundaries_make_the_layers():
    w = jnp.ones((4, 4))

    def loss_fn(ws, x):
        for k, wk in enumerate(ws):
            x = jnp.tanh(x @ wk)
            if k < 3:
                x = stage_boundary(x)
        return jnp.mean(x**2)

    def step(ws, x):
        loss, g = value_and_grad(loss_fn)(ws, x)
        return [a - 0.1 * b for a, b in zip(ws, g)], loss

    s = sp.split_step(step, ([w] * 4, jnp.ones((8, 4))), num_micro_batches=2)
    assert len(s.boundaries) == 3
    layers = stage_io.layer_groups(s)
    assert len(layers) == 4
    assert [sum(s.forward.nodes[n].primitive == "dot_general" for n in layer)
            for layer in layers] == [1, 1, 1, 1]
    assert all(sp.is_marker(s.forward.nodes[layer[-1]]) for layer in layers[:3])


def test_repeated_layers_share_a_signature():
    step, args, _ = mlp_step(num_layers=8)
    s = sp.split_step(step, args, num_micro_batches=2)
    ios = stage_io.stage_ios(s, stage_io.layer_groups(s, 8))
    sigs = [stage_io.layer_signature(s.forward, io) for io in ios]
    assert len(set(sigs[1:-1])) == 1 and len(set(sigs)) == 3
    other, args2, _ = mlp_step(num_layers=8, width=32)
    s2 = sp.split_step(other, args2, num_micro_batches=2)
    io2 = stage_io.stage_ios(s2, stage_io.layer_groups(s2, 8))
    assert stage_io.layer_signature(s2.forward, io2[1]) != sigs[1]


def _homes(s, ios):
    return [next((k for k, io in enumerate(ios) if d in io.diff_in), 0) for d in s.diff_values]


def test_per_parameter_update_splits_without_exchange():
    step, args, _ = mlp_step(optimizer=optax.adamw(1e-3))
    s = sp.split_step(step, args, num_micro_batches=2)
    ios = stage_io.stage_ios(s, stage_io.merge_groups(stage_io.layer_groups(s, 8), [(0, 3), (4, 7)]))
    homes = _homes(s, ios)
    u = update_mod.split_update(s, homes, 2)
    assert not any(part.outputs for part in u.reduce)
    ties = s.traced.arg_info.ties
    for j, stage in enumerate(u.output_stage):
        src = ties[j]
        if src is not None and src in s.diff_sources:
            assert stage == homes[s.diff_sources.index(src)]
    assert u.output_stage[-1] == 1  # the loss goes to the last stage


def test_global_norm_clipping_exchanges_scalars():
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(1e-2))
    step, args, _ = mlp_step(optimizer=opt)
    s = sp.split_step(step, args, num_micro_batches=2)
    ios = stage_io.stage_ios(s, stage_io.merge_groups(stage_io.layer_groups(s, 8), [(0, 3), (4, 7)]))
    u = update_mod.split_update(s, _homes(s, ios), 2)
    assert all(part.outputs for part in u.reduce)
    for part in u.reduce:
        assert all(s.update.values[v].size <= update_mod.MAX_COUPLING_ELEMENTS for v in part.outputs)
    # the other stage's partial norm is an input of each apply part
    for k, part in enumerate(u.apply):
        assert set(u.reduce[1 - k].outputs) & set(part.inputs)


def test_a_large_coupling_is_rejected():
    w = {"a": jnp.ones((64, 64)), "b": jnp.ones((64, 64))}

    def loss_fn(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]) ** 2)

    def step(p, x):
        loss, g = value_and_grad(loss_fn)(p, x)
        mixed = g["a"] @ g["b"]  # couples the two stages' gradients in full
        return {"a": p["a"] - mixed, "b": p["b"] - g["b"]}, loss

    s = sp.split_step(step, (w, jnp.ones((8, 64))))
    with pytest.raises(sp.PipelineSplitError, match="couples the parameters of stages"):
        update_mod.split_update(s, [0, 1], 2)


def test_errors_say_what_to_do():
    def plain(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - g, loss

    with pytest.raises(sp.PipelineSplitError, match="shardplan.value_and_grad"):
        sp.split_step(plain, (jnp.ones((4, 4)), jnp.ones((6, 4))))
    step, args, _ = mlp_step(batch=6)
    with pytest.raises(sp.PipelineSplitError, match="not divisible by num_micro_batches=4"):
        sp.split_step(step, args, num_micro_batches=4)

    def from_batch(w, x):
        loss, g = value_and_grad(lambda v: jnp.mean(v**2))(w * x.sum())
        return w - g, loss

    with pytest.raises(sp.PipelineSplitError, match="computed from the batch"):
        sp.split_step(from_batch, (jnp.ones((4, 4)), jnp.ones((8, 4))), num_micro_batches=2)
