"""Alpa's shard_parallel expectations (its tests/shard_parallel/test_conv.py and test_moe.py),
ported to today's flax and optax and checked against the collectives XLA compiled for the
plan on 8 CPU devices. Alpa counted collectives in its HLO text and left out scalar
all-reduces (`ignore_scalar_all_reduce`); so do these tests. Alpa's solver never ran a
heavy operator replicated (`allow_recompute_heavy_op=False`); here the plans are priced on the
profile of the machine the tests compile on, where compute is dear beside the links."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardplan
from shardplan.analysis import hlo

HARDWARE = "cpu"


def _counts(stats: hlo.ProgramStats) -> dict[str, int]:
    """kind -> executions, scalar all-reduces left out (as Alpa's counts)."""
    out: dict[str, int] = {}
    for c in stats.collectives:
        if c.group_size <= 1:
            continue
        if c.kind == "all-reduce" and all(s == () for s in c.shapes):
            continue
        out[c.kind] = out.get(c.kind, 0) + c.count
    return dict(sorted(out.items()))


def _ring(kind: str, nbytes: float, n: int) -> float:
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * nbytes


def _mesh(n: int):
    return jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def _plan_and_compile(step, args, mesh):
    auto = shardplan.auto(step, mesh=mesh, hardware=HARDWARE)
    plan = auto.plan(*args)
    return auto, plan, hlo.analyze(auto.lower(*args).compile())


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# -- convolutions (Alpa's test_conv.py) ---------------------------------------------------------


class DepthwiseConvNet(nn.Module):
    """Alpa's depthwise case: a 3x3 convolution to 8 x channel features, a depthwise 3x3
    convolution over them, a 3x3 convolution back to channel features, relu, batch norm."""

    channel: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8 * self.channel, (3, 3), use_bias=False)(x)
        x = nn.Conv(8 * self.channel, (3, 3), feature_group_count=8 * self.channel,
                    use_bias=False)(x)
        x = nn.Conv(self.channel, (3, 3), use_bias=False)(x)
        x = nn.relu(x)
        return nn.BatchNorm(use_running_average=not train)(x)


class ConvNet(nn.Module):
    """Alpa's n-layer case: (3x3 stride-2 convolution, batch norm, relu, 2x2 max pool) x n."""

    channel: int
    num_layers: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        for _ in range(self.num_layers):
            x = nn.Conv(self.channel, (3, 3), strides=(2, 2), use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train)(x)
            x = nn.relu(x)
            x = nn.max_pool(x, (2, 2), strides=(1, 1), padding="SAME")
        return x


def _conv_step(model, x, y):
    tx = optax.sgd(0.1, momentum=0.9)
    variables = model.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]

    def step(params, stats, opt_state, x, y):
        def loss(p):
            out, new = model.apply({"params": p, "batch_stats": stats}, x,
                                   mutable=["batch_stats"])
            return jnp.mean((out - y) ** 2), new["batch_stats"]
        (value, new_stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, value

    return step, (params, stats, tx.init(params), x, y)


def test_depthwise_conv_model_parallel_is_one_all_reduce():
    """Alpa's test_n_layer_depthwise_conv_model_parallel (batch 4, 8x8 images, 256
    channels): the batch does not divide the devices, so the channels are split through all
    three convolutions (and both gradients of each), and the step's one collective is the
    all-reduce of the last convolution's partial sums. Alpa: one all-reduce, nothing else."""
    batch, image, channel, n = 4, 8, 256, 8
    x = jnp.ones((batch, image, image, channel))
    step, args = _conv_step(DepthwiseConvNet(channel), x, x)
    _, plan, stats = _plan_and_compile(step, _abstract(args), _mesh(n))
    kernels = [tuple(plan.in_specs[f"[0]['Conv_{i}']['kernel']"]) for i in range(3)]
    # HWIO: output channels, the depthwise convolution's channels, input channels
    assert kernels == [(None, None, None, "x"), (None, None, None, "x"), (None, None, "x")]
    assert plan.estimate.comm_bytes == pytest.approx(stats.bytes_sent, rel=0.01)
    assert _counts(stats) == {"all-reduce": 1}, stats.summary()
    # the all-reduce of the last convolution's output, [batch, image, image, channel]
    assert stats.bytes_sent == pytest.approx(
        _ring("all-reduce", batch * image * image * channel * 4, n), rel=0.01)


def test_depthwise_conv_plan_runs_as_one_device():
    """The depthwise net's plan, run on 8 devices, computes what one device computes."""
    batch, image, channel = 4, 4, 16
    x = jax.random.normal(jax.random.key(1), (batch, image, image, channel))
    y = jax.random.normal(jax.random.key(2), x.shape)
    step, args = _conv_step(DepthwiseConvNet(channel), x, y)
    auto = shardplan.auto(step, mesh=_mesh(8), hardware=HARDWARE)
    got, want = auto(*args), jax.jit(step)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


@pytest.mark.xfail(strict=True, reason=(
    "priced otherwise: on the cpu profile (memory read at the links' bandwidth) the plan "
    "splits the input images' channels and all-reduces each stride-2 convolution's 4x smaller "
    "output rather than read the images whole: 4 all-reduces and 3 all-gathers, 1.74 MiB sent "
    "per device against Alpa's 3 all-reduces (0.44 MiB), and priced as compiled below the "
    "plan pinned to Alpa's layouts (images whole, kernels alternating output and input "
    "channels); on a100-80gb it runs replicated"))
def test_conv_model_parallel_all_reduces_between_layers():
    """Alpa's test_n_layer_conv_model_parallel (batch 8, 16x16 images, 256 channels, 4
    layers): the channels split, convolutions alternating between output and input
    channels. Alpa: num_layers - 1 all-reduces and nothing else (its solver priced the
    collectives alone, not reading an input whole)."""
    batch, image, channel, layers, n = 8, 16, 256, 4, 8
    x = jnp.ones((batch, image, image, channel))
    y = jnp.ones((batch, image >> layers, image >> layers, channel))
    step, args = _conv_step(ConvNet(channel, layers), x, y)
    _, _, stats = _plan_and_compile(step, _abstract(args), _mesh(n))
    counts = _counts(stats)
    assert set(counts) == {"all-reduce"}, stats.summary()
    assert counts["all-reduce"] <= layers - 1, stats.summary()


# -- mixture of experts (Alpa's test_moe.py, its model alpa/model/moe.py) -----------------------


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    seq: int
    group: int
    experts: int

    @property
    def ffn(self) -> int:
        return 4 * self.hidden


def _normal():
    return nn.initializers.normal(0.02)


def top2_gating(gates):
    """GShard's top-2 gating (Alpa's top2_gating, from lingvo): [G, S, E] gates ->
    combine weights and dispatch mask, [G, S, E, C] with capacity C = 2S/E."""
    _, s, e = gates.shape
    cap = 2 * s // e
    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, e, dtype=jnp.int32)
    gate_1 = jnp.einsum("GSE,GSE->GS", gates, mask_1)
    without_1 = gates * (1 - mask_1)
    index_2 = jnp.argmax(without_1, axis=-1)
    mask_2 = jax.nn.one_hot(index_2, e, dtype=jnp.int32)
    gate_2 = jnp.einsum("GSE,GSE->GS", without_1, mask_2)
    pos_1 = jnp.cumsum(mask_1, axis=-2) - mask_1
    mask_1 *= pos_1 < cap
    pos_1 = jnp.einsum("GSE,GSE->GS", pos_1, mask_1)
    mask_1_count = jnp.sum(mask_1, axis=-2)
    mask_1_flat = jnp.sum(mask_1, axis=-1)
    pos_2 = jnp.cumsum(mask_2, axis=-2) - mask_2 + jnp.expand_dims(mask_1_count, -2)
    mask_2 *= pos_2 < cap
    pos_2 = jnp.einsum("GSE,GSE->GS", pos_2, mask_2)
    mask_2_flat = jnp.sum(mask_2, axis=-1)
    gate_1 *= mask_1_flat
    gate_2 *= mask_2_flat
    denom = gate_1 + gate_2
    denom = jnp.where(denom > 0, denom, jnp.ones_like(denom))
    gate_1 /= denom
    gate_2 /= denom
    first = jnp.einsum("GSE,GSC->GSEC",
                       jnp.expand_dims(gate_1 * mask_1_flat, -1) * jax.nn.one_hot(index_1, e),
                       jax.nn.one_hot(pos_1, cap))
    second = jnp.einsum("GSE,GSC->GSEC",
                        jnp.expand_dims(gate_2 * mask_2_flat, -1) * jax.nn.one_hot(index_2, e),
                        jax.nn.one_hot(pos_2, cap))
    combined = first + second
    return combined, combined.astype(jnp.bool_)


class SelfAttention(nn.Module):
    """BERT's attention (Alpa's FlaxBertAttention): one qvk projection, softmax attention
    with the padding mask as a bias, an output projection, residual and layer norm."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, h, mask):
        cfg = self.cfg
        head_dim = cfg.hidden // cfg.heads
        qvk = nn.Dense(3 * cfg.hidden, kernel_init=_normal(), name="qvk_combined")(h)
        qvk = qvk.reshape(qvk.shape[:2] + (-1, 3))
        q, v, k = (t.reshape(h.shape[:2] + (cfg.heads, head_dim))
                   for t in jnp.split(qvk, 3, axis=3))
        mask = jnp.expand_dims(mask, axis=(-3, -2))
        bias = jax.lax.select(mask > 0, jnp.full(mask.shape, 0.0), jnp.full(mask.shape, -1e10))
        weights = nn.attention.dot_product_attention_weights(q, k, bias=bias)
        out = jnp.einsum("...hqk,...khd->...qhd", weights, v).reshape(h.shape)
        out = nn.Dense(cfg.hidden, kernel_init=_normal(), name="dense")(out)
        return nn.LayerNorm(epsilon=1e-12)(out + h)


class MoEMLP(nn.Module):
    """Alpa's FlaxPositionWiseMoELayer: top-2 routing of groups of S tokens to E experts,
    expert weights with a leading expert dimension."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        init = nn.initializers.lecun_normal()
        wg = self.param("wg", init, (cfg.hidden, cfg.experts))
        wi = self.param("wi", init, (cfg.experts, cfg.hidden, cfg.ffn))
        wo = self.param("wo", init, (cfg.experts, cfg.ffn, cfg.hidden))
        tokens = x.reshape(-1, cfg.group, cfg.hidden)
        gates = jax.nn.softmax(jnp.einsum("GSM,ME->GSE", tokens, wg))
        combined, dispatch = top2_gating(gates)
        dispatched = jnp.einsum("GSEC,GSM->EGCM", dispatch, tokens)
        h = nn.relu(jnp.einsum("EGCM,EMH->EGCH", dispatched, wi))
        expert_out = jnp.einsum("EGCH,EHM->GECM", h, wo)
        return jnp.einsum("GSEC,GECM->GSM", combined, expert_out).reshape(x.shape)


class MoELayer(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, h, mask):
        a = SelfAttention(self.cfg, name="attention")(h, mask)
        return nn.LayerNorm(epsilon=1e-12)(MoEMLP(self.cfg, name="moe")(a) + a)


class BertLayer(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, h, mask):
        a = SelfAttention(self.cfg, name="attention")(h, mask)
        i = nn.gelu(nn.Dense(self.cfg.ffn, kernel_init=_normal(), name="intermediate")(a),
                    approximate=False)
        o = nn.Dense(self.cfg.hidden, kernel_init=_normal(), name="output")(i)
        return nn.LayerNorm(epsilon=1e-12)(o + a)


class MoELM(nn.Module):
    """Alpa's FlaxMoEForLMModule: word and position embeddings, layers alternating MoE and
    BERT layers, logits from the tied word embedding plus a bias."""

    cfg: MoEConfig

    @nn.compact
    def __call__(self, input_ids, mask, position_ids):
        cfg = self.cfg
        words = nn.Embed(cfg.vocab, cfg.hidden, embedding_init=_normal(), name="word_embeddings")
        h = words(input_ids) + nn.Embed(cfg.seq, cfg.hidden, embedding_init=_normal(),
                                        name="position_embeddings")(position_ids)
        h = nn.LayerNorm(epsilon=1e-12)(h)
        for i in range(cfg.layers):
            layer = MoELayer if i % 2 == 0 else BertLayer
            h = layer(cfg, name=f"layer_{i}")(h, mask)
        bias = self.param("bias", nn.initializers.zeros, (cfg.vocab,))
        return words.attend(h) + bias


def _moe_lm_step(cfg: MoEConfig, batch: int, tx):
    model = MoELM(cfg)
    ids = jnp.ones((batch, cfg.seq), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, ids, ids))
    opt_state = jax.eval_shape(tx.init, params)

    def step(params, opt_state, input_ids, mask, position_ids, labels):
        def loss_fn(p):
            logits = model.apply(p, input_ids, mask, position_ids)
            label_mask = jnp.where(labels > 0, 1.0, 0.0)
            one_hot = jax.nn.one_hot(labels, logits.shape[-1])
            loss = -jnp.sum(one_hot * jax.nn.log_softmax(logits, axis=-1), axis=-1)
            return (label_mask * loss).sum() / label_mask.sum()
        grads = jax.grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    batch_arg = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    return step, (params, opt_state, *(batch_arg,) * 4)


ALPA_MOE = MoEConfig(vocab=32, hidden=64, layers=2, heads=16, seq=16, group=32, experts=16)


def _adafactor():
    """Alpa's optimizer for the MoE LM (weight decay masked off vectors; no decay rate)."""
    return optax.adafactor(learning_rate=1e-2, min_dim_size_to_factor=4,
                           weight_decay_mask=lambda tree: jax.tree.map(lambda x: x.ndim > 1,
                                                                        tree))


def test_moe_lm_all_to_alls_and_few_all_reduces():
    """Alpa's test_moe_lm (2 layers, batch 64, seq 16, hidden 64, 16 experts in groups of
    32 tokens, Adafactor): the experts split over the devices with 4 all-to-alls (dispatch
    and combine, forward and backward), and at most 4 other all-reduces: the gradients of
    the replicated weights are reduced together, not one all-reduce per parameter."""
    n = 8
    step, args = _moe_lm_step(ALPA_MOE, 64, _adafactor())
    _, plan, stats = _plan_and_compile(step, args, _mesh(n))
    counts = _counts(stats)
    assert counts.get("all-to-all") == 4, stats.summary()
    assert counts.get("all-reduce", 0) <= 4, stats.summary()
    assert set(counts) <= {"all-reduce", "all-to-all"}, stats.summary()
    # each all-to-all moves one device's share of the dispatched tokens, [E, G, C, M] with
    # capacity C = 2S/E: 2 x tokens x hidden values in all (Alpa's all_to_all_cost)
    dispatched = 2 * 64 * ALPA_MOE.seq * ALPA_MOE.hidden * 4
    for op in stats.collectives:
        if op.kind == "all-to-all":
            assert op.bytes_sent == pytest.approx(_ring("all-to-all", dispatched / n, n))
    assert plan.estimate.comm_bytes == pytest.approx(stats.bytes_sent, rel=0.02)
