"""The memory model: every buffer a device holds during the step, when it is live, and how its
size depends on the members' choices; the ILP's memory rows and a plan's peak both read it.

It follows what `compiled.memory_analysis()` counts (argument + output + temp - alias):
- the step's inputs, live throughout; a state output tied to a donated input is that input's
  buffer (counted once), any other output is a buffer of its own, live throughout;
- each intermediate from the node that makes it to its last reader;
- each copy a reshard makes (an operand gathered, sliced or all-reduced into the layout its
  reader wants): XLA makes one copy per layout for all the readers that want it (an
  all-gathered kernel is kept from the forward pass to the backward), so a reader's copy is
  counted from the reader to the last reader of the value that could reshard it too;
- a state output computed in another layout than its input's: the result before the reshard;
- what XLA:CPU does that a list schedule of the jaxpr does not show, each measured on its live
  ranges (--xla_dump_to): a weight gathered for a dot, and a broadcast of what only the inputs
  feed, start before the first layer (its scheduler hoists them); a broadcast read by several
  ops is written once and kept; an elementwise op whose operands are both smaller than its
  result (a norm's 1/std times its scale) is written as its two broadcast operands.
What remains (XLA's heap gaps, the rest of its schedule) is the margin (MARGIN).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from shardplan.cost.model import FUSED
from shardplan.intra import ilp
from shardplan.ir import primitives

# Generators XLA:CPU runs as a loop of their own (threefry, partitioned as the plan says):
# the two 32-bit words it draws per element are both kept (the bits are their xor, fused
# into the readers), and the loop's counters are as large again while it runs.
GENERATORS = frozenset({"random_bits"})

# What the model does not see of XLA's buffers, as a share of the step's activations (every
# buffer but its inputs and outputs, which it counts exactly). Set against XLA's own liveness
# (the live-range dump, --xla_dump_to: "Stack trace breakdown for peak usage") over the zoo at
# test size on 2x4 devices, the model's live set at its peak is within 4% of XLA's (gpt -0.6%,
# bert -0.1%, llama -3.3%, moe +5.9%); what memory_analysis() reports is more: XLA's heap packs
# the temporaries into one allocation with gaps, 5-6% above their live peak (gpt 1.064, bert
# 1.057, llama 1.04). The margin covers the gaps and the model's error in XLA's favour; it is
# uncertain (a measured spread, not a model of the heap), and the plan's notes say so.
# (A bf16 step compiled on CPU is no evidence either way: XLA:CPU computes bf16 through f32
# buffers that a GPU or TPU never makes; shardplan.measure accounts for it.)
MARGIN = 0.10
# Scalars XLA:CPU's temp allocation holds that the model does not list (a partial sum and its
# all-reduced copy, loop counters, the offsets of 16-byte alignment): 16 bytes measured on a
# one-op step (tests/test_fuzz_plans.py), kept with room.
SMALL_TEMPS = 64.0


@dataclasses.dataclass(frozen=True, eq=False)
class Buffer:
    """A buffer whose size is `nbytes[k]` when root `root` makes its choice k."""

    root: int
    nbytes: np.ndarray
    start: int
    end: int
    what: str = ""  # what the buffer holds, for reports


@dataclasses.dataclass(frozen=True, eq=False)
class Copy:
    """A buffer that exists only when two roots' layouts of one value differ (ilp.Copy), over
    root choices rather than the ILP's representatives."""

    a: int
    key_a: np.ndarray
    bytes_a: np.ndarray
    b: int
    key_b: np.ndarray
    bytes_b: np.ndarray
    start: int
    end: int
    what: str = ""


def schedule(graph) -> list[int]:
    """The position of each node in the order XLA's memory-minimising scheduler would run
    them, approximated by its list scheduler: of the nodes whose operands are ready, run the
    one that frees the most bytes net of what it allocates (ties: program order). The
    jaxpr's own order runs, say, every first moment update of an optimizer before any second
    one, keeping every gradient alive that XLA frees leaf by leaf."""
    import heapq

    nodes = graph.nodes
    producer = {v: node.id for node in nodes for v in node.outputs}
    readers: dict[int, set[int]] = {}
    for node in nodes:
        for v in node.inputs:
            if v in producer:
                readers.setdefault(v, set()).add(node.id)
    pinned = set(graph.outputs)
    waiting = [len({producer[v] for v in node.inputs if v in producer}) for node in nodes]
    dependents: dict[int, set[int]] = {}
    for node in nodes:
        for v in node.inputs:
            if v in producer:
                dependents.setdefault(producer[v], set()).add(node.id)
    left = {v: len(r) for v, r in readers.items()}

    def priority(i):
        node = nodes[i]
        freed = sum(graph.values[v].nbytes for v in set(node.inputs)
                    if left.get(v) == 1 and v in producer and v not in pinned)
        made = sum(graph.values[v].nbytes for v in node.outputs)
        return (made - freed, i)

    heap = [priority(i) for i in range(len(nodes)) if waiting[i] == 0]
    heapq.heapify(heap)
    done, pos = set(), [0] * len(nodes)
    while heap:
        key, i = heapq.heappop(heap)
        if i in done or priority(i)[0] != key:
            if i not in done:
                heapq.heappush(heap, priority(i))
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


# Ops XLA's fusion duplicates into every consumer (InstructionFusion: not IsExpensive, and
# "effectively at most unary": one operand of the result's rank that is not a broadcast). A
# result of one that only fused ops read is never written; its operand stays live instead
# until the last of those reads (a dropout mask: the generator's bits kept for the backward).
_CHEAP = """
    abs add add_any and ceil clamp convert_element_type eq floor ge gt is_finite le lt max min
    mul ne neg not or round select_n shift_left shift_right_arithmetic shift_right_logical sign
    square sub xor bitcast_convert_type copy stop_gradient broadcast_in_dim reshape squeeze
    transpose slice pad rev iota integer_pow
"""
CHEAP = frozenset(_CHEAP.split())
# Ops that are not fused whatever the table says: XLA:CPU runs them as loops of their own.
UNFUSED = GENERATORS | {"threefry2x32"}
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                        "argmin", "reduce_and", "reduce_or"})


def _unary(graph, node, producer) -> bool:
    """At most one operand of the result's rank that is not a broadcast or an iota."""
    out = max((graph.values[v].ndim for v in node.outputs), default=0)

    def big(v):
        value = graph.values[v]
        if value.is_literal or value.ndim < out:
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


def _outer(graph, node, v) -> bool:
    """An elementwise op of two operands each smaller than its result (a layer norm's
    1/std [b, s, 1] times its scale [1, 1, h]): XLA:CPU writes both operands broadcast to the
    result's shape and fuses the product into every reader (the live ranges of a GPT on 8
    devices), two buffers of the result's size where the model would see one."""
    if node.primitive not in CHEAP or len(node.inputs) != 2:
        return False
    size = graph.values[v].size
    return all(not graph.values[u].is_literal and graph.values[u].size < size
               for u in node.inputs)


def lifetimes(graph, pos, readers, outputs) -> tuple[set[int], dict[int, int]]:
    """(values XLA never writes, the position of each value's last read). A value is never
    written when its producer is fused into its readers: an op read once by another fused op,
    or a cheap unary op (CHEAP) that only fused ops read; the reads of such a value read its
    producer's operands, so their last read moves to the value's. A reduction's operand is
    written (XLA:CPU runs a reduction as a library fusion or a reduce-window tree that takes in
    no producer, or only the last one: counted written, the safe side)."""
    producer = {v: node.id for node in graph.nodes for v in node.outputs}
    fused = FUSED - UNFUSED
    takes_in = fused - REDUCTIONS
    virtual: set[int] = set()
    last: dict[int, int] = {}
    for node in reversed(graph.nodes):
        for v in node.outputs:
            rs = readers.get(v, ())
            if not rs:
                continue
            last[v] = max(max(pos[r] for r in rs),
                          max((last[o] for r in rs for o in graph.nodes[r].outputs
                               if o in virtual), default=0))
            if v in outputs or node.primitive not in fused:
                continue
            if all(graph.nodes[r].primitive in takes_in for r in rs) and (
                    len(rs) == 1 or (node.primitive in CHEAP and _unary(graph, node, producer)
                                     and not _materialised(graph, node, rs))):
                virtual.add(v)
    return virtual, last


def _keys(a: Sequence, b: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Equal specs -> equal ints, across both sides."""
    index: dict = {}  # specs are frozen dataclasses: equal specs hash equal
    ka = np.array([index.setdefault(s, len(index)) for s in a])
    kb = np.array([index.setdefault(s, len(index)) for s in b])
    return ka, kb


class MemoryModel:
    """The buffers of a Problem (see the module docstring); `donated` are the flat input
    indices whose buffers the step may reuse for their tied outputs; activations are counted
    (1 + margin) times (MARGIN)."""

    def __init__(self, problem, donated: frozenset[int] | None = None, margin: float = 0.0):
        from shardplan.intra.problem import is_tensor

        self.problem = p = problem
        g = p.graph
        self.n = n = len(g.nodes)
        donated = frozenset(range(p.num_inputs)) if donated is None else donated
        cost, root = p.cost, p.groups.root
        self.buffers: list[Buffer] = []
        self.copies: list[Copy] = []
        end = max(n - 1, 0)

        self.scale = scale = 1.0 + margin

        def sizes(v, m, out_idx):
            r = root[m]
            return np.ceil([cost.value_bytes(g.values[v], p.out_spec(m, out_idx, k))
                            for k in range(len(p.strategies[r]))])

        self.pos = pos = schedule(g)
        readers: dict[int, list[int]] = {}
        for node in g.nodes:
            for v in set(node.inputs):
                readers.setdefault(v, []).append(node.id)
        for i, v in enumerate(g.inputs):
            self.buffers.append(Buffer(root[i], sizes(v, i, 0), 0, end, f"input {i}"))
        if p.num_inputs:
            self.buffers.append(Buffer(root[0], np.full(len(p.strategies[root[0]]), SMALL_TEMPS),
                                       0, end, "small temporaries"))
        outputs = {}
        for j, v in enumerate(g.outputs):
            outputs.setdefault(v, []).append(j)
        self.virtual, self.last = virtual, last = lifetimes(g, pos, readers, outputs)
        # XLA's scheduler runs what only the step's inputs feed (a weight gathered for a dot,
        # a layer norm's scale broadcast) as soon as it can: the live ranges it dumps start
        # every gathered kernel and broadcast scale of a 2-layer GPT or ViT before the first
        # layer runs, not at their readers. They start at the first op that reads an input
        # and is not fused (the first layer's first dot or gather).
        self.first = min((pos[r] for v in g.inputs for r in readers.get(v, ())
                          if g.nodes[r].primitive not in FUSED), default=0)
        static = set(g.inputs)
        for node in g.nodes:
            if all(v in static or g.values[v].is_literal for v in node.inputs):
                static.update(node.outputs)
        for node in g.nodes:
            m = p.num_inputs + node.id
            for k, v in enumerate(node.outputs):
                if not is_tensor(g.values[v]) or (v not in readers and v not in outputs):
                    continue
                js = outputs.get(v, [])
                ties = [g.output_ties[j] for j in js if g.output_ties[j] is not None]
                if not js:
                    if v in virtual:
                        continue
                    nbytes = scale * sizes(v, m, k)
                    if _outer(g, node, v):
                        nbytes = 2 * nbytes
                    if node.primitive in GENERATORS:
                        nbytes = 2 * nbytes
                        self.buffers.append(Buffer(root[m], nbytes, pos[node.id], pos[node.id],
                                                  f"{node.primitive} {node.name} counters"))
                    start = pos[node.id]
                    if node.primitive == "broadcast_in_dim" and v in static:
                        start = min(start, self.first)
                    self.buffers.append(Buffer(root[m], nbytes, start,
                                               last[v], f"{node.primitive} {node.name}"))
                    continue
                if len(ties) < len(js):
                    # An output of its own: memory_analysis counts it for the whole program.
                    self.buffers.append(Buffer(root[m], sizes(v, m, k), 0, end, f"output {js}"))
                for t in ties:
                    if t not in donated:
                        self.buffers.append(Buffer(root[t], sizes(g.inputs[t], t, 0), 0, end,
                                                  f"output tied to undonated input {t}"))
                    # Computed in another layout than its input's, the result is a temporary.
                    ka, kb = _keys([p.out_spec(m, k, c) for c in range(len(p.strategies[root[m]]))],
                                   [p.out_spec(t, 0, c) for c in range(len(p.strategies[root[t]]))])
                    self.copies.append(Copy(root[m], ka, scale * sizes(v, m, k), root[t], kb,
                                            np.zeros(len(kb)), pos[node.id], pos[node.id],
                                            f"state {t} computed in another layout"))
        self._add_operand_copies(is_tensor)

    def _add_operand_copies(self, is_tensor) -> None:
        p = self.problem
        g, root = p.graph, p.groups.root
        readers: dict[int, list[tuple[int, int]]] = {}
        for node in g.nodes:
            for i, v in enumerate(node.inputs):
                value = g.values[v]
                if is_tensor(value) and value.ndim > 0 and v in p.producer:
                    readers.setdefault(v, []).append((p.num_inputs + node.id, i))
        bytes_of: dict = {}  # (shape, spec) -> bytes: repeated layers read the same
        first = self.first  # gathered inputs start there (see __init__)
        for v in sorted(readers):
            src, out_idx = p.source[v]
            rs = root[src]
            srcs = [p.out_spec(src, out_idx, k) for k in range(len(p.strategies[rs]))]
            # Readers in the producer's group take its layout as it is (never a copy).
            movers = [(m, i) for m, i in readers[v] if root[m] != rs]
            if not movers:
                continue
            # A copy is shared with the later readers that could want the same layout: the
            # ops that gather an operand (a dot, a gather...), not the fused elementwise ones
            # (an optimizer's update reads a weight in its own layout, not the gathered one).
            heavy = [self.pos[m - p.num_inputs] for m, _ in movers
                     if g.nodes[m - p.num_inputs].primitive not in FUSED]
            seen = set()
            for m, i in movers:
                rm = root[m]
                dsts = [p.in_spec(m, i, k) for k in range(len(p.strategies[rm]))]
                key = (rm, tuple(dsts))
                if key in seen or len(set(dsts).union(srcs)) == 1:
                    continue
                seen.add(key)
                ka, kb = _keys(srcs, dsts)
                value = g.values[v]
                shape = (value.shape, value.dtype, value.itemsize)
                for d in dsts:
                    if (shape, d) not in bytes_of:
                        bytes_of[(shape, d)] = p.cost.value_bytes(value, d)
                nbytes = self.scale * np.ceil([bytes_of[(shape, d)] for d in dsts])
                at = self.pos[m - p.num_inputs]
                last = max([at, *(t for t in heavy if t > at)])
                what = f"{g.nodes[m - p.num_inputs].primitive} {g.nodes[m - p.num_inputs].name}"
                start = at
                if src < p.num_inputs and heavy and at == min(heavy):
                    # the first gathering reader's copy, which the later ones share if they
                    # read the same layout (theirs start at their reader: never hoisted twice)
                    start = min(at, first)
                self.copies.append(Copy(rs, ka, np.zeros(len(ka)), rm, kb, nbytes, start, last,
                                        f"reshard of v{v} for {what}"))
                if primitives.info(g.nodes[m - p.num_inputs].primitive).leader:
                    # A gathered operand of a dot is copied once more into the layout the dot
                    # reads (XLA's layout assignment), for the moment of the dot.
                    self.copies.append(Copy(rs, ka, np.zeros(len(ka)), rm, kb, nbytes, at, at,
                                            f"layout copy of v{v} for {what}"))

    # -- points -----------------------------------------------------------------------------

    def points(self) -> list[tuple[list[int], list[int]]]:
        """(buffers, copies) live at each point where the live set can peak: a point whose live
        set is contained in another's never peaks alone. With intervals: the last point before
        some buffer ends, if a buffer started since the previous such point."""
        cached = self.__dict__.get("_points")
        if cached is not None:
            return cached
        items = [(b.start, b.end) for b in self.buffers] + [(c.start, c.end) for c in self.copies]
        if not items:
            return []
        starts = np.array([a for a, _ in items])
        ends = np.array([b for _, b in items])
        start_points = np.unique(starts)
        nb = len(self.buffers)
        out, prev = [], -1
        for t in np.unique(ends):
            if not ((start_points > prev) & (start_points <= t)).any():
                continue  # nothing new since the previous point: this set is contained in it
            prev = t
            live = np.flatnonzero((starts <= t) & (ends >= t))
            out.append(([int(x) for x in live if x < nb], [int(x) - nb for x in live if x >= nb]))
        self.__dict__["_points"] = out
        return out

    # -- the ILP's rows -----------------------------------------------------------------------

    def solver_terms(self, index: Mapping[int, int], num_reps: int):
        """(base, rows, copies, row_copies) for ilp.SolverInput: terms over representatives
        (`index`: root -> representative). Buffers live at every point form the base."""
        pts = self.points()
        always = set(range(len(self.buffers)))
        for bufs, _ in pts:
            always &= set(bufs)

        def unary(ids, extra=()):
            by: dict[int, np.ndarray] = {}
            for i in ids:
                b = self.buffers[i]
                by[index[b.root]] = by.get(index[b.root], 0) + b.nbytes
            for rep, arr in extra:
                by[rep] = by.get(rep, 0) + arr
            return tuple(sorted(by.items(), key=lambda kv: kv[0]))

        copies, copy_id, diag = [], {}, {}
        for j, c in enumerate(self.copies):
            ia, ib = index[c.a], index[c.b]
            if ia == ib:
                diag[j] = (ia, np.where(c.key_a != c.key_b, c.bytes_a + c.bytes_b, 0.0))
            else:
                copy_id[j] = len(copies)
                copies.append(ilp.Copy(ia, c.key_a, c.bytes_a, ib, c.key_b, c.bytes_b))
        base = unary(sorted(always)) if pts else ()
        rows, row_copies, seen = [], [], set()
        for bufs, cps in pts:
            row = unary([b for b in bufs if b not in always], [diag[j] for j in cps if j in diag])
            rc = tuple(sorted(copy_id[j] for j in cps if j in copy_id))
            key = (tuple((r, a.tobytes()) for r, a in row), rc)
            if key in seen:
                continue
            seen.add(key)
            rows.append(row)
            row_copies.append(rc)
        return base, tuple(rows), tuple(copies), tuple(row_copies)

    # -- a chosen plan's peak ----------------------------------------------------------------

    def peak(self, root_choice: Mapping[int, int]) -> float:
        """The peak bytes per device when each root r takes choice root_choice[r]: the most
        bytes live at one moment, swept over the buffers' intervals (the maximum is at one of
        the points(), where the rows are)."""
        items = [(b.start, b.end, float(b.nbytes[root_choice[b.root]])) for b in self.buffers]
        for c in self.copies:
            ka, kb = root_choice[c.a], root_choice[c.b]
            if c.key_a[ka] != c.key_b[kb]:
                items.append((c.start, c.end, float(c.bytes_a[ka] + c.bytes_b[kb])))
        if not items:
            return 0.0
        starts, ends, sizes = (np.array(x) for x in zip(*items))
        change = np.zeros(int(ends.max()) + 2)
        np.add.at(change, starts.astype(int), sizes)
        np.add.at(change, ends.astype(int) + 1, -sizes)
        return max(0.0, float(np.cumsum(change).max()))


# -- XLA:CPU's view of a narrow-float step ----------------------------------------------------

NARROW_FLOATS = frozenset({"bfloat16", "float16"})


def cpu_widening(graph) -> float:
    """The share of XLA:CPU's temporaries that a device computing in bf16/f16 natively holds.

    XLA:CPU has no bf16 arithmetic: it normalises every bf16 op to f32 (FloatNormalization)
    and keeps the f32 results between fusions (measured: a bf16 GPT's compiled peak on CPU
    equals the f32 GPT's, to the byte), so a bf16 step compiled on CPU devices standing in for
    a GPU or TPU holds its bf16 intermediates twice over. This is the peak of the step's
    intermediates (not its inputs and outputs, whose buffers keep their dtype) under the
    memory model's schedule and lifetimes, at their own widths, over the same peak with every
    narrow float held as f32: 1.0 for a step without narrow floats. A model, not a
    measurement (the target's program cannot be compiled on CPU): shardplan.measure says so
    where it uses it."""
    if not any(v.dtype in NARROW_FLOATS for v in graph.values):
        return 1.0
    pos = schedule(graph)
    readers: dict[int, list[int]] = {}
    for node in graph.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    outputs = {v: [j] for j, v in enumerate(graph.outputs)}
    virtual, last = lifetimes(graph, pos, readers, outputs)
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
