"""The pipeline planner: cost tables from layer ILPs, the stage choice against pure intra-op
on slow and fast links, and a pipelined GPT against the single-device step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from shardplan import timeline
from shardplan.cost.hardware import HardwareProfile
from shardplan.emit.pipeline import emit_pipeline
from shardplan.fingerprint import Fingerprint
from shardplan.grad import value_and_grad
from shardplan.inter import planner
from shardplan.models import base
from shardplan.models.gpt import GPT
from shardplan.models.layers import TransformerConfig
from shardplan.options import SearchOptions
from shardplan.plan_file import load_plan
from shardplan.planning.pipelines import choose, pipeline_plan
from tests.test_inter_split import mlp_step

SLOW = HardwareProfile.two_level(4)  # 1e11 B/s within a host, 1e10 between hosts
FAST = HardwareProfile.uniform(bandwidth=1e12)  # one host, fast links


def gpt_step(batch=8):
    """The zoo's GPT (tiny, 2 blocks, tied embeddings, no dropout) with shardplan's gradient."""
    cfg = TransformerConfig(num_layers=2, dropout_rate=0.0, batch_size=batch)
    model = GPT(cfg)
    opt = optax.sgd(1e-2, momentum=0.9)
    ids = jnp.zeros((batch, cfg.seq_len), jnp.int32)
    shapes = jax.eval_shape(lambda k: model.init(k, ids, train=False),
                            jax.random.PRNGKey(0))["params"]
    params = base.host_init(shapes, seed=0, std=0.02)
    data = base.example_batch({"input_ids": ((batch, cfg.seq_len), jnp.int32, cfg.vocab_size),
                               "labels": ((batch, cfg.seq_len), jnp.int32, cfg.vocab_size)},
                              abstract=False)

    def loss_fn(p, batch):
        logits = model.apply({"params": p}, batch["input_ids"], train=False)
        return base.cross_entropy(logits, batch["labels"])

    def step(params, opt_state, batch):
        loss, grads = value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step, (params, opt.init(params), data)


@pytest.mark.parametrize("num_stages,schedule", [
    (4, "1f1b"), pytest.param(4, "gpipe", marks=pytest.mark.slow)])
def test_gpt_pipeline_equals_the_single_device_step(mesh2x4, num_stages, schedule):
    # 4 stages (2 once left the last holding only the loss, which reads no embedding) and
    # batch 256: enough compute per layer that every stage gets some (at a small batch the
    # latency of a stage boundary outweighs a whole block, and the last stage holds only the
    # loss: at 64 since the compute time charges the step's I/O, not elementwise traffic)
    step, args = gpt_step(256)
    choice = choose(step, args, mesh2x4, SLOW, SearchOptions(
        pipeline=True, num_stages=num_stages, num_micro_batches=2, schedule=schedule))
    pp = choice.pipeline
    # the tied embedding is read by the first and the last stage: its gradients are summed
    names = pp.split.traced.arg_info.input_names
    wte = pp.split.diff_values[next(i for i, n in enumerate(names) if "wte" in n)]
    assert sum(wte in io.diff_in for io in pp.ios) == 2
    ref = jax.jit(step)
    got_args = want_args = args
    run = emit_pipeline(pp.split, pp.ios, pp.specs, pp.stages, pp.device_mesh, pp.schedule)
    for _ in range(2):
        got, want = run(*got_args), ref(*want_args)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6),
                     got, want)
        got_args, want_args = (*got[:2], args[2]), (*want[:2], args[2])


def test_plan_round_trip_and_forced_stage_errors(mesh8, tmp_path):
    step, args, _ = mlp_step(num_layers=4, width=16, batch=8)
    pp = planner.plan_pipeline(step, args, mesh8, SLOW,
                               SearchOptions(num_stages=2, num_micro_batches=2))
    # a plan file records the step it was made for (load_plan refuses one without)
    plan = dataclasses.replace(pipeline_plan(pp, SLOW),
                               fingerprint=Fingerprint("inputs", "function", "mesh"))
    path = tmp_path / "plan.json"
    plan.save(path)
    again = load_plan(path)
    assert again.stages == plan.stages
    assert again.estimate.bubble_fraction == plan.estimate.bubble_fraction > 0
    assert "pipeline stages" in plan.summary()
    png = timeline.draw_pipeline(pp, tmp_path / "t.png")
    with open(png, "rb") as f:
        assert f.read(4) == b"\x89PNG"
    with pytest.raises(ValueError, match="equal submeshes"):
        planner.plan_pipeline(step, args, mesh8, SLOW, SearchOptions(num_stages=3))


def test_moves_between_stages_are_priced_over_the_link_they_cross(mesh8):
    """Two stages on the two hosts of SLOW: the activations and their gradients cross the
    inter-host link (in a multi-controller job, the processes), priced by
    inter.transfer_cost where the stages sit; a slower inter-host link costs the step exactly
    that much more, and the notes say so."""
    from shardplan.inter import transfer_cost

    step, args, _ = mlp_step(num_layers=4, width=64, batch=16)
    options = SearchOptions(num_stages=2, num_micro_batches=2)
    slower = HardwareProfile.two_level(4, inter_bandwidth=1e8)
    pp, pp_slow = (planner.plan_pipeline(step, args, mesh8, hw, options) for hw in (SLOW, slower))
    assert [s.devices for s in pp.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    split = pp.split
    tables = planner.build_tables(split, planner.stage_io.layer_groups(split, None),
                                  planner.CostTables(SLOW, planner.Cluster.of(mesh8, SLOW),
                                                     planner.intra_options(options)), SLOW,
                                  None, [(1, 4)])
    first_of_stage_1 = pp.stages[1].layers[0]
    nbytes = tables.in_bytes[first_of_stage_1]
    assert nbytes > 0
    fast_moves, slow_moves = (transfer_cost.boundary(nbytes, (0, 1, 2, 3), (1, 4),
                                                     (4, 5, 6, 7), (1, 4), hw)
                              for hw in (SLOW, slower))
    assert all(m.program == "permute" and m.inter_host for m in fast_moves)
    extra = sum(m.seconds for m in slow_moves) - sum(m.seconds for m in fast_moves)
    assert pp.stages[0].estimate.comm_s == pytest.approx(pp_slow.stages[0].estimate.comm_s)
    assert pp_slow.stages[1].estimate.comm_s - pp.stages[1].estimate.comm_s == \
        pytest.approx(extra)
    assert pp.estimate.total_s == pytest.approx(pp.chosen.total_s)
    notes = "\n".join(pp.notes)
    assert "stage 0 -> 1" in notes and "by permute over the inter-host link" in notes, notes
