"""What XLA keeps of a random generator's bits (a dropout mask) once a plan is fixed.

The memory model (intra/memory/model.py) keeps a generator's two 32-bit words until the last read of
the mask computed from them: XLA:CPU fuses the mask's compare into each reader, so the bits
are what it holds. But where a reader reads the mask in another layout than the generator's,
XLA fuses the compare into the reshard instead, right after the generator: what it holds for
that reader is the resharded mask, one byte per element, and the bits die once every reader in
their own layout has run (a GPT on 2x4 devices: every dropout mask resharded as `pred` and the
words freed at once; the model held 8 bytes per element to the backward, 65 KiB of its 72 KiB
over-count at the peak). Whether the bits live on depends on the generator's layout and every
reader's: a plan's evaluation (MemoryModel.peak) counts it exactly; the ILP's rows keep the
bits to the last read and hold each reader's copy from the first read to its own, which never
counts less.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.intra.memory import liveness
from shardplan.intra.memory.buffers import LiveCopy


@dataclasses.dataclass(frozen=True, eq=False)
class Read:
    """A read of a mask value (computed from the bits alone) by a node outside the chain."""

    value: int
    src: int  # the root whose choice lays out the value as made
    key_src: np.ndarray  # layout keys by that root's choice, comparable with key_dst
    dst: int  # the reader's root
    key_dst: np.ndarray
    specs: tuple  # the reader's layout by its root's choice (to share one copy)
    nbytes: np.ndarray  # the value's bytes in the reader's layout by its root's choice, scaled
    end: int  # the last moment the read holds the value (through what is fused into it)


@dataclasses.dataclass(frozen=True, eq=False)
class Mask:
    """A generator's bits (model.buffers[buffer]) and the reads of the mask made from them."""

    buffer: int
    first: int  # the first read: the reshards are made by then
    reads: tuple[Read, ...]


def chain(graph, bits: int, readers, virtual,
          constant: set[int]) -> tuple[set[int], list[tuple[int, int, int]]]:
    """(the values computed from `bits` alone that XLA never writes, the reads of them by other
    nodes as (node id, input index, value)); `constant`: liveness.constants(graph)."""
    values, reads, stack = {bits}, [], [bits]
    while stack:
        u = stack.pop()
        for r in sorted(set(readers.get(u, ()))):
            node = graph.nodes[r]
            inner = node.outputs and all(o in virtual for o in node.outputs) and all(
                w in values or graph.values[w].is_literal or w in constant
                or graph.values[w].ndim == 0 for w in node.inputs)
            if inner:
                new = [o for o in node.outputs if o not in values]
                values.update(new)
                stack.extend(new)
            else:
                reads += [(r, i, u) for i, w in enumerate(node.inputs) if w == u]
    return values - {bits}, reads


def masks(model, lay, generated: dict[int, int]) -> tuple[list[Mask], set[int]]:
    """The Masks of `model` (generated: bits value -> the index of its buffer), and the mask
    values whose reshards they count (those without a fan-out member: the operand copies
    leave them out)."""
    p = model.problem
    g, root = p.graph, p.groups.root
    readers: dict[int, list[int]] = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    fanned = p.held_fanouts
    # once for every generator: per generator, the work would grow with the number of
    # dropout masks times the step's length
    constant = liveness.constants(g) if generated else set()
    out, mine = [], set()
    for bits, buffer in sorted(generated.items()):
        values, reads = chain(g, bits, readers, model.virtual, constant)
        if not reads or any(u in fanned for _, _, u in reads):
            continue  # a fan-out's copy is counted where it is made (model.py)
        found = []
        for r, i, u in reads:
            if u == bits:
                break  # the bits themselves read: nothing to refine
            src, out_idx = p.producer[u]
            m = p.num_inputs + r
            srcs, dsts = lay.of(src, "out", out_idx), lay.of(m, "in", i)
            ka, kb, _ = lay.keys(srcs, dsts)
            end = max([model.pos[r], *(model.last[o] for o in g.nodes[r].outputs
                                       if o in model.virtual and o in model.last)])
            if root[m] == root[src]:  # the producer's group reads its layout as it is
                ka, kb = np.zeros(len(ka), int), np.zeros(len(kb), int)
            found.append(Read(u, root[src], ka, root[m], kb, dsts[0],
                              lay.sized(g.values[u], dsts), end))
        else:
            first = min(model.pos[r] for r, _, _ in reads)
            out.append(Mask(buffer, first, tuple(found)))
            mine.update(values)
    return out, mine


def ilp_copies(mask: Mask) -> list[LiveCopy]:
    """The rows' terms of a mask's reshards: each read's copy from the first read to its own,
    which never counts less than the evaluation's (evaluate)."""
    return [LiveCopy(rd.src, rd.key_src, np.zeros(len(rd.key_src)), rd.dst, rd.key_dst, rd.nbytes,
                 mask.first, max(mask.first, rd.end), f"mask v{rd.value} resharded")
            for rd in mask.reads]


def evaluate(mask: Mask, start: int, end: int, root_choice) -> tuple[int, list]:
    """(the bits' last moment, [(start, end, bytes)] of the resharded masks) at a choice: the
    bits live to the last read in their own layout (at least to the first read); the reads in
    one other layout share one copy, from the first read to the last of them."""
    last, shared = mask.first, {}
    for rd in mask.reads:
        ks, kd = root_choice[rd.src], root_choice[rd.dst]
        if rd.key_src[ks] == rd.key_dst[kd]:
            last = max(last, rd.end)
            continue
        key = (rd.value, rd.specs[kd])
        lo, hi, nbytes = shared.get(key, (mask.first, mask.first, 0.0))
        shared[key] = (lo, max(hi, rd.end), max(nbytes, float(rd.nbytes[kd])))
    return min(max(last, start), end), list(shared.values())
