"""Convolutions and windowed reductions (pooling): splits of the batch and feature dimensions,
and of any dimension a window does not slide over."""

from __future__ import annotations

import math

from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec

ROLES = ("batch", "out", "in", "group")


def _roles(p: dict, depthwise: bool) -> tuple[bool, ...]:
    """Which roles a convolution offers (ROLES' order). Groups are split whole: the lhs
    features and rhs output features of a depthwise convolution, the lhs batch and rhs output
    features of a batch-grouped one (the weight gradient of a grouped convolution). XLA
    all-gathers the split groups and the split batch of a feature-grouped convolution unless
    it is depthwise (one input feature per group): replicated there. A batch-grouped
    convolution's output batch is a slice of every group: not split."""
    fgc, bgc = p.get("feature_group_count", 1), p.get("batch_group_count", 1)
    grouped_ok = bgc > 1 or (fgc > 1 and depthwise)
    return (bgc == 1 and (fgc == 1 or depthwise), fgc == 1 and bgc == 1, fgc == 1, grouped_ok)


def conv_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Each mesh axis splits the batch (lhs and output batch), the output features (rhs and
    output features), the input features (lhs and rhs: the output is a partial sum, as a
    dot's contracting dimension; in the weight gradient these are the batch) or the groups
    of a grouped convolution, from params['dimension_numbers']. A depthwise convolution's
    groups are its channels; its weight gradient is batch-grouped (batch_group_count), its
    groups the input channels. tests/test_strategies_conv.py compiles every strategy."""
    p = node.params
    dn = p["dimension_numbers"]
    lhs, rhs = graph.value(node.inputs[0]), graph.value(node.inputs[1])
    out = graph.value(node.outputs[0])
    fgc, bgc = p.get("feature_group_count", 1), p.get("batch_group_count", 1)
    if fgc > 1 and bgc > 1:
        return []
    groups = max(fgc, bgc)
    offered = _roles(p, rhs.shape[dn.rhs_spec[1]] == 1)
    lb, lf = dn.lhs_spec[0], dn.lhs_spec[1]
    ro, ri = dn.rhs_spec[0], dn.rhs_spec[1]
    ob, of = dn.out_spec[0], dn.out_spec[1]
    lhs_group = lf if fgc > 1 else lb  # the lhs dimension the groups divide
    found = []
    for assign in common.assignments(mesh, len(ROLES)):
        if any(ax and not ok for ax, ok in zip(assign, offered)):
            continue
        batch, out_feat, in_feat, group = assign
        if groups % mesh.size(group):
            continue  # a split inside a group
        if bgc > 1 and in_feat and len(set(batch + out_feat + in_feat + group)) < len(
                mesh.useful_axes()):
            # XLA sums a batch-grouped convolution's partial results over the devices it
            # leaves replicated too, a multiple of the sum (tests/test_strategies_conv.py
            # compiles every strategy offered against what it declares)
            continue
        lhs_dims, rhs_dims, out_dims = [()] * lhs.ndim, [()] * rhs.ndim, [()] * out.ndim
        lhs_dims[lb] = out_dims[ob] = batch
        rhs_dims[ro] = out_dims[of] = out_feat
        lhs_dims[lf] = rhs_dims[ri] = in_feat
        if group:
            lhs_dims[lhs_group] = rhs_dims[ro] = out_dims[of] = group
        used = (*batch, *out_feat, *in_feat, *group)
        name = "conv " + (" ".join(f"{r}:{'+'.join(ax)}" for r, ax in zip(ROLES, assign) if ax)
                          or "replicated")
        found.append(common.make(
            node, graph, mesh, [ShardSpec(tuple(lhs_dims)), ShardSpec(tuple(rhs_dims))],
            [ShardSpec(tuple(out_dims), in_feat)], name=name,
            split=math.prod(mesh.size(a) for a in used)))
    return [s for s in found if s is not None]


def window_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Pooling and its gradients: dimensions with a trivial window (size and stride 1, no
    padding or dilation) split freely; the others stay whole (a split one needs halos)."""
    p = node.params
    ndim = len(p["window_dimensions"])
    ones = (1,) * ndim
    strides = p.get("window_strides", ones)
    padding = p.get("padding", ((0, 0),) * ndim)
    base = p.get("base_dilation", ones)
    dil = p.get("window_dilation", ones)
    whole = [d for d in range(ndim)
             if (p["window_dimensions"][d], strides[d], tuple(padding[d]), base[d], dil[d])
             != (1, 1, (0, 0), 1, 1)]
    return common.same_spec(node, graph, mesh, whole)


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {"conv": conv_rule, "window": window_rule}
