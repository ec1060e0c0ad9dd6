"""GShard-style MoE language model: GPT decoder blocks, every other MLP a top-2 MoE layer.

Sizes follow Alpa's MoE benchmark (seq 1024, vocab 32000, 16 heads, expert MLP width 8 x hidden,
expert groups of 2048 tokens, capacity 2S/E); the experts' weights carry a leading expert dim.
mixtral-8x7b is MaxText's configs/models/mixtral-8x7b.yml on the Llama block (every layer a
top-2 MoE of 8 SwiGLU experts, grouped-query attention), routed GShard-style with a capacity
(MaxText's capacity_factor, its token-dropping mode).
"""

from __future__ import annotations

from shardplan.models import base, gpt, layers

TC = layers.TransformerConfig


def _alpa(hidden: int, num_layers: int, num_experts: int) -> TC:
    return TC(vocab_size=32000, seq_len=1024, hidden=hidden, num_layers=num_layers,
              num_heads=16, ffn_dim=8 * hidden, num_experts=num_experts,
              expert_group_size=2048, capacity_factor=1.0)


def _mixtral() -> TC:
    return TC(vocab_size=32000, seq_len=2048, hidden=4096, num_layers=32, num_heads=32,
              num_kv_heads=8, ffn_dim=14336, fused_qkv=False, use_bias=False, position="rope",
              tied_embeddings=False, norm="rms", norm_eps=1e-5, mlp="swiglu", dropout_rate=0.0,
              num_experts=8, moe_every=1, expert_group_size=2048, capacity_factor=1.25)


SIZES = {
    "tiny": TC(ffn_dim=128, num_experts=8, expert_group_size=16, capacity_factor=2.0),
    "380m": _alpa(768, 8, 8),
    "690m": _alpa(768, 8, 16),
    "1.3b": _alpa(768, 16, 16),
    "2.4b": _alpa(1024, 16, 16),
    "10b": _alpa(1536, 16, 32),
    "27b": _alpa(2048, 16, 48),
    "70b": _alpa(2048, 32, 64),
    "mixtral-8x7b": _mixtral(),
}


def build(cfg: layers.TransformerConfig, *, abstract: bool, size: str) -> base.TrainStep:
    if cfg.num_experts < 1:
        raise ValueError("moe needs num_experts >= 1; for a dense model use 'gpt'")
    desc = (f"GShard MoE decoder: {cfg.num_layers} layers (MoE every {cfg.moe_every}), "
            f"{cfg.num_experts} experts, top-2, group {cfg.expert_group_size}, hidden "
            f"{cfg.hidden}, expert ffn {cfg.ffn_dim}, vocab {cfg.vocab_size}, seq {cfg.seq_len}, "
            f"batch {cfg.batch_size}, {cfg.dtype}")
    return gpt.build_lm(f"moe-{size}", cfg, abstract=abstract, description=desc)
