"""The update of a split step (the step after the gradient call), split by stage: the part
each stage runs on the parameters it holds, and the reductions (a global gradient norm's
partial sums) passed between stages."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from shardplan.grad import PipelineSplitError
from shardplan.inter.split import SplitStep
from shardplan.ir.graph import Graph

# values the update may pass between stages (a global gradient norm's partial sums)
MAX_COUPLING_ELEMENTS = 1024


@dataclasses.dataclass(frozen=True)
class UpdatePart:
    """Nodes of the update graph one stage runs, the values it reads and those it returns."""

    nodes: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class UpdateSplit:
    """The update per stage: `reduce[s]` computes the small values (partial sums of a global
    norm) other stages need, `apply[s]` the step outputs of stage s (its new parameters and
    optimizer state) from its inputs and every stage's reduce outputs."""

    reduce: tuple[UpdatePart, ...]
    apply: tuple[UpdatePart, ...]
    output_stage: tuple[int, ...]
    input_stages: Mapping[int, tuple[int, ...]]
    """update input value -> the stages whose update parts read it."""


def split_update(split: SplitStep, diff_home: Sequence[int], num_stages: int) -> UpdateSplit:
    """Assign the update's operations to stages by the gradients and differentiated inputs
    they read (`diff_home[k]` is the stage of gradient k).

    A value computed from several stages' values is "shared": it must be small (a global
    gradient norm), as must the single-stage values it combines (each stage's partial sum).
    Those partials are computed by each stage's reduce part, exchanged, and every stage that
    needs a shared value recomputes it from them; a scalar computed from a shared value and
    one stage's scalars continues the reduction (a sum over leaves in order). Larger
    couplings are an error that says so.
    """
    g = split.update
    dep, frontier = _dependencies(split, diff_home)
    none: frozenset[int] = frozenset()
    last = num_stages - 1
    output_stage = [next(iter(dep.get(v, none)), last) for v in g.outputs]
    reduce, apply = [], []
    for s in range(num_stages):
        targets = sorted(v for v in frontier if dep[v] == frozenset([s]))
        reduce.append(update_slice(g, targets, set()))
        outs = [v for v, t in zip(g.outputs, output_stage) if t == s]
        apply.append(update_slice(g, list(dict.fromkeys(outs)), frontier))
    readers: dict[int, set[int]] = collections.defaultdict(set)
    for s, part in enumerate(reduce + apply):
        for v in part.inputs:
            readers[v].add(s % num_stages)
    return UpdateSplit(tuple(reduce), tuple(apply), tuple(output_stage),
                       {v: tuple(sorted(r)) for v, r in sorted(readers.items())})


def _dependencies(split: SplitStep, diff_home: Sequence[int]
                  ) -> tuple[dict[int, frozenset[int]], set[int]]:
    """(value -> the stages it depends on, empty for shared values; the single-stage partials
    combined into shared values), checking that couplings are small and one round deep."""
    g = split.update
    pos = split.update_inputs()
    home: dict[int, int] = {}
    for k, s in enumerate(diff_home):
        home[g.inputs[pos["grads"][k]]] = s
        src = split.diff_sources[k]
        if src is not None:
            home.setdefault(g.inputs[src], s)
    none: frozenset[int] = frozenset()
    dep = {v: frozenset([s]) for v, s in home.items()}  # stages a value depends on
    shared: set[int] = set()
    frontier: set[int] = set()
    for node in g.nodes:
        d = none.union(*(dep.get(v, none) for v in node.inputs))
        outs = [g.values[v] for v in node.outputs]
        reads_shared = any(v in shared for v in node.inputs)
        combine = len(d) > 1 or (reads_shared and d and all(o.ndim == 0 for o in outs))
        if not combine:
            for v in node.outputs:
                dep[v] = d
                if reads_shared and not d:
                    shared.add(v)
            continue
        parts = [v for v in node.inputs if len(dep.get(v, none)) == 1]
        for val in [*outs, *(g.values[v] for v in parts)]:
            if val.size > MAX_COUPLING_ELEMENTS:
                raise PipelineSplitError(
                    f"the update couples the parameters of stages {sorted(d)} through "
                    f"`{node.primitive}` ({node.name or 'unnamed'}) on a value of shape "
                    f"{val.shape}: only small values (e.g. the partial sums of a global "
                    "gradient norm) can be combined across stages; make the update "
                    "per-parameter or plan without pipeline stages (pipeline=False)")
        frontier.update(parts)
        for v in node.outputs:
            dep[v] = none
            shared.add(v)
    for v in frontier:  # one exchange: the partials must not need a shared value
        if any(u in shared for n in update_slice(g, [v], set()).nodes for u in g.nodes[n].outputs):
            raise PipelineSplitError(
                "the update combines values across stages twice in a row (a reduction over "
                "the result of another); shardplan exchanges one round of partial sums: "
                "simplify the update or plan without pipeline stages (pipeline=False)")
    return dep, frontier


def update_slice(g: Graph, targets: Sequence[int], stop: set[int]) -> UpdatePart:
    """The nodes computing `targets`, not looking past `stop` values, and what they read."""
    producers = g.producers()
    consts = set(g.consts)
    nodes: set[int] = set()
    inputs: set[int] = set()
    stack = list(targets)
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        val = g.values[v]
        if val.is_literal or v in consts:
            continue
        if v in stop or v not in producers:
            inputs.add(v)
            continue
        nid = producers[v][0]
        if nid not in nodes:
            nodes.add(nid)
            stack.extend(g.nodes[nid].inputs)
    order = {v: k for k, v in enumerate(g.inputs)}
    return UpdatePart(tuple(sorted(nodes)), tuple(sorted(inputs, key=lambda v: (order.get(v, 1 << 30), v))),
                      tuple(targets))
