"""XLA's all-reduce combiner, as the estimate models it: which of a plan's reductions the
compiled program runs as one collective.

XLA:CPU runs `AllReduceCombiner` with no byte threshold and at most 256 operands per combined
all-reduce (cpu_compiler.cc: kCombineBytes = int64 max, kCombineCount = 256). The pass
(collective_combiner_utils.h CombineInstructionsByKey) merges all-reduces of one key (the
reduction, element type and replica groups) that do not depend on each other, in one
computation (a loop body is its own). Here the key is the mesh axes, and a reduction's level
counts the reductions of its key on the longest path from it to the end of the step: two of
one key and level never depend on each other, and the levels of a key are as few groups as
its longest dependent chain allows (what the pass reaches when it takes each key's
reductions in dependency order; the gradients' reductions, the last of every path, are one).
Reductions of other keys (an activation's all-reduce over another axis, an all-gather) do
not separate them. A reduce-scatter the accelerator forms of an all-reduce (XLA:CPU keeps the
all-reduce and slices it; analysis/hlo_collectives.py CollectiveOp.formed) is combined with
the all-reduces of its key and split off again: one combined all-reduce and one
reduce-scatter where the group holds both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

from shardplan.ir import primitives
from shardplan.ir.graph import Graph
from shardplan.strategies.base import Collective

MAX_OPERANDS = 256
"""Operands of one combined all-reduce on XLA:CPU (combine_threshold_count)."""


@dataclasses.dataclass(frozen=True)
class Combined:
    """One collective of the compiled program that `operands` of the plan's reductions share."""

    kind: str
    axes: tuple[str, ...]
    trips: float
    operands: int
    nbytes: int


def key(loop: int | None, trips: float, c: Collective) -> tuple:
    """What two reductions must share to be combined: the computation (loop) they run in and
    the device groups (mesh axes)."""
    return (loop, trips, tuple(sorted(c.axes)))


def levelled(g: Graph, node_reds: Mapping[int, Sequence[tuple[float, Collective]]],
             edge_reds: Mapping[int, Sequence[tuple[float, Collective]]],
             from_end: bool = True, alone: frozenset[tuple[int, tuple]] = frozenset()):
    """(key, level, trips, Collective) of every reduction: `node_reds` are those a node runs
    (node id -> (trips, Collective)), `edge_reds` those resharding a value runs before its
    readers (value id -> the same). A reduction's level counts the reductions of its key on
    the longest path from it to the end of the step (`from_end`), or up to it: counted from
    the end, the gradients' reductions, which no reduction of theirs follows, share level 1
    whatever the reductions before them, as XLA combines them (GPT-2 124M on 2x4: 39 combined
    all-reduces and reduce-scatters counted from the end, 51 from the start, 42 compiled; the
    zoo at test size: the same counts either way). `alone`: (value id, sorted axes) of the
    reductions that run as their own collective (level 0), the loss's where the forward
    pass reduces over the same devices (loss_alone)."""
    producer = {v: node.id for node in g.nodes for v in node.outputs}
    loops = {v: g.nodes[n].loop for v, n in producer.items()}
    if from_end:  # the same count on the graph with its edges reversed
        order = [(n.id, n.loop, n.outputs, n.inputs) for n in reversed(g.nodes)]
    else:
        order = [(n.id, n.loop, n.inputs, n.outputs) for n in g.nodes]
    at: dict[int, dict] = {}  # value id -> {key: level}
    after: dict[int, dict] = {}  # the same, once the value's own reshards ran
    out = []

    def read(v):
        if v in after:
            return after[v]
        lv = at.get(v, {})
        reds = edge_reds.get(v)
        if reds:
            base, lv = lv, dict(lv)
            for trips, c in reds:
                k = key(loops.get(v), trips, c)
                own = (v, tuple(sorted(c.axes))) in alone
                out.append((k, 0 if own else base.get(k, 0) + 1, trips, c))
                lv[k] = base.get(k, 0) + 1
        after[v] = lv
        return lv

    for node_id, loop, inputs, outputs in order:
        ins = [read(v) for v in inputs]
        lv = ins[0] if len(ins) == 1 else {}
        if len(ins) > 1:
            for d in ins:
                for k, n in d.items():
                    if n > lv.get(k, 0):
                        lv[k] = n
        reds = node_reds.get(node_id)
        if reds:
            base, lv = lv, dict(lv)
            for trips, c in reds:
                k = key(loop, trips, c)
                out.append((k, base.get(k, 0) + 1, trips, c))
                lv[k] = base.get(k, 0) + 1
        for v in outputs:
            if v in at and from_end:  # a value read by several nodes: the longest path on
                lv = {k: max(n, at[v].get(k, 0)) for k, n in {**at[v], **lv}.items()}
            at[v] = lv
    for v in edge_reds:
        read(v)  # values no node reads (outputs): their reshards still run
    return out


def forward_values(g: Graph, loss: frozenset[int]) -> set[int]:
    """The values the loss is computed from that the backward pass reads too (what reduces
    them runs before the loss's reduction and is not the loss's own)."""
    tied = {v for v, tie in zip(g.outputs, g.output_ties) if tie is not None}
    return upstream(g, loss) & upstream(g, tied)


def loss_alone(g: Graph, loss: frozenset[int],
               node_reds: Mapping[int, Sequence[tuple[float, Collective]]],
               edge_reds: Mapping[int, Sequence[tuple[float, Collective]]]
               ) -> frozenset[tuple[int, tuple]]:
    """(value id, sorted axes) of the reductions of the loss's last values (`loss`) that XLA
    runs alone: those over devices the forward pass also reduces over (a split vocabulary's
    log-sum-exp), as intra/combiner/loss_latency.py prices them in the ILP. XLA's combiner walks the
    post order and stops a group at the first all-reduce that depends on a member: one of
    the forward's lands in the gradients' last group, and the loss's runs by itself (a tied
    64k-vocab embedding on 8 devices compiled to five all-reduces where a plan pricing the
    loss's as joined expected four)."""
    forward = forward_values(g, loss)
    keys = {tuple(sorted(c.axes)) for v in forward for _, c in edge_reds.get(v, ())}
    keys |= {tuple(sorted(c.axes)) for node in g.nodes if any(v in forward for v in node.outputs)
             for _, c in node_reds.get(node.id, ())}
    return frozenset((v, k) for v in loss for _, c in edge_reds.get(v, ())
                     if (k := tuple(sorted(c.axes))) in keys)


def combine(reductions: Iterable[tuple]) -> list[Combined]:
    """The collectives the compiled program runs for `reductions` (levelled's): one per key,
    level and kind, each of at most MAX_OPERANDS operands; reductions of no bytes or no
    devices run nothing and are left out."""
    groups: dict[tuple, list[Collective]] = {}
    for k, level, trips, c in reductions:
        if c.nbytes > 0 and c.axes:
            groups.setdefault((k, level, trips), []).append(c)
    out = []
    for (k, _, trips), cs in sorted(groups.items(), key=lambda kv: repr(kv[0])):
        # XLA combines all of them as all-reduces; the accelerator splits the sliced part off
        chunks = math.ceil(len(cs) / MAX_OPERANDS)
        for kind in sorted({c.kind for c in cs}):
            mine = [c for c in cs if c.kind == kind]
            per = math.ceil(len(mine) / chunks)
            for i in range(0, len(mine), per):
                part = mine[i:i + per]
                out.append(Combined(kind, part[0].axes, trips, len(part),
                                    sum(c.nbytes for c in part)))
    return out


def latency_saving(reductions: Sequence[tuple], cost) -> float:
    """Seconds of latency the combiner saves: each reduction priced alone pays its ring's
    latency steps; each combined collective pays them once."""
    alone = sum(trips * cost.combined_latency([c]) for _, _, trips, c in reductions if c.axes)
    combined = sum(x.trips * cost.combined_latency([Collective(x.kind, x.axes, x.nbytes)])
                   for x in combine(reductions))
    return alone - combined


def terminal_values(g: Graph, heads: frozenset[str]) -> frozenset[int]:
    """The values no node of `heads` (primitives) reads, directly or through what is computed
    from them, loop carries included: with heads the contractions, a train step's gradients as
    its optimizer update reads them and the loss, not the activations (or their gradients)
    that feed a further matmul. The reductions of such values do not depend on each other
    unless an update reads one from another (a global norm), so XLA runs them as one or a few
    combined all-reduces whatever their number; the ILP prices them without their own latency
    (intra/problem.py)."""
    feeds = upstream(g, (), heads)  # values from which a head is reachable
    made = {v for node in g.nodes for v in node.outputs}
    return frozenset(made - feeds)


def gradient_values(g: Graph, heads: frozenset[str]) -> frozenset[int]:
    """The terminal values (terminal_values) from which an output tied to an input (the
    updated state) is reachable: the gradients and what the update computes of them, not the
    loss and the values only the loss reads (the loss's reductions hang off the forward
    pass's: on a split vocabulary XLA runs them apart from the gradients' combined all-reduce,
    each with its own latency)."""
    terminal = terminal_values(g, heads)
    tied = {v for v, tie in zip(g.outputs, g.output_ties) if tie is not None}
    reaches = upstream(g, tied)
    return frozenset((terminal & reaches) - reduced_again(g, terminal))


REDUCING = frozenset({"reduce_sum", "reduce", "dot", "conv", "scatter_add"})
"""Families whose strategies sum over a split dimension (a partial output or an all-reduce of
their own): the nodes where a gradient's reduction can happen."""

REDUCTIONS = frozenset({"reduce_sum", "reduce"})
"""Families of the reductions an optimizer runs over a gradient (norms, means of squares)."""


def reduced_again(g: Graph, terminal: frozenset[int]) -> frozenset[int]:
    """The terminal values an optimizer computes by reducing a gradient, and what it computes
    from them: a reduction (REDUCTIONS) of a value shaped as a state input (a parameter) and
    made, directly or through what is computed from it, by a reduction (REDUCING) of the
    step's tail: Adafactor's factored second moments and update RMS, a global norm. Split,
    each runs its own collective after the gradient's reduction it reads, and XLA's combiner
    stops a group at an all-reduce that depends on a member: one such reduction per parameter
    breaks the gradients' combined all-reduce into one per parameter
    (tests/test_intra_combiner.py::test_adafactor_keeps_the_gradients_all_reduce_combined,
    tests/test_alpa_shard_parallel.py::test_moe_lm_all_to_alls_and_few_all_reduces). They
    are priced with their own latency, not as members of the gradients' combined collective.
    A parameter's own norm (Adafactor's parameter scale) reads no gradient: not these."""
    state = {g.values[g.inputs[t]].shape for t in g.output_ties if t is not None}
    reduced: set[int] = set()
    second: set[int] = set()
    for node in g.nodes:  # program order: a value's makers come before its readers
        family = primitives.info(node.primitive).family
        if family in REDUCING or any(v in reduced for v in node.inputs):
            reduced.update(v for v in node.outputs if v in terminal)
        if any(v in second for v in node.inputs) or (family in REDUCTIONS and any(
                v in reduced and g.values[v].shape in state for v in node.inputs)):
            second.update(node.outputs)
    return frozenset(second & terminal)


PASSING = frozenset({"elementwise", "broadcast", "reshape", "squeeze", "transpose",
                     "identity"})
"""Families of the primitives that sum over no dimension: a whole value stays whole
through them, so they make no new partial sum to reduce."""


def loss_values(g: Graph, contractions: frozenset[str]) -> frozenset[int]:
    """The values the loss is finished from: made by a node, upstream of an output tied to no
    input, read (directly or through what is computed from them) only by elementwise and
    shape ops (PASSING), neither upstream of an output tied to an input (the updated state)
    nor downstream of a gradient (gradient_values, `contractions` its heads). No reduction follows theirs, none of the
    gradients' depends on theirs and theirs on none: XLA combines a reduction of the loss's
    sum over the batch with the gradients' all-reduce over the same devices
    (tests/test_intra_combiner.py::test_ilp_prices_data_parallel_as_compiled_and_beats_it:
    data parallel compiles to one all-reduce, the loss's and the gradients'; priced with its
    own latency, the loss's reduction would make the ILP gather the log-probabilities
    instead, to finish the loss on every device). The loss's
    earlier reductions (a split vocabulary's) are read by the backward pass: not these."""
    heads = frozenset(n.primitive for n in g.nodes
                      if primitives.info(n.primitive).family not in PASSING)
    grads = gradient_values(g, contractions)
    after = set(grads)
    for node in g.nodes:
        if any(v in after for v in node.inputs):
            after.update(node.outputs)
    tied = {v for v, tie in zip(g.outputs, g.output_ties) if tie is not None}
    untied = {v for v, tie in zip(g.outputs, g.output_ties) if tie is None}
    made = {v for node in g.nodes for v in node.outputs} & upstream(g, untied)
    return frozenset(made - upstream(g, (), heads) - upstream(g, tied) - after)


def upstream(g: Graph, seeds, heads: frozenset[str] = frozenset()) -> set[int]:
    """The values from which a value of `seeds` or a node of `heads` (primitives) is
    reachable, through nodes and loop carries (Graph.upstream)."""
    return set(g.upstream(seeds, heads))
