"""Hand-written plans shardplan must beat: data parallel, FSDP (ZeRO-3), Megatron, 2-D.

Each baseline maps a TrainStep and a mesh to (in_shardings, out_shardings), pytrees of
NamedSharding matching the step's args and its outputs (state outputs as their inputs, the loss
replicated). The plans themselves are the expert tables of shardplan.intra.experts (the same
specs the planner is seeded with); this module lays them out over a TrainStep's pytrees.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from shardplan import _compat
from shardplan.intra import experts
from shardplan.intra.experts import MEGATRON_RULES, SplitRule
from shardplan.ir.graph import Role
from shardplan.models.base import TrainStep
from shardplan.options import path_str
from shardplan.strategies.spec import MeshShape

__all__ = ["BASELINES", "MEGATRON_RULES", "SplitRule", "applicable_baselines", "as_auto_mesh",
           "baseline_shardings", "compile_baseline", "data_parallel", "fsdp", "megatron",
           "path_str", "two_d"]


def as_auto_mesh(mesh) -> jax.sharding.Mesh:
    """The same devices and axis names with every axis of type Auto (make_mesh gives Explicit)."""
    return _compat.auto_mesh(mesh)


def _leaves(step: TrainStep):
    """(path, shape, role) of every leaf of the step's args, and each arg's treedef."""
    paths, shapes, roles, trees = [], [], [], []
    for i, arg in enumerate(step.args):
        flat, tree = jax.tree_util.tree_flatten_with_path(arg)
        role = (Role.STATE if i in step.state_argnums else
                Role.BATCH if i in step.batch_argnums else Role.OTHER)
        for p, x in flat:
            paths.append(path_str(p))
            shapes.append(tuple(x.shape))
            roles.append(role)
        trees.append((tree, len(flat)))
    return paths, shapes, roles, trees


def _shardings(expert: str, step: TrainStep, mesh, tensor_axis: str | None = None,
               rules: Sequence[SplitRule] = MEGATRON_RULES):
    """The expert table of `step` on `mesh` (over all its axes) as (in, out) NamedShardings."""
    paths, shapes, roles, trees = _leaves(step)
    specs = experts.input_specs(expert, paths, shapes, roles, MeshShape.of(mesh),
                                tuple(mesh.axis_names), tensor_axis, rules)
    shardings = [NamedSharding(mesh, s.to_partition_spec()) for s in specs]
    in_shardings, start = [], 0
    for tree, n in trees:
        in_shardings.append(jax.tree_util.tree_unflatten(tree, shardings[start:start + n]))
        start += n
    in_shardings = tuple(in_shardings)
    out_shardings = tuple(in_shardings[i] for i in step.state_argnums) + (
        NamedSharding(mesh, PartitionSpec()),)
    return in_shardings, out_shardings


def data_parallel(step: TrainStep, mesh):
    """Batch split over all mesh axes (the first that divide it); params and optimizer state
    replicated."""
    return _shardings("data_parallel", step, as_auto_mesh(mesh))


def fsdp(step: TrainStep, mesh):
    """ZeRO-3: batch split over all axes (the first that divide it); every state leaf split
    over all axes on its largest dimension divisible by the device count (replicated if none
    is)."""
    return _shardings("fsdp", step, as_auto_mesh(mesh))


def megatron(step: TrainStep, mesh, *, axis: str | None = None,
             rules: Sequence[SplitRule] = MEGATRON_RULES):
    """Tensor parallel over `axis` (the last by default) by the Megatron rule table (the
    optimizer state by its paths, so adam's moments follow their parameter); the batch is
    replicated on `axis` and split over the other axes (so on a 2-D mesh this is also data
    parallel on the first)."""
    mesh = as_auto_mesh(mesh)
    axis = axis or mesh.axis_names[-1]
    if axis not in mesh.axis_names:
        raise ValueError(f"megatron: axis {axis!r} is not in the mesh axes {mesh.axis_names}")
    return _shardings("megatron", step, mesh, axis, rules)


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


def applicable_baselines(step: TrainStep, mesh) -> list[str]:
    """The baselines that make sense for `step` on `mesh`: two_d on 2-D meshes (where it
    replaces megatron, which would be the same plan), megatron on 1-D meshes, and either only
    when the rule table splits some parameter of the model."""
    mesh = as_auto_mesh(mesh)
    names = ["data_parallel", "fsdp"]
    paths, shapes, roles, trees = _leaves(step)
    first = step.state_argnums[0]  # the parameters: does the rule table split one of them?
    start = sum(n for _, n in trees[:first])
    stop = start + trees[first][1]
    specs = experts.input_specs("megatron", paths, shapes, roles, MeshShape.of(mesh),
                                tuple(mesh.axis_names))
    if experts.splits_state(specs[start:stop], roles[start:stop]):
        names.append("two_d" if len(mesh.axis_names) == 2 else "megatron")
    return names


def compile_baseline(name: str, step: TrainStep, mesh, **options) -> jax.stages.Compiled:
    """The step compiled with the baseline's shardings (concrete or abstract args)."""
    in_shardings, out_shardings = baseline_shardings(name, step, mesh, **options)
    jitted = jax.jit(step.fn, in_shardings=in_shardings, out_shardings=out_shardings)
    return jitted.lower(*step.args).compile()
