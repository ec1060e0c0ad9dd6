"""The planner end to end: the plans it finds, the programs it emits, and their numbers."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan import timeline
from shardplan.analysis import hlo
from shardplan.cost.hardware import get_profile
from shardplan.models import get_model
from tests.conftest import auto_mesh

A100 = "a100-80gb"
# XLA:CPU compiles a reduce-scatter as an all-reduce (JAX-NOTES): tests that read the compiled
# collectives plan with a profile that knows it, so the plan prices what the CPU runs.
A100_ON_CPU = dataclasses.replace(get_profile(A100), forms_reduce_scatter=False)


def mlp_step(params, x, y):
    def loss_fn(p):
        h = x
        for i, w in enumerate(p):
            h = h @ w
            if i < len(p) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)], loss


def mlp_args(batch, width, layers=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), layers + 2)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:layers]]
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.normal(keys[-1], (batch, width))
    return params, x, y


def assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_mlp_small_batch_wide_layers_is_tensor_parallel(mesh8):
    args = mlp_args(batch=8, width=2048)
    step = shardplan.auto(mlp_step, mesh=mesh8, hardware=A100)
    plan = step.plan(*args)
    weights = plan.input_specs[:4]
    # Every weight is split over the devices (column or row, as in Megatron), none replicated.
    assert all(w.num_shards(plan.mesh) == 8 for w in weights), [str(w) for w in weights]
    stats = hlo.analyze(step.lower(*args).compile())
    activation = 8 * 2048 * 4
    assert stats.collectives, "tensor parallelism needs collectives of activations"
    assert all(c.nbytes <= activation for c in stats.collectives), stats.summary()
    weight_bytes = 4 * 2048 * 2048 * 4
    assert stats.bytes_sent < weight_bytes / 100
    assert_tree_close(step(*args), mlp_step(*args), rtol=2e-4, atol=2e-5)


def test_mlp_large_batch_narrow_layers_is_data_parallel(mesh8):
    args = mlp_args(batch=16384, width=256)
    step = shardplan.auto(mlp_step, mesh=mesh8, hardware=A100_ON_CPU)
    plan = step.plan(*args)
    assert all(s.to_partition_spec() == P() for s in plan.input_specs[:4])
    assert plan.input_specs[4].to_partition_spec() == P("x")
    assert plan.output_specs[:4] == plan.input_specs[:4]
    stats = hlo.analyze(step.lower(*args).compile())
    reduced = sum(c.nbytes for c in stats.collectives if c.kind == "all-reduce")
    param_bytes = 4 * 256 * 256 * 4
    # The gradients are reduced once (plus the 4-byte loss), nothing else is sent.
    assert param_bytes <= reduced <= param_bytes + 64, stats.summary()
    assert {c.kind for c in stats.collectives} == {"all-reduce"}
    assert_tree_close(step(*args), mlp_step(*args), rtol=2e-4, atol=2e-5)


def test_transformer_block_2x4_is_data_by_tensor(mesh2x4):
    model = get_model("gpt", "tiny", abstract=True, batch_size=16, hidden=1024, num_heads=16,
                      ffn_dim=4096, num_layers=1, seq_len=128, dropout_rate=0.0)
    plan = shardplan.auto(model.fn, mesh=mesh2x4, hardware=A100).plan(*model.args)
    forward = {o.name.split("/")[-1]: o.strategy for o in plan.ops
               if o.primitive == "dot_general" and o.name.startswith("jvp(GPT)/layer_0")}
    # The batch over the data axis, Megatron over the model axis: column-parallel fc_in,
    # row-parallel fc_out and attention output, attention heads split.
    assert forward["fc_in"] == "dot m0:data n0:model", forward
    assert forward["fc_out"] == "dot m0:data k0:model", forward
    assert forward["out"] == "dot m0:data k0:model", forward
    assert forward["bqnd,bknd->bnqk"] == "dot b0:data b1:model", forward
    specs = dict(zip(plan.input_names, plan.input_specs))
    fc_in = specs["[0]['layer_0']['mlp']['fc_in']['kernel']"]
    fc_out = specs["[0]['layer_0']['mlp']['fc_out']['kernel']"]
    assert "model" in fc_in.dims[1] and "model" in fc_out.dims[0]


@pytest.fixture(scope="module")
def gpt_tiny():
    return get_model("gpt", "tiny", optimizer="adamw")


def test_gpt_adamw_three_steps_match_single_device(gpt_tiny, mesh2x4):
    m = gpt_tiny
    params, opt_state, batch, rng = m.args
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware=A100)
    plan = step.plan(*m.args)
    ref_p, ref_s, got_p, got_s = params, opt_state, params, opt_state
    for i in range(3):
        key = jax.random.fold_in(rng, i)
        ref_p, ref_s, ref_loss = jax.jit(m.fn)(ref_p, ref_s, batch, key)
        got_p, got_s, got_loss = step(got_p, got_s, batch, key)
        np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
        # The state keeps its shardings between steps: no resharding on the next call.
        for leaf, sharding in zip(jax.tree_util.tree_leaves((got_p, got_s)),
                                  jax.tree_util.tree_leaves(plan.in_shardings[:2])):
            assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    # Adam divides by sqrt(nu): where a gradient is analytically zero (the key bias: softmax
    # ignores it) both runs update by rounding noise times the learning rate, so the absolute
    # tolerance is 1% of one step's size (lr 1e-3) rather than a relative one.
    assert_tree_close(got_p, ref_p, rtol=1e-4, atol=1e-5)
    assert_tree_close(got_s, ref_s, rtol=1e-4, atol=1e-5)
    assert len(step._cache) == 1


def adam_mlp():
    opt = optax.adam(1e-3)
    params, x, y = mlp_args(batch=64, width=2048, layers=4)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            h = x
            for w in p:
                h = jax.nn.relu(h @ w)
            return jnp.mean((h - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt.init(params), x, y)


def test_memory_budget_gives_a_plan_that_fits(mesh8):
    """Replicated, the parameters and Adam's moments (192 MiB) do not fit a 100 MiB budget;
    the plan shards them and fits, per XLA's memory analysis of the compiled program."""
    step_fn, args = adam_mlp()
    budget = 100 * 2**20
    replicated = jax.jit(step_fn).lower(*args).compile()
    assert hlo.analyze(replicated).peak_bytes > budget
    step = shardplan.auto(step_fn, mesh=mesh8, hardware=A100_ON_CPU, memory_budget=budget,
                          donate_argnums=(0, 1))
    plan = step.plan(*args)
    assert plan.estimate.peak_bytes <= budget
    stats = hlo.analyze(step.lower(*args).compile())
    assert stats.peak_bytes <= budget, stats.summary()


def test_impossible_budget_says_what_is_needed(mesh8):
    args = mlp_args(batch=64, width=1024, layers=4)
    step = shardplan.auto(mlp_step, mesh=mesh8, hardware="cpu", memory_budget="256KiB",
                          grad_accumulation=1)  # tests/test_planning_driver.py: with it
    with pytest.raises(shardplan.InfeasibleMemory, match="smallest any plan needs") as e:
        step.plan(*args)
    assert e.value.min_bytes > 256 * 1024


@pytest.mark.parametrize("shape", [(8,), (2, 4)], ids=["8", "2x4"])
@pytest.mark.parametrize("name", ["gpt", "bert", "moe", "wresnet", "vit"])
def test_predicted_bytes_match_compiled(name, shape):
    """The cost model's bytes per device against the collectives XLA compiled, for the zoo on
    1-D and 2-D meshes (the cpu profile: compute slow enough that every plan communicates,
    and no reduce-scatters, as XLA:CPU compiles)."""
    mesh = auto_mesh(shape, ("x",) if len(shape) == 1 else ("data", "model"))
    m = get_model(name, "tiny", batch_size=64)
    step = shardplan.auto(m.fn, mesh=mesh, hardware="cpu")
    plan = step.plan(*m.args)
    stats = hlo.analyze(step.lower(*m.args).compile())
    assert plan.estimate.comm_bytes > 0.1 * 2**20
    assert plan.estimate.comm_bytes == pytest.approx(stats.bytes_sent, rel=0.10)


def test_predicted_bytes_match_compiled_with_reduce_scatters(mesh2x4):
    """A profile that forms reduce-scatters, against the compiled program as a GPU/TPU runs
    it (CPU all-reduce-then-slice priced as the reduce-scatter, analysis.hlo)."""
    # a batch large enough that the plan communicates (since the compute time charges the
    # step's I/O, not elementwise traffic, the tiny GPT at 256 plans replicated on an A100)
    m = get_model("gpt", "tiny", batch_size=4096)
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware=A100)
    plan = step.plan(*m.args)
    stats = hlo.analyze(step.lower(*m.args).compile()).formed()
    # (0.94 MB since the loss's reduction joins the gradients' combined all-reduce: 1.x before)
    assert plan.estimate.comm_bytes > 2**19
    assert plan.estimate.comm_bytes == pytest.approx(stats.bytes_sent, rel=0.10)


def test_bare_decorator_and_lower_with_abstract_args():
    @shardplan.auto
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w), jnp.sum(w)

    w, x = jnp.ones((16, 16)), jnp.ones((64, 16))
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (w, x))
    lowered = step.lower(*abstract)
    assert isinstance(lowered, jax.stages.Lowered)
    assert_tree_close(step(w, x), (w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w),
                                   jnp.sum(w)))


def test_plan_round_trip_and_summary(tmp_path, mesh8):
    args = mlp_args(batch=8, width=256)
    step = shardplan.auto(mlp_step, mesh=mesh8, hardware=A100)
    plan = step.plan(*args)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = shardplan.load_plan(path)
    assert loaded.input_specs == plan.input_specs
    assert loaded.constraints == plan.constraints
    assert loaded.operand_specs == plan.operand_specs
    assert loaded.estimate == plan.estimate
    text = plan.summary()
    assert "estimate per step" in text and "PartitionSpec" in text
    # A loaded plan runs without planning again, with the same numbers.
    rerun = shardplan.auto(mlp_step, mesh=mesh8, plan=str(path))
    assert_tree_close(rerun(*args), step(*args))


def test_explicit_mesh_is_accepted():
    mesh = jax.make_mesh((8,), ("x",))  # Explicit axes since jax 0.9
    args = mlp_args(batch=8, width=64)
    step = shardplan.auto(mlp_step, mesh=mesh)
    assert_tree_close(step(*args), mlp_step(*args), rtol=1e-4, atol=1e-6)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="memory size"):
        shardplan.auto(mlp_step, memory_budget="lots")
    with pytest.raises(TypeError, match="function"):
        shardplan.auto(3)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_auto_pipeline_true_equals_single_device(mesh8, schedule):
    from tests.test_inter_split import mlp_step as pipeline_mlp

    step_fn, args, _ = pipeline_mlp()
    step = shardplan.auto(step_fn, mesh=mesh8, pipeline=True, num_stages=2,
                          num_micro_batches=4, schedule=schedule)
    plan = step.plan(*args)
    assert len(plan.stages) == 2
    ref = jax.jit(step_fn)(*args)
    got = step(*args)
    assert_tree_close(got, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pipeline"):
        step.lower(*args)


def test_auto_pipeline_auto_explains_its_choice(mesh8):
    from tests.test_inter_split import mlp_step as pipeline_mlp

    step_fn, args, _ = pipeline_mlp()
    step = shardplan.auto(step_fn, mesh=mesh8, pipeline="auto", hardware=A100)
    plan = step.plan(*args)
    assert any("intra-op" in n for n in plan.notes), plan.notes
    assert_tree_close(step(*args), jax.jit(step_fn)(*args), rtol=1e-5, atol=1e-6)


def test_pipelined_plan_draws_its_timeline(tmp_path, mesh8):
    from tests.test_inter_split import mlp_step as pipeline_mlp

    step_fn, args, _ = pipeline_mlp()
    plan = shardplan.auto(step_fn, mesh=mesh8, pipeline=True, num_stages=2,
                          num_micro_batches=4).plan(*args)
    assert plan.num_micro_batches == 4 and plan.schedule == "1f1b"
    timeline.draw_plan(plan, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    plan.save(tmp_path / "p.json")
    assert shardplan.load_plan(tmp_path / "p.json").num_micro_batches == 4
