"""dot_general: each mesh axis splits a batch, free or contracting dimension, or nothing
(Alpa's Table 2, generalised to any dimension numbers and any number of mesh axes)."""

from __future__ import annotations

import dataclasses
import math

from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec


@dataclasses.dataclass(frozen=True)
class DotDims:
    """Where each role's dimensions sit: lhs/rhs/out dimension index per batch (b), lhs free
    (m), rhs free (n) and contracting (k) dimension. The output is batch, then m, then n."""

    lhs_batch: tuple[int, ...]
    rhs_batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]
    lhs_contract: tuple[int, ...]
    rhs_contract: tuple[int, ...]

    @classmethod
    def of(cls, params, lhs_ndim: int, rhs_ndim: int) -> DotDims:
        (lc, rc), (lb, rb) = params["dimension_numbers"]
        lc, rc, lb, rb = (tuple(int(d) for d in x) for x in (lc, rc, lb, rb))
        lf = tuple(d for d in range(lhs_ndim) if d not in lc and d not in lb)
        rf = tuple(d for d in range(rhs_ndim) if d not in rc and d not in rb)
        return cls(lb, rb, lf, rf, lc, rc)

    def roles(self) -> list[str]:
        """Role names in a fixed order: b0.., m0.., n0.., k0.."""
        return ([f"b{i}" for i in range(len(self.lhs_batch))]
                + [f"m{i}" for i in range(len(self.lhs_free))]
                + [f"n{i}" for i in range(len(self.rhs_free))]
                + [f"k{i}" for i in range(len(self.lhs_contract))])


def dot_general_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """One strategy per assignment of mesh axes to roles; a split contracting dimension
    leaves the output partial over its axes (the consumer's edge pays the reduction)."""
    lhs, rhs = graph.value(node.inputs[0]), graph.value(node.inputs[1])
    dd = DotDims.of(node.params, lhs.ndim, rhs.ndim)
    roles = dd.roles()
    nb, nm, nn = len(dd.lhs_batch), len(dd.lhs_free), len(dd.rhs_free)
    found = []
    for assign in common.assignments(mesh, len(roles)):
        b, m = assign[:nb], assign[nb:nb + nm]
        n, k = assign[nb + nm:nb + nm + nn], assign[nb + nm + nn:]
        lhs_dims, rhs_dims = [()] * lhs.ndim, [()] * rhs.ndim
        for dims, pos, axes in ((lhs_dims, dd.lhs_batch, b), (rhs_dims, dd.rhs_batch, b),
                                (lhs_dims, dd.lhs_free, m), (rhs_dims, dd.rhs_free, n),
                                (lhs_dims, dd.lhs_contract, k), (rhs_dims, dd.rhs_contract, k)):
            for d, a in zip(pos, axes):
                dims[d] = a
        partial = common.mesh_order([a for ax in k for a in ax], mesh)
        out = ShardSpec((*b, *m, *n), partial)
        used = [a for ax in assign for a in ax]
        name = "dot " + (" ".join(f"{r}:{'+'.join(ax)}" for r, ax in zip(roles, assign) if ax)
                         or "replicated")
        found.append(common.make(node, graph, mesh, [ShardSpec(tuple(lhs_dims)),
                                                     ShardSpec(tuple(rhs_dims))], [out],
                                 name=name, split=math.prod(mesh.size(a) for a in used)))
    return [s for s in found if s is not None]


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {"dot": dot_general_rule}
