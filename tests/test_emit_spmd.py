"""The SPMD pipeline (shardplan.emit.spmd): a scan over stacked layers run as a GPipe loop in
shard_map over a `stage` mesh axis, one jit program. Pipelined steps of a scanned 8-layer MLP
and of the zoo's scanned GPT (4 stages, 8 micro-batches) against the single-device step over
3 optimizer steps; the compiled program's collective-permutes against the schedule; the
planner's choice between SPMD and MPMD and its reasons."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan.analysis import hlo_collectives
from shardplan.emit import spmd
from shardplan.inter import layer_scan, stage_body
from shardplan.models import base, get_model, gpt
from tests.conftest import auto_mesh
from tests.test_inter_split import mlp_step

S, M, L = 4, 8, 8


def scanned_mlp(num_layers=L, width=16, batch=16):
    """A train step whose 8 tanh layers run as one lax.scan over stacked [L, ...] parameters,
    between an input and an output projection; sgd with momentum (linear in the gradients)."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)

    params = {"embed": normal(width, width), "head": normal(width, width),
              "layers": {"kernel": normal(num_layers, width, width),
                         "bias": jnp.zeros((num_layers, width), jnp.float32)}}
    opt = optax.sgd(1e-1, momentum=0.9)
    batch_ = {k: jnp.asarray(rng.standard_normal((batch, width)), jnp.float32) for k in "xy"}

    def loss_fn(p, b):
        def layer(h, w):
            return jnp.tanh(h @ w["kernel"] + w["bias"]), None

        h, _ = jax.lax.scan(layer, b["x"] @ p["embed"], p["layers"])
        return jnp.mean((h @ p["head"] - b["y"]) ** 2)

    def step(params, opt_state, batch):
        loss, grads = shardplan.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt.init(params), batch_)


@functools.cache
def scanned_gpt():
    """The zoo's tiny GPT with 8 scanned (stacked, rematerialised) layers, its step taking the
    gradient with shardplan.value_and_grad; no dropout, sgd."""
    m = get_model("gpt", "tiny", scan_layers=True, num_layers=L, dropout_rate=0.0,
                  batch_size=16, optimizer="sgd")
    model = gpt.GPT(m.config)

    def loss_fn(params, _all, batch, rng):
        logits = model.apply({"params": params}, batch["input_ids"], train=True,
                             rngs={"dropout": rng})
        return base.cross_entropy(logits, batch["labels"]), None

    step = base.make_train_step(loss_fn, base.make_optimizer(m.config), "gpt",
                                value_and_grad=shardplan.value_and_grad)
    return step, m.args


def stage_mesh():
    return auto_mesh((S, 2), ("stage", "data"))


def check_three_steps(step, args, auto_step, rtol=2e-5, atol=2e-6):
    """3 steps of the planned step equal 3 single-device steps (state fed back)."""
    ref = jax.jit(step)
    got_args = want_args = args
    for _ in range(3):
        got, want = auto_step(*got_args), ref(*want_args)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol),
                     got, want)
        got_args = (*got[:2], *args[2:])
        want_args = (*want[:2], *args[2:])


def permutes(text: str) -> list[list[tuple[int, int]]]:
    """The source-target pairs of each collective-permute in an HLO text."""
    out = []
    for line in text.splitlines():
        if "collective-permute" in line and "source_target_pairs=" in line:
            body = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line).group(1)
            out.append([(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", body)])
    return out


TICKS = {"gpipe": M + S - 1, "1f1b": M + 2 * S - 2}
BUBBLE = {"gpipe": ("bubble: 24 of 88 stage-ticks idle = 27.3%", "3/11", 3 / 11),
          "1f1b": ("bubble: 48 of 112 stage-slots idle = 42.9%", "6/14", 6 / 14)}


def check_program(auto_step, args, plan):
    """The compiled program passes activations stage s -> s + 1 (forward) and cotangents
    s + 1 -> s (backward), each once per tick of the schedule: GPipe M + S - 1 ticks forward
    then as many backward (two loops), 1F1B M + 2S - 2 ticks of one loop doing both."""
    text = auto_step.lower(*args).compile().as_text()
    stage_of = {d: s for s, st in enumerate(plan.stages) for d in st.devices}
    directions = {frozenset((stage_of[a], stage_of[b]) for a, b in pairs)
                  for pairs in permutes(text)}
    assert frozenset((s, s + 1) for s in range(S - 1)) in directions, directions
    assert frozenset((s + 1, s) for s in range(S - 1)) in directions, directions
    ops = [c for c in hlo_collectives.parse_collectives(text, 8)
           if c.kind == "collective-permute"]
    # (others, run once, are the intra-op plan's resharding outside the pipeline)
    ticks = [c for c in ops if c.in_loop]
    want = TICKS[plan.schedule]
    assert [c.count for c in ticks] == [want] * 2, [(c.count, c.shapes) for c in ops]
    return text


def check_plan(plan, schedule):
    assert plan.pipeline_kind == "spmd" and plan.schedule == schedule
    assert len(plan.stages) == S and plan.num_micro_batches == M
    assert [st.layers for st in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert any("SPMD pipeline" in n for n in plan.notes), plan.notes
    idle, ratio, fraction = BUBBLE[schedule]
    assert plan.estimate.bubble_fraction == pytest.approx(fraction)
    timeline = plan.timeline()
    assert idle in timeline and ratio in timeline, timeline


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_scanned_mlp_spmd_pipeline_equals_the_single_device_step(schedule):
    step, args = scanned_mlp()
    auto = shardplan.auto(step, mesh=stage_mesh(), hardware="cpu", pipeline=True,
                          num_micro_batches=M, schedule=schedule, cache=False)
    plan = auto.plan(*args)
    check_plan(plan, schedule)
    # the stacked layers (and their momentum) are split over the stages on dim 0
    specs = plan.in_specs
    assert specs["[0]['layers']['kernel']"][0] == "stage", specs
    assert all(p[0] == "stage" for n, p in specs.items() if "layers" in n), specs
    assert all(len(p) == 0 or p[0] != "stage" for n, p in specs.items() if "embed" in n)
    check_three_steps(step, args, auto)
    check_program(auto, args, plan)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_scanned_gpt_spmd_pipeline_equals_the_single_device_step(schedule):
    step, args = scanned_gpt()
    auto = shardplan.auto(step, mesh=stage_mesh(), hardware="cpu", pipeline="spmd",
                          num_micro_batches=M, schedule=schedule, cache=False)
    plan = auto.plan(*args)
    check_plan(plan, schedule)
    # the stage's plan computes a parameter's gradient in another layout than autodiff of its
    # forward would: the layers run their backward in the plan's layouts (layer_backward)
    assert any(k[0] >= stage_body.BACKWARD for k in plan.operand_specs)
    check_three_steps(step, args, auto, rtol=2e-5, atol=5e-6)
    check_program(auto, args, plan)


def test_the_forward_loop_gathers_the_activation_once_per_layer_and_tick():
    """A layer that reads its activation split by rows and hands it on held whole (the plan's
    carry): one all-gather per layer and tick, as the plan prices the carry's loop edge; the
    head reading the outputs split by columns outside the loop no longer lays the layers'
    result out split, to be gathered again before every ppermute."""
    step, args = scanned_mlp(width=64, batch=32)
    mesh = stage_mesh()
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), args)
    shardings[0]["head"] = NamedSharding(mesh, P("data", None))
    jitted = spmd.emit_spmd(step, mesh, S, M, shardings, schedule="gpipe", carry_specs=[P()],
                            operand_specs={(0, 0): P("data", None)})
    text = jitted.lower(*args).compile().as_text()
    forward = [c for c in hlo_collectives.parse_collectives(text, 8)
               if c.in_loop and c.kind == "all-gather" and "transpose" not in c.op_name]
    assert sum(c.count for c in forward) == TICKS["gpipe"] * L // S, [
        (c.count, c.shapes, c.op_name) for c in forward]


def test_a_dot_gives_its_result_in_the_plans_layout():
    """A layer whose matmul reads its activation split by rows and the weight whole, its
    result split by rows (the plan's: a sequence-parallel layer), read split by columns next:
    held so, the forward loop moves the result with all-to-alls as the plan does; with the
    operands alone held XLA gathered the activation whole at every layer (GPT 6.7B on 8x8, 2
    stages: 0.21 s of the forward, as much again in the backward)."""
    step, args = scanned_mlp(width=64, batch=64)
    mesh = stage_mesh()
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), args)
    # the layer: 0 dot(h, kernel), 1 broadcast(bias), 2 add, 3 tanh
    specs = {(0, 0): P("data", None), (0, 1): P(None, None), (0, -1): P("data", None),
             (2, 0): P(None, "data")}
    jitted = spmd.emit_spmd(step, mesh, S, M, shardings, schedule="gpipe",
                            carry_specs=[P("data", None)], operand_specs=specs)
    text = jitted.lower(*args).compile().as_text()
    forward = [c for c in hlo_collectives.parse_collectives(text, 8)
               if c.in_loop and "transpose" not in c.op_name and c.kind != "collective-permute"]
    assert forward and all(c.kind == "all-to-all" for c in forward), [
        (c.kind, c.count, c.shapes, c.op_name) for c in forward]


def test_a_mesh_without_a_stage_axis_is_laid_out_stage_by_data(mesh8):
    step, args = scanned_mlp()
    auto = shardplan.auto(step, mesh=mesh8, hardware="cpu", pipeline=True, num_stages=S,
                          num_micro_batches=M, schedule="gpipe", cache=False)
    plan = auto.plan(*args)
    assert dict(zip(plan.mesh.names, plan.mesh.sizes)) == {"stage": S, "data": 2}
    assert [st.devices for st in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    check_three_steps(step, args, auto)


def test_unrolled_layers_get_an_mpmd_pipeline_and_the_reason(mesh8):
    step, args, _ = mlp_step(num_layers=4, width=16, batch=8)
    plan = shardplan.auto(step, mesh=mesh8, hardware="cpu", pipeline=True, num_stages=2,
                          num_micro_batches=2, cache=False).plan(*args)
    assert plan.pipeline_kind == "mpmd"
    assert "not SPMD: the loss runs no scan over stacked layers" in plan.notes[0], plan.notes
    assert "1F1B MPMD" in plan.timeline()
    with pytest.raises(ValueError, match="pipeline='spmd': no SPMD pipeline: the loss runs no"):
        shardplan.auto(step, mesh=mesh8, pipeline="spmd", num_stages=2,
                       cache=False).plan(*args)


def test_obstacles_name_what_does_not_divide():
    step, args = scanned_mlp()
    flat_scan = layer_scan.probe_step(step, args, lambda scan: (3, 4))
    assert flat_scan.obstacle == "its scan runs 8 layers, which 3 equal stages do not divide"
    odd = layer_scan.probe_step(step, args, lambda scan: (4, 5))
    assert odd.obstacle == "the batch of 16 does not divide into 5 micro-batches"
    ok = layer_scan.probe_step(step, args, lambda scan: (4, 8))
    assert ok.obstacle is None and ok.scan.length == 8 and ok.micro_scan.carry_shapes == ((2, 16),)
    plain = layer_scan.probe_step(lambda p, o, b: jax.grad(lambda p: p["head"].sum())(p),
                                  args, lambda scan: (4, 8))
    assert "no gradient with shardplan.value_and_grad" in plain


def test_defaults_1f1b_with_two_micro_batches_per_stage(tmp_path):
    step, args = scanned_mlp()
    plan = shardplan.auto(step, mesh=stage_mesh(), hardware="cpu", pipeline=True,
                          cache=False).plan(*args)
    plan.save(tmp_path / "plan.json")
    again = shardplan.load_plan(tmp_path / "plan.json")
    assert again.pipeline_kind == "spmd" and again.in_specs == plan.in_specs
    assert again.timeline() == plan.timeline()
    assert plan.num_micro_batches == M  # the fewest >= 2 per stage that divide 16
    assert plan.schedule == "1f1b"
    assert any(n.startswith("1F1B: 8 micro-batches, one loop of 14 ticks") for n in plan.notes)


def test_an_spmd_plan_is_cached_and_the_second_run_does_not_plan(tmp_path, monkeypatch):
    from shardplan.planning import driver

    step, args = scanned_mlp()
    first = shardplan.auto(step, mesh=stage_mesh(), pipeline="spmd", num_micro_batches=M,
                           cache=tmp_path)
    plan = first.plan(*args)
    assert plan.pipeline_kind == "spmd" and list(tmp_path.glob("plan-*.json"))

    def no_planning(*a, **k):
        raise AssertionError("planned again instead of loading the cached plan")

    monkeypatch.setattr(driver, "choose_program", no_planning)
    again = shardplan.auto(step, mesh=stage_mesh(), pipeline="spmd", num_micro_batches=M,
                           cache=tmp_path)
    loaded = again.plan(*args)
    assert loaded.pipeline_kind == "spmd" and len(loaded.stages) == len(plan.stages)
    assert loaded.num_micro_batches == M and loaded.schedule == plan.schedule
    check_three_steps(step, args, again)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bf16_spmd_pipeline_compiles_and_runs_on_cpu(schedule):
    """A bf16 step: on XLA:CPU a 16-bit psum over the stage axis of the partly manual
    shard_map aborted the process while compiling ("Invalid binary instruction opcode copy");
    the pipeline sums those in float32 (layer_scan.stage_psum). One step close to one
    device's bf16 step."""
    step, args = scanned_mlp()
    args = jax.tree.map(lambda x: x.astype(jnp.bfloat16), args)
    auto = shardplan.auto(step, mesh=stage_mesh(), hardware="cpu", pipeline="spmd",
                          num_micro_batches=M, schedule=schedule, cache=False)
    assert auto.plan(*args).pipeline_kind == "spmd"
    got, want = auto(*args), jax.jit(step)(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-2, atol=5e-2), got, want)
