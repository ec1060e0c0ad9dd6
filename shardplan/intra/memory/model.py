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
- what the compiler does that a list schedule of the jaxpr does not show, as its Rules say
  (intra/memory/compilers.py: one value per compiler, from IntraOptions.compiler, the target's
  HardwareProfile.backend). XLA:CPU's rules hold for a CPU target and for a GPU one (no GPU
  compiler runs here without a GPU to measure: a GPU's plans are checked where they are
  compiled); the TPU compiler's below them. XLA:CPU, each measured on its live
  ranges (--xla_dump_to): a weight gathered for a dot, and a broadcast of what only the inputs
  feed, start before the first layer (its scheduler hoists them); a broadcast read by several
  ops is written once and kept; an elementwise op whose operands are both smaller than its
  result (a norm's 1/std times its scale) is fused into its readers, never written, but a
  reduction of 4096 elements or more a device (YNNPACK's) reads such an operand broadcast,
  written from where it is made (a norm's backward: its scale and 1/std); a scan's
  stacked ys are made before the first layer; a weight that a later dot reads in a larger
  layout than the first one's is held in the larger from the first layer; gradients reduced
  by XLA's combined all-reduce (a scattered one too) are held until it runs, and its results
  are live with them; a later dot shares the copy an earlier reader holds when their layouts
  are one; a convolution's operand laid out otherwise than NHWC/HWIO is copied transposed.
  The TPU compiler (its heap peak: tests/test_memory_tpu.py, benchmarks/tpu_check.py) keeps
  bf16 narrow, fuses the generator and each elementwise value into its readers (dots and
  reductions too), recomputed there but where liveness.unwritten says, reduces each gradient
  where it is made, casts a scan's stacked weights before it (stack_casts.py), gathers a
  weight at its reader and holds short-lived buffers on chip (fast_memory.py): none of
  XLA:CPU's rules above but the stacked ys and the fan-out copies.
What remains (XLA's heap gaps, the rest of its schedule) is the margin (MARGIN).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shardplan.cost.model import FUSED
from shardplan.intra.memory import (
    compilers,
    fast_memory,
    gradient_holds,
    ilp_rows,
    layouts,
    liveness,
    masks,
    originals,
    stack_casts,
    windows,
)
from shardplan.intra.memory.buffers import Buffer, LiveCopy, is_tensor
from shardplan.intra.memory.liveness import lifetimes, schedule
from shardplan.ir import primitives

# What the model does not see of XLA's buffers, as a share of the step's activations (every
# buffer but its inputs and outputs, which it counts exactly): XLA's heap gaps, small beside
# the temporaries' live peak (benchmarks/xla_live.py), and the model's own error, both ways
# (benchmarks/memory_check.py: the zoo's estimates against their compiled peaks at three
# budgets; tests/test_memory_fit.py::
# test_the_memory_models_own_estimate_is_within_tolerance_of_the_compiled_peak holds them
# within it). What lies past it is XLA's own resharding of activations a plan leaves sharded:
# gathers and all-to-alls made in the forward and held to the backward, which the plan does
# not hold (benchmarks/model_live.py). The margin is a measured spread, not a model of the
# heap; the plan's notes say so, and under a budget on devices the plan is compiled and
# checked.
MARGIN = 0.10
CONV = "conv_general_dilated"


class MemoryModel:
    """The buffers of a Problem (see the module docstring); `donated` are the flat input
    indices whose buffers the step may reuse for their tied outputs; activations are counted
    (1 + margin) times (MARGIN)."""

    def __init__(self, problem, donated: frozenset[int] | None = None, margin: float = 0.0,
                 compiler: str = "cpu"):
        self.rules = rules = compilers.rules(compiler)
        self.problem = p = problem
        self.nbytes = lambda value, spec: rules.value_bytes(p.cost, value, spec)  # as stored
        g = p.graph
        self.n = n = len(g.nodes)
        donated = frozenset(range(p.num_inputs)) if donated is None else donated
        root = p.groups.root
        self.buffers: list[Buffer] = []
        self.copies: list[LiveCopy] = []
        end = max(n - 1, 0)

        self.scale = scale = 1.0 + margin

        made: dict[tuple, np.ndarray] = {}  # tied layers write the same: priced once

        def sizes(v, m, out_idx):
            # in the layouts the compiler stores them in (compilers.Rules.tiled): the step's
            # inputs and outputs and its temporaries alike
            value = g.values[v]
            key = (value.shape, value.dtype, value.itemsize, p.choice_key(m), out_idx)
            if key not in made:
                made[key] = np.ceil([self.nbytes(value, p.out_spec(m, out_idx, k))
                                     for k in range(len(p.strategies[root[m]]))])
                made[key].flags.writeable = False
            return made[key]

        readers: dict[int, list[int]] = {}
        for node in g.nodes:
            for v in set(node.inputs):
                readers.setdefault(v, []).append(node.id)
        outputs = {}
        for j, v in enumerate(g.outputs):
            outputs.setdefault(v, []).append(j)
        unwritten = liveness.unwritten(g, readers, outputs, rules)
        # scheduled by the buffers XLA writes: a state update written into its input's buffer
        # allocates nothing, so the updates run as soon as their gradients are made, not after
        # every gradient is held (tests/test_intra_liveness.py::
        # test_schedule_is_the_list_schedule_it_defines)
        tied = frozenset(v for j, v in enumerate(g.outputs) if g.output_ties[j] is not None)
        self.pos = pos = schedule(g, frozenset(unwritten), tied)
        for i, v in enumerate(g.inputs):
            self.buffers.append(Buffer(root[i], sizes(v, i, 0), 0, end, f"input {i}"))
        if p.num_inputs and rules.small_temps:
            self.buffers.append(Buffer(root[0], np.full(len(p.strategies[root[0]]),
                                                        rules.small_temps),
                                       0, end, "small temporaries"))
        self.virtual, self.last = virtual, last = lifetimes(
            g, pos, readers, outputs, unwritten, liveness.recast(g, readers, unwritten, rules))
        self.first_reads = liveness.first_reads(g, pos, readers, virtual)
        # XLA's scheduler runs what only the step's inputs feed (a weight gathered for a dot,
        # a layer norm's scale broadcast) as soon as it can: the live ranges it dumps start
        # every gathered kernel and broadcast scale of a 2-layer GPT or ViT before the first
        # layer runs, not at their readers. They start at the first op that reads an input
        # and is not fused (the first layer's first dot or gather).
        self.first = min((pos[r] for v in g.inputs for r in readers.get(v, ())
                          if g.nodes[r].primitive not in FUSED), default=0)
        generated: dict[int, int] = {}  # a generator's bits -> the index of their buffer
        self.owned: dict[int, int] = {}  # an intermediate -> the index of its buffer
        self.originals: list[originals.Original] = []
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
                    if node.primitive in rules.generators:
                        nbytes = 2 * nbytes
                        generated[v] = len(self.buffers) + 1  # after the counters' buffer
                        self.buffers.append(Buffer(root[m], nbytes, pos[node.id], pos[node.id],
                                                  f"{node.primitive} {node.name} counters"))
                    start = pos[node.id]
                    if (node.primitive == "broadcast_in_dim" and v in static
                            and rules.hoisted_broadcasts
                            or node.primitive in liveness.STACKED):
                        # a scan's stacked ys too: XLA writes them into a buffer of every
                        # row that its loop carries, made (zeros, from no input) before the
                        # first layer (a rematerialized MLP's backward held both weight
                        # gradients' stacks through its forward loop)
                        start = min(start, self.first)
                    if v not in generated:
                        self.owned[v] = len(self.buffers)
                    self.buffers.append(Buffer(root[m], nbytes, start,
                                               last[v], f"{node.primitive} {node.name}"))
                    continue
                if len(ties) < len(js):
                    # An output of its own: memory_analysis counts it for the whole program.
                    self.buffers.append(Buffer(root[m], sizes(v, m, k), 0, end,
                                               f"output {js}"))
                for t in ties:
                    if t not in donated:
                        self.buffers.append(Buffer(root[t], sizes(g.inputs[t], t, 0), 0, end,
                                                  f"output tied to undonated input {t}"))
                    # Computed in another layout than its input's, the result is a temporary.
                    ka, kb = layouts.keys(
                        [p.out_spec(m, k, c) for c in range(len(p.strategies[root[m]]))],
                        [p.out_spec(t, 0, c) for c in range(len(p.strategies[root[t]]))])
                    self.copies.append(LiveCopy(root[m], ka, scale * sizes(v, m, k), root[t], kb,
                                            np.zeros(len(kb)), pos[node.id], pos[node.id],
                                            f"state {t} computed in another layout"))
        self.windows = windows.windows(self) if rules.output_fusions or rules.fused_slices else {}
        if rules.output_fusions:
            self.copies += windows.operand_copies(self, readers, virtual)
        for node in g.nodes:
            # XLA:CPU convolves NHWC operands with HWIO kernels: an operand laid out otherwise
            # (a kernel gradient's images, whose batch is their channels) is first copied
            # transposed, hoisted when only inputs feed it (tests/test_memory_fit.py::
            # test_a_convolution_reading_its_operand_in_another_layout_holds_a_transposed_copy)
            dn = (node.params.get("dimension_numbers")
                  if node.primitive == CONV and rules.conv_layout_copies else None)
            for i, spec in enumerate((dn.lhs_spec, dn.rhs_spec) if dn else ()):
                n_, v, m = len(spec), node.inputs[i], p.num_inputs + node.id
                if tuple(spec) == ((0, n_ - 1, *range(1, n_ - 1)) if i == 0
                                   else (n_ - 1, n_ - 2, *range(n_ - 2))):
                    continue
                nbytes = scale * np.ceil([self.nbytes(g.values[v], p.in_spec(m, i, k))
                                          for k in range(len(p.strategies[root[m]]))])
                self.buffers.append(Buffer(
                    root[m], nbytes, min(self.first if v in static else end, pos[node.id]),
                    pos[node.id], f"v{v} transposed for {node.primitive} {node.name}"))
        self.buffers += stack_casts.hoisted_casts(self, sizes, readers)
        # a broadcast operand of what a YNNPACK reduction reads, written whole (liveness.py);
        # one buffer per operand and shape (XLA merges equal broadcasts), only in the layouts
        # that leave the reduction large enough for YNNPACK
        broadcasts: dict[tuple, list] = {}
        made_by = {v: node.id for node in g.nodes for v in node.outputs}
        for e, u, _ in (liveness.ynn_broadcasts(g, readers, virtual)
                        if rules.reduction_broadcasts else ()):
            v, m = g.nodes[e].outputs[0], p.num_inputs + e
            nbytes = sizes(v, m, 0)
            large = nbytes >= liveness.YNN_MIN_ELEMENTS * g.values[v].itemsize
            start = self.first if u in static else pos[made_by[u]]
            held_b = broadcasts.setdefault((u, g.values[v].shape), [
                root[m], scale * np.where(large, nbytes, 0.0), start, pos[e] - 1, v])
            held_b[3] = max(held_b[3], pos[e] - 1)
        for (u, _), (r, nbytes, start, end, v) in broadcasts.items():
            if start <= end and nbytes.any():
                self.buffers.append(Buffer(r, nbytes, start, end,
                                           f"v{u} broadcast for the reduction of v{v}"))
        held, copies = (gradient_holds.holds(self) if rules.holds_gradients
                        else ([], []))
        self.buffers += held
        self.copies += copies
        lay = layouts.Layouts(p, self.scale, self.nbytes)
        # a dropout mask's reshards, and how long the bits live, as masks.py counts them
        self.masks, counted = masks.masks(self, lay, generated)
        self.mask_copies = frozenset(range(len(self.copies), len(self.copies) + sum(
            len(mk.reads) for mk in self.masks)))
        for mk in self.masks:
            self.copies += masks.ilp_copies(mk)
        self._add_operand_copies(lay, frozenset(counted))

    def _add_operand_copies(self, lay, counted: frozenset[int]) -> None:
        p = self.problem
        g, root = p.graph, p.groups.root
        readers: dict[int, list[tuple[int, int]]] = {}
        made_anew = liveness.literal_broadcasts(g)  # never resharded
        for node in g.nodes:
            for i, v in enumerate(node.inputs):
                value = g.values[v]
                if (is_tensor(value) and value.ndim > 0 and v in p.producer
                        and v not in counted and v not in made_anew):
                    readers.setdefault(v, []).append((p.num_inputs + node.id, i))

        # A value with a fan-out member is resharded once into the fan-out's layout, which all
        # its readers read (the copies below start from it): that copy is held from the first
        # reader on (on llama at test size on 8 devices, a hidden-split activation
        # all-gathered for the q/k/v dots was kept by XLA until their backward dots read it).
        for f, v in enumerate(p.fanout_of):
            if v not in readers or v not in p.held_fanouts:
                continue
            src, out_idx = p.producer[v]
            fm = p.num_real + f
            rs, rf = root[src], root[fm]
            # a partial sum reduced into the fan-out's layout is all-reduced in place (its
            # operand dies there): no second buffer
            srcs = [p.out_spec(src, out_idx, k).without_partial()
                    for k in range(len(p.strategies[rs]))]
            dsts = [p.out_spec(fm, 0, k).without_partial() for k in range(len(p.strategies[rf]))]
            if len(set(dsts).union(srcs)) == 1:
                continue
            # held to its last reader itself, not to the last read of what is fused into that
            # reader (llama's logits gathered for its loss died at the softmax, before the
            # one-hot's last elementwise reader)
            at = [self.pos[m - p.num_inputs] for m, _ in readers[v]]
            ka, kb = layouts.keys(srcs, dsts)
            self.copies.append(LiveCopy(rs, ka, np.zeros(len(ka)), rf, kb,
                                    lay.nbytes(g.values[v], dsts), min(at), max(at),
                                    f"fan-out of v{v}"))
        # gathered inputs start there (see __init__), where the compiler hoists them
        first = self.first if self.rules.hoisted_gathers else len(self.pos)
        # A later gathering reader of a weight (the backward pass) that wants another layout
        # than the first one's: XLA's scheduler hoists its gather too, before the first layer.
        # Only on a mesh with one useful axis: on 2x4 the later layout is mostly a slice of the
        # first one's gathered copy, which XLA slices at the reader. On 2x4 the other way round
        # holds too:
        # when the later layout is the larger (a weight gathered on one axis for the forward
        # dot and whole for the backward one), XLA gathers it whole at the first reader and
        # slices the first layout from it: the copy held from the first layer is the larger
        # of the two (tests/test_memory_fit.py::
        # test_a_kernel_read_whole_in_the_backward_is_held_whole_from_the_forward).
        hoist = len(p.mesh.useful_axes()) == 1
        n_in, fanned = p.num_inputs, set(p.held_fanouts) | {s for s, _, _ in g.carry_edges()}

        def through(m):  # the last read by node m, through what is fused into it
            return max([self.pos[m - n_in], *(self.last[o] for o in g.nodes[m - n_in].outputs
                                              if o in self.virtual and o in self.last)])

        ends = liveness.loop_ends(g, self.pos)

        def held_to(m):  # the last moment reader m needs a copy made for it (loop_ends)
            reader = g.nodes[m - n_in]
            looped = reader.primitive == "loop_slice" and reader.loop is not None
            return max(self.pos[m - n_in], ends[reader.loop] if looped else 0)

        made_in = {v: node.loop for node in g.nodes for v in node.outputs}
        for v in sorted(readers):
            src, out_idx = p.source[v] if v in p.held_fanouts else p.producer[v]
            rs = root[src]
            srcs = lay.of(src, "out", out_idx)
            # Readers in the producer's group take its layout as it is (never a copy).
            movers = [(m, i) for m, i in readers[v] if root[m] != rs]
            if not movers:
                continue
            # how long the value itself is read or resharded from (originals.py)
            own = None if v in fanned else self.owned.get(v)
            floor = max([0, *(through(m) for m, _ in readers[v] if root[m] == rs)])
            needs = []
            # A copy is shared with the later readers that could want the same layout: the
            # ops that gather an operand (a dot, a gather...), not the fused elementwise ones
            # (an optimizer's update reads a weight in its own layout, not the gathered one).
            gathering = [m for m, _ in movers if g.nodes[m - p.num_inputs].primitive not in FUSED]
            heavy = [self.pos[m - p.num_inputs] for m in gathering]
            heavy_to = [(self.pos[m - p.num_inputs], held_to(m)) for m in gathering]
            seen, lead, held = set(), None, None
            for m, i in sorted(movers, key=lambda mi: self.pos[mi[0] - p.num_inputs]):
                rm = root[m]
                dsts = lay.of(m, "in", i)
                key = (rm, dsts[1])
                ka, kb, same = lay.keys(srcs, dsts)
                if same:
                    floor = max(floor, through(m))
                else:
                    needs.append(originals.Need(through(m), rs, ka, rm, kb, True))
                if key in seen or same:
                    continue
                seen.add(key)
                nbytes = lay.sized(g.values[v], dsts)
                at = self.pos[m - p.num_inputs]
                # to the last read of what is fused into the reader (test_memory_fit.py)
                last = max([held_to(m), through(m), *(end for t, end in heavy_to if t > at)])
                what = f"{g.nodes[m - p.num_inputs].primitive} {g.nodes[m - p.num_inputs].name}"
                # a reader fused into its own (a weight's transpose) reads it where they run
                outs = g.nodes[m - p.num_inputs].outputs
                start = min([self.first_reads.get(o, at) for o in outs] + [last]) if outs else at
                if src < p.num_inputs and heavy and at == min(heavy):
                    # the first gathering reader's copy, which the later ones share if they
                    # read the same layout (theirs start at their reader: never hoisted twice)
                    start = min(at, first)
                    lead = (rm, dsts)
                elif (src < p.num_inputs and lead is not None and first < at
                      and g.nodes[m - p.num_inputs].primitive not in FUSED):
                    # counted while the two layouts differ, from the first layer to the reader:
                    # whole (one useful axis), or what it adds to the first reader's (else)
                    kl, km, _ = lay.keys(lead[1], dsts)
                    grows = (np.zeros(len(kl)) if hoist
                             else -lay.sized(g.values[v], lead[1]))
                    self.copies.append(LiveCopy(lead[0], kl, grows, rm, km, nbytes, first, at - 1,
                                            f"hoisted reshard of v{v} for {what}"))
                if held is not None and g.nodes[m - p.num_inputs].primitive not in FUSED:
                    # The first reader's copy is held to this one (last, above): XLA reads it
                    # here too when the layouts are one, and makes a copy of its own only when
                    # they differ (counted from the source, a layout equal to both was counted
                    # twice here: BERT's logits' operand at its backward dot)
                    kh, km, _ = lay.keys(held[1], dsts)
                    self.copies.append(LiveCopy(held[0], kh, np.zeros(len(kh)), rm, km, nbytes,
                                            start, last, f"reshard of v{v} for {what}"))
                    needs.append(originals.Need(at, held[0], kh, rm, km, False))
                else:
                    # a slice its reader may take into its fusion (windows.py; live())
                    reader = g.nodes[m - p.num_inputs]
                    sliced = ((srcs[0], dsts[0], frozenset(
                        r - p.num_inputs for r, _ in readers[v]) & set(self.windows))
                        if self.rules.fused_slices and reader.loop == made_in.get(v)
                        and (reader.primitive in FUSED or reader.primitive == "dot_general"
                             or reader.primitive in liveness.REDUCTIONS) else None)
                    self.copies.append(LiveCopy(rs, ka, np.zeros(len(ka)), rm, kb, nbytes, start,
                                                last, f"reshard of v{v} for {what}", sliced))
                    if held is None:
                        floor = max(floor, at)
                    else:
                        needs.append(originals.Need(at, rs, ka, rm, kb, False))
                    held = held or (rm, dsts)
                if (self.rules.layout_copies
                        and primitives.info(g.nodes[m - p.num_inputs].primitive).leader):
                    # A gathered operand of a dot is copied once more into the layout the dot
                    # reads (XLA's layout assignment), for the moment of the dot.
                    self.copies.append(LiveCopy(rs, ka, np.zeros(len(ka)), rm, kb, nbytes, at, at,
                                            f"layout copy of v{v} for {what}"))
            if own is not None and floor < self.buffers[own].end:
                floor = max(floor, self.buffers[own].start)
                self.originals.append(originals.Original(own, floor, tuple(needs)))

    # -- points -----------------------------------------------------------------------------

    def points(self) -> list[tuple[list[int], list[int]]]:
        """(buffers, copies) live at each point where the live set can peak
        (ilp_rows.live_ranges)."""
        nb = len(self.buffers)
        times, first, last = ilp_rows.live_ranges(
            [b.start for b in self.buffers] + [c.start for c in self.copies],
            [b.end for b in self.buffers] + [c.end for c in self.copies])
        out = []
        for p in range(len(times)):
            live = np.flatnonzero((first <= p) & (last >= p))
            out.append(([int(x) for x in live if x < nb], [int(x) - nb for x in live if x >= nb]))
        return out

    # -- the ILP's rows -----------------------------------------------------------------------

    def solver_terms(self, index: Mapping[int, int]):
        """(base, rows, copies, row_copies) for types.SolverInput: terms over representatives
        (`index`: root -> representative). Buffers live at every point form the base."""
        return ilp_rows.solver_terms(self.buffers, self.copies, index)

    # -- a chosen plan's peak ----------------------------------------------------------------

    def live(self, root_choice: Mapping[int, int]) -> list[tuple[int, int, float, str]]:
        """(start, end, bytes, what) of every buffer a plan holds (root r takes its choice
        root_choice[r]): the buffers, the copies whose layouts differ, and a dropout mask's
        bits and reshards as XLA holds them once every layout is known (masks.py)."""
        items = [(b.start, b.end, float(b.nbytes[root_choice[b.root]]), b.what)
                 for b in self.buffers]
        for o in self.originals:  # an activation read only through copies (originals.py)
            b = self.buffers[o.buffer]
            items[o.buffer] = (b.start, originals.evaluate(o, b.end, root_choice),
                               items[o.buffer][2], b.what)
        for mk in self.masks:
            b = self.buffers[mk.buffer]
            end, copies = masks.evaluate(mk, b.start, b.end, root_choice)
            items[mk.buffer] = (b.start, end, items[mk.buffer][2], b.what)
            items += [(lo, hi, nbytes, f"{b.what}: mask resharded") for lo, hi, nbytes in copies]
        windowed = windows.windowed(self, root_choice) if self.windows else set()
        for j, c in enumerate(self.copies):
            ka, kb = root_choice[c.a], root_choice[c.b]
            sl = c.sliced
            if sl and windows.slices_only(sl[0][ka], sl[1][kb]) and not sl[2] & windowed:
                continue  # taken into the reader's fusion (Rules.fused_slices)
            if j not in self.mask_copies and c.key_a[ka] != c.key_b[kb]:
                items.append((c.start, c.end, max(0.0, float(c.bytes_a[ka] + c.bytes_b[kb])),
                              c.what))
        return items

    def peak(self, root_choice: Mapping[int, int]) -> float:
        """The peak bytes per device when each root r takes choice root_choice[r]: the most
        bytes live at one moment, swept over the intervals of live(), less what the compiler
        holds on chip (fast_memory.py). Never above the rows at the points() (masks.py: the
        rows count a mask's bits to its last read)."""
        return fast_memory.hbm_peak(self.live(root_choice), len(self.pos),
                                    self.problem.cost.hardware.fast_memory_bytes, self.scale)
