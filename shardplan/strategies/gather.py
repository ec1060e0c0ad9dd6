"""gather and scatter (embedding lookups and their gradients, one-hot updates): splits of the
dimensions no index touches, and of the rows an index picks (vocab-parallel lookups), read
from the Gather/ScatterDimensionNumbers. JAX puts the index
vector in the last dimension of the indices; the others are the batch ("scatter") dimensions."""

from __future__ import annotations

from shardplan.ir.graph import Graph, Node
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec


def _name(kind: str, roles, assign) -> str:
    return kind + " " + (" ".join(f"{r}:{'+'.join(ax)}" for r, ax in zip(roles, assign) if ax)
                         or "replicated")


def gather_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Each mesh axis splits an index batch dimension (and the output dimension it becomes,
    and the operand batching dimension it is paired with), or an operand dimension the slice
    takes whole and no index addresses (and its output offset dimension), or nothing."""
    operand, indices = graph.value(node.inputs[0]), graph.value(node.inputs[1])
    out = graph.value(node.outputs[0])
    dn, sizes = node.params["dimension_numbers"], node.params["slice_sizes"]
    n_idx = indices.ndim - 1
    out_batch = [d for d in range(out.ndim) if d not in dn.offset_dims]
    window = [d for d in range(operand.ndim)
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    whole = [(d, o) for d, o in zip(window, dn.offset_dims)
             if sizes[d] == operand.shape[d] and d not in dn.start_index_map]
    if len(out_batch) != n_idx:
        return []
    # Megatron's vocab-parallel lookup: a dimension an index picks single rows of may be split;
    # each device looks up the rows it holds (zeros elsewhere) and the result is a partial sum.
    indexed = [d for d in dn.start_index_map if d in dn.collapsed_slice_dims and sizes[d] == 1]
    if not common.is_float(out):
        indexed = []
    roles = ([f"idx{j}" for j in range(n_idx)] + [f"op{d}" for d, _ in whole]
             + [f"rows{d}" for d in indexed])
    found = []
    for assign in common.assignments(mesh, len(roles)):
        op_dims, idx_dims, out_dims = [()] * operand.ndim, [()] * indices.ndim, [()] * out.ndim
        for j, axes in enumerate(assign[:n_idx]):
            idx_dims[j] = out_dims[out_batch[j]] = axes
            if j in dn.start_indices_batching_dims:
                op_dims[dn.operand_batching_dims[dn.start_indices_batching_dims.index(j)]] = axes
        for (d, o), axes in zip(whole, assign[n_idx:n_idx + len(whole)]):
            op_dims[d] = out_dims[o] = axes
        partial: list[str] = []
        for d, axes in zip(indexed, assign[n_idx + len(whole):]):
            op_dims[d] = axes
            partial += axes
        found.append(common.make(
            node, graph, mesh, [ShardSpec(tuple(op_dims)), ShardSpec(tuple(idx_dims))],
            [ShardSpec(tuple(out_dims), common.mesh_order(partial, mesh))],
            name=_name("gather", roles, assign)))
    return [s for s in found if s is not None]


def scatter_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """scatter (replace) and scatter-mul, -min, -max, -sub: see _scatter."""
    return _scatter(node, graph, mesh, additive=False)


def scatter_add_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """scatter-add, whose combiner is a sum: updates split by index leave a partial sum."""
    return _scatter(node, graph, mesh, additive=True)


def _scatter(node: Node, graph: Graph, mesh: MeshShape, *, additive: bool) -> list[Strategy]:
    """Each mesh axis splits an operand dimension the updates cover whole and no index
    addresses (with its update window dimension), or an index batch dimension with the
    updates' scatter dimension: paired with an operand batching dimension it splits that
    too; otherwise, for scatter-add only, each device adds its own updates and the output is
    a partial sum over the axis (the operand counted once), else it is not offered."""
    if len(node.inputs) != 3:
        return []
    operand, indices, updates = (graph.value(v) for v in node.inputs)
    dn = node.params["dimension_numbers"]
    n_idx = indices.ndim - 1
    upd_scatter = [d for d in range(updates.ndim) if d not in dn.update_window_dims]
    window = [d for d in range(operand.ndim)
              if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    whole = [(d, u) for d, u in zip(window, dn.update_window_dims)
             if updates.shape[u] == operand.shape[d] and d not in dn.scatter_dims_to_operand_dims]
    if len(upd_scatter) != n_idx:
        return []
    # The gradient of a vocab-parallel lookup: a dimension indices address single rows of may
    # be split; each device applies the updates that land in the rows it holds.
    indexed = [d for d in dn.scatter_dims_to_operand_dims if d in dn.inserted_window_dims]
    roles = ([f"idx{j}" for j in range(n_idx)] + [f"op{d}" for d, _ in whole]
             + [f"rows{d}" for d in indexed])
    batching = dn.scatter_indices_batching_dims
    found = []
    for assign in common.assignments(mesh, len(roles)):
        op_dims, idx_dims, upd_dims = [()] * operand.ndim, [()] * indices.ndim, [()] * updates.ndim
        partial: list[str] = []
        for j, axes in enumerate(assign[:n_idx]):
            idx_dims[j] = upd_dims[upd_scatter[j]] = axes
            if j in batching:
                op_dims[dn.operand_batching_dims[batching.index(j)]] = axes
            elif axes:
                partial += axes
        if partial and not additive:
            continue
        for (d, u), axes in zip(whole, assign[n_idx:n_idx + len(whole)]):
            op_dims[d] = upd_dims[u] = axes
        for d, axes in zip(indexed, assign[n_idx + len(whole):]):
            op_dims[d] = axes
        op_spec = ShardSpec(tuple(op_dims))
        found.append(common.make(
            node, graph, mesh, [op_spec, ShardSpec(tuple(idx_dims)), ShardSpec(tuple(upd_dims))],
            [op_spec.with_partial(common.mesh_order(partial, mesh))],
            name=_name("scatter", roles, assign)))
    return [s for s in found if s is not None]


def rules() -> dict[str, Rule]:
    """Rule of each family this module handles (families: shardplan/ir/primitives.py)."""
    return {"gather": gather_rule, "scatter": scatter_rule, "scatter_add": scatter_add_rule}
