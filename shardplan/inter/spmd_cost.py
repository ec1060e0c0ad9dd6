"""What an SPMD pipeline step costs under the cost model: its stage program, the schedule's
ticks and the collectives over the stage axis.

The SPMD pipeline (shardplan.emit.spmd, spmd_1f1b) runs one program on a (stage, rest...) mesh.
Everything but the scan over layers (embedding, head, loss, optimizer update) runs on every
stage's devices under the intra-op plan of the step on one stage's devices (the `rest` axes),
at full batch; the scan runs as a loop of ticks in which each stage runs its L/S layers on one
micro-batch. So, from two intra-op plans on one stage's devices priced node by node (their op
rows), the step's at full batch and the step's on one micro-batch (the stage program: its
layers are what a stage runs per tick, their collectives at micro-batch size):

    F, Bk     the micro-batch step's forward and backward scans over the L layers; one stage
              runs F/S, Bk/S per tick
    rest      the full-batch plan's estimate less its own scans over layers
    post      the head and loss after the scan (forward and backward)

    GPipe     rest + T (F + Bk) / S                T = M + S - 1 ticks forward, then backward
    1F1B      rest + T (2F + Bk) / S               T = M + 2S - 2 ticks, a forward, and a
              + T post(micro) - post(full)         backward that recomputes its forward; the
                                                   head and loss run every tick

plus the collectives over the stage axis: every tick a permute of one micro-batch's activation
(forward, and its cotangent backward), and all-reduces of the full activation (GPipe: the
outputs' psum, its transpose and the carry's cotangent; 1F1B: one psum of the carry's
cotangent and the head's gradients). The activation is laid out as the plan lays out the
scan's carry (the stage body is constrained to it, and each layer's operands to the layouts
the stage program's plan reads them in: body_operand_specs, shardplan.emit.spmd). The op rows
price a loop's carry edges and its entry once per entry, as the ILP does.

Memory: the stacked state is divided by the stages; the layers' saved activations scale by
the ticks a stage keeps them for (GPipe T/(S M), 1F1B at most 2S-1 micro-batches).

Without the micro-batch plan (it failed to trace), the full-batch layers are divided by M
(a collective's latency, or the bytes of a weight it gathers, are then counted M times too
few).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

from shardplan import _compat
from shardplan._compat import Literal
from shardplan.cost import ring
from shardplan.cost.estimate import Estimate
from shardplan.cost.hardware import HardwareProfile
from shardplan.inter.layer_scan import STAGE_AXIS, LossTrace
from shardplan.intra.planner import IntraPlan
from shardplan.ir.graph import Graph
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import fmt_bytes, fmt_seconds


@dataclasses.dataclass(frozen=True)
class SpmdCost:
    """The SPMD pipeline step's estimate and its parts (seconds per device)."""

    estimate: Estimate
    rest_s: float
    """Everything outside the scan over layers, at full batch on one stage's devices."""
    forward_s: float
    """One stage's layers, forward, on one micro-batch (the micro-batch step's plan)."""
    backward_s: float
    """One stage's layers, backward, on one micro-batch."""
    post_s: float
    """The head and loss after the scan (forward and backward), full batch."""
    permute_s: float
    """Every permute between stages over the step."""
    allreduce_s: float
    """The all-reduces over the stage axis."""
    layers_s: float
    """The pipelined layers over the step (the ticks, bubble included)."""
    carry_bytes: float
    """The scan's carry (the activation) at full batch, per device, as the plan lays it out."""
    found: bool
    """Whether the graph's scans over layers were found (else the step is scaled whole)."""
    flops: float = 0.0
    """Flops per device of the pipelined step (the schedule's ticks, recomputation included):
    what the compiled program's flops (loops at their trip counts) are checked against."""
    stages: int = 1
    grad_reduce_s: float = 0.0
    """The layers' partial gradients reduced into the accumulator at every tick."""

    def explain(self, schedule: str, ticks: int) -> str:
        if not self.found:
            return ("estimate: the step's scans over layers were not found in its graph; the "
                    "intra-op plan on one stage's devices scaled by the schedule")
        per = "2F + B" if schedule == "1f1b" else "F + B"
        return (f"estimate: {fmt_seconds(self.estimate.total_s)} = outside the layers "
                f"{fmt_seconds(self.rest_s)} (intra-op plan on one stage's devices) + {ticks} "
                f"ticks of {per} (F {fmt_seconds(self.forward_s)}, B "
                f"{fmt_seconds(self.backward_s)} per stage and micro-batch) = "
                f"{fmt_seconds(self.layers_s)}"
                + (f" (the head and loss every tick: {fmt_seconds(self.post_s)} at full batch)"
                   if schedule == "1f1b" else "")
                + (f" + the layers' gradients reduced every tick "
                   f"{fmt_seconds(self.grad_reduce_s)}" if self.grad_reduce_s else "")
                + f" + permutes {fmt_seconds(self.permute_s)} + all-reduces over the stages "
                f"{fmt_seconds(self.allreduce_s)} (activation {fmt_bytes(self.carry_bytes)} "
                f"per device); memory: stacked state / {self.stages}, activations kept for the "
                f"ticks they live")


def layer_loops(graph: Graph, lt: LossTrace) -> tuple[set[int], set[int]]:
    """(forward, backward) ids of the graph's scans over the layers: length L, reading a value
    shaped like the stacked parameters (nested loops included)."""
    stacked = set(lt.scan.xs_shapes)
    fwd, bwd = set(), set()
    for loop in graph.loops:
        if loop.kind != "scan" or int(loop.eqn.params["length"]) != lt.scan.length:
            continue
        if not any(graph.values[v].shape in stacked for v in loop.operands):
            continue
        (bwd if loop.eqn.params["reverse"] else fwd).add(loop.id)
    changed = True
    while changed:  # loops inside them
        changed = False
        for loop in graph.loops:
            for group in (fwd, bwd):
                if loop.parent in group and loop.id not in group:
                    group.add(loop.id)
                    changed = True
    return fwd, bwd


def _descendants(graph: Graph, values: Sequence[int], skip: set[int]) -> set[int]:
    """Nodes (ids, outside the loops `skip`) that read what `values` lead to."""
    readers: dict[int, list] = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers.setdefault(v, []).append(node)
    seen, stack = set(), list(values)
    while stack:
        v = stack.pop()
        for node in readers.get(v, ()):
            if node.id not in seen:
                seen.add(node.id)
                stack.extend(node.outputs)
    return {n for n in seen if graph.nodes[n].loop not in skip}


@dataclasses.dataclass(frozen=True)
class Priced:
    """A lifted step, its intra-op plan on one stage's devices and that plan's op rows
    (shardplan.planning.intra_op.op_rows, in node order)."""

    graph: Graph
    intra: IntraPlan
    ops: Sequence


@dataclasses.dataclass(frozen=True)
class _Parts:
    fwd: set
    bwd: set
    forward: tuple[float, float, float]
    """(compute seconds, comm seconds, flops per device)"""
    backward: tuple[float, float, float]
    post: tuple[float, float, float]
    carry_bytes: float
    resid_bytes: float
    carries: tuple[ShardSpec, ...]
    partial_grads: tuple[tuple[float, tuple[str, ...], bool, bool], ...] = ()
    """(bytes per device, mesh axes, whether the stacked result is split over them, whether
    the stack holds it partial) of each per-layer value the backward scan stacks from a
    partial sum (a weight's gradient over split rows): held partial, the plan reduces it once
    after the loop and the pipeline's accumulator at every tick (a reduce-scatter where the
    result is split and the target forms them, else an all-reduce); else the loop's rows
    reduce it at every layer (B)."""


def node_flops(p: Priced, nodes) -> float:
    """Flops per device of these nodes under the plan's strategies, every time they run."""
    return math.fsum(p.intra.node_strategies[n].flops * p.graph.nodes[n].trips for n in nodes
                     if n in p.intra.node_strategies)


def _parts(p: Priced, lt: LossTrace, batch: int) -> _Parts:
    """The costs (compute, comm) of the forward and backward scans over layers, of the head
    and loss (`post`), the carry's and the saved activations' bytes per device."""
    graph, intra, ops = p.graph, p.intra, p.ops
    fwd, bwd = layer_loops(graph, lt)

    def cost(nodes) -> tuple[float, float, float]:
        nodes = list(nodes)
        return (math.fsum(ops[n].compute_s for n in nodes),
                math.fsum(ops[n].comm_s for n in nodes), node_flops(p, nodes))

    zero = (0.0, 0.0, 0.0)
    if not (fwd and bwd):
        return _Parts(fwd, bwd, zero, zero, zero, 0.0, 0.0, ())
    first = graph.loops[min(fwd)]
    nc = _compat.scan_counts(first.eqn.params)[0]
    carries, carry_bytes, resid = [], 0.0, 0.0
    for v in first.operands[nc:nc + first.num_carry]:
        value = graph.values[v]
        spec = intra.value_specs.get(v) or ShardSpec.replicated(value.ndim)
        carries.append(spec)
        carry_bytes += value.nbytes / spec.num_shards(intra.mesh)
    for v in first.results[first.num_carry:]:
        spec = intra.value_specs.get(v)
        resid += graph.values[v].nbytes / (spec.num_shards(intra.mesh) if spec else 1)
    loops = fwd | bwd
    post = (_descendants(graph, first.results, loops)
            - _descendants(graph, [r for lp in bwd if graph.loops[lp].parent not in bwd
                                   for r in graph.loops[lp].results], loops))
    post = [n for n in sorted(post) if any(
        graph.values[v].shape[:1] == (batch,)
        for v in (*graph.nodes[n].inputs, *graph.nodes[n].outputs))]
    partial = []
    for lp in sorted(bwd):
        loop = graph.loops[lp]
        if loop.parent in bwd:
            continue
        for n in loop.leave:
            node = graph.nodes[n]
            spec = intra.value_specs.get(node.inputs[0]) if node.inputs else None
            if node.primitive == "loop_stack" and spec is not None and spec.partial:
                strategy = intra.node_strategies.get(n)
                read = strategy.in_specs[0] if strategy and strategy.in_specs else spec
                out = intra.value_specs.get(node.outputs[0])
                split = out is not None and any(a in spec.partial for d in out.dims for a in d)
                partial.append((graph.values[node.inputs[0]].nbytes
                                / spec.num_shards(intra.mesh), tuple(spec.partial), split,
                                read is None or bool(read.partial)))
    return _Parts(fwd, bwd, cost(n.id for n in graph.nodes if n.loop in fwd),
                  cost(n.id for n in graph.nodes if n.loop in bwd), cost(post), carry_bytes,
                  resid, tuple(carries), tuple(partial))


def carry_specs(stage: Priced, lt: LossTrace) -> tuple[ShardSpec, ...] | None:
    """How the stage's intra-op plan lays out the scan's carry (the activation between
    layers), for the stage body to be held in (None: no scan over layers found)."""
    parts = _parts(stage, lt, lt.micro_scan.batch)
    return parts.carries or None


def spmd_cost(full: Priced, stage: Priced | None, lt: LossTrace, mesh: MeshShape,
              hw: HardwareProfile, device_order: Sequence[int] | None, schedule: str
              ) -> SpmdCost:
    """The SPMD pipeline step's cost: `full` the step at full batch, `stage` the same step on
    one micro-batch (its layers are what a stage runs per tick; None: the full step's scaled
    by 1/M), both planned on one stage's devices; `lt` the loss traced for the pipeline,
    `mesh` the pipeline mesh (with the stage axis), `device_order` its device ids in mesh
    order."""
    S, M = lt.num_stages, lt.num_micro_batches
    e = full.intra.estimate
    ticks = M + S - 1 if schedule == "gpipe" else M + 2 * S - 2
    big = _parts(full, lt, lt.scan.batch)
    found = bool(big.fwd and big.bwd)
    small = _parts(stage, lt, lt.micro_scan.batch) if stage is not None else None
    if small is None or not (small.fwd and small.bwd):
        small = dataclasses.replace(
            big, forward=tuple(x / M for x in big.forward),
            backward=tuple(x / M for x in big.backward), post=tuple(x / M for x in big.post),
            carry_bytes=big.carry_bytes / M, resid_bytes=big.resid_bytes / M)
    all_flops = node_flops(full, [n.id for n in full.graph.nodes])
    rest = [e.compute_s, e.comm_s, all_flops]
    rest = [rest[i] - big.forward[i] - big.backward[i] for i in range(3)]
    f, b, post = small.forward, small.backward, small.post
    if schedule == "gpipe":
        lay = [ticks * (f[i] + b[i]) / S for i in range(3)]
    else:  # the head and loss run every tick instead of once at full batch
        lay = [ticks * (2 * f[i] + b[i]) / S + ticks * post[i] - big.post[i] for i in range(3)]
    if not found:  # the schedule scales the whole step (the old estimate)
        scale = ticks / (M * S) * (1.0 if schedule == "gpipe" else 4.0 / 3.0)
        rest = [0.0, 0.0, 0.0]
        lay = [e.compute_s * scale, e.comm_s * scale, all_flops * scale]
    rest_c, rest_k = rest[0], rest[1]
    links = hw.axis_links(mesh, device_order=device_order)
    carry_bytes = small.carry_bytes * M
    permute = 2 * ticks * ring.collective_time("collective-permute", small.carry_bytes,
                                               STAGE_AXIS, mesh, links)
    if schedule == "gpipe":  # the outputs' psum, its transpose, the carry's cotangent
        reduced = [carry_bytes] * 3
    else:  # one psum: the carry's cotangent, the head's gradients, the loss
        reduced = [carry_bytes + _post_param_bytes(lt) + 4.0]
    allreduce = math.fsum(ring.collective_time("all-reduce", x, STAGE_AXIS, mesh, links)
                          for x in reduced)
    # the layers' gradients summed into the stage's accumulator every tick: a partial one is
    # reduced there (the plan reduced it once, after its backward scan)
    def reduce(b, axes, split):
        kind = "reduce-scatter" if split and hw.forms_reduce_scatter else "all-reduce"
        return ring.collective_time(kind, b, axes, mesh, links)

    # (one the stack reads reduced is reduced at every layer in B already, and not counted
    # here again)
    per_layer = math.fsum(reduce(b, axes, split)
                          for b, axes, split, held in small.partial_grads if held)
    grad_reduce = ticks * per_layer * lt.scan.length / S
    # the full-batch plan (`rest`) reduces its partial ones held in the stack once, after its
    # backward scan; the pipeline does not (its accumulator is reduced at every tick, above)
    once = math.fsum(reduce(b * lt.scan.length, axes, split)
                     for b, axes, split, held in big.partial_grads if held)
    sub = full.intra.mesh
    stacked = set(lt.scan.xs_shapes)
    # the updated state moved into its own layout (the plan's output edges, in `rest` and in
    # no op row): a stage moves 1/S of the stacked layers'
    # (tests/test_inter_spmd_cost.py::test_the_estimate_is_the_compiled_program_within_10_percent)
    outs = {j for j, v in enumerate(full.graph.outputs) if full.graph.values[v].shape in stacked}
    written = math.fsum(ring.collective_time(c.kind, c.nbytes, c.axes, mesh, links)
                        for where, c in full.intra.comms
                        if where.startswith("output ")
                        and int(where.split()[1].rstrip(":")) in outs)
    rest_k = max(rest_k - once - written * (1 - 1 / S), 0.0)
    stacked_state = math.fsum(
        full.graph.values[v].nbytes / s.num_shards(sub)
        for v, s in zip(full.graph.inputs, full.intra.input_specs)
        if full.graph.values[v].shape in stacked)
    # the step reads its state and writes it back (the compute's I/O term, intra.problem
    # input_io_time): a stage holds 1/S of the stacked layers' state
    ties = collections.Counter(t for t in full.graph.output_ties if t is not None)
    stacked_io = math.fsum(
        (1 + ties[m]) * full.graph.values[v].nbytes / s.num_shards(sub)
        for m, (v, s) in enumerate(zip(full.graph.inputs, full.intra.input_specs))
        if full.graph.values[v].shape in stacked) / hw.mem_bandwidth
    rest_c = max(rest_c - stacked_io * (1 - 1 / S), 0.0)
    if schedule == "gpipe":  # a stage keeps its layers' residuals of every tick
        kept = small.resid_bytes * ticks / S
    else:  # the inputs of at most 2S - 1 micro-batches, one tick's residuals
        kept = min(M, 2 * S - 1) * small.carry_bytes + small.resid_bytes / S
    peak = e.peak_bytes - stacked_state * (1 - 1 / S) - big.resid_bytes + kept
    est = Estimate(compute_s=rest_c + lay[0],
                   comm_s=rest_k + lay[1] + permute + allreduce + grad_reduce,
                   peak_bytes=max(peak, 0.0),
                   state_bytes=e.state_bytes - stacked_state * (1 - 1 / S),
                   comm_bytes=e.comm_bytes)
    return SpmdCost(est, rest_c + rest_k, (f[0] + f[1]) / S, (b[0] + b[1]) / S,
                    big.post[0] + big.post[1], permute, allreduce, lay[0] + lay[1], carry_bytes,
                    found, rest[2] + lay[2], S, grad_reduce)


def _post_param_bytes(lt: LossTrace) -> float:
    """Bytes of the loss's arguments read after the scan whole (the head's parameters): their
    gradients are summed over the stages once in 1F1B."""
    jaxpr = lt.micro.jaxpr
    k = lt.micro_scan.index
    full = {v: a for v, a in zip(jaxpr.invars, lt.full.in_avals)}
    read = {v for e in jaxpr.eqns[k + 1:] for v in e.invars
            if not isinstance(v, Literal) and v in full}
    return float(sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in read
                     if tuple(v.aval.shape) == tuple(full[v].shape)))

