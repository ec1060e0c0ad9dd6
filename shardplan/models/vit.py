"""Vision Transformer: patch embedding, class token, pre-norm encoder blocks, linear head."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from shardplan.models import base, layers

TC = layers.TransformerConfig


def _vit(hidden: int, num_layers: int, num_heads: int, patch: int) -> TC:
    return TC(hidden=hidden, num_layers=num_layers, num_heads=num_heads, ffn_dim=4 * hidden,
              causal=False, dropout_rate=0.0, image_size=224, patch_size=patch,
              num_classes=1000, norm_eps=1e-6)


SIZES = {
    "tiny": TC(causal=False, dropout_rate=0.0, image_size=32, patch_size=8, num_classes=16),
    "b16": _vit(768, 12, 12, 16),
    "l16": _vit(1024, 24, 16, 16),
    "h14": _vit(1280, 32, 16, 14),
}


class ViT(nn.Module):
    """Images (B, H, W, 3) -> logits (B, num_classes) from the class token."""

    cfg: layers.TransformerConfig

    @nn.compact
    def __call__(self, images, *, train: bool):
        c = self.cfg
        dtype, param_dtype = c.dtypes()
        p = c.patch_size
        x = nn.Conv(c.hidden, (p, p), strides=(p, p), padding="VALID", dtype=dtype,
                    param_dtype=param_dtype, name="patch_embed")(images.astype(dtype))
        b = x.shape[0]
        x = x.reshape(b, -1, c.hidden)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c.hidden), param_dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, c.hidden)), x], axis=1)
        wpe = self.param("wpe", nn.initializers.normal(c.init_std), (1, x.shape[1], c.hidden),
                         param_dtype)
        x = nn.Dropout(c.dropout_rate)(x + wpe.astype(dtype), deterministic=not train)
        for i in range(c.num_layers):
            x = layers.Block(c, name=f"layer_{i}")(x, train=train)
        x = layers.make_norm(c, "ln_f")(x[:, 0])
        return nn.Dense(c.num_classes, dtype=dtype, param_dtype=param_dtype,
                        kernel_init=nn.initializers.zeros, name="head")(x)


def build(cfg: layers.TransformerConfig, *, abstract: bool, size: str) -> base.TrainStep:
    """fn(params, opt_state, batch, rng); batch = images (B, I, I, 3) and labels (B,)."""
    layers.require_unrolled(cfg, "vit")
    if cfg.image_size % cfg.patch_size:
        raise ValueError(f"image_size={cfg.image_size} is not divisible by patch_size="
                         f"{cfg.patch_size}")
    model = ViT(cfg)
    opt = base.make_optimizer(cfg)
    b, i = cfg.batch_size, cfg.image_size
    images = jnp.zeros((b, i, i, 3), jnp.float32)

    def variables_fn(key):
        return model.init({"params": key}, images, train=False)

    def loss_fn(params, _all, batch, rng):
        logits = model.apply({"params": params}, batch["images"], train=True,
                             rngs={"dropout": rng})
        return base.cross_entropy(logits, batch["labels"]), None

    params, opt_state = base.init_state(variables_fn, opt, abstract=abstract,
                                        init_std=cfg.init_std)
    batch = base.example_batch({"images": ((b, i, i, 3), jnp.float32, None),
                                "labels": ((b,), jnp.int32, cfg.num_classes)},
                               abstract=abstract)
    desc = (f"ViT: {cfg.num_layers} layers, hidden {cfg.hidden}, {cfg.num_heads} heads, "
            f"patch {cfg.patch_size}, image {cfg.image_size}, {cfg.num_classes} classes, "
            f"batch {cfg.batch_size}, {cfg.dtype}")
    return base.TrainStep(
        name=f"vit-{size}", fn=base.make_train_step(loss_fn, opt, "vit"),
        args=(params, opt_state, batch, base.rng_arg(abstract=abstract)),
        state_argnums=(0, 1), batch_argnums=(2,), num_params=base.count_params(params),
        description=desc, config=cfg)
