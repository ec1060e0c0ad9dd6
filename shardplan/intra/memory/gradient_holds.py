"""The gradients XLA's combined all-reduce holds, as the memory model (intra/memory/model.py) counts
them.

XLA combines the reductions of the step's gradients into one all-reduce (its combiner;
intra/combiner/xla.py), which runs once the last of them is made: a gradient whose plan reduces it
(a partial sum, or a reduction inside its node) is held until then, not freed by its reader.
(GPT on 8 devices, data parallel: every weight's gradient was live at XLA's peak, just before
the one all-reduce of them all; the model, freeing each at its update, put the plan at 1/1.40
of its compiled peak.) The all-reduce's results are written while its operands are read: both
are live then (memory_analysis' peak of that plan is its live peak with every gradient twice).
The combiner merges only reductions that do not depend on each other: a gradient that feeds
another one the plan reduces too (the first layer's input gradient, summed into the embedding's
scattered gradient) is reduced where it is made, not held (llama on 2x4: the combined
all-reduce held no activation-sized operand; the model held three, 48 KiB twice over).
"""

from __future__ import annotations

import numpy as np

from shardplan.cost.model import CONTRACTIONS
from shardplan.intra.combiner import xla
from shardplan.intra.memory.buffers import Buffer, LiveCopy, is_tensor

# The ops whose gradients a plan leaves as partial sums of the weights' size: the contractions
# (a kernel's gradient) and the scatter-add of a gather's (an embedding's). (A bias's
# reduce_sum is left out: a few hundred bytes, and a global norm's reductions of the
# gradients, which run after the combined all-reduce, would be taken for one.)
SUMS = CONTRACTIONS | frozenset({"scatter-add"})


def _reduced(p, m: int, k: int) -> np.ndarray:
    """By member m's root choice: whether its strategy reduces its output k."""
    out = []
    for c in range(len(p.strategies[p.groups.root[m]])):
        s = p.strategies[m][p.groups.pick[m][c]]
        out.append(bool(s.out_specs[k].partial) or any(
            x.kind in ("all-reduce", "reduce-scatter") for x in s.comms))
    return np.array(out)


def _later(g, node, ids: set[int], readers) -> set[int]:
    """The gradient-making nodes (`ids`) first reached from `node`'s outputs."""
    seen, out, stack = set(), set(), list(node.outputs)
    while stack:
        for r in readers.get(stack.pop(), ()):
            if r not in seen:
                seen.add(r)
                if r in ids:
                    out.add(r)
                else:
                    stack.extend(g.nodes[r].outputs)
    return out


def holds(model) -> tuple[list[Buffer], list[LiveCopy]]:
    """The buffers (and, for a gradient that feeds one other, copies: held only when that
    one is not reduced) of the gradients held for the combined all-reduce."""
    p = model.problem
    g, root = p.graph, p.groups.root
    grads = xla.gradient_values(g, CONTRACTIONS)
    made = [node for node in g.nodes if node.outputs and node.primitive in SUMS
            and all(v in grads for v in node.outputs)]
    if not made:
        return [], []
    ids = {node.id for node in made}
    readers: dict[int, list[int]] = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    end = max(model.pos[node.id] for node in made)
    buffers, copies = [], []
    for node in made:
        m = p.num_inputs + node.id
        later = _later(g, node, ids, readers)
        for k, v in enumerate(node.outputs):
            if not is_tensor(g.values[v]) or v not in model.last:
                continue
            reduced = _reduced(p, m, k)
            nbytes = model.scale * np.ceil([model.nbytes(g.values[v], p.out_spec(m, k, c))
                                            if r else 0.0 for c, r in enumerate(reduced)])
            if not nbytes.any():
                continue
            # a value XLA would fold away (a gather's gradient scattered into the add that
            # sums it with another) is written when it is reduced: an all-reduce's operand is a
            # buffer (GPT on 8 devices: the embedding's scattered gradient and its result in
            # the combined all-reduce, 128 KiB the model missed)
            held_from = model.pos[node.id] if v in model.virtual else model.last[v] + 1
            what = f"{node.primitive} {node.name}"
            spans = [(held_from, end, f"{what} held for the combined all-reduce")] * (
                held_from <= end)
            # the all-reduce writes its results while it reads its operands
            spans.append((end, end, f"{what} all-reduced"))
            if len(later) == 1:
                # held only where the later gradient is not reduced: keys differ exactly when
                # this one is reduced (1) and that one is not (2)
                (n2,) = later
                m2 = p.num_inputs + n2
                red2 = np.any([_reduced(p, m2, j) for j in range(len(g.nodes[n2].outputs))],
                              axis=0)
                ka, kb = reduced.astype(int), np.where(red2, 1, 2)
                copies += [LiveCopy(root[m], ka, nbytes, root[m2], kb, np.zeros(len(kb)), a, b, w)
                           for a, b, w in spans]
            else:
                buffers += [Buffer(root[m], nbytes, a, b, w) for a, b, w in spans]
    return buffers, copies
