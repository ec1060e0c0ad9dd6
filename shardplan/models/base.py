"""The TrainStep every zoo model builds, and the helpers the models share to build one. (The
zoo's registry, get_model by name and size, is shardplan.models.)"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A plain single-device train step with example arguments.

    `fn(params, opt_state, batch, *extra) -> (params, opt_state, loss)`; `args` are concrete
    arrays or, in abstract mode, jax.ShapeDtypeStruct pytrees. `num_params` counts trainable
    parameters only (not batch-norm statistics). `config` is the model's frozen config.
    """

    name: str
    fn: Callable
    args: tuple
    state_argnums: tuple[int, ...]
    batch_argnums: tuple[int, ...]
    num_params: int
    description: str
    config: Any = None

    @property
    def abstract(self) -> bool:
        """True when the example args are ShapeDtypeStructs (nothing was allocated)."""
        return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(self.args))


def count_params(tree) -> int:
    """Number of scalars in a pytree of arrays or ShapeDtypeStructs."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def as_dtype(name) -> jnp.dtype:
    """A dtype from a config string such as "float32" or "bfloat16"."""
    try:
        return jnp.dtype(name)
    except TypeError as e:
        raise ValueError(f"unknown dtype {name!r}: use a numpy name such as 'float32' or "
                         "'bfloat16'") from e


def resolve_config(model: str, sizes: Mapping[str, Any], size: str, batch_size: int | None,
                   overrides: Mapping[str, Any]):
    """The named size's config with `batch_size` and field overrides applied."""
    key = size.lower()
    if key not in sizes:
        raise ValueError(f"model {model!r} has no size {size!r}; known sizes: "
                         f"{', '.join(sizes)}")
    cfg = sizes[key]
    fields = {f.name for f in dataclasses.fields(cfg)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"model {model!r} has no config field(s) {unknown}; known fields: "
                         f"{', '.join(sorted(fields))}")
    changes = dict(overrides)
    if batch_size is not None:
        changes["batch_size"] = batch_size
    return dataclasses.replace(cfg, **changes)


OPTIMIZERS: dict[str, Callable[[Any], optax.GradientTransformation]] = {
    "adamw": lambda c: optax.adamw(c.learning_rate, weight_decay=c.weight_decay),
    # linear in the gradients: sharded and single-device updates agree to rounding, where
    # adam turns rounding noise in near-zero gradients into a sizeable fraction of a step
    "sgd": lambda c: optax.chain(optax.add_decayed_weights(c.weight_decay),
                                 optax.sgd(c.learning_rate, momentum=0.9)),
}


def make_optimizer(cfg) -> optax.GradientTransformation:
    """The config's optimizer (`cfg.optimizer`, adamw by default) with its rate and decay."""
    if cfg.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.optimizer!r}; use one of {sorted(OPTIMIZERS)}")
    return OPTIMIZERS[cfg.optimizer](cfg)


def init_state(variables_fn: Callable[[jax.Array], Any], optimizer: optax.GradientTransformation,
               *, abstract: bool, to_params: Callable = lambda v: v["params"],
               trainable: Callable = lambda p: p, init_std: float | None = None,
               seed: int = 0):
    """(params, opt_state) for `variables_fn(key)` (a flax `model.init`).

    The variables' shapes come from jax.eval_shape, so abstract mode allocates nothing.
    Concrete values are drawn on the host (see `host_init`) rather than by running the flax
    initialisers: compiling those costs seconds per model on CPU, drawing costs milliseconds.
    """
    shapes = to_params(jax.eval_shape(variables_fn, jax.random.PRNGKey(seed)))
    if abstract:
        return shapes, jax.eval_shape(optimizer.init, trainable(shapes))
    params = host_init(shapes, seed=seed, std=init_std)
    return params, optimizer.init(trainable(params))


def host_init(shapes, *, seed: int, std: float | None = None):
    """Deterministic numpy values for a pytree of ShapeDtypeStructs, by leaf name: biases,
    means and class tokens 0; scales and variances 1; everything else (kernels, embeddings,
    experts) normal with `std`, or 1/sqrt(fan_in) when std is None (LeCun normal)."""
    rng = np.random.default_rng(seed)
    zeros = {"bias", "lm_bias", "mean", "cls"}
    ones = {"scale", "var"}

    def leaf(path, x):
        name = str(getattr(path[-1], "key", getattr(path[-1], "name", path[-1])))
        if name in zeros or name in ones or len(x.shape) < 2:  # stacked (L, d) scales too
            value = np.ones(x.shape) if name in ones else np.zeros(x.shape)
        else:
            scale = std if std is not None else 1.0 / math.sqrt(math.prod(x.shape[:-1]))
            value = rng.standard_normal(x.shape) * scale
        return jnp.asarray(value.astype(np.float32), dtype=x.dtype)

    return jax.tree_util.tree_map_with_path(leaf, shapes)


def example_batch(specs: Mapping[str, tuple[tuple[int, ...], Any, int | None]], *,
                  abstract: bool, seed: int = 1) -> dict:
    """A deterministic batch: for each name, (shape, dtype, maxval): integers uniform in
    [0, maxval), floats standard normal, or a ShapeDtypeStruct in abstract mode."""
    out = {}
    rng = np.random.default_rng(seed)
    for name in sorted(specs):
        shape, dtype, maxval = specs[name]
        dtype = jnp.dtype(dtype)
        if abstract:
            out[name] = jax.ShapeDtypeStruct(shape, dtype)
        elif jnp.issubdtype(dtype, jnp.integer):
            out[name] = jnp.asarray(rng.integers(0, maxval, shape), dtype=dtype)
        else:
            out[name] = jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype=dtype)
    return out


def rng_arg(*, abstract: bool, seed: int = 2):
    """The dropout key passed as the step's extra argument (a raw uint32[2] key)."""
    key = jax.random.PRNGKey(seed)
    return jax.ShapeDtypeStruct(key.shape, key.dtype) if abstract else key


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, name: str,
                    *, trainable: Callable | None = None, merge: Callable | None = None,
                    value_and_grad: Callable | None = None):
    """fn(params, opt_state, batch, *extra) -> (params, opt_state, loss).

    `loss_fn(trainable_params, params, batch, *extra) -> (loss, aux)`. By default every param
    is trainable and aux is ignored; `trainable(params)` selects the optimised part (e.g.
    without batch-norm statistics) and `merge(params, new_trainable, aux)` builds the new state.
    `value_and_grad`: None for jax.value_and_grad, looked up when the step runs (as a step
    written by hand does, so that gradient accumulation can cut it), or
    shardplan.value_and_grad (the same outside the planner) for a step that shardplan may
    pipeline.
    """

    def train_step(params, opt_state, batch, *extra):
        train_params = trainable(params) if trainable else params
        vg = jax.value_and_grad if value_and_grad is None else value_and_grad
        (loss, aux), grads = vg(loss_fn, has_aux=True)(
            train_params, params, batch, *extra)
        updates, opt_state = optimizer.update(grads, opt_state, train_params)
        train_params = optax.apply_updates(train_params, updates)
        params = merge(params, train_params, aux) if merge else train_params
        return params, opt_state, loss

    # the HLO module is named after the function
    train_step.__name__ = train_step.__qualname__ = re.sub(r"\W", "_", f"{name}_train_step")
    return train_step


def cross_entropy(logits, labels, weights=None):
    """Mean softmax cross-entropy over (optionally weighted) integer labels, in float32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    if weights is None:
        return losses.mean()
    weights = weights.astype(jnp.float32)
    return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)
