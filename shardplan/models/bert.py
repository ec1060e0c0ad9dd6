"""BERT encoder (post-norm blocks, token-type embeddings) trained with a masked-LM loss."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from shardplan.models import base, layers

TC = layers.TransformerConfig


def _bert(hidden: int, num_layers: int, num_heads: int) -> TC:
    return TC(vocab_size=30522, seq_len=512, hidden=hidden, num_layers=num_layers,
              num_heads=num_heads, ffn_dim=4 * hidden, causal=False, pre_norm=False,
              norm_eps=1e-12)


SIZES = {
    "tiny": TC(causal=False, pre_norm=False, norm_eps=1e-12),
    "base": _bert(768, 12, 12),
    "large": _bert(1024, 24, 16),
    "megatron-3.9b": _bert(2560, 48, 40),
}

TYPE_VOCAB = 2
MASK_PROB = 0.15


class Bert(nn.Module):
    """Embeddings (word, position, token type) -> encoder blocks -> MLM head tied to `wte`."""

    cfg: layers.TransformerConfig

    @nn.compact
    def __call__(self, input_ids, token_type_ids, *, train: bool):
        c = self.cfg
        dtype, param_dtype = c.dtypes()
        init = nn.initializers.normal(c.init_std)
        embed = {"dtype": dtype, "param_dtype": param_dtype, "embedding_init": init}
        wte = nn.Embed(c.vocab_size, c.hidden, name="wte", **embed)
        t = input_ids.shape[1]
        x = (wte(input_ids) + nn.Embed(c.seq_len, c.hidden, name="wpe", **embed)(jnp.arange(t))
             + nn.Embed(TYPE_VOCAB, c.hidden, name="token_type", **embed)(token_type_ids))
        x = layers.make_norm(c, "ln_emb")(x)
        x = nn.Dropout(c.dropout_rate)(x, deterministic=not train)
        for i in range(c.num_layers):
            x = layers.Block(c, name=f"layer_{i}")(x, train=train)
        x = nn.Dense(c.hidden, dtype=dtype, param_dtype=param_dtype, kernel_init=init,
                     name="mlm_dense")(x)
        x = layers.make_norm(c, "mlm_ln")(nn.gelu(x))
        bias = self.param("lm_bias", nn.initializers.zeros, (c.vocab_size,), param_dtype)
        return wte.attend(x) + bias.astype(dtype)


def build(cfg: layers.TransformerConfig, *, abstract: bool, size: str) -> base.TrainStep:
    """fn(params, opt_state, batch, rng); the batch marks the masked positions in `weights`."""
    layers.require_unrolled(cfg, "bert")
    model = Bert(cfg)
    opt = base.make_optimizer(cfg)
    b, t = cfg.batch_size, cfg.seq_len
    ids = jnp.zeros((b, t), jnp.int32)

    def variables_fn(key):
        return model.init({"params": key}, ids, ids, train=False)

    def loss_fn(params, _all, batch, rng):
        logits = model.apply({"params": params}, batch["input_ids"], batch["token_type_ids"],
                             train=True, rngs={"dropout": rng})
        return base.cross_entropy(logits, batch["labels"], batch["weights"]), None

    params, opt_state = base.init_state(variables_fn, opt, abstract=abstract,
                                        init_std=cfg.init_std)
    batch = base.example_batch({"input_ids": ((b, t), jnp.int32, cfg.vocab_size),
                                "token_type_ids": ((b, t), jnp.int32, TYPE_VOCAB),
                                "labels": ((b, t), jnp.int32, cfg.vocab_size)},
                               abstract=abstract)
    batch["weights"] = _mlm_weights(b, t, abstract)
    desc = (f"BERT encoder, masked LM: {cfg.num_layers} layers, hidden {cfg.hidden}, "
            f"{cfg.num_heads} heads, ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}, seq "
            f"{cfg.seq_len}, batch {cfg.batch_size}, {cfg.dtype}")
    return base.TrainStep(
        name=f"bert-{size}", fn=base.make_train_step(loss_fn, opt, "bert"),
        args=(params, opt_state, batch, base.rng_arg(abstract=abstract)),
        state_argnums=(0, 1), batch_argnums=(2,), num_params=base.count_params(params),
        description=desc, config=cfg)


def _mlm_weights(b: int, t: int, abstract: bool):
    """1.0 at the ~15% of positions whose token the loss predicts, else 0.0."""
    if abstract:
        return jax.ShapeDtypeStruct((b, t), jnp.float32)
    rng = np.random.default_rng(3)
    return jnp.asarray((rng.random((b, t)) < MASK_PROB).astype(np.float32))
