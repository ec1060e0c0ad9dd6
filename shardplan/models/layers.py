"""Transformer building blocks shared by the zoo: attention, MLPs, a GShard MoE layer, a block.

Module names are the contract with shardplan.baselines: attention projections are `qkv` (fused,
laid out heads-major so a column split keeps whole heads) or `query`/`key`/`value`, then `out`;
MLPs are `fc_in`/`fc_out` or `gate`/`up`/`down`; MoE layers have a `router` and `experts`
holding `wi` (E, d, f) and `wo` (E, f, d).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from shardplan.models import base


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters of the zoo's transformer models (gpt, llama, moe, bert, vit)."""

    vocab_size: int = 256
    seq_len: int = 16
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention, each shared by num_heads / num_kv_heads query
    heads; needs fused_qkv=False); None means num_heads."""
    ffn_dim: int = 256
    """Inner width of the MLP (of each expert for MoE layers)."""
    fused_qkv: bool = True
    use_bias: bool = True
    causal: bool = True
    position: str = "learned"
    """"learned" (a `wpe` table), "rope" (rotary on q and k) or "none"."""
    tied_embeddings: bool = True
    norm: str = "layer"
    """"layer" (LayerNorm) or "rms" (RMSNorm)."""
    norm_eps: float = 1e-5
    mlp: str = "gelu"
    """"gelu" or "relu" (fc_in/fc_out) or "swiglu" (gate/up/down)."""
    pre_norm: bool = True
    dropout_rate: float = 0.1
    num_experts: int = 0
    """0 for a dense model; else every `moe_every`-th layer (1, 3, ... for 2) is a MoE layer
    (every layer for 1, as Mixtral). The experts' MLP is SwiGLU where `mlp` is "swiglu" (`wi`
    then holds the gate and up kernels, (E, d, 2, f)), else ReLU."""
    moe_every: int = 2
    expert_group_size: int = 2048
    """Tokens per routing group (GShard's S); the batch's tokens must divide into groups."""
    capacity_factor: float = 1.0
    """Expert capacity C = ceil(capacity_factor * 2 * S / E) tokens per group."""
    aux_loss_coef: float = 0.01
    batch_size: int = 8
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    optimizer: str = "adamw"
    """"adamw", or "sgd" (momentum 0.9: linear in the gradients, for exact comparisons)."""
    dtype: str = "float32"
    """Compute dtype."""
    param_dtype: str | None = None
    """Parameter dtype; None means the compute dtype."""
    init_std: float = 0.02
    scan_layers: bool = False
    """gpt and llama: stack the layers' parameters (leading layer dimension) and run one block
    with `nn.scan` (MaxText's layout, params under `layers`); False: `layer_0`, `layer_1`, ..."""
    remat: bool | None = None
    """Recompute each block's activations in the backward pass (`nn.remat`); None means
    `scan_layers` (MaxText's default: remat when scanning)."""
    attention_chunk: int | None = None
    """Queries per chunk of the attention: a scan over chunks of the queries, each against all
    keys and recomputed in the backward pass (`jax.checkpoint`), so one chunk's scores
    [b, heads, chunk, t] are held at a time where None holds [b, heads, t, t] (MaxText's
    splash attention holds no [t, t] scores either). Needs dropout_rate=0."""
    # vit only
    image_size: int = 32
    patch_size: int = 8
    num_classes: int = 16

    def __post_init__(self):
        for field, allowed in (("position", ("learned", "rope", "none")),
                               ("norm", ("layer", "rms")), ("mlp", ("gelu", "relu", "swiglu"))):
            if getattr(self, field) not in allowed:
                raise ValueError(f"unknown {field} {getattr(self, field)!r}; use one of {allowed}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads="
                             f"{self.num_heads}; change one of them")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not divisible by num_kv_heads="
                             f"{self.num_kv_heads}; change one of them")
        if self.kv_heads != self.num_heads and self.fused_qkv:
            raise ValueError("grouped-query attention (num_kv_heads < num_heads) needs "
                             "fused_qkv=False")
        chunk = self.attention_chunk
        if chunk is not None and (chunk <= 0 or self.seq_len % chunk):
            raise ValueError(f"attention_chunk={chunk} does not divide seq_len={self.seq_len}; "
                             "use a divisor of it, or None for the whole attention at once")
        if chunk is not None and self.dropout_rate > 0:
            raise ValueError(f"attention_chunk needs dropout_rate=0 (it is {self.dropout_rate}); "
                             "set dropout_rate to 0 or attention_chunk to None")
        moe = [i for i in range(self.num_layers) if self.is_moe_layer(i)]
        if self.scan_layers and moe and len(moe) < self.num_layers:
            raise ValueError(
                f"scan_layers needs identical layers, but layers {moe} are MoE layers "
                f"(num_experts={self.num_experts}, moe_every={self.moe_every}) and the others "
                "dense; use scan_layers=False, or moe_every=1 (every layer MoE)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i % self.moe_every == self.moe_every - 1

    def dtypes(self) -> tuple[jnp.dtype, jnp.dtype]:
        """(compute dtype, parameter dtype)."""
        return base.as_dtype(self.dtype), base.as_dtype(self.param_dtype or self.dtype)


def _dense(cfg: TransformerConfig, features: int, name: str, use_bias: bool | None = None):
    dtype, param_dtype = cfg.dtypes()
    return nn.Dense(features, use_bias=cfg.use_bias if use_bias is None else use_bias,
                    dtype=dtype, param_dtype=param_dtype,
                    kernel_init=nn.initializers.normal(cfg.init_std), name=name)


def make_norm(cfg: TransformerConfig, name: str) -> nn.Module:
    dtype, param_dtype = cfg.dtypes()
    kinds = {
        "layer": functools.partial(nn.LayerNorm, use_bias=cfg.use_bias),
        "rms": nn.RMSNorm,
    }
    return kinds[cfg.norm](epsilon=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                           name=name)


def rotary(x, base_freq: float = 10000.0):
    """Rotary position embedding of x (batch, seq, heads, head_dim), rotate-half form."""
    t, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (base_freq ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.arange(t, dtype=jnp.float32)[:, None] * inv[None, :]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rot = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rot * sin).astype(x.dtype)


def chunked_attention(q, k, v, chunk: int, *, causal: bool):
    """softmax(q k^T / sqrt(d)) v of q (batch, seq, heads, head_dim) and k, v (batch, seq,
    kv_heads, head_dim; each key/value head serves heads // kv_heads query heads, as
    jnp.repeat lays them out), `chunk` queries at a time: a scan over the chunks, each
    rematerialized, so its scores (batch, kv_heads, group, chunk, seq) are the largest buffer
    in the forward and the backward pass; keys and values are not repeated (MaxText's
    grouped-query attention neither). Equal to the whole attention
    (tests/test_models_scan.py::test_chunked_attention_equals_the_whole)."""
    b, t, n, d = q.shape
    kv = k.shape[2]
    chunks = jnp.moveaxis(q.reshape(b, t // chunk, chunk, kv, n // kv, d), 1, 0)

    @jax.checkpoint
    def one(q_i, start):
        scores = jnp.einsum("bqkgd,btkd->bkgqt", q_i, k).astype(jnp.float32) / math.sqrt(d)
        if causal:
            scores = _causal(scores, start)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        return jnp.einsum("bkgqt,btkd->bqkgd", probs, v)

    _, ys = jax.lax.scan(lambda start, q_i: (start + chunk, one(q_i, start)), jnp.int32(0),
                         chunks)
    return jnp.moveaxis(ys, 0, 1).reshape(b, t, n, d)


def _causal_mask(shape, start):
    """Whether query row start + i may see key j, for scores of `shape` (..., rows, keys)."""
    rows = start + jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 2)
    return rows >= jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)


@jax.custom_vjp
def _causal(scores, start):
    """scores with the keys after each query row (row i is query start + i) masked out. Its
    backward pass recomputes the mask from `start`: differentiated as jnp.where, JAX keeps
    the mask broadcast to the scores' shape for the backward pass, one [b, heads, chunk, t]
    array per chunk and layer (the TPU compiler held all of a layer's at once)."""
    return jnp.where(_causal_mask(scores.shape, start), scores, jnp.finfo(scores.dtype).min)


def _causal_fwd(scores, start):
    return _causal(scores, start), start


def _causal_bwd(start, g):
    return jnp.where(_causal_mask(g.shape, start), g, 0), None


_causal.defvjp(_causal_fwd, _causal_bwd)


class Attention(nn.Module):
    """Multi-head self-attention; causal for decoders, full for encoders."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x, *, train: bool):
        c = self.cfg
        b, t, h = x.shape
        n, d = c.num_heads, c.head_dim
        if c.fused_qkv:
            # heads-major (n, 3, d): a column split of the 3h outputs keeps whole heads
            qkv = _dense(c, 3 * h, "qkv")(x).reshape(b, t, n, 3, d)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q = _dense(c, h, "query")(x).reshape(b, t, n, d)
            kv = c.kv_heads
            k, v = (_dense(c, kv * d, nm)(x).reshape(b, t, kv, d) for nm in ("key", "value"))
        chunked = c.attention_chunk is not None and c.attention_chunk < t
        if k.shape[2] < n and not chunked:
            # grouped-query attention: each key/value head serves n // kv query heads
            k, v = (jnp.repeat(y, n // k.shape[2], axis=2) for y in (k, v))
        if c.position == "rope":
            q, k = rotary(q), rotary(k)
        if chunked:
            y = chunked_attention(q, k, v, c.attention_chunk, causal=c.causal)
            return _dense(c, h, "out")(y.reshape(b, t, h))
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / math.sqrt(d)
        if c.causal:
            mask = jnp.tril(jnp.ones((t, t), dtype=bool))
            scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        probs = nn.Dropout(c.dropout_rate)(probs, deterministic=not train)
        y = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(b, t, h)
        return _dense(c, h, "out")(y)


class Mlp(nn.Module):
    """The position-wise MLP: fc_in -> activation -> fc_out, or SwiGLU gate/up -> down."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        h = x.shape[-1]
        if c.mlp == "swiglu":
            y = nn.silu(_dense(c, c.ffn_dim, "gate")(x)) * _dense(c, c.ffn_dim, "up")(x)
            return _dense(c, h, "down")(y)
        acts = {"gelu": nn.gelu, "relu": nn.relu}
        return _dense(c, h, "fc_out")(acts[c.mlp](_dense(c, c.ffn_dim, "fc_in")(x)))


def top2_gating(gates, capacity: int):
    """GShard top-2 routing with capacity. gates (G, S, E) -> combine weights (G, S, E, C),
    dispatch mask (G, S, E, C) and the load-balancing auxiliary loss."""
    num_experts = gates.shape[-1]
    idx1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(idx1, num_experts, dtype=gates.dtype)
    gates_rest = gates * (1.0 - mask1)
    idx2 = jnp.argmax(gates_rest, axis=-1)
    mask2 = jax.nn.one_hot(idx2, num_experts, dtype=gates.dtype)
    # load balance (GShard eq. 4): fraction of tokens sent first to each expert times its
    # mean gate, scaled so that a uniform router gives 1
    aux = jnp.mean(jnp.mean(mask1, axis=1) * jnp.mean(gates, axis=1)) * num_experts**2
    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = gate1 + gate2 + 1e-9
    gate1, gate2 = gate1 / denom, gate2 / denom
    # position of each token in its expert's buffer; tokens past the capacity are dropped
    pos1 = jnp.cumsum(mask1, axis=1) - mask1
    mask1 = mask1 * (pos1 < capacity)
    pos2 = jnp.cumsum(mask2, axis=1) - mask2 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < capacity)
    combine = 0.0
    for gate, mask, pos in ((gate1, mask1, pos1), (gate2, mask2, pos2)):
        slot = jax.nn.one_hot(jnp.sum(pos * mask, axis=-1).astype(jnp.int32), capacity,
                              dtype=gates.dtype)
        combine = combine + jnp.einsum("gs,gse,gsc->gsec", gate, mask, slot)
    dispatch = (combine > 0).astype(gates.dtype)
    return combine, dispatch, aux


class Experts(nn.Module):
    """E expert MLPs as two stacked weights with a leading expert dimension."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, expert_in):  # (E, G, C, M)
        c = self.cfg
        _, param_dtype = c.dtypes()
        m = expert_in.shape[-1]
        init = nn.initializers.normal(c.init_std)
        wo = self.param("wo", init, (c.num_experts, c.ffn_dim, m), param_dtype)
        if c.mlp == "swiglu":
            wi = self.param("wi", init, (c.num_experts, m, 2, c.ffn_dim), param_dtype)
            gu = jnp.einsum("egcm,emkf->egckf", expert_in, wi.astype(expert_in.dtype))
            h = nn.silu(gu[..., 0, :]) * gu[..., 1, :]
        else:
            wi = self.param("wi", init, (c.num_experts, m, c.ffn_dim), param_dtype)
            h = nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, wi.astype(expert_in.dtype)))
        return jnp.einsum("egcf,efm->egcm", h, wo.astype(expert_in.dtype))


class MoeMlp(nn.Module):
    """GShard MoE layer: route groups of S tokens top-2 to E experts, einsum dispatch/combine."""

    cfg: TransformerConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        b, t, m = x.shape
        tokens = b * t
        group = min(c.expert_group_size, tokens)
        if tokens % group:
            raise ValueError(f"MoE: batch*seq_len={tokens} tokens do not divide into groups of "
                             f"expert_group_size={c.expert_group_size}; change one of them")
        e = c.num_experts
        capacity = max(1, math.ceil(c.capacity_factor * 2 * group / e))
        xs = x.reshape(tokens // group, group, m)
        logits = _dense(c, e, "router", use_bias=False)(xs).astype(jnp.float32)
        combine, dispatch, aux = top2_gating(jax.nn.softmax(logits, axis=-1), capacity)
        self.sow("intermediates", "aux_loss", aux)
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), xs)
        expert_out = Experts(c, name="experts")(expert_in)
        y = jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), expert_out)
        return y.reshape(b, t, m)


class Block(nn.Module):
    """A transformer layer: attention then MLP (or MoE), pre- or post-norm, with dropout."""

    cfg: TransformerConfig
    moe: bool = False

    @nn.compact
    def __call__(self, x, *, train: bool):
        c = self.cfg
        drop = functools.partial(nn.Dropout(c.dropout_rate), deterministic=not train)
        mlp = MoeMlp(c, name="mlp") if self.moe else Mlp(c, name="mlp")
        attn = Attention(c, name="attn")
        if c.pre_norm:
            x = x + drop(attn(make_norm(c, "ln_1")(x), train=train))
            return x + drop(mlp(make_norm(c, "ln_2")(x)))
        x = make_norm(c, "ln_1")(x + drop(attn(x, train=train)))
        return make_norm(c, "ln_2")(x + drop(mlp(x)))


class ScannedBlock(Block):
    """Block as an `nn.scan` body: the carry is x, `train` is a static attribute, no output."""

    train: bool = False

    @nn.compact
    def __call__(self, x, _):
        return super().__call__(x, train=self.train), None


def require_unrolled(cfg: TransformerConfig, model: str) -> None:
    """For the models that build their blocks unrolled only (bert, vit)."""
    if cfg.scan_layers or cfg.remat:
        raise ValueError(f"{model} does not support scan_layers or remat; gpt and llama do")


def decoder_layers(cfg: TransformerConfig, x, *, train: bool):
    """The config's `num_layers` blocks applied to x, from inside a compact method: unrolled
    (`layer_0`, `layer_1`, ...) or, with `scan_layers`, one block scanned over parameters
    stacked on a leading layer dimension (`layers`), each block rematerialised if `remat`."""
    remat = cfg.scan_layers if cfg.remat is None else cfg.remat
    if not cfg.scan_layers:
        for i in range(cfg.num_layers):
            moe, name = cfg.is_moe_layer(i), f"layer_{i}"
            if remat:  # `train` as an attribute: remat traces its arguments
                x, _ = nn.remat(ScannedBlock)(cfg, moe=moe, train=train, name=name)(x, None)
            else:
                x = Block(cfg, moe=moe, name=name)(x, train=train)
        return x
    # MaxText's layout; inside a scan, CSE cannot merge the recomputation across iterations
    body = nn.remat(ScannedBlock, prevent_cse=False) if remat else ScannedBlock
    stack = nn.scan(body, variable_axes={"params": 0, "intermediates": 0},
                    split_rngs={"params": True, "dropout": True}, length=cfg.num_layers)
    x, _ = stack(cfg, moe=cfg.is_moe_layer(0), train=train, name="layers")(x, None)
    return x


def aux_loss(state) -> jax.Array:
    """Sum of the MoE auxiliary losses sown into the `intermediates` collection (a scan's
    stacked on its layer dimension)."""
    leaves = jax.tree.leaves(state.get("intermediates", {}))
    return sum((jnp.sum(x) if x.ndim else x for x in leaves), jnp.zeros((), jnp.float32))
