"""Convolutions and windowed reductions (pooling): splits of the batch and feature dimensions,
and of any dimension a window does not slide over."""

from __future__ import annotations

import math

from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec


def conv_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Each mesh axis splits the batch (lhs and output batch), the output features (rhs and
    output features) or the input features (lhs and rhs: the output is a partial sum), from
    params['dimension_numbers']. Depthwise convolutions: batch split only; other grouped
    convolutions and batch-grouped ones: replicated."""
    p = node.params
    dn = p["dimension_numbers"]
    lhs, rhs = graph.value(node.inputs[0]), graph.value(node.inputs[1])
    out = graph.value(node.outputs[0])
    if p.get("batch_group_count", 1) > 1:
        return []
    grouped = p.get("feature_group_count", 1) > 1
    lb, lf = dn.lhs_spec[0], dn.lhs_spec[1]
    ro, ri = dn.rhs_spec[0], dn.rhs_spec[1]
    ob, of = dn.out_spec[0], dn.out_spec[1]
    if grouped and rhs.shape[ri] != 1:
        return []  # measured: XLA all-gathers the batch of grouped, non-depthwise convs
    found = []
    for assign in common.assignments(mesh, 1 if grouped else 3):
        batch, out_feat, in_feat = (*assign, (), ())[:3]
        lhs_dims, rhs_dims, out_dims = [()] * lhs.ndim, [()] * rhs.ndim, [()] * out.ndim
        lhs_dims[lb] = out_dims[ob] = batch
        rhs_dims[ro] = out_dims[of] = out_feat
        lhs_dims[lf] = rhs_dims[ri] = in_feat
        used = (*batch, *out_feat, *in_feat)
        name = "conv " + (" ".join(f"{r}:{'+'.join(ax)}" for r, ax in
                                   (("batch", batch), ("out", out_feat), ("in", in_feat)) if ax)
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
