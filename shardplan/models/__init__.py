"""The model zoo: train steps for planning, tests and benchmarks, by name and size.

    step = get_model("gpt", "6.7b", abstract=True)   # ShapeDtypeStruct args, nothing allocated
    params, opt_state, loss = jax.jit(step.fn)(*get_model("mlp").args)
"""

from __future__ import annotations

import importlib

from shardplan.models import base
from shardplan.models.base import TrainStep

# name -> (module, builder, sizes table); modules are imported on first use
_MODELS: dict[str, tuple[str, str, str]] = {
    "mlp": ("shardplan.models.mlp", "build", "SIZES"),
    "gpt": ("shardplan.models.gpt", "build", "GPT_SIZES"),
    "llama": ("shardplan.models.gpt", "build_llama", "LLAMA_SIZES"),
    "moe": ("shardplan.models.moe", "build", "SIZES"),
    "wresnet": ("shardplan.models.wresnet", "build", "SIZES"),
    "bert": ("shardplan.models.bert", "build", "SIZES"),
    "vit": ("shardplan.models.vit", "build", "SIZES"),
}


def list_models() -> list[str]:
    """Names get_model accepts."""
    return sorted(_MODELS)


def _entry(name: str):
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(list_models())}")
    module, builder, sizes = _MODELS[name]
    mod = importlib.import_module(module)
    return getattr(mod, builder), getattr(mod, sizes)


def list_sizes(name: str) -> list[str]:
    """The named sizes of a model ("tiny" first)."""
    return list(_entry(name)[1])


def get_config(name: str, size: str = "tiny", *, batch_size: int | None = None, **overrides):
    """The frozen config get_model would build, with the same overrides applied."""
    _, sizes = _entry(name)
    return base.resolve_config(name, sizes, size, batch_size, overrides)


def get_model(name: str, size: str = "tiny", *, abstract: bool = False,
              batch_size: int | None = None, **overrides) -> TrainStep:
    """A model's train step at a named size; `overrides` replace config fields (e.g.
    num_layers=4, dtype="bfloat16"). Abstract mode returns ShapeDtypeStruct args."""
    builder, _ = _entry(name)
    cfg = get_config(name, size, batch_size=batch_size, **overrides)
    return builder(cfg, abstract=abstract, size=size.lower())


__all__ = ["TrainStep", "get_config", "get_model", "list_models", "list_sizes"]
