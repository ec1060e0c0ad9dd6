"""Shape the ILP before solving: merge follower nodes into the node they follow (Alpa's
"follower" merging), so each group of cheap ops makes one choice; give values read several
times a fan-out member, or their producers twins that reshard them once; tie repeated
layers."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Collection, Sequence

from shardplan.ir import primitives
from shardplan.ir.graph import Graph
from shardplan.strategies.base import Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec


@dataclasses.dataclass(frozen=True)
class Groups:
    """Members are graph inputs (0..I-1, the "sources") and nodes (I + node id).
    root[m] is the member whose choice decides m's; pick[m][k] is m's strategy when the root
    chooses its strategy k."""

    root: tuple[int, ...]
    pick: tuple[tuple[int, ...], ...]

    def roots(self) -> list[int]:
        return sorted({r for r in self.root})


def merge_followers(graph: Graph, strategies: list[list[Strategy]], producer: dict[int, tuple[int, int]],
                    node_cost, cost_key=None, work=None) -> Groups:
    """A node follows its largest tensor operand (as in Alpa) when it performs no collective
    in any strategy and can take every spec that operand's group can produce; it then runs in
    that spec at its cheapest matching strategy, and its other operands are resharded to it.
    `producer` maps value -> (member, output idx); `node_cost(member, k)` prices a strategy;
    `cost_key(member)`, where given, is equal for members that cost the same under each
    strategy of a shared list (the same operator in tied layers): their mapping is made once
    (`work` counts the mappings made)."""
    root = list(range(len(strategies)))
    pick: list[tuple[int, ...]] = [tuple(range(len(s))) for s in strategies]
    num_inputs = len(graph.inputs)
    # (strategy list, operand, spec) -> the strategies that read the operand in that spec:
    # nodes of repeated layers share their strategy lists.
    reading: dict[tuple[int, int, object], list[int]] = {}
    # (follower's list and cost, operand, producer's list and picks, output) -> its picks
    mappings: dict[tuple, tuple[int, ...] | None] = {}
    no_comms: dict[int, bool] = {}
    for node in graph.nodes:
        m = num_inputs + node.id
        if primitives.info(node.primitive).leader or len(node.outputs) != 1:
            continue
        tensor_inputs = [(i, v) for i, v in enumerate(node.inputs)
                         if not graph.values[v].is_literal and graph.values[v].const is None
                         and graph.values[v].ndim > 0 and v in producer]
        if len(tensor_inputs) != 1:
            continue
        if id(strategies[m]) not in no_comms:
            no_comms[id(strategies[m])] = not any(s.comms for s in strategies[m])
        if not no_comms[id(strategies[m])]:
            continue
        i, v = max(tensor_inputs, key=lambda iv: (graph.values[iv[1]].nbytes, -iv[0]))
        p, out_idx = producer[v]
        r = root[p]
        key = None
        if cost_key is not None:
            key = (id(strategies[m]), cost_key(m), i, id(strategies[p]), pick[p], out_idx)
            if key in mappings:
                if mappings[key] is not None:
                    root[m], pick[m] = r, mappings[key]
                continue
        if work is not None:
            work["follower mappings"] += 1
        mapping = []
        for k in range(len(strategies[r])):
            spec = strategies[p][pick[p][k]].out_specs[out_idx]
            rkey = (id(strategies[m]), i, spec)
            if rkey not in reading:
                reading[rkey] = [l for l, s in enumerate(strategies[m]) if s.in_specs[i] == spec]
            matches = reading[rkey]
            # A follower's layout must follow from its operand's: where several outputs are
            # possible (a broadcast may split its new dims), the choice is left to the ILP.
            if not matches:
                mapping = None
                break
            # Cheapest, then the one whose other operands share the followed spec (no reshard).
            mapping.append(min(matches, key=lambda l: (
                node_cost(m, l), sum(x != spec for x in strategies[m][l].in_specs), l)))
        if mapping is not None:
            root[m] = r
            pick[m] = tuple(mapping)
        if key is not None:
            mappings[key] = pick[m] if mapping is not None else None
    return Groups(tuple(root), tuple(pick))


def read_counts(graph: Graph) -> dict[int, int]:
    """value -> the nodes that read it, plus one per output it is (written back)."""
    counts: dict[int, int] = {}
    for v in [v for node in graph.nodes for v in set(node.inputs)] + list(graph.outputs):
        counts[v] = counts.get(v, 0) + 1
    return counts


def fanout_members(graph: Graph, strategies: list[list[Strategy]],
                   producer: dict[int, tuple[int, int]], partial_only: bool,
                   across_layers: bool = False,
                   reduced_only: bool = False) -> list[tuple[int, list[Strategy], bool]]:
    """A value read by several consumers gets a fan-out member: the layout it is resharded
    to once (XLA reshards a value once for all consumers that want the same layout), from
    which each consumer reads. Without it, every consumer would pay the same collective.
    `across_layers`: only values read outside every named scope (by the optimizer's update)
    as well as inside one. `reduced_only`: a fan-out's layouts are the whole ones (no partial
    sums): XLA reduces a partial value once, where it is first read whole, and its other
    readers read that (a reader that takes a partial sum reads a whole value as one for free).
    (value, its fan-out's strategies, whether it is read outside every scope) in value order;
    `producer` maps value -> (member, output idx), members as in Groups."""
    g, n_in = graph, len(graph.inputs)
    readers: dict[int, set[ShardSpec]] = {}
    outside: set[int] = set()
    # (strategy list, operand) -> the specs its strategies read: tied layers share lists
    read: dict[tuple[int, int], frozenset[ShardSpec]] = {}
    for node in g.nodes:
        for i, v in enumerate(node.inputs):
            value = g.values[v]
            if not value.is_literal and value.const is None and value.ndim > 0 and v in producer:
                listed = strategies[n_in + node.id]
                if (id(listed), i) not in read:
                    read[(id(listed), i)] = frozenset(s.in_specs[i] for s in listed)
                readers.setdefault(v, set()).update(read[(id(listed), i)])
                p = producer[v][0]
                if not node.name and p >= n_in and g.nodes[p - n_in].name:
                    outside.add(v)
    for j, v in enumerate(g.outputs):
        tie = g.output_ties[j]
        if tie is not None and v in readers:
            readers[v].update(s.out_specs[0] for s in strategies[tie])
    counts = read_counts(g)
    lists: dict[tuple[ShardSpec, ...], list[Strategy]] = {}
    out = []
    for v in sorted(readers):
        if counts.get(v, 0) < 2:
            continue
        p, out_idx = producer[v]
        made = {s.out_specs[out_idx] for s in strategies[p]}
        if partial_only and not any(s.partial for s in made):
            continue
        if across_layers and v not in outside:
            continue
        layouts = made | readers[v]
        if reduced_only:
            layouts = {s for s in layouts if not s.partial}
        ordered = tuple(sorted(layouts, key=lambda s: (len(s.used_axes()), str(s))))
        # fan-outs of the same layouts (each layer's) share one list
        if ordered not in lists:
            lists[ordered] = [Strategy("fanout", (s,), (s,), 0.0) for s in ordered]
        out.append((v, lists[ordered], v in outside))
    return out


FANOUT_MODES = ("auto", "none", "layers", "reduce", "partial", "reduced", "all")


def fanout_mode(mode: str, mesh: MeshShape) -> str:
    """IntraOptions.fanouts resolved: "auto" is "partial" on a mesh with one useful axis,
    "reduce" on the others."""
    if mode not in FANOUT_MODES:
        raise ValueError(f"fanouts={mode!r}: use one of {', '.join(map(repr, FANOUT_MODES))}")
    if mode == "auto":
        return "partial" if len(mesh.useful_axes()) == 1 else "reduce"
    return mode


def fanouts_of(graph: Graph, strategies: list[list[Strategy]],
               producer: dict[int, tuple[int, int]], mode: str
               ) -> tuple[list[tuple[int, list[Strategy]]], frozenset[int]]:
    """The fan-out members a resolved fanout_mode asks for ("reduce": those of "layers"; its
    twins are reduce_once's), and the values among them that the memory model holds as copies
    of their own (memory/model.py): all but those "reduced" adds to "layers" (the ILP prices them
    reduced once; the memory model counts their readers' copies as it does without a fan-out,
    as its tests and benchmarks/memory_check.py were written for)."""
    if mode == "none":
        return [], frozenset()
    found = fanout_members(graph, strategies, producer, partial_only=mode != "all",
                           across_layers=mode in ("layers", "reduce"),
                           reduced_only=mode == "reduced")
    held = frozenset(v for v, _, across in found if across or mode != "reduced")
    return [(v, listed) for v, listed, _ in found], held


_LAYER = re.compile(r"([A-Za-z][A-Za-z0-9]*?)_(\d+)(?=\W|$)")


def layer_template(name: str) -> tuple[str, int] | None:
    """('.../layer_*/attn', 3) for '.../layer_3/attn': the outermost numbered scope of a node
    or input name and its number; None when the name has none."""
    m = _LAYER.search(name)
    if m is None:
        return None
    return name[: m.start()] + m.group(1) + "_*" + name[m.end():], int(m.group(2))


def tie_layers(names: Sequence[str], strategies: list[list[Strategy]], roots: Sequence[int],
               signature, period: int = 2) -> dict[int, int]:
    """Repeated layers share variables: each root maps to a representative, the root with the
    same layer template, occurrence and strategies in the lowest-numbered layer of the same
    residue modulo `period`. Roots outside numbered scopes represent themselves.
    `signature(m)` tells members apart beyond strategies (primitive, shapes).

    A period of 2 lets neighbouring layers differ, as Megatron's column / row split of
    consecutive dense layers does (with a period of 1 every Dense_i takes one layout); it
    admits every period-1 plan, so it is never worse."""
    occurrence: dict[tuple, int] = {}
    first: dict[tuple, int] = {}
    rep = {}
    for r in roots:
        t = layer_template(names[r])
        if t is None:
            rep[r] = r
            continue
        template, layer = t
        key = (template, layer % period, signature(r), tuple(s.name for s in strategies[r]))
        n = occurrence.get((key, layer), 0)
        occurrence[(key, layer)] = n + 1
        rep[r] = first.setdefault((key, n), r)
    return rep


def reduce_once(graph: Graph, strategies: list[list[Strategy]], mesh: MeshShape,
                skip: Collection[int], reduce_comms
                ) -> tuple[list[list[Strategy]], dict[Strategy, tuple[int, ShardSpec]]]:
    """`strategies` where a value read by several nodes may be resharded once, where it is made:
    each strategy that leaves it a partial sum gets twins that reduce it into a whole layout,
    its own or one split over the summed axes (an all-reduce or a reduce-scatter: the twin's
    extra collectives are `reduce_comms(value, partial spec, whole spec)`). XLA reduces a
    partial value once, where it is first read whole, for all its readers; priced on the edges
    instead, each reader pays it, and the ILP kept a batch norm's statistics and a layer norm's
    input away from the layouts that leave them partial. A fan-out member does the same with
    a member of its own ("reduced"), at the cost of the LP relaxation: a fan-out member can
    leave the LP half in every layout where the twins leave it integral
    (IntraOptions.fanouts). A cast read by several nodes (a kernel's bf16 copy, read by its
    forward and backward dots) gets twins that all-gather it, once, as FSDP's program does
    (tests/test_intra_reduce_scatter.py::
    test_a_split_value_read_twice_is_gathered_once_in_its_own_dtype). Not every split value:
    with gathers for all, the ILP, which still charges other reshards once per reader, trades
    them for plans its estimate prices dearer (benchmarks/vs_experts.py).
    Values in `skip` (a fan-out reshards them) are left. Also returns each twin's (output
    index, the layout it reshards from)."""
    n_in, counts = len(graph.inputs), read_counts(graph)
    out, twins = list(strategies), {}
    # (strategy list, outputs read several times) -> the list with twins: tied layers share it
    twinned: dict[tuple[int, tuple[int, ...]], list[Strategy]] = {}
    for node in graph.nodes:
        ks = tuple(k for k, v in enumerate(node.outputs) if counts.get(v, 0) >= 2 and v not in skip)
        if not ks:
            continue
        listed = strategies[n_in + node.id]
        key = (id(listed), ks)
        if key not in twinned:
            extra, cast = [], node.primitive == "convert_element_type"
            for s in listed:
                for k in ks:
                    if s.out_specs[k].partial or (cast and s.out_specs[k].used_axes()):
                        for twin in _twins(s, k, graph.values[node.outputs[k]], mesh,
                                           reduce_comms):
                            twins[twin] = (k, s.out_specs[k])
                            extra.append(twin)
            twinned[key] = listed + extra if extra else listed
        out[n_in + node.id] = twinned[key]
    return out, twins


def _twins(s: Strategy, k: int, value, mesh: MeshShape, reduce_comms) -> list[Strategy]:
    """s, its output k all-reduced, or reduce-scattered onto one dimension (a partial sum), or
    all-gathered over some of the minor axes of its dimensions (a split value)."""
    spec = s.out_specs[k]
    whole = spec.without_partial()
    if not spec.partial:
        targets = [ShardSpec(tuple(d[:n] for d, n in zip(spec.dims, keep)))
                   for keep in itertools.product(*(range(len(d) + 1) for d in spec.dims))]
        return [_twin(s, k, t, "gathered", reduce_comms(value, spec, t))
                for t in targets if t != spec]
    targets = [whole]
    order = mesh.names.index
    for d, axes in enumerate(whole.dims):
        # the summed axes join the dimension's minor end, in mesh order (else a permute)
        split = axes + tuple(sorted(spec.partial, key=order))
        if list(split) == sorted(split, key=order):
            target = ShardSpec(whole.dims[:d] + (split,) + whole.dims[d + 1:])
            if target.valid_for(value.shape, mesh):
                targets.append(target)
    return [_twin(s, k, t, "reduced", reduce_comms(value, spec, t)) for t in targets]


def _twin(s: Strategy, k: int, target: ShardSpec, what: str, comms) -> Strategy:
    outs = s.out_specs[:k] + (target,) + s.out_specs[k + 1:]
    return dataclasses.replace(s, name=f"{s.name}, {what}{target}", out_specs=outs,
                               comms=s.comms + tuple(comms))
