"""The TPU compiler's windowed einsums as the memory model sees them (MemoryModel): the dots a
plan runs as loops of collective-permutes (a partial sum over the whole slice reduce-scattered
over it: intra.reshard_prices), whose operands are the loop's, written whole; and the slices
a reader takes into its fusion, but where such a loop reads them
(compilers.Rules.output_fusions, fused_slices)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shardplan.intra.memory import dot_operands
from shardplan.intra.memory.buffers import LiveCopy
from shardplan.strategies.dot import DotDims
from shardplan.strategies.spec import ShardSpec


def windows(model) -> dict[int, tuple]:
    """The dots the TPU compiler may run as windowed einsums: dot node id -> (its choices
    that may window (ReshardPrices.may_window: its partial sum spans the slice), [(a reader
    member, that reader's choices that take the sum, or what is cast or transposed of it,
    scattered over the slice, as window_time prices it)]). A dot is windowed where both
    hold (windowed)."""
    p = model.problem
    g, root = p.graph, p.groups.root
    if p.cost.hardware.backend != "tpu":
        return {}
    out: dict[int, tuple] = {}
    for node in g.nodes:
        n = p.num_inputs + node.id
        for i, w in enumerate(node.inputs):
            found = p.reshards.dot_made(g.values[w]) if w in p.producer else None
            if found is None:
                continue
            dot, m = found[0], p.num_inputs + found[0].id
            if dot.id not in out:
                out[dot.id] = (np.array([p.reshards.may_window(dot, p.out_spec(m, 0, k))
                                         for k in range(len(p.strategies[root[m]]))]), [])
            if not out[dot.id][0].any() or root[n] == root[m]:
                continue
            value = g.values[w]
            src = ShardSpec.replicated(value.ndim).with_partial(p.mesh.names)
            scatters = np.array([p.reshards.window_time(value, src, p.in_spec(n, i, k)) > 0
                                 for k in range(len(p.strategies[root[n]]))])
            if scatters.any():
                out[dot.id][1].append((n, scatters))
    return {d: (may, rs) for d, (may, rs) in out.items() if rs}


def windowed(model, root_choice: Mapping[int, int]) -> set[int]:
    """The dots (node ids) a plan runs as windowed einsums (windows)."""
    root = model.problem.groups.root
    return {d for d, (may, rs) in model.windows.items()
            if may[root_choice[root[model.problem.num_inputs + d]]]
            and any(sc[root_choice[root[n]]] for n, sc in rs)}


def operand_copies(model, readers, virtual) -> list[LiveCopy]:
    """An activation of a dot's output that a windowed dot reads (dot_operands.
    window_operand): the loop's operand, written whole in the layout that dot reads it
    in, from where it is made to that dot; a copy over the dot's choices (the activation's
    bytes where it may window) and its reader's (counted where that reader scatters:
    windows)."""
    p = model.problem
    g, root = p.graph, p.groups.root
    producer = {v: node.id for node in g.nodes for v in node.outputs}
    out = []
    for v in sorted(virtual):
        rs = readers.get(v, ())
        if v not in producer or not dot_operands.window_operand(
                g, g.nodes[producer[v]], rs, producer):
            continue
        made = g.nodes[producer[v]]
        for r in rs:
            if r not in model.windows:
                continue
            may, scattering = model.windows[r]
            dot, m = g.nodes[r], p.num_inputs + r
            j = dot.inputs.index(v)
            nbytes = np.where(may, [model.nbytes(g.values[v], p.in_spec(m, j, k))
                                    for k in range(len(may))], 0.0)
            n, scatters = scattering[0]  # the first reader: XLA reduces the sum once
            out.append(LiveCopy(root[m], np.zeros(len(may), int),
                                model.scale * np.ceil(nbytes), root[n],
                                scatters.astype(int), np.zeros(len(scatters)),
                                model.pos[made.id], model.pos[r],
                                f"{made.primitive} {made.name}, a windowed dot's operand"))
    # A step's input that a windowed dot contracts over a dimension other than its minor
    # one: copied into the layout the loop reads, from its first reader to that dot (the
    # MLP's batch, read by its first weight gradient's windowed dot: bf16[8192, 4096]
    # copied as {0,1}, v5e 2x4, FSDP).
    inputs = set(g.inputs)
    for r, (may, scattering) in model.windows.items():
        dot, m = g.nodes[r], p.num_inputs + r
        lhs, rhs = (g.values[v] for v in dot.inputs[:2])
        dd = DotDims.of(dot.params, lhs.ndim, rhs.ndim)
        for j, contract in enumerate((dd.lhs_contract, dd.rhs_contract)):
            v = dot.inputs[j]
            if v not in inputs or list(contract) == [g.values[v].ndim - 1]:
                continue
            nbytes = np.where(may, [model.nbytes(g.values[v], p.in_spec(m, j, k))
                                    for k in range(len(may))], 0.0)
            n, scatters = scattering[0]
            out.append(LiveCopy(root[m], np.zeros(len(may), int),
                                model.scale * np.ceil(nbytes), root[n],
                                scatters.astype(int), np.zeros(len(scatters)),
                                min(model.pos[u] for u in readers[v]), model.pos[r],
                                f"input v{v} laid out for a windowed dot"))
    return out


def slices_only(src: ShardSpec, dst: ShardSpec) -> bool:
    """Whether resharding src to dst only slices: neither partial, and each of dst's dims
    split over src's axes of that dim and then more (each device's part of dst lies in its
    part of src). MemoryModel.live leaves such a copy out where its reader takes the slice
    into its fusion (an elementwise op, a dot or a reduction, in the loop that made the
    value) and no windowed dot reads the value (windowed: the loop's operand, written)."""
    return (not src.partial and not dst.partial and src != dst
            and all(d[:len(s)] == s for s, d in zip(src.dims, dst.dims)))
