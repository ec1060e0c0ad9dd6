"""The expert plans, written once as ShardSpec tables: data parallel, FSDP/ZeRO-3, Megatron
(tensor parallel by an ordered regex rule table) and 2-D (data x tensor).

The intra-op planner solves the ILP with each expert plan's inputs pinned as well as free and
keeps the cheapest, so its plan is never worse, under the cost model, than what an expert
writes by hand; shardplan.planning.select compiles them as candidates; shardplan.baselines turns them
into NamedShardings of a TrainStep's arguments. A split that does not divide falls back to
replicated for that leaf (a batch to the first axes that divide it), so every spec is valid.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from shardplan.ir.graph import Graph, Role
from shardplan.strategies.spec import MeshShape, ShardSpec

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
"""Megatron's layout: the first rule whose regex matches the path decides (as maxtext's
logical axis rules)."""


# -- one leaf -------------------------------------------------------------------------------


def split_dim(shape: Sequence[int], dim: int | None, axes: Sequence[str],
              mesh: MeshShape) -> ShardSpec:
    """`dim` split over `axes`, or replicated if there is no dim or it does not divide."""
    if dim is None or not axes or not shape:
        return ShardSpec.replicated(len(shape))
    dim = dim % len(shape)
    if shape[dim] % mesh.size(axes):
        return ShardSpec.replicated(len(shape))
    return ShardSpec.split(len(shape), dim, axes)


def batch_spec(shape: Sequence[int], axes: Sequence[str], mesh: MeshShape) -> ShardSpec:
    """The leading (batch) dimension split over the longest run of `axes`, from the first,
    that divides it: a batch of 8 on an 8x8 mesh over `data` alone, as an expert splits it,
    where over both it would be replicated, every device computing the whole step."""
    for k in range(len(axes), 0, -1):
        spec = split_dim(shape, 0, axes[:k], mesh)
        if not spec.is_replicated():
            return spec
    return ShardSpec.replicated(len(shape))


def largest_dim_spec(shape: Sequence[int], axes: Sequence[str], mesh: MeshShape) -> ShardSpec:
    """The largest dimension divisible by the axes' size split over them (the first of equal
    ones); replicated if none is."""
    n = mesh.size(axes) if axes else 1
    dims = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
    if not axes or not dims:
        return ShardSpec.replicated(len(shape))
    return ShardSpec.split(len(shape), max(dims, key=lambda d: (shape[d], -d)), axes)


def rule_spec(path: str, shape: Sequence[int], rules: Sequence[SplitRule], axes: Sequence[str],
              mesh: MeshShape) -> ShardSpec:
    """The first rule whose regex matches `path` decides the split dimension."""
    for pattern, dim in rules:
        if re.search(pattern, path):
            return split_dim(shape, dim, axes, mesh)
    return ShardSpec.replicated(len(shape))


# -- the table ------------------------------------------------------------------------------

StateRule = Callable[[str, Sequence[int], Sequence[str], str, MeshShape, Sequence[SplitRule]],
                     ShardSpec]
"""(path, shape, all axes, tensor axis, mesh, rules) -> the spec of a state leaf."""

EXPERTS: dict[str, tuple[StateRule, bool]] = {
    # name: (the spec of a state leaf, whether the batch stays whole on the tensor axis)
    "data_parallel": (lambda path, shape, axes, tensor, mesh, rules:
                      ShardSpec.replicated(len(shape)), False),
    "fsdp": (lambda path, shape, axes, tensor, mesh, rules:
             largest_dim_spec(shape, axes, mesh), False),
    "megatron": (lambda path, shape, axes, tensor, mesh, rules:
                 rule_spec(path, shape, rules, (tensor,), mesh), True),
}
EXPERTS["two_d"] = EXPERTS["megatron"]  # on a 2-D mesh: data parallel x Megatron


def input_specs(expert: str, paths: Sequence[str], shapes: Sequence[Sequence[int]],
                roles: Sequence[Role], mesh: MeshShape, axes: Sequence[str],
                tensor_axis: str | None = None,
                rules: Sequence[SplitRule] = MEGATRON_RULES) -> tuple[ShardSpec, ...]:
    """The expert's spec of every input leaf over `axes` of `mesh`: state by its rule, the
    batch's leading dimension split (not on the tensor axis for Megatron; over fewer axes
    where all of them do not divide it, batch_spec), the rest replicated. `tensor_axis`
    defaults to the last of `axes`."""
    state_rule, tensor_parallel = EXPERTS[expert]
    tensor = tensor_axis or axes[-1]
    batch_axes = [a for a in axes if a != tensor] if tensor_parallel else list(axes)
    out = []
    for path, shape, role in zip(paths, shapes, roles):
        if role == Role.STATE:
            out.append(state_rule(path, tuple(shape), tuple(axes), tensor, mesh, rules))
        elif role == Role.BATCH:
            out.append(batch_spec(shape, batch_axes, mesh))
        else:
            out.append(ShardSpec.replicated(len(shape)))
    return tuple(out)


def splits_state(specs: Sequence[ShardSpec], roles: Sequence[Role]) -> bool:
    """Whether a plan splits any state leaf (Megatron's rules may match no parameter)."""
    return any(not s.is_replicated() for s, r in zip(specs, roles) if r == Role.STATE)


def name_path(name: str) -> str:
    """"[0]['layer_0']['mlp']['fc_in']['kernel']" -> "0/layer_0/mlp/fc_in/kernel"."""
    return "/".join(re.findall(r"\[?'?([^\[\]'.]+)'?\]?", name))


def expert_inputs(graph: Graph, mesh: MeshShape) -> dict[str, dict[int, ShardSpec]]:
    """Flat input index -> spec for each expert plan that applies to this step and mesh (over
    the mesh's axes of more than one device): data parallel, FSDP, and Megatron (1-D) or 2-D
    when its rules split some state."""
    axes = mesh.useful_axes()
    if not axes:
        return {}
    shapes = [graph.values[v].shape for v in graph.inputs]
    names = list(graph.input_names) or [""] * len(shapes)
    paths = [name_path(n) for n in names]
    roles = graph.input_roles
    found = {name: dict(enumerate(input_specs(name, paths, shapes, roles, mesh, axes)))
             for name in ("data_parallel", "fsdp")}
    tensor = "megatron" if len(axes) == 1 else "two_d"
    megatron = input_specs(tensor, paths, shapes, roles, mesh, axes)
    if splits_state(megatron, roles):
        found[tensor] = dict(enumerate(megatron))
    return found
