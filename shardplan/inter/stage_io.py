"""Stages of the forward pass: what each stage (or layer) runs, reads and hands on
(StageIO), the body cut into layers, a layer's signature, and a stage as a differentiable
function of its inputs."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from shardplan.inter.split import SplitStep, ancestors, eval_nodes, is_float, is_marker
from shardplan.ir.graph import Graph
from shardplan.ir.layers import cluster_graph


@dataclasses.dataclass(frozen=True)
class StageIO:
    """What one stage (or layer) of the forward pass runs, reads and hands on.

    `diff_in` are differentiated (differentiated arguments and floating activations from
    earlier stages), `const_in` are not (step inputs, integer activations, values computed
    from the state before the loss function). `outs` are produced here and read by later
    stages or returned (loss, aux). `prep` are the nodes computing this stage's inputs from
    the state when they are not step inputs themselves (casts before the loss function).
    """

    nodes: tuple[int, ...]
    diff_in: tuple[int, ...]
    const_in: tuple[int, ...]
    outs: tuple[int, ...]
    prep: tuple[int, ...] = ()


def stage_ios(split: SplitStep, groups: Sequence[Sequence[int]]) -> tuple[StageIO, ...]:
    """The StageIO of each group of body nodes (contiguous groups, in program order)."""
    g = split.forward
    stage_of: dict[int, int] = {}
    for s, nodes in enumerate(groups):
        for nid in nodes:
            stage_of[nid] = s
    producers = g.producers()
    diff = set(split.diff_values)
    pre = set(split.pre_nodes)
    consts = set(g.consts)
    readers: dict[int, set[int]] = collections.defaultdict(set)
    for nid, s in stage_of.items():
        for v in g.nodes[nid].inputs:
            readers[v].add(s)
    final = set(g.outputs)
    out = []
    for s, nodes in enumerate(groups):
        own = set(nodes)
        seen: set[int] = set()
        diff_in, const_in, outs = [], [], []
        prep_targets = []
        for nid in nodes:
            for v in g.nodes[nid].inputs:
                val = g.values[v]
                if v in seen or val.is_literal or v in consts:
                    continue
                p = producers.get(v)
                if p is not None and p[0] in own:
                    continue
                seen.add(v)
                if v in diff or (p is not None and p[0] in stage_of and is_float(g, v)):
                    diff_in.append(v)
                else:
                    const_in.append(v)
                if p is not None and p[0] in pre and not _is_source(split, v):
                    prep_targets.append(v)
        for nid in nodes:
            for v in g.nodes[nid].outputs:
                if v in final or any(t > s for t in readers.get(v, ())):
                    outs.append(v)
        prep = _prep_nodes(split, prep_targets)
        out.append(StageIO(tuple(nodes), tuple(diff_in), tuple(const_in), tuple(outs), prep))
    return tuple(out)


def _is_source(split: SplitStep, v: int) -> bool:
    """A differentiated value that is a step input itself (no computation before the loss)."""
    for d, src in zip(split.diff_values, split.diff_sources):
        if d == v:
            return src is not None
    return False


def prep_source(split: SplitStep, v: int) -> int:
    """The value a stage's preparation computes for input v (a differentiated value is its
    unmarked argument: the mark is an identity over all of them, not to be run per stage)."""
    if v in split.diff_values:
        return split.diff_inputs[split.diff_values.index(v)]
    return v


def _prep_nodes(split: SplitStep, targets: Sequence[int]) -> tuple[int, ...]:
    if not targets:
        return ()
    need = ancestors(split.forward, [prep_source(split, v) for v in targets])
    return tuple(n for n in split.pre_nodes if n in need and not is_marker(split.forward.nodes[n]))


def layer_groups(split: SplitStep, num_layers: int | None = None, delta: float = 0.5
                 ) -> tuple[tuple[int, ...], ...]:
    """The body's nodes cut into layers: at the user's stage_boundary marks if there are any
    (and num_layers is None or their count + 1), else clustered by flops with small cuts."""
    body = split.body
    if split.boundaries and num_layers in (None, len(split.boundaries) + 1):
        cuts = [k + 1 for k in split.boundaries if k + 1 < len(body)]
        bounds = [0, *cuts, len(body)]
        return tuple(tuple(body[a:b]) for a, b in itertools.pairwise(bounds) if b > a)
    n = len(body)
    if num_layers is None:
        num_layers = min(8, n)
    if not 1 <= num_layers <= n:
        raise ValueError(f"num_layers={num_layers} must be between 1 and the {n} operations of "
                         "the loss function")
    return cluster_graph(split.forward, body, num_layers, delta=delta)


def merge_groups(layers: Sequence[Sequence[int]], ranges: Sequence[tuple[int, int]]
                 ) -> tuple[tuple[int, ...], ...]:
    """Node ids of each stage, given its (first layer, last layer) range."""
    return tuple(tuple(n for layer in layers[i:j + 1] for n in layer) for i, j in ranges)


def layer_signature(graph: Graph, io: StageIO) -> tuple:
    """A key equal for layers that compute the same thing on the same shapes (repeated
    blocks), so that their costs are computed once."""
    local: dict[int, tuple] = {}
    head = []
    for tag, vids in (("d", io.diff_in), ("c", io.const_in)):
        for k, v in enumerate(vids):
            local[v] = (tag, k)
            head.append((tag, graph.values[v].shape, graph.values[v].dtype))
    items = [tuple(head)]
    for idx, nid in enumerate(io.nodes):
        node = graph.nodes[nid]
        ins = []
        for v in node.inputs:
            val = graph.values[v]
            ins.append(local.get(v, ("k", val.shape, val.dtype)))
        outs = tuple((graph.values[v].shape, graph.values[v].dtype) for v in node.outputs)
        items.append((node.primitive, tuple(ins), outs, _params_key(node.params)))
        for o, v in enumerate(node.outputs):
            local[v] = ("n", idx, o)
    items.append(tuple(local.get(v) for v in io.outs))
    return tuple(items)


def _params_key(params: Mapping) -> str:
    return re.sub(r" at 0x[0-9a-f]+", "", repr(sorted((k, repr(v)) for k, v in params.items())))


# -- a stage as a differentiable function ---------------------------------------------------------


def stage_function(split: SplitStep, io: StageIO):
    """f(diff values, const values) -> (floating outputs, other outputs) of one stage, for
    jax.vjp(..., has_aux=True): the floating outputs get cotangents, the others do not."""
    g = split.forward
    run = eval_nodes(g, io.nodes, (*io.diff_in, *io.const_in), io.outs)
    float_pos = [k for k, v in enumerate(io.outs) if is_float(g, v)]
    other_pos = [k for k, v in enumerate(io.outs) if not is_float(g, v)]

    def fn(diff, const):
        outs = run(*diff, *const)
        return [outs[k] for k in float_pos], [outs[k] for k in other_pos]

    return fn


def float_outs(split: SplitStep, io: StageIO) -> tuple[int, ...]:
    return tuple(v for v in io.outs if is_float(split.forward, v))


def other_outs(split: SplitStep, io: StageIO) -> tuple[int, ...]:
    return tuple(v for v in io.outs if not is_float(split.forward, v))


def forward_backward(split: SplitStep, io: StageIO):
    """f(diff, const, cotangents) -> (outputs, gradients of diff): one micro-batch of a stage,
    forward and backward, the graph the intra-op planner costs a stage (or a layer) by."""
    fn = stage_function(split, io)

    def fb(diff, const, cots):
        outs, vjp, others = jax.vjp(lambda *d: fn(list(d), const), *diff, has_aux=True)
        grads = vjp(list(cots))
        return list(outs), list(others), list(grads)

    return fb


def avals(graph: Graph, vids: Sequence[int]) -> list:
    return [jax.ShapeDtypeStruct(graph.values[v].shape, np.dtype(graph.values[v].dtype))
            if not graph.values[v].dtype.startswith("key") else
            jax.ShapeDtypeStruct(graph.values[v].shape, graph.values[v].dtype)
            for v in vids]
