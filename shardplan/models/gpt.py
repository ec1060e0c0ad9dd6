"""GPT decoder (Megatron-style blocks) and its Llama variant, as causal language models.

Sizes: GPT-2 (gpt2-*), the GPT-3 family Alpa and Megatron benchmark (350m ... 76b, vocab 51200,
seq 1024, tied embeddings) and Llama (RMSNorm, SwiGLU, no biases, rotary, untied head; Llama 2
as MaxText's model configs, grouped-query attention in the 70B).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from shardplan.models import base, layers

TC = layers.TransformerConfig


def _gpt3(hidden: int, num_layers: int, num_heads: int) -> TC:
    return TC(vocab_size=51200, seq_len=1024, hidden=hidden, num_layers=num_layers,
              num_heads=num_heads, ffn_dim=4 * hidden)


def _gpt2(hidden: int, num_layers: int, num_heads: int) -> TC:
    return TC(vocab_size=50257, seq_len=1024, hidden=hidden, num_layers=num_layers,
              num_heads=num_heads, ffn_dim=4 * hidden)


def _llama(hidden: int, num_layers: int, num_heads: int, ffn_dim: int, seq_len: int = 2048,
           vocab_size: int = 32000, num_kv_heads: int | None = None,
           norm_eps: float = 1e-6) -> TC:
    return TC(vocab_size=vocab_size, seq_len=seq_len, hidden=hidden, num_layers=num_layers,
              num_heads=num_heads, num_kv_heads=num_kv_heads, ffn_dim=ffn_dim, fused_qkv=False,
              use_bias=False, position="rope", tied_embeddings=False, norm="rms",
              norm_eps=norm_eps, mlp="swiglu", dropout_rate=0.0)


LLAMA_SIZES = {
    "tiny": _llama(64, 2, 8, 128, seq_len=16, vocab_size=256),
    "7b": _llama(4096, 32, 32, 11008),
    "13b": _llama(5120, 40, 40, 13824),
    "65b": _llama(8192, 80, 64, 22016),
    # MaxText's configs/models/llama2-7b.yml and llama2-70b.yml (grouped-query attention with
    # 8 key/value heads in the 70B)
    "llama2-7b": _llama(4096, 32, 32, 11008, norm_eps=1e-5),
    "llama2-70b": _llama(8192, 80, 64, 28672, num_kv_heads=8, norm_eps=1e-5),
}

GPT_SIZES = {
    "tiny": TC(),
    "gpt2-124m": _gpt2(768, 12, 12),
    "gpt2-355m": _gpt2(1024, 24, 16),
    "gpt2-774m": _gpt2(1280, 36, 20),
    "gpt2-1.5b": _gpt2(1600, 48, 25),
    "350m": _gpt3(1024, 24, 16),
    "760m": _gpt3(1536, 24, 16),
    "1.3b": _gpt3(2048, 24, 32),
    "2.6b": _gpt3(2560, 32, 32),
    "6.7b": _gpt3(4096, 32, 32),
    "15b": _gpt3(5120, 48, 40),
    "39b": _gpt3(8192, 48, 64),
    "76b": _gpt3(10240, 60, 80),
    **{f"llama-{k}": v for k, v in LLAMA_SIZES.items()},
}


class GPT(nn.Module):
    """Token (+ position) embedding, decoder blocks, final norm, tied or untied LM head."""

    cfg: layers.TransformerConfig

    @nn.compact
    def __call__(self, input_ids, *, train: bool):
        c = self.cfg
        dtype, param_dtype = c.dtypes()
        init = nn.initializers.normal(c.init_std)
        wte = nn.Embed(c.vocab_size, c.hidden, dtype=dtype, param_dtype=param_dtype,
                       embedding_init=init, name="wte")
        x = wte(input_ids)
        if c.position == "learned":
            t = input_ids.shape[1]
            wpe = nn.Embed(c.seq_len, c.hidden, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=init, name="wpe")
            x = x + wpe(jnp.arange(t))[None]
        x = nn.Dropout(c.dropout_rate)(x, deterministic=not train)
        x = layers.decoder_layers(c, x, train=train)
        x = layers.make_norm(c, "ln_f")(x)
        if c.tied_embeddings:
            return wte.attend(x)
        return nn.Dense(c.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                        kernel_init=init, name="lm_head")(x)


def build_lm(model_name: str, cfg: layers.TransformerConfig, *, abstract: bool,
             description: str) -> base.TrainStep:
    """A causal-LM train step: fn(params, opt_state, batch, rng), batch = input_ids, labels."""
    model = GPT(cfg)
    opt = base.make_optimizer(cfg)
    b, t = cfg.batch_size, cfg.seq_len
    ids = jnp.zeros((b, t), jnp.int32)

    def variables_fn(key):
        return model.init({"params": key}, ids, train=False)

    def loss_fn(params, _all, batch, rng):
        logits, state = model.apply({"params": params}, batch["input_ids"], train=True,
                                    rngs={"dropout": rng}, mutable=["intermediates"])
        loss = base.cross_entropy(logits, batch["labels"])
        return loss + cfg.aux_loss_coef * layers.aux_loss(state), None

    params, opt_state = base.init_state(variables_fn, opt, abstract=abstract,
                                        init_std=cfg.init_std)
    batch = base.example_batch({"input_ids": ((b, t), jnp.int32, cfg.vocab_size),
                                "labels": ((b, t), jnp.int32, cfg.vocab_size)},
                               abstract=abstract)
    fn = base.make_train_step(loss_fn, opt, model_name)
    return base.TrainStep(
        name=model_name, fn=fn, args=(params, opt_state, batch, base.rng_arg(abstract=abstract)),
        state_argnums=(0, 1), batch_argnums=(2,), num_params=base.count_params(params),
        description=description, config=cfg)


def _describe(kind: str, cfg: layers.TransformerConfig) -> str:
    return (f"{kind}: {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.num_heads} heads, "
            f"ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}, seq {cfg.seq_len}, "
            f"batch {cfg.batch_size}, {cfg.dtype}")


def build(cfg: layers.TransformerConfig, *, abstract: bool, size: str) -> base.TrainStep:
    kind = "Llama decoder" if cfg.mlp == "swiglu" else "GPT decoder"
    return build_lm(f"gpt-{size}", cfg, abstract=abstract, description=_describe(kind, cfg))


def build_llama(cfg: layers.TransformerConfig, *, abstract: bool, size: str) -> base.TrainStep:
    return build_lm(f"llama-{size}", cfg, abstract=abstract,
                    description=_describe("Llama decoder", cfg))
