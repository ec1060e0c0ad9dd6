"""The model zoo: tiny steps train on one device, named sizes have their published sizes, abstract
mode allocates nothing, and the GShard gating respects its capacity."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardplan import models
from shardplan.models import layers

ALL = ["bert", "gpt", "llama", "mlp", "moe", "vit", "wresnet"]


def _paths(tree) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p): tuple(x.shape)
            for p, x in flat}


def _run(step, n=3):
    fn = jax.jit(step.fn)
    args, losses = step.args, []
    for _ in range(n):
        params, opt_state, loss = fn(*args)
        losses.append(float(loss))
        args = (params, opt_state) + tuple(args[2:])
    return args, losses


def test_registry_lists_every_model():
    assert models.list_models() == ALL
    for name in ALL:
        assert models.list_sizes(name)[0] == "tiny"


# dropout is exercised by gpt; off elsewhere, as the random bits double the CPU compile time
NO_DROPOUT = {"bert": {"dropout_rate": 0.0}, "moe": {"dropout_rate": 0.0}}


@pytest.mark.parametrize("name", ALL)
def test_tiny_step_trains_on_one_device(name):
    step = models.get_model(name, **NO_DROPOUT.get(name, {}))
    assert step.name == f"{name}-tiny" and step.description
    assert step.state_argnums == (0, 1) and step.batch_argnums == (2,)
    assert not step.abstract
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(step.args))
    assert step.num_params == sum(x.size for x in jax.tree.leaves(
        step.args[0]["params"] if name == "wresnet" else step.args[0]))
    (params, opt_state, *_), losses = _run(step)
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[2] < losses[1] < losses[0], losses
    # outputs keep the structure and dtypes of the state inputs (the step can be iterated)
    assert jax.tree.structure(params) == jax.tree.structure(step.args[0])
    assert jax.tree.structure(opt_state) == jax.tree.structure(step.args[1])
    if name == "wresnet":  # batch-norm running statistics are updated by the step
        for new, old in zip(jax.tree.leaves(params["batch_stats"]),
                            jax.tree.leaves(step.args[0]["batch_stats"])):
            assert not np.allclose(new, old)


def test_mlp_param_count_by_hand():
    step = models.get_model("mlp", num_layers=3, width=32)
    assert step.num_params == 3 * (32 * 32 + 32)
    assert sorted(_paths(step.args[0])) == [
        "block_0/fc_in/bias", "block_0/fc_in/kernel", "block_0/fc_out/bias",
        "block_0/fc_out/kernel", "block_1/fc_in/bias", "block_1/fc_in/kernel"]


def test_deterministic():
    a, b = models.get_model("gpt"), models.get_model("gpt")
    for x, y in zip(jax.tree.leaves(a.args), jax.tree.leaves(b.args)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_wresnet_batch_norm_stats_are_state_not_params():
    step = models.get_model("wresnet", abstract=True)
    params = step.args[0]
    assert set(params) == {"params", "batch_stats"}
    assert step.num_params == sum(math.prod(x.shape) for x in jax.tree.leaves(params["params"]))
    assert jax.tree.leaves(params["batch_stats"])
    # the optimizer state covers the trainable params only
    assert jax.tree.structure(step.args[1][0].mu) == jax.tree.structure(params["params"])
    group = models.get_model("wresnet", norm="group", abstract=True)
    assert "batch_stats" not in group.args[0] and group.num_params == step.num_params


# published parameter counts: GPT-2 small and XL, LLaMA-7B, Llama 2 7B and 70B (grouped-query
# attention), Mixtral 8x7B, BERT-large with its MLM head, ViT-B/16; the GPT-3 family by name
# within 3%
EXACT = [("gpt", "gpt2-124m", 124_439_808), ("gpt", "gpt2-1.5b", 1_557_611_200),
         ("llama", "7b", 6_738_415_616), ("llama", "llama2-7b", 6_738_415_616),
         ("llama", "llama2-70b", 68_976_648_192), ("moe", "mixtral-8x7b", 46_702_792_704),
         ("bert", "large", 335_174_458), ("vit", "b16", 86_567_656)]
APPROX = [("gpt", "6.7b", 6.7e9), ("gpt", "39b", 39e9), ("gpt", "1.3b", 1.3e9),
          ("moe", "380m", 380e6), ("moe", "2.4b", 2.4e9), ("wresnet", "1b", 1e9),
          ("wresnet", "6.8b", 6.8e9), ("mlp", "1b", 1e9 * 1.0737), ("bert", "megatron-3.9b", 3.9e9)]


@pytest.mark.parametrize("name,size,count", EXACT)
def test_published_param_counts(name, size, count):
    assert models.get_model(name, size, abstract=True).num_params == count


@pytest.mark.parametrize("name,size,count", APPROX)
def test_named_sizes_are_their_size(name, size, count):
    n = models.get_model(name, size, abstract=True).num_params
    assert abs(n - count) / count < 0.03, (name, size, n)


def test_abstract_mode_allocates_nothing():
    before = sum(x.nbytes for x in jax.live_arrays())
    step = models.get_model("gpt", "6.7b", abstract=True, batch_size=4)
    after = sum(x.nbytes for x in jax.live_arrays())
    assert after - before < 1 << 20
    assert step.abstract
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(step.args))
    assert step.args[2]["input_ids"].shape == (4, 1024)
    # adam's mu and nu mirror the params
    adam = step.args[1][0]
    assert jax.tree.structure(adam.mu) == jax.tree.structure(step.args[0])
    assert step.args[0]["layer_31"]["mlp"]["fc_in"]["kernel"].shape == (4096, 16384)


def test_dtype_override():
    step = models.get_model("gpt", "gpt2-124m", abstract=True, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(step.args[0])} == {jnp.dtype("bfloat16")}
    mixed = models.get_model("gpt", abstract=True, dtype="bfloat16", param_dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(mixed.args[0])} == {jnp.dtype("float32")}
    out = jax.eval_shape(mixed.fn, *mixed.args)
    assert out[2].dtype == jnp.float32


def test_module_names_are_the_baselines_contract():
    gpt = _paths(models.get_model("gpt", abstract=True).args[0])
    for path in ["wte/embedding", "wpe/embedding", "layer_0/attn/qkv/kernel",
                 "layer_0/attn/out/kernel", "layer_1/mlp/fc_in/kernel", "layer_1/mlp/fc_out/bias",
                 "ln_f/scale"]:
        assert path in gpt, path
    assert gpt["layer_0/attn/qkv/kernel"] == (64, 192)
    llama = _paths(models.get_model("llama", abstract=True).args[0])
    for path in ["layer_0/attn/query/kernel", "layer_0/attn/key/kernel", "layer_0/mlp/gate/kernel",
                 "layer_0/mlp/up/kernel", "layer_0/mlp/down/kernel", "lm_head/kernel"]:
        assert path in llama, path
    assert not any(p.endswith("bias") for p in llama) and "wpe/embedding" not in llama
    moe = _paths(models.get_model("moe", abstract=True).args[0])
    assert moe["layer_1/mlp/experts/wi"] == (8, 64, 128)
    assert moe["layer_1/mlp/experts/wo"] == (8, 128, 64)
    assert moe["layer_1/mlp/router/kernel"] == (64, 8)
    assert "layer_0/mlp/fc_in/kernel" in moe  # dense and MoE layers alternate


def test_fused_qkv_is_heads_major():
    """Splitting the fused qkv output features into contiguous blocks keeps whole heads: the
    fused projection equals separate q/k/v projections whose kernels are its (n, 3, d) slices."""
    cfg = models.get_config("gpt", dropout_rate=0.0)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, cfg.seq_len, cfg.hidden))
    fused = layers.Attention(cfg)
    params = jax.jit(lambda k: fused.init(k, x, train=False))(jax.random.PRNGKey(1))["params"]
    n, d, h = cfg.num_heads, cfg.head_dim, cfg.hidden
    w = params["qkv"]["kernel"].reshape(h, n, 3, d)
    bias = params["qkv"]["bias"].reshape(n, 3, d)
    split = {nm: {"kernel": w[:, :, i].reshape(h, h), "bias": bias[:, i].reshape(h)}
             for i, nm in enumerate(("query", "key", "value"))}
    split["out"] = params["out"]
    separate = layers.Attention(models.get_config("gpt", dropout_rate=0.0, fused_qkv=False))
    run = jax.jit(lambda m, p: m.apply({"params": p}, x, train=False), static_argnums=0)
    np.testing.assert_allclose(run(fused, params), run(separate, split), rtol=1e-5, atol=1e-6)


def test_top2_gating_respects_capacity():
    g, s, e, cap = 3, 32, 4, 6
    gates = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(0), (g, s, e)) * 3, axis=-1)
    combine, dispatch, aux = jax.jit(layers.top2_gating, static_argnums=1)(gates, cap)
    combine, dispatch = np.asarray(combine), np.asarray(dispatch)
    assert combine.shape == dispatch.shape == (g, s, e, cap)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert dispatch.sum(axis=(2, 3)).max() <= 2  # at most two experts per token
    assert dispatch.sum(axis=1).max() <= 1  # one token per expert slot
    assert (dispatch.sum(axis=(1, 3)) <= cap).all()  # capacity per expert and group
    assert (combine.sum(axis=(2, 3)) <= 1 + 1e-6).all()
    # a token kept by its first choice goes to the argmax expert
    first = np.asarray(jnp.argmax(gates, -1))
    kept = dispatch.sum(axis=3)  # (g, s, e)
    for gi, si in zip(*np.nonzero(kept.sum(-1) == 2)):
        assert kept[gi, si, first[gi, si]] == 1
    assert float(aux) > 0


def test_scanned_moe_of_every_layer_trains():
    """Mixtral's layout: every layer a MoE of SwiGLU experts, scanned, grouped-query attention;
    each layer's auxiliary loss counted once."""
    kw = {"moe_every": 1, "scan_layers": True, "remat": False, "mlp": "swiglu",
          "fused_qkv": False, "num_kv_heads": 2, "num_layers": 3, "dropout_rate": 0.0}
    step = models.get_model("moe", "tiny", **kw)
    layer = step.args[0]["layers"]
    assert layer["mlp"]["experts"]["wi"].shape == (3, 8, 64, 2, 128)
    assert layer["attn"]["key"]["kernel"].shape == (3, 64, 2 * 8)
    _, _, loss = jax.jit(step.fn)(*step.args)
    plain = models.get_model("moe", "tiny", aux_loss_coef=0.0, **kw)
    _, _, base = jax.jit(plain.fn)(*plain.args)
    assert np.isfinite(loss) and float(loss) > float(base)
    with pytest.raises(ValueError, match="moe_every=1"):
        models.get_model("moe", "tiny", scan_layers=True)
    with pytest.raises(ValueError, match="fused_qkv=False"):
        models.get_model("llama", "tiny", num_kv_heads=2, fused_qkv=True)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no size 'huge'.*tiny"):
        models.get_model("gpt", "huge")
    with pytest.raises(ValueError, match="unknown model 'gtp'"):
        models.get_model("gtp")
    with pytest.raises(ValueError, match="no config field.*'layers'"):
        models.get_model("gpt", layers=3)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        models.get_model("gpt", num_heads=7)
    with pytest.raises(ValueError, match="expert_group_size"):
        models.get_model("moe", expert_group_size=48, abstract=True)


@pytest.mark.slow
def test_tracing_the_39b_gpt_is_fast():
    import time

    step = models.get_model("gpt", "39b", abstract=True)
    t = time.perf_counter()
    jax.make_jaxpr(step.fn)(*step.args)
    assert time.perf_counter() - t < 20
