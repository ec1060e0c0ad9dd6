"""The pipeline runtime: pipelined steps of an 8-layer MLP against the single-device step
(loss, gradients, updated state over two steps)."""

import itertools

import jax
import numpy as np
import optax
import pytest

from shardplan.cost.hardware import HardwareProfile
from shardplan.emit import pipeline as pl
from shardplan.inter.planner import plan_pipeline
from shardplan.options import SearchOptions
from shardplan.planning.pipelines import choose
from tests.test_inter_split import mlp_step

HW = HardwareProfile.two_level(4)


def _run(pp, *args):
    return pl.emit_pipeline(pp.split, pp.ios, pp.specs, pp.stages, pp.device_mesh,
                            pp.schedule)(*args)


def _compare(step, args, mesh, num_stages, schedule, steps=2, micro=4, **kw):
    choice = choose(step, args, mesh, HW, SearchOptions(
        pipeline=True, num_stages=num_stages, num_micro_batches=micro, schedule=schedule, **kw))
    assert choice.pipelined and choice.pipeline.num_stages == num_stages
    ref = jax.jit(step)
    got_args = want_args = args
    for _ in range(steps):
        got, want = _run(choice.pipeline, *got_args), ref(*want_args)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
                     got, want)
        got_args = (got[0], got[1], args[2])
        want_args = (want[0], want[1], args[2])
    return choice


@pytest.mark.parametrize("num_stages,schedule", [(2, "1f1b"), (4, "gpipe"), (4, "1f1b")])
def test_mlp_pipeline_equals_the_single_device_step(mesh2x4, num_stages, schedule):
    step, args, _ = mlp_step(num_layers=8, width=16, batch=8, return_grads=True)
    choice = _compare(step, args, mesh2x4, num_stages, schedule)
    plan = choice.plan
    assert len(plan.stages) == num_stages
    devices = sorted(d for st in plan.stages for d in st.devices)
    assert devices == list(range(8))
    layers = [st.layers for st in plan.stages]
    assert layers[0][0] == 0 and all(a[1] + 1 == b[0] for a, b in itertools.pairwise(layers))
    assert 0 < plan.estimate.bubble_fraction < 1


def test_global_norm_clipping_and_computed_arguments(mesh8):
    opt = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1e-2, momentum=0.9))
    step, args, _ = mlp_step(num_layers=8, width=16, batch=8, optimizer=opt, cast=True,
                             return_grads=True)
    choice = _compare(step, args, mesh8, 2, "1f1b")
    pp = choice.pipeline
    rt = pl.emit_pipeline(pp.split, pp.ios, pp.specs, pp.stages, pp.device_mesh, pp.schedule)
    assert all(part.outputs for part in rt.update.reduce)
    assert all(io.prep for io in rt.ios)


def test_adamw_state_stays_with_its_stage(mesh2x4):
    step, args, _ = mlp_step(num_layers=4, width=16, batch=8, optimizer=optax.adamw(1e-3))
    choice = choose(step, args, mesh2x4, HW,
                    SearchOptions(pipeline=True, num_stages=2, num_micro_batches=2))
    params, opt_state, loss = _run(choice.pipeline, *args)
    stage_devices = [set(st.devices) for st in choice.plan.stages]
    mu = jax.tree.leaves(opt_state[0].mu)
    for p, m in zip(jax.tree.leaves(params), mu):
        pd = {d.id for d in p.sharding.device_set}
        assert pd == {d.id for d in m.sharding.device_set}
        assert pd in stage_devices
    want = jax.jit(step)(*args)
    np.testing.assert_allclose(loss, want[2], rtol=1e-6)


def test_wrong_arguments_are_rejected(mesh8):
    step, args, _ = mlp_step(num_layers=4, width=16, batch=8)
    pp = plan_pipeline(step, args, mesh8, HW, SearchOptions(num_stages=2, num_micro_batches=2))
    with pytest.raises(ValueError, match="plan it again"):
        _run(pp, args[0], args[1])
    half = jax.tree.map(lambda x: x[:4], args[2])
    with pytest.raises(ValueError, match=r"has shape \(4, 16\).*planned for \(8, 16\)"):
        _run(pp, args[0], args[1], half)
