"""The SPMD pipeline judged as compiled (shardplan.inter.spmd_cost, shardplan.planning.select): its
estimate, built from the stage program (the micro-batch step's layers on one stage's devices)
with the schedule's ticks, permutes and all-reduces over the stages, against the one compiled
SPMD program priced by the same profile (flops with the loop's trip counts); and
pipeline="auto" with measure=True keeping the cheaper program as priced."""

import dataclasses
import re

import jax
import pytest

import shardplan
from shardplan.cost.hardware import get_profile
from shardplan.models import base, get_model, gpt
from shardplan.options import SearchOptions
from shardplan.planning import compiled
from shardplan.planning.pipelines import choose
from tests.conftest import auto_mesh
from tests.test_emit_spmd import L, M, scanned_mlp

HW = get_profile("a100-80gb")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_estimate_is_the_compiled_program_within_10_percent(schedule):
    step, args = scanned_mlp(width=256, batch=64)
    mesh = auto_mesh((4, 2), ("stage", "data"))
    choice = choose(step, args, mesh, HW, SearchOptions(pipeline="spmd", num_micro_batches=M,
                                                        schedule=schedule))
    plan, cost = choice.plan, choice.spmd
    assert cost.found and plan.pipeline_kind == "spmd"
    stats, priced = compiled.price_spmd(step, args, plan, mesh, HW, "float32")
    # XLA counts the loop of ticks once; analyze() counts it M + S - 1 (2M + 2S - 2) times
    assert stats.loop_flops > stats.flops / 2
    assert cost.flops == pytest.approx(stats.flops, rel=0.1)
    assert plan.estimate.comm_s == pytest.approx(priced.comm_s, rel=0.1)
    assert priced.per_kind["collective-permute"].count == 2 * (
        M + 3 if schedule == "gpipe" else M + 6)
    # the step as price.py prices it (flops at the profile's peak, the contractions' and the
    # step's I/O traffic at its memory bandwidth, the collectives)
    assert plan.estimate.total_s == pytest.approx(priced.total_s, rel=0.1)
    # the stages' estimate is not the intra-op plan's scaled: memory is divided by the stages
    assert plan.estimate.state_bytes < choice.intra.estimate.state_bytes
    assert any(n.startswith("estimate: ") and "ticks of" in n for n in plan.notes), plan.notes


def test_auto_with_measure_keeps_the_cheaper_program_as_priced():
    step, args = scanned_mlp(width=256, batch=64)
    mesh = auto_mesh((4, 2), ("stage", "data"))
    auto = shardplan.auto(step, mesh=mesh, hardware="a100-80gb", pipeline="auto",
                          num_micro_batches=M, schedule="gpipe", measure=True, cache=False)
    plan = auto.plan(*args)
    note = next(n for n in plan.notes if n.startswith("measured (compiled by XLA"))
    spmd_s, intra_s = (float(x) for x in re.findall(r"(?:SPMD pipeline|intra-op) ([\d.]+) us",
                                                    note))
    assert ("kept the SPMD pipeline" in note) == (spmd_s < intra_s), note
    assert (plan.pipeline_kind == "spmd") == (spmd_s < intra_s)
    assert plan.model_estimate is not None  # the estimate is the compiled program's
    jax.tree.map(lambda a, b: None, auto(*args), jax.jit(step)(*args))  # it runs


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_whose_plan_has_collectives_is_priced_within_10_percent(schedule, stages):
    """2 stages x 4 (and 4 x 2) model-parallel devices on the cpu profile (slow links: the
    stage's plan splits the layers' hidden dimension): the stage's intra-op plan is applied
    inside the layer (operand layouts), so XLA runs the collectives the plan priced: one
    all-gather of the activation per layer forward (the backward reads the gathered input
    the forward kept; 1F1B recomputes its forward; without the layouts XLA gathered it again
    in the backward: 72 instead of 36 for GPipe on 2 stages), and the estimate's
    communication is the compiled program's."""
    hw = get_profile("cpu")
    step, args = scanned_mlp(width=256, batch=16)
    mesh = auto_mesh((stages, 8 // stages), ("stage", "model"))
    choice = choose(step, args, mesh, hw, SearchOptions(pipeline="spmd", num_micro_batches=M,
                                                        schedule=schedule))
    plan = choice.plan
    assert plan.operand_specs and any(s[0].dims != ((),) * len(s[0].dims)
                                      for s in plan.operand_specs.values())
    _, priced = compiled.price_spmd(step, args, plan, mesh, hw, "float32")
    S, per_stage = stages, L // stages
    ticks = M + S - 1 if schedule == "gpipe" else M + 2 * S - 2
    # GPipe gathers once per layer and tick; 1F1B also where its backward's recomputed
    # forward does not read the gathered input its forward kept (as the stage's plan says)
    gathers = priced.per_kind["all-gather"].count
    assert gathers == ticks * per_stage if schedule == "gpipe" else gathers in (
        ticks * per_stage, 2 * ticks * per_stage)
    assert plan.estimate.comm_s == pytest.approx(priced.comm_s, rel=0.1)
    assert plan.estimate.total_s == pytest.approx(priced.total_s, rel=0.1)


def test_1f1b_runs_the_head_every_tick_in_the_stage_plans_layouts():
    """1F1B runs the head and loss inside its loop, every tick. Left to XLA, their layouts
    followed the tied embedding's (split over the stage's devices): the logits' max and sum
    and the head's cotangent were all-reduced every tick (GPT 6.7B on 8x8, 4 stages: the
    logits, 1.6 GiB, 1.8 s of a 4.6 s estimate), where the stage's plan runs the head with
    none. The head reads its operands in the plan's layouts: the loop's only collectives are
    the schedule's permutes, as the plan says, and the step is priced as estimated."""
    m = get_model("gpt", "tiny", scan_layers=True, num_layers=4, batch_size=16,
                  vocab_size=8192, hidden=128, seq_len=64, dropout_rate=0.0, optimizer="sgd",
                  abstract=True)
    model = gpt.GPT(m.config)

    def loss_fn(params, _all, batch, rng):
        logits = model.apply({"params": params}, batch["input_ids"], train=False)
        return base.cross_entropy(logits, batch["labels"]), None

    step = base.make_train_step(loss_fn, base.make_optimizer(m.config), "gpt",
                                value_and_grad=shardplan.value_and_grad)
    hw = dataclasses.replace(HW, devices_per_host=8)
    mesh = auto_mesh((2, 4), ("stage", "data"))
    plan = choose(step, m.args, mesh, hw, SearchOptions(pipeline="spmd", num_micro_batches=4,
                                                        schedule="1f1b")).plan
    assert any(k[0] < 0 for k in plan.operand_specs)  # the head's layouts (post_key)
    stats, priced = compiled.price_spmd(step, m.args, plan, mesh, hw, "float32")
    in_loop = [op for op in stats.collectives if op.in_loop]
    ticks = 4 + 2 * 2 - 2
    assert {op.kind for op in in_loop} == {"collective-permute"}, in_loop
    assert sum(op.count for op in in_loop) == 2 * ticks
    assert plan.estimate.total_s == pytest.approx(priced.total_s, rel=0.15)
