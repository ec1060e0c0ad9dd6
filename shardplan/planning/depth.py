"""A deep step priced from two shallow copies of it: each candidate plan compiled on the step cut
down to k and k + 1 of its repeated layers, every priced figure extrapolated linearly to its
depth.

The measured selection compiles every candidate, and compiling an unrolled step grows with
its depth: most of a deep step's compile is one layer compiled again for every layer. An
unrolled stack of identical layers adds the same program per layer: the same flops, bytes,
collectives and buffers, so each priced figure is a + b * layers. Two compiles of the
cut-down step (k and k + 1 layers) give a and b; the deep step's figure is read off the line
(tests/test_planning_depth.py::test_extrapolated_candidates_agree_with_the_full_compile: GPT, 8 layers).

Where it applies, and nothing else: the plan maps node for node onto the cut-down step. The
layers are found by the `layer_<i>` scope of the nodes (the zoo's unrolled blocks; the
optimizer's updates by their parameter's name); the layers must repeat (every layer the same
sequence of operators and shapes, or every p-th: MoE layers between dense ones, cut at k and
k + p), and the full step with layers k.. removed must be the cut-down step, operator for
operator and input for input. Otherwise, or when a cut-down compile fails or a
figure shrinks with depth, the candidate is compiled in full (`compiled.measure`). The kept
plan is the cheapest as extrapolated; it is not compiled again in full, and its notes (and
MeasuredProgram.extrapolated) say its figures are extrapolated.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Sequence

from shardplan.analysis import targets
from shardplan.analysis.price import KindCost, PricedStep
from shardplan.cost.hardware import HardwareProfile
from shardplan.intra.memory import liveness
from shardplan.ir.graph import Graph
from shardplan.ir.trace import TracedStep
from shardplan.plan import Plan
from shardplan.planning import compiled

_LAYER = re.compile(r"(?<![A-Za-z0-9])layer_(\d+)(?![0-9])")

# Below this many layers the full compile is cheap enough: two cut-down compiles save little.
MIN_LAYERS = 6


def cut_depths(period: int, least: int = 1) -> tuple[int, int]:
    """The two depths to compile a step whose layers repeat every `period` at: the first
    multiple of the period from `least`, and one period more. Not from 0 (no layer): the
    first layer is not priced like the embedding's neighbour without it, so a line through
    0 and 1 misses the peak bytes; from 1 and 2 the figures agree with the full compile
    (tests/test_planning_depth.py::test_extrapolated_candidates_agree_with_the_full_compile)."""
    first = -(-least // period) * period
    return first, first + period


def node_layers(graph: Graph) -> tuple[list[int | None], list[int | None]]:
    """(layer of each input, layer of each node): the `layer_<i>` in its name, a node without
    one taking its first operand's (an optimizer update, its parameter's); None for neither."""
    def of(name: str) -> int | None:
        m = _LAYER.findall(name)
        return int(m[0]) if len(set(m)) == 1 else None

    ins = [of(n) for n in graph.input_names] + [None] * (len(graph.inputs) - len(graph.input_names))
    by_value = dict(zip(graph.inputs, ins))
    nodes: list[int | None] = []
    for node in graph.nodes:
        layer = of(node.name) if node.name else next(
            (by_value[v] for v in node.inputs if by_value.get(v) is not None), None)
        nodes.append(layer)
        for v in node.outputs:
            by_value[v] = layer
    return ins, nodes


def _signature(graph: Graph, node) -> tuple:
    return (node.primitive, tuple(graph.values[v].shape for v in node.inputs),
            tuple(graph.values[v].shape for v in node.outputs),
            tuple(str(graph.values[v].dtype) for v in node.outputs))


def layer_period(graph: Graph) -> tuple[int, int] | None:
    """(layers, period): how many layers the step repeats and every how many layers they
    repeat alike (the same operators and shapes, the same parameter names but the index:
    1 for a stack of one block, 2 for MoE layers between dense ones), or None when it has no
    unrolled stack of them."""
    if graph.loops:  # a scanned stack is compiled once already: nothing to cut
        return None
    ins, nodes = node_layers(graph)
    found = sorted({layer for layer in nodes if layer is not None})
    if not found or found != list(range(len(found))):
        return None
    per: dict[int, list] = {i: [] for i in found}
    for node, layer in zip(graph.nodes, nodes):
        if layer is not None:
            per[layer].append(_signature(graph, node))
    for name, layer in zip(graph.input_names, ins):
        if layer is not None:
            per[layer].append(_LAYER.sub("layer_", name))
    n = len(found)
    for p in range(1, n // 2 + 1):
        if n % p == 0 and all(per[i] == per[i % p] for i in found):
            return n, p
    return None


@dataclasses.dataclass(frozen=True)
class CutMap:
    """The full step's nodes and values that the step cut down to `depth` layers holds, and
    what they are there."""

    depth: int
    values: dict[int, int]  # full value id -> cut-down value id
    nodes: dict[int, int]  # full node id -> cut-down node id
    inputs: tuple[int, ...]  # the full step's input index of each cut-down input
    outputs: tuple[int, ...]  # the full step's output index of each cut-down output
    removed_nodes: frozenset[int]  # node ids of the layers cut off
    removed_values: frozenset[int]  # their values and parameters


def _pairs(full: Graph, cut: Graph, depth: int) -> list[tuple[int, int]] | None:
    """(full node index, cut-down node index) of the nodes both steps hold: the layers' below
    `depth` in order, then the others (embedding, head, loss) aligned in order, where the full
    step may hold more of them (one per layer: the sum of MoE layers' auxiliary losses)."""
    _, fl = node_layers(full)
    _, cl = node_layers(cut)
    pairs = []
    for mine, theirs in (([k for k, x in enumerate(fl) if x is not None and x < depth],
                          [k for k, x in enumerate(cl) if x is not None]),
                         ([k for k, x in enumerate(fl) if x is None],
                          [k for k, x in enumerate(cl) if x is None])):
        if len(mine) == len(theirs):
            pairs += zip(mine, theirs)
            continue
        a = [_signature(full, full.nodes[k]) for k in mine]
        b = [_signature(cut, cut.nodes[k]) for k in theirs]
        ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
        if any(op not in ("equal", "delete") for op, *_ in ops):
            return None
        pairs += [(mine[i1 + j], theirs[j1 + j]) for op, i1, i2, j1, _ in ops if op == "equal"
                  for j in range(i2 - i1)]
    return pairs


def cut_map(full: Graph, cut: Graph, depth: int) -> CutMap | None:
    """The full step with its layers from `depth` on removed, matched to `cut` (the step built
    with `depth` layers) node for node; None where they differ."""
    fin, _ = node_layers(full)
    keep_in = [i for i, layer in enumerate(fin) if layer is None or layer < depth]
    if (len(keep_in) != len(cut.inputs)
            or [full.input_names[i] for i in keep_in] != list(cut.input_names)):
        return None
    pairs = _pairs(full, cut, depth)
    if pairs is None or len(pairs) != len(cut.nodes):
        return None
    values = {full.inputs[i]: c for i, c in zip(keep_in, cut.inputs)}
    nodes = {}
    for k, c in pairs:
        mine, node = full.nodes[k], cut.nodes[c]
        if _signature(full, mine) != _signature(cut, node):
            return None
        nodes[mine.id] = node.id
        values.update(zip(mine.outputs, node.outputs))
    outputs = tuple(j for j, v in enumerate(full.outputs) if v in values)
    if [values[full.outputs[j]] for j in outputs] != list(cut.outputs):
        return None
    removed = [n for n in full.nodes if n.id not in nodes]
    removed_values = {v for n in removed for v in n.outputs}
    removed_values |= {full.inputs[i] for i in range(len(full.inputs)) if i not in set(keep_in)}
    return CutMap(depth, values, nodes, tuple(keep_in), outputs,
                  frozenset(n.id for n in removed), frozenset(removed_values))


def map_plan(plan: Plan, m: CutMap) -> Plan | None:
    """The full step's plan as it lays out the cut-down step: the specs of the inputs, outputs,
    constrained values and operand routes it keeps (those of the layers cut off dropped);
    None when it names a value or node the cut-down step lacks for another reason."""
    constraints = {}
    for v, spec in plan.constraints.items():
        if v in m.values:
            constraints[m.values[v]] = spec
        elif v not in m.removed_values:
            return None
    routes = {}
    for (n, i), route in plan.operand_specs.items():
        if n in m.nodes:
            routes[(m.nodes[n], i)] = route
        elif n not in m.removed_nodes:
            return None
    return dataclasses.replace(
        plan, input_specs=tuple(plan.input_specs[i] for i in m.inputs),
        output_specs=tuple(plan.output_specs[j] for j in m.outputs),
        constraints=constraints, operand_specs=routes)


def extrapolate(a: PricedStep, b: PricedStep, depth: int, layers: int,
                period: int = 1) -> PricedStep | None:
    """The priced step at `layers` layers from its prices at `depth` (a) and depth + period
    (b): every figure a + (layers - depth) / period * (b - a); None when one shrinks with
    depth (the layers do not add alike) or a collective kind is in one program only."""
    if (layers - depth) % period:
        return None
    n = (layers - depth) // period

    def line(x: float, y: float) -> float:
        return y + (n - 1) * (y - x)

    figures = ("compute_s", "comm_s", "peak_bytes", "bytes_sent")
    if any(getattr(b, f) < getattr(a, f) * (1 - 1e-9) for f in figures):
        return None
    if set(a.per_kind) != set(b.per_kind):
        return None
    kinds = {}
    for k, x in a.per_kind.items():
        y = b.per_kind[k]
        if y.count < x.count or y.bytes_sent < x.bytes_sent * (1 - 1e-9):
            return None
        kinds[k] = KindCost(int(line(x.count, y.count)), line(x.bytes_sent, y.bytes_sent),
                            line(x.seconds, y.seconds))
    compute, comm = line(a.compute_s, b.compute_s), line(a.comm_s, b.comm_s)
    return PricedStep(compute_s=compute, comm_s=comm, total_s=compute + comm,
                      peak_bytes=line(a.peak_bytes, b.peak_bytes),
                      bytes_sent=line(a.bytes_sent, b.bytes_sent), per_kind=kinds)


@dataclasses.dataclass(frozen=True)
class Shallow:
    """The step cut down to `depth` and `depth` + `period` layers (traced and lifted), for a
    step of `layers` that repeat every `period` (layer_period)."""

    layers: int
    depth: int
    traced: tuple[TracedStep, TracedStep]
    graphs: tuple[Graph, Graph]
    period: int = 1

    @property
    def depths(self) -> tuple[int, int]:
        return self.depth, self.depth + self.period


def compiler(graph: Graph, traced: TracedStep, shallow: Shallow | None, mesh,
             hw: HardwareProfile, donate_argnums: Sequence[int] = ()
             ) -> Callable[[str, Plan], compiled.MeasuredProgram]:
    """(name, plan of `graph`) -> the plan compiled and priced (compiled.MeasuredProgram):
    from the two `shallow` copies where the plan maps onto them (the module), else in full."""
    dtype = compiled.compute_dtype(graph)
    widening = liveness.cpu_widening(graph) if targets.widens(mesh, hw) else 1.0
    maps = None
    if shallow is not None and layer_period(graph) == (shallow.layers, shallow.period):
        maps = [cut_map(graph, g, d) for g, d in zip(shallow.graphs, shallow.depths)]
        maps = None if None in maps else maps

    def full(name: str, plan: Plan) -> compiled.MeasuredProgram:
        return compiled.measure(graph, traced, plan, mesh, hw, name, donate_argnums, dtype,
                               widening)

    def compile_one(name: str, plan: Plan) -> compiled.MeasuredProgram:
        cut = [map_plan(plan, m) for m in maps] if maps is not None else [None]
        if None in cut:
            return full(name, plan)
        got = [compiled.measure(g, t, p, mesh, hw, name, donate_argnums, dtype, widening)
               for g, t, p in zip(shallow.graphs, shallow.traced, cut)]
        if any(c.priced is None for c in got):
            return full(name, plan)
        priced = extrapolate(got[0].priced, got[1].priced, shallow.depth, shallow.layers,
                             shallow.period)
        if priced is None:
            return full(name, plan)
        a, b = shallow.depths
        how = f"extrapolated from the step compiled at {a} and {b} of its {shallow.layers} layers"
        return compiled.MeasuredProgram(name, plan, priced, extrapolated=how)

    return compile_one
