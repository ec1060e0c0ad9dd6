"""Hand-written plans shardplan must beat: data parallel, FSDP (ZeRO-3), Megatron, 2-D.

Each baseline maps a TrainStep and a mesh to (in_shardings, out_shardings), pytrees of
NamedSharding matching the step's args and its outputs (state outputs as their inputs, the loss
replicated). Megatron's layout lives in an ordered rule table, regex on the parameter path ->
the dimension to split, first match wins (as maxtext's logical axis rules). A split that does not
divide falls back to replicated for that leaf, so every sharding returned is valid.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardplan import _compat
from shardplan.models.base import TrainStep

SplitRule = tuple[str, int | None]
"""(regex searched in the '/'-joined parameter path, dimension to split or None to replicate);
negative dimensions count from the end."""

MEGATRON_RULES: tuple[SplitRule, ...] = (
    # expert parallel: stacked expert weights split on their leading expert dimension
    (r"(^|/)experts/w[io]$", 0),
    # column parallel: split the output features (whole heads, as qkv is laid out heads-major)
    (r"(^|/)(qkv|query|key|value|fc_in|wi|up|gate)/(kernel|bias)$", -1),
    # row parallel: split the input features (counted from the end: a scanned model's
    # kernels are stacked on a leading layer dim); the bias is added after the all-reduce
    (r"(^|/)(out|fc_out|wo|down)/kernel$", -2),
    # vocab parallel embeddings and LM head
    (r"(^|/)wte/embedding$", 0),
    (r"(^|/)lm_head/kernel$", -1),
    (r"(^|/)lm_bias$", 0),
    (r".*", None),
)


def as_auto_mesh(mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with every axis of type Auto (make_mesh gives Explicit)."""
    return _compat.auto_mesh(mesh)


def path_str(path) -> str:
    """A pytree key path as 'a/b/0/c' (dict keys, attribute names and indices)."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _axes_entry(axes: Sequence[str]):
    return axes[0] if len(axes) == 1 else tuple(axes)


def _split(shape: Sequence[int], dim: int | None, axes: Sequence[str], mesh) -> PartitionSpec:
    """PartitionSpec splitting `dim` over `axes`, or replicated if it does not divide."""
    if dim is None or not axes or not shape:
        return PartitionSpec()
    dim = dim % len(shape)
    if shape[dim] % math.prod(mesh.shape[a] for a in axes):
        return PartitionSpec()
    return PartitionSpec(*([None] * dim), _axes_entry(axes))


def rule_spec(path: str, shape: Sequence[int], rules: Sequence[SplitRule], axes: Sequence[str],
              mesh) -> PartitionSpec:
    """The first rule whose regex matches `path` decides the split dimension."""
    for pattern, dim in rules:
        if re.search(pattern, path):
            return _split(shape, dim, axes, mesh)
    return PartitionSpec()


def largest_dim_spec(shape: Sequence[int], axes: Sequence[str], mesh) -> PartitionSpec:
    """Split the largest dimension divisible by the axes' size (the first of equal ones)."""
    n = math.prod(mesh.shape[a] for a in axes)
    dims = [d for d in range(len(shape)) if shape[d] % n == 0]
    if not dims:
        return PartitionSpec()
    return _split(shape, max(dims, key=lambda d: (shape[d], -d)), axes, mesh)


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)


def _common_suffix(a: Sequence[str], b: Sequence[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def follow_params(opt_state, params, param_specs, default: Callable) -> object:
    """Specs for the optimizer state: each leaf takes the spec of the parameter of the same shape
    whose path shares the longest suffix with the leaf's (mu/nu follow their parameter); leaves
    that match no parameter (step counts) get `default(path, shape)`."""
    flat, _ = _leaves(params)
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    by_shape: dict[tuple, list] = {}
    for (p, x), s in zip(flat, specs):
        by_shape.setdefault(tuple(x.shape), []).append((path_str(p).split("/"), s))

    def leaf(path, x):
        parts = path_str(path).split("/")
        best, spec = 0, None
        for pparts, s in by_shape.get(tuple(x.shape), ()):
            n = _common_suffix(parts, pparts)
            if n > best:
                best, spec = n, s
        return spec if spec is not None else default(path_str(path), tuple(x.shape))

    return jax.tree_util.tree_map_with_path(leaf, opt_state)


def _state_specs(step: TrainStep, param_spec: Callable[[str, tuple], PartitionSpec],
                 follow: bool) -> tuple:
    """Specs for the step's state args: params by `param_spec`; the optimizer state either
    follows its parameters (`follow`) or gets `param_spec` leaf by leaf."""
    params, opt_state = (step.args[i] for i in step.state_argnums)
    pspecs = jax.tree_util.tree_map_with_path(
        lambda p, x: param_spec(path_str(p), tuple(x.shape)), params)
    if follow:
        ospecs = follow_params(opt_state, params, pspecs, lambda p, s: PartitionSpec())
    else:
        ospecs = jax.tree_util.tree_map_with_path(
            lambda p, x: param_spec(path_str(p), tuple(x.shape)), opt_state)
    return pspecs, ospecs


def _assemble(step: TrainStep, mesh, state_specs: tuple, batch_axes: Sequence[str]):
    """in/out shardings from the state specs; the batch's leading dim split over batch_axes."""
    in_specs = []
    for i, arg in enumerate(step.args):
        if i in step.state_argnums:
            in_specs.append(state_specs[step.state_argnums.index(i)])
        elif i in step.batch_argnums:
            in_specs.append(jax.tree.map(lambda x: _split(x.shape, 0, batch_axes, mesh), arg))
        else:
            in_specs.append(jax.tree.map(lambda x: PartitionSpec(), arg))
    to_sharding = lambda spec: NamedSharding(mesh, spec)
    is_spec = lambda x: isinstance(x, PartitionSpec)
    in_shardings = tuple(jax.tree.map(to_sharding, s, is_leaf=is_spec) for s in in_specs)
    out_shardings = tuple(in_shardings[i] for i in step.state_argnums) + (
        NamedSharding(mesh, PartitionSpec()),)
    return in_shardings, out_shardings


def data_parallel(step: TrainStep, mesh):
    """Batch split over all mesh axes; params and optimizer state replicated."""
    mesh = as_auto_mesh(mesh)
    specs = _state_specs(step, lambda path, shape: PartitionSpec(), follow=False)
    return _assemble(step, mesh, specs, mesh.axis_names)


def fsdp(step: TrainStep, mesh):
    """ZeRO-3: batch split over all axes; every state leaf split over all axes on its largest
    dimension divisible by the device count (replicated if none is)."""
    mesh = as_auto_mesh(mesh)
    axes = tuple(mesh.axis_names)
    specs = _state_specs(step, lambda path, shape: largest_dim_spec(shape, axes, mesh),
                         follow=False)
    return _assemble(step, mesh, specs, axes)


def megatron(step: TrainStep, mesh, *, axis: str | None = None,
             rules: Sequence[SplitRule] = MEGATRON_RULES):
    """Tensor parallel over `axis` (the last by default) by the Megatron rule table; the
    optimizer state follows its parameters; the batch is replicated on `axis` and split over
    the other axes (so on a 2-D mesh this is also data parallel on the first)."""
    mesh = as_auto_mesh(mesh)
    axis = axis or mesh.axis_names[-1]
    if axis not in mesh.axis_names:
        raise ValueError(f"megatron: axis {axis!r} is not in the mesh axes {mesh.axis_names}")
    specs = _state_specs(step, lambda path, shape: rule_spec(path, shape, rules, (axis,), mesh),
                         follow=True)
    return _assemble(step, mesh, specs, [a for a in mesh.axis_names if a != axis])


def two_d(step: TrainStep, mesh):
    """On a 2-D mesh: data parallel on the first axis, Megatron on the second."""
    mesh = as_auto_mesh(mesh)
    if len(mesh.axis_names) != 2:
        raise ValueError(f"two_d needs a 2-D mesh, got axes {mesh.axis_names}; use megatron "
                         "or data_parallel on a 1-D mesh")
    return megatron(step, mesh, axis=mesh.axis_names[1])


BASELINES: dict[str, Callable] = {
    "data_parallel": data_parallel,
    "fsdp": fsdp,
    "megatron": megatron,
    "two_d": two_d,
}


def baseline_shardings(name: str, step: TrainStep, mesh, **options):
    """(in_shardings, out_shardings) of the named baseline for `step` on `mesh`."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINES)}")
    return BASELINES[name](step, mesh, **options)


def _megatron_splits_something(step: TrainStep, mesh, axis: str) -> bool:
    params = step.args[step.state_argnums[0]]
    return any(rule_spec(path_str(p), x.shape, MEGATRON_RULES, (axis,), mesh) != PartitionSpec()
               for p, x in _leaves(params)[0])


def applicable_baselines(step: TrainStep, mesh) -> list[str]:
    """The baselines that make sense for `step` on `mesh`: two_d on 2-D meshes (where it
    replaces megatron, which would be the same plan), megatron on 1-D meshes, and either only
    when the rule table splits some parameter of the model."""
    mesh = as_auto_mesh(mesh)
    names = ["data_parallel", "fsdp"]
    axis = mesh.axis_names[-1]
    if _megatron_splits_something(step, mesh, axis):
        names.append("two_d" if len(mesh.axis_names) == 2 else "megatron")
    return names


def compile_baseline(name: str, step: TrainStep, mesh, **options) -> jax.stages.Compiled:
    """The step compiled with the baseline's shardings (concrete or abstract args)."""
    in_shardings, out_shardings = baseline_shardings(name, step, mesh, **options)
    jitted = jax.jit(step.fn, in_shardings=in_shardings, out_shardings=out_shardings)
    return jitted.lower(*step.args).compile()
