"""When XLA holds each value of a step: the order its scheduler runs the nodes in (a list
schedule), which values its fusion never writes, and when each written value is last read; and
what XLA:CPU's widening of narrow floats adds. intra/memory/model.py builds its buffers on these."""

from __future__ import annotations

import heapq

import numpy as np

from shardplan.cost.model import FUSED
from shardplan.intra.memory import compilers, dot_operands
from shardplan.intra.memory.dot_operands import backward
from shardplan.ir import primitives


def schedule(graph, unwritten: frozenset[int] = frozenset(),
             in_place: frozenset[int] = frozenset()) -> list[int]:
    """The position of each node in the order XLA's memory-minimising scheduler would run
    them, approximated by its list scheduler: of the nodes whose operands are ready, run the
    one that frees the most bytes net of what it allocates (ties: program order); values in
    `unwritten` (fused into their readers) are no buffers, and outputs `in_place` (a state
    update written into its input's buffer) allocate nothing. The
    jaxpr's own order runs, say, every first moment update of an optimizer before any second
    one, keeping every gradient alive that XLA frees leaf by leaf."""
    nodes = graph.nodes
    producer = {v: node.id for node in nodes for v in node.outputs}
    readers: dict[int, set[int]] = {}
    for node in nodes:
        for v in node.inputs:
            if v in producer:
                readers.setdefault(v, set()).add(node.id)
    pinned = set(graph.outputs)
    # A loop's results wait for its body: a loop_result reads the carry as it enters (the
    # graph's one iteration), but XLA's while loop hands its results on after the last
    # iteration. Without this the backward scan's body ran beside the forward's (Llama2-70B's
    # memory model peaked with both scans' attention live at once).
    after = {node.id: {producer[v] for v in node.inputs if v in producer} for node in nodes}
    for loop in graph.loops:
        body = {i for b in loop.bodies for i in b.nodes}
        for i in loop.leave:
            after[i] |= body
    waiting = [len(after[node.id]) for node in nodes]
    dependents: dict[int, set[int]] = {}
    for j, before in after.items():
        for i in before:
            dependents.setdefault(i, set()).add(j)
    left = {v: len(r) for v, r in readers.items()}
    # per node: the bytes it writes, and its operands that its run may free with their bytes
    made = [sum(graph.values[v].nbytes for v in node.outputs
                if v not in unwritten and v not in in_place) for node in nodes]
    freeable = [[(v, graph.values[v].nbytes) for v in set(node.inputs)
                 if v in producer and v not in pinned and v not in unwritten] for node in nodes]

    def priority(i):
        return (made[i] - sum(b for v, b in freeable[i] if left.get(v) == 1), i)

    heap = [priority(i) for i in range(len(nodes)) if waiting[i] == 0]
    heapq.heapify(heap)
    done, pos = set(), [0] * len(nodes)
    while heap:
        # A node's priority only falls (an operand's last reader it becomes), and each fall
        # pushes it again: its first entry out is its current priority, later ones are stale.
        _, i = heapq.heappop(heap)
        if i in done:
            continue
        pos[i] = len(done)
        done.add(i)
        for v in set(nodes[i].inputs):
            if v in left:
                left[v] -= 1
                if left[v] == 1:
                    # its last reader now frees it: ask that reader again
                    for j in readers[v]:
                        if j not in done and waiting[j] == 0:
                            heapq.heappush(heap, priority(j))
        for j in sorted(dependents.get(i, ())):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(heap, priority(j))
    return pos


# Ops XLA's fusion duplicates into every consumer (the primitive table's `duplicated`), where
# "effectively at most unary": one operand of the result's rank that is not a broadcast. A
# result of one that only fused ops read is never written; its operand stays live instead
# until the last of those reads (a dropout mask: the generator's bits kept for the backward).
CHEAP = frozenset(n for n, i in primitives.PRIMITIVES.items() if i.duplicated)
# A scan's stacked ys: a buffer of every iteration's row, written whole (its row in the body is
# the value written in place), whoever reads it: never fused into a reader.
STACKED = frozenset({"loop_stack"})
REDUCTIONS = frozenset(n for n, i in primitives.PRIMITIVES.items() if i.reduction)


def _unary(graph, node, producer) -> bool:
    """At most one operand of the result's size that is not a broadcast or an iota (an operand
    of size-1 dimensions, a layer norm's 1/std [b, s, 1] or scale [1, 1, h], is broadcast in
    the fusion: XLA:CPU fuses their product into each reader, gpt-6.7b on 8x8 and GPT at test
    size alike, and writes neither)."""
    out = max((graph.values[v].size for v in node.outputs), default=0)

    def big(v):
        value = graph.values[v]
        if value.is_literal or value.size < out:
            return False
        return v not in producer or graph.nodes[producer[v]].primitive not in ("broadcast_in_dim",
                                                                               "iota")
    return sum(map(big, node.inputs)) <= 1


def _materialised(graph, node, rs) -> bool:
    """A broadcast that several ops read (a layer norm's scale or 1/std, read in the forward
    and the backward pass): XLA:CPU writes it once (common subexpressions merged, not fused
    into the readers) and keeps it from the first read to the last; the live ranges of a GPT
    on 8 devices held ten activation-sized broadcasts at the peak."""
    if node.primitive != "broadcast_in_dim" or len(rs) < 2:
        return False
    return all(graph.values[o].size > graph.values[node.inputs[0]].size for o in node.outputs)


# What a compiler that recomputes (compilers.Rules.recomputes) recomputes in each reader.
RECOMPUTED = frozenset({"elementwise", "broadcast", "reshape", "squeeze", "transpose", "slice",
                        "split", "rev", "iota", "random", "random_bits"})


def _recomputable(graph, node, rs) -> bool:
    """An elementwise value (or a reshape of one...) that no reduction reads: recomputed in
    every fusion that reads it (a reduction's fusion writes what it shares with others). But
    a forward value that a reduction reads and, beside it, only the backward pass: recomputed
    there, not written (the loss's softmax exp over the vocabulary, which its sum reads: the
    TPU compiler recomputes it from the logits in the backward, the MoE of
    tests/test_memory_tpu.py on v5e 2x4; the attention's exp, which the normalising divide
    reads in the forward too, is written)."""
    if primitives.info(node.primitive).family not in RECOMPUTED:
        return False
    others = [graph.nodes[r] for r in rs if graph.nodes[r].primitive not in REDUCTIONS]
    if len(others) == len(rs):
        return True
    return bool(others) and not backward(node) and all(map(backward, others))


def literal_broadcasts(graph) -> set[int]:
    """The broadcasts of a literal (attention's -inf): made in each reader's layout, fused
    into it, never resharded (Llama2-70B's rematerialized backward on 16x16 was counted a
    2 GiB copy of one; tests/test_intra_liveness.py::
    test_a_broadcast_literal_is_never_resharded)."""
    return {v for node in graph.nodes if node.primitive == "broadcast_in_dim"
            and all(graph.values[u].is_literal for u in node.inputs) for v in node.outputs}


def constants(graph) -> set[int]:
    """The values computed from literals alone (no input of the step feeds them)."""
    constant: set[int] = set()
    for node in graph.nodes:
        if all(graph.values[u].is_literal or u in constant for u in node.inputs):
            constant.update(node.outputs)
    return constant


def _scattered_into_add(graph, node, rs, constant) -> bool:
    """A scatter-add into constant zeros that an add alone reads (a gather's gradient summed
    with another, the loss's softmax gradient or a tied embedding's): XLA scatters into the
    add's other operand in place (its algebraic simplifier)."""
    return (node.primitive == "scatter-add" and bool(node.inputs)
            and node.inputs[0] in constant
            and all(graph.nodes[r].primitive in ("add", "add_any") for r in rs))


def _folded(graph, node, v, rs, constant, readers) -> bool:
    """Values XLA's simplification passes leave unwritten, measured on the live ranges of the
    zoo's steps (--xla_dump_to):
    - a broadcast of a constant (the zeros a gather's gradient is scattered into): fused into
      its readers, unless a scatter-add that XLA does not fold into an add reads it: that
      scatter updates the zeros in place, written where the step starts (the scheduler
      hoists what no input feeds) and held to the scatter (llama's untied embedding at test
      size on 8 devices: its table's gradient, 64 KiB of zeros held through the forward
      pass, 7% of its compiled peak);
    - a scatter-add into such zeros that an add alone reads (_scattered_into_add): no buffer
      of its own;
    - a transpose that only dots read: folded into the dots' dimension numbers."""
    prim = node.primitive
    if prim == "broadcast_in_dim" and v in constant:
        return not any(graph.nodes[r].primitive == "scatter-add" and not _scattered_into_add(
            graph, graph.nodes[r], readers.get(graph.nodes[r].outputs[0], ()), constant)
            for r in rs)
    if prim == "scatter-add":
        return _scattered_into_add(graph, node, rs, constant)
    if prim == "transpose":
        return all(graph.nodes[r].primitive == "dot_general" for r in rs)
    return False


def _loop_operand(graph, node, rs) -> bool:
    """A value made outside a loop (scan, while, cond) that a node of the loop's body reads
    (a constant of the loop): XLA passes it into its while loop as an operand, which the
    body's fusions cannot take in, so it is written whole and held through the loop; but a
    broadcast of a literal, which XLA sinks into the body (WhileLoopConstantSinking) and fuses
    there. On the TPU compiler (Llama2-7B, layers scanned, on v5e 4x4: benchmarks/tpu_check.py)
    the causal mask broadcast to [b, heads, t, t] before the layers' scans, where JAX hoists
    what both scans read, was written (2 GiB a device) and held through both; the -inf
    broadcast beside it was sunk."""
    if node.primitive == "broadcast_in_dim" and all(graph.values[u].is_literal
                                                    for u in node.inputs):
        return False
    return any(graph.nodes[r].loop != node.loop for r in rs)


def unwritten(graph, readers, outputs, rules: compilers.Rules = compilers.CPU) -> set[int]:
    """The values XLA never writes. A value is never written when its producer is fused into
    its readers: an op read once by another fused op, or a cheap unary op (CHEAP) that only
    fused ops read; or when XLA's simplifier folds it (_folded). A reduction's operand is
    written unless the compiler's reductions fuse their producers (XLA:CPU runs a reduction as
    a library fusion or a reduce-window tree that takes in no producer, or only the last one:
    counted written, the safe side). A loop's constant is written (_loop_operand), and so is a
    value that several dots read on the TPU compiler (dot_operands.written)."""
    producer = {v: node.id for node in graph.nodes for v in node.outputs}
    fused = (FUSED | rules.also_fused) - rules.unfused
    takes_in = fused if rules.reductions_fuse_producers else fused - REDUCTIONS
    if rules.dots_fuse_producers:
        takes_in = takes_in | {"dot_general"}
    constant = constants(graph)
    virtual: set[int] = set()
    for node in graph.nodes:
        for v in node.outputs:
            rs = readers.get(v, ())
            if not rs or v in outputs:
                continue
            fused_in = node.primitive in fused and node.primitive not in STACKED and all(
                graph.nodes[r].primitive in takes_in for r in rs) and (
                len(rs) == 1 or (node.primitive in CHEAP and _unary(graph, node, producer)
                                 and not (rules.shared_broadcasts
                                          and _materialised(graph, node, rs)))
                or (rules.recomputes and _recomputable(graph, node, rs))) and not (
                rules.output_fusions and dot_operands.written(graph, node, rs, producer, readers))
            if (fused_in or _folded(graph, node, v, rs, constant, readers)) and not (
                    _loop_operand(graph, node, rs)):
                virtual.add(v)
    return virtual


def recast(graph, readers, virtual, rules: compilers.Rules = compilers.CPU) -> set[int]:
    """Casts to a wider float written for the forward pass, which the backward pass recasts
    where it reads them, on a compiler that recomputes (Rules.recomputes): the logits of
    GPT-2 124M and of the zoo's MoE on v5e 4x4 (benchmarks/xla_live.py on their dumps), cast
    to f32 and read by the loss's reductions beside its other forward ops (so written:
    _recomputable), dead 2 to 4 steps later; the bf16 logits are held to the backward pass.
    lifetimes moves the backward pass's reads of them to what they cast."""
    if not rules.recomputes:
        return set()
    return {v for node in graph.nodes if node.primitive == "convert_element_type"
            and not backward(node) for v in node.outputs
            if v not in virtual and readers.get(v)
            and graph.values[v].itemsize > graph.values[node.inputs[0]].itemsize}


def loop_ends(graph, pos) -> dict[int, int]:
    """The position of each loop's last node. A scan's stacked input read in another layout
    than it is made in is resharded whole before the loop and passed into it: the copy is held
    to the loop's end, not only where the loop slices it (Llama2-70B on 16x16, f32 weights,
    layers scanned: each stacked weight gathered over `data` for all 80 layers at once, 9 GiB
    a chip held through the forward and backward loops; model.py's operand copies,
    tests/test_memory_fit.py::test_a_stacked_weight_resharded_for_its_scan_is_held_through_the_loop)."""
    return {loop.id: max((pos[n] for b in loop.bodies for n in b.nodes + loop.leave),
                         default=0) for loop in graph.loops}


def _reads(graph, v, pos, readers, virtual, seen=None) -> tuple[int, int]:
    """The last read of `v` in the forward pass and in the backward one (0: none), through
    its readers that are never written (a value recomputed in its readers is read where they
    run)."""
    seen = {} if seen is None else seen
    if v not in seen:
        fwd = bwd = 0
        for r in readers.get(v, ()):
            node = graph.nodes[r]
            if backward(node):
                bwd = max(bwd, pos[r])
            else:
                fwd = max(fwd, pos[r])
            for o in node.outputs:
                if o in virtual:
                    f, b = _reads(graph, o, pos, readers, virtual, seen)
                    fwd, bwd = max(fwd, f), max(bwd, b)
        seen[v] = (fwd, bwd)
    return seen[v]


def lifetimes(graph, pos, readers, outputs, virtual=None, recasts=frozenset()
              ) -> tuple[set[int], dict[int, int]]:
    """(values XLA never writes (unwritten, unless given), the position of each value's last
    read). The reads of a value never written read its producer's operands, so their last
    read moves to the value's; so do the backward pass's reads of the `recasts` (recast)."""
    if virtual is None:
        virtual = unwritten(graph, readers, outputs)
    ends = loop_ends(graph, pos)
    parent = {loop.id: loop.parent for loop in graph.loops}

    def chain(loop):  # the loops around a node, innermost first
        out = []
        while loop is not None:
            out.append(loop)
            loop = parent[loop]
        return out

    last: dict[int, int] = {}
    recast_to: dict[int, int] = {}
    for node in reversed(graph.nodes):
        around = set(chain(node.loop))
        for v in node.outputs:
            # A scan writes each row of its stacked output in place: the row is no buffer
            # beyond the stack's (tests/test_intra_liveness.py::
            # test_a_scans_inputs_are_held_through_its_loop_and_its_rows_written_in_place)
            rs = [r for r in readers.get(v, ()) if graph.nodes[r].primitive not in STACKED]
            if not readers.get(v):
                continue
            at = [pos[node.id]]
            fwd, bwd = _reads(graph, v, pos, readers, virtual) if v in recasts else (0, 0)
            if bwd:  # its forward reads; the backward's are its operand's
                at.append(fwd)
                recast_to[v], rs = bwd, []
            for r in rs:
                at.append(pos[r])
                # read in a loop it is made outside of (a loop's constant, a scan's stacked
                # input; not a carry's initial value, which the loop's carry takes over): read
                # again each iteration, so held to the outermost such loop's end
                if graph.nodes[r].primitive != "loop_carry":
                    outer = [lp for lp in chain(graph.nodes[r].loop) if lp not in around]
                    if outer:
                        at.append(ends[outer[-1]])
                at.extend(last[o] for o in graph.nodes[r].outputs if o in virtual and o in last)
                at.extend(recast_to[o] for o in graph.nodes[r].outputs if o in recast_to)
            last[v] = max(at)
    return virtual, last


# XLA:CPU runs a reduction of at least this many elements per device (or of an operand that
# large) through YNNPACK (ynn_support.cc, IsInstructionPreferredByYnn), a GPT at test size on 8
# devices ([1, 16, 64]) through its own reduce emitter.
YNN_MIN_ELEMENTS = 4096
YNN_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min"})
YNN_BINARY = frozenset({"add", "add_any", "sub", "mul", "div", "max", "min", "pow"})


def first_reads(graph, pos, readers, virtual) -> dict[int, int]:
    """The position of the first read of each value never written (`virtual`): its readers
    run where the first of theirs that is written does, since they are fused into it (a
    weight's transpose, which only the inputs feed and the list scheduler runs first, is read
    where its dot runs)."""
    first: dict[int, int] = {}
    for node in reversed(graph.nodes):
        for v in node.outputs:
            if v in virtual and readers.get(v):
                first[v] = min(min((first[o] for o in graph.nodes[r].outputs if o in first),
                                   default=pos[r]) for r in readers[v])
    return first


def ynn_broadcasts(graph, readers, virtual) -> list[tuple[int, int, int]]:
    """(node, operand, reduction): a binary elementwise node that only a reduction reads, and
    its operand that XLA broadcasts to the node's shape. XLA:CPU's YNNPACK reduction fuses the
    node but not the broadcast: it writes the operand broadcast, scheduled where the operand
    is made (where the step starts, for what only the inputs feed) and kept to the reduction.
    A layer norm's backward pass reduces its 1/std [b, s, 1] and its scale [1, 1, h] times the
    incoming gradient: ViT at test size on 8 devices held both broadcasts of each of its four
    norms from the forward pass on (8 activation-sized buffers, a fifth of its peak).
    Whether a reduction is large enough for YNNPACK depends on the layout: the caller checks
    the node's size per device against YNN_MIN_ELEMENTS."""
    producer = {v: node.id for node in graph.nodes for v in node.outputs}
    found = []
    for node in graph.nodes:
        if node.primitive not in YNN_BINARY or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        rs = readers.get(out, ())
        if len(rs) != 1 or graph.nodes[rs[0]].primitive not in YNN_REDUCTIONS:
            continue
        size = graph.values[out].size
        for u in dict.fromkeys(node.inputs):
            value = graph.values[u]
            if u in virtual and u in producer and (
                    graph.nodes[producer[u]].primitive == "broadcast_in_dim"):
                u = graph.nodes[producer[u]].inputs[0]  # an explicit broadcast, fused
                value = graph.values[u]
            if not value.is_literal and 1 < value.size < size:
                found.append((node.id, u, rs[0]))
    return found


# -- XLA:CPU's view of a narrow-float step ----------------------------------------------------

NARROW_FLOATS = frozenset({"bfloat16", "float16"})


def cpu_widening(graph) -> float:
    """The share of XLA:CPU's temporaries that a device computing in bf16/f16 natively holds.

    The XLA:CPU of jax 0.10 has no bf16 arithmetic: it normalises every bf16 op to f32
    (FloatNormalization) and keeps the f32 results between fusions (tests/test_memory_fit.py::
    test_xla_cpu_computes_bf16_in_f32_and_the_widening_says_how_much_the_target_keeps), so a
    bf16 step compiled on CPU devices standing in for a GPU or TPU holds its bf16 intermediates
    twice over; the XLA:CPU of jax 0.12 keeps them in bf16, and analysis.targets.widens (a
    probe compile) says which one is in use: only there is this share applied. This is the peak of the step's intermediates (not its inputs and outputs, whose
    buffers keep their dtype) under the memory model's schedule and lifetimes, at their own
    widths, over the same peak with every narrow float held as f32: 1.0 for a step without
    narrow floats. A model, not a measurement (the target's program cannot be compiled on CPU):
    shardplan.planning.select says so where it uses it."""
    if not any(v.dtype in NARROW_FLOATS for v in graph.values):
        return 1.0
    readers: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    outputs = {v: [j] for j, v in enumerate(graph.outputs)}
    virtual = unwritten(graph, readers, outputs)
    tied = frozenset(v for j, v in enumerate(graph.outputs) if graph.output_ties[j] is not None)
    pos = schedule(graph, frozenset(virtual), tied)
    virtual, last = lifetimes(graph, pos, readers, outputs, virtual)
    n = len(graph.nodes) + 1
    native, widened = np.zeros(n + 1), np.zeros(n + 1)
    for node in graph.nodes:
        for v in node.outputs:
            value = graph.values[v]
            if v in virtual or v in outputs or v not in last or value.ndim == 0:
                continue
            a, b = pos[node.id], last[v] + 1
            native[a] += value.nbytes
            native[b] -= value.nbytes
            wide = value.size * 4 if value.dtype in NARROW_FLOATS else value.nbytes
            widened[a] += wide
            widened[b] -= wide
    top = float(np.cumsum(widened).max())
    return float(np.cumsum(native).max()) / top if top > 0 else 1.0
