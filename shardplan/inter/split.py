"""Split a traced train step at its gradient call into the loss function's forward pass (cut
into stages, each differentiated on its own) and the update (split per stage by the
parameters it touches).

The step is traced twice inside shardplan.grad.intercepting: once to capture the forward
graph (the step up to the shardplan.value_and_grad call, then the loss function; the
differentiated arguments pass through a marked identity), once with the loss and gradients
as inputs, giving the update graph (the rest of the step). Both are Graphs (shardplan.ir)
whose node subsets are run again by `eval_nodes`, as shardplan.emit.jit does for a whole
graph. Custom JVP/VJP rules inside the loss are differentiated through their bodies (lift
inlines them), as jax.grad of the inlined code would.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from shardplan import _compat

# from-imports: once shardplan exports the function `grad`, the attribute shardplan.grad
# is no longer this module
from shardplan.grad import (
    BOUNDARY_SCOPE,
    GRAD_ARGS_SCOPE,
    CapturedLoss,
    CaptureForward,
    PipelineSplitError,
    ReplayUpdate,
    intercepting,
)
from shardplan.ir.graph import Graph, Node, Role
from shardplan.ir.lift import ArgInfo, LiftOptions, lift
from shardplan.ir.trace import TracedStep, trace

# values the update may pass between stages (a global gradient norm's partial sums)
MAX_COUPLING_ELEMENTS = 1024

__all__ = ["PipelineSplitError"]  # re-exported: the error of this module


# -- the split step -----------------------------------------------------------------------------


# Stages are cut between nodes and run by binding each node's equation: loops stay whole.
OPAQUE_LOOPS = LiftOptions(loops=False)


def is_marker(node: Node) -> bool:
    """A shardplan identity (stage boundary or differentiated-argument mark)."""
    return node.primitive == "optimization_barrier" and (
        BOUNDARY_SCOPE in node.name or GRAD_ARGS_SCOPE in node.name)


@dataclasses.dataclass(frozen=True, eq=False)
class SplitStep:
    """A train step cut at its gradient call.

    `forward` runs on one micro-batch: its inputs are the step's flat arguments (the leaves in
    `micro_leaves` cut to a micro-batch along dim 0), its outputs the loss and the aux leaves.
    `diff_values[k]` is the forward value of the k-th differentiated leaf (in the order of the
    gradients' leaves); `diff_sources[k]` the step input it is, or None if computed.
    `update` takes (step leaves at full size, loss, aux leaves, gradient leaves) and returns
    the step's flat outputs.
    """

    traced: TracedStep
    num_micro_batches: int
    micro_leaves: tuple[int, ...]
    forward: Graph
    diff_values: tuple[int, ...]
    diff_sources: tuple[int | None, ...]
    diff_inputs: tuple[int, ...]
    """The values marked as differentiated (diff_values[k] is diff_inputs[k] passed through
    an identity): what a stage computes when a differentiated value is not a step input."""
    grad_tree: Any
    has_aux: bool
    aux_tree: Any
    pre_nodes: tuple[int, ...]
    body: tuple[int, ...]
    boundaries: tuple[int, ...]
    update: Graph

    @property
    def num_inputs(self) -> int:
        return len(self.traced.in_avals)

    @property
    def loss_value(self) -> int:
        return self.forward.outputs[0]

    def update_inputs(self) -> dict[str, range]:
        """Positions of the update graph's inputs: step leaves, loss, aux leaves, grads."""
        n, a = self.num_inputs, len(self.forward.outputs) - 1
        return {"step": range(n), "loss": range(n, n + 1), "aux": range(n + 1, n + 1 + a),
                "grads": range(n + 1 + a, n + 1 + a + len(self.diff_values))}


def micro_batch_leaves(traced: TracedStep, batch_argnums: Sequence[int] | None) -> tuple[int, ...]:
    """Flat inputs split into micro-batches: the leaves of `batch_argnums` (every leaf with a
    dimension), or else the batch-role leaves whose leading dimension is the batch size (the
    most common leading dimension among them), so that PRNG keys and scalars stay whole."""
    avals = traced.in_avals
    if batch_argnums is not None:
        starts = np.concatenate([[0], np.cumsum(traced.arg_leaf_counts)]).astype(int)
        found = [i for a in sorted(batch_argnums) for i in range(starts[a], starts[a + 1])
                 if len(avals[i].shape) >= 1]
        return tuple(found)
    cands = [i for i, r in enumerate(traced.arg_info.roles)
             if r == Role.BATCH and len(avals[i].shape) >= 1]
    if not cands:
        return ()
    counts = collections.Counter(avals[i].shape[0] for i in cands)
    size = max(counts, key=lambda d: (counts[d], d))
    return tuple(i for i in cands if avals[i].shape[0] == size)


def split_step(fn, args: Sequence, *, num_micro_batches: int = 1,
               state_argnums: Sequence[int] | None = None,
               batch_argnums: Sequence[int] | None = None,
               traced: TracedStep | None = None) -> SplitStep:
    """Trace `fn(*args)` (arrays or ShapeDtypeStructs) and split it at its
    shardplan.value_and_grad / shardplan.grad call, for `num_micro_batches` micro-batches."""
    args = tuple(args)
    if traced is None:
        traced = trace(fn, args, state_argnums, batch_argnums)
    B = int(num_micro_batches)
    if B < 1:
        raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
    micro = micro_batch_leaves(traced, batch_argnums)
    full = list(traced.in_avals)
    if B > 1 and not micro:
        raise PipelineSplitError("no batch argument to split into micro-batches: pass "
                                 "batch_argnums=(...) or num_micro_batches=1")
    small = list(full)
    for i in micro:
        shape = full[i].shape
        if shape[0] % B:
            raise PipelineSplitError(
                f"input {traced.arg_info.input_names[i]} has leading (batch) dimension "
                f"{shape[0]}, not divisible by num_micro_batches={B}; choose a divisor")
        small[i] = jax.ShapeDtypeStruct((shape[0] // B, *shape[1:]), full[i].dtype)

    capture = CaptureForward()

    def forward_fn(*flat):
        step_args = jax.tree_util.tree_unflatten(traced.in_tree, list(flat))
        with intercepting(capture):
            try:
                fn(*step_args)
            except CapturedLoss as c:
                return c.outputs
        raise PipelineSplitError(
            "the step never called shardplan.value_and_grad or shardplan.grad: write the "
            "gradient with those (drop-ins for jax's) so the pipeline planner can find the "
            "loss function, or plan without pipeline stages (pipeline=False)")

    closed = jax.make_jaxpr(forward_fn)(*small)
    forward = lift(closed, ArgInfo(traced.arg_info.roles, (None,) * len(closed.jaxpr.outvars),
                                   traced.arg_info.input_names), OPAQUE_LOOPS)
    marks = [n for n in forward.nodes if n.primitive == "optimization_barrier"
             and GRAD_ARGS_SCOPE in n.name]
    if len(marks) != 1:
        raise PipelineSplitError(f"found {len(marks)} marked gradient calls in the step; "
                                 "call shardplan.value_and_grad once, at the step's top level "
                                 "(not inside jit, scan or vmap)")
    barrier = marks[0]
    diff_values = tuple(barrier.outputs)
    inputs = {v: i for i, v in enumerate(forward.inputs)}
    diff_sources = tuple(inputs.get(v) for v in barrier.inputs)

    needed = _ancestors(forward, forward.outputs)
    pre = _ancestors(forward, barrier.inputs) | {barrier.id}
    pre_inputs = _input_ancestors(forward, [n for n in forward.nodes if n.id in pre])
    bad = sorted(set(pre_inputs) & {forward.inputs[i] for i in micro})
    if bad:
        names = [forward.input_names[inputs[v]] for v in bad]
        raise PipelineSplitError(f"the differentiated arguments are computed from the batch "
                                 f"({', '.join(names)}); pipelining needs them to depend on "
                                 "the state only")
    body = tuple(n.id for n in forward.nodes if n.id in needed and n.id not in pre)
    producers = forward.producers()
    if forward.outputs[0] not in producers or producers[forward.outputs[0]][0] in pre:
        raise PipelineSplitError("the loss does not depend on the differentiated arguments")
    boundaries = tuple(k for k, nid in enumerate(body) if is_marker(forward.nodes[nid])
                       and BOUNDARY_SCOPE in forward.nodes[nid].name)
    aux_avals = [forward.values[v] for v in forward.outputs[1:]]
    for a in aux_avals:
        if not np.issubdtype(np.dtype(a.dtype), np.floating):
            raise PipelineSplitError(f"an aux output has dtype {a.dtype}: pipelining averages "
                                     "aux over micro-batches, which needs floating values")

    # the update: the step again, its gradient call returning the given loss, aux and grads
    grad_avals = [jax.ShapeDtypeStruct(forward.values[v].shape, forward.values[v].dtype)
                  for v in diff_values]
    loss_aval = jax.ShapeDtypeStruct((), forward.values[forward.outputs[0]].dtype)
    aux_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in aux_avals]
    n_in, n_aux = len(full), len(aux_structs)

    def update_fn(*flat):
        step_args = jax.tree_util.tree_unflatten(traced.in_tree, list(flat[:n_in]))
        aux = jax.tree_util.tree_unflatten(capture.out_tree, list(flat[n_in + 1:n_in + 1 + n_aux]))
        grads = jax.tree_util.tree_unflatten(capture.grad_tree, list(flat[n_in + 1 + n_aux:]))
        if not isinstance(capture.argnums, int):
            grads = tuple(grads)
        replay = ReplayUpdate(flat[n_in], aux, grads, capture.has_aux)
        with intercepting(replay):
            out = fn(*step_args)
        return jax.tree_util.tree_leaves(out)

    full_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in full]
    closed_u, out_shape = jax.make_jaxpr(update_fn, return_shape=True)(
        *full_structs, loss_aval, *aux_structs, *grad_avals)
    want = [(tuple(a.shape), str(a.dtype)) for a in traced.out_avals]
    got = [(tuple(a.shape), str(a.dtype)) for a in out_shape]
    if want != got:
        raise PipelineSplitError("the step's outputs change shape when the loss function runs "
                                 "on a micro-batch (does the aux output depend on the batch "
                                 "size?); return batch-independent aux or use "
                                 "num_micro_batches=1")
    roles = (*traced.arg_info.roles, *(Role.OTHER,) * (1 + n_aux), *(Role.STATE,) * len(diff_values))
    update = lift(closed_u, ArgInfo(roles, traced.arg_info.ties), OPAQUE_LOOPS)
    return SplitStep(traced, B, micro, forward, diff_values, diff_sources,
                     tuple(barrier.inputs), capture.grad_tree,
                     capture.has_aux, capture.out_tree, tuple(sorted(pre)), body, boundaries,
                     update)


def _ancestors(graph: Graph, values: Iterable[int]) -> set[int]:
    """Ids of the nodes that `values` depend on."""
    producers = graph.producers()
    seen: set[int] = set()
    stack = [v for v in values]
    while stack:
        v = stack.pop()
        if v not in producers:
            continue
        nid = producers[v][0]
        if nid in seen:
            continue
        seen.add(nid)
        stack.extend(graph.nodes[nid].inputs)
    return seen


def _input_ancestors(graph: Graph, nodes: Sequence[Node]) -> set[int]:
    ins = set(graph.inputs)
    return {v for n in nodes for v in n.inputs if v in ins}


# -- running node subsets -------------------------------------------------------------------------


def eval_nodes(graph: Graph, node_ids: Sequence[int], in_vids: Sequence[int],
               out_vids: Sequence[int]):
    """A function of the values `in_vids` returning the values `out_vids`, running the given
    nodes of `graph` in order (shardplan's marks run as identities)."""
    consts = set(graph.consts)
    nodes = [graph.nodes[i] for i in node_ids]
    in_vids, out_vids = tuple(in_vids), tuple(out_vids)

    def run(*vals):
        env = dict(zip(in_vids, vals))

        def read(v):
            val = graph.values[v]
            if val.is_literal or v in consts:
                return val.const
            return env[v]

        for node in nodes:
            ins = [read(v) for v in node.inputs]
            outs = ins if is_marker(node) else _compat.bind_eqn(node.eqn, ins)
            env.update(zip(node.outputs, outs))
        return [read(v) for v in out_vids]

    return run


def is_float(graph: Graph, v: int) -> bool:
    return np.issubdtype(np.dtype(graph.values[v].dtype), np.inexact)


# -- stages of the forward pass -----------------------------------------------------------------


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
    need = _ancestors(split.forward, [prep_source(split, v) for v in targets])
    return tuple(n for n in split.pre_nodes if n in need and not is_marker(split.forward.nodes[n]))


def layer_groups(split: SplitStep, num_layers: int | None = None, delta: float = 0.5
                 ) -> tuple[tuple[int, ...], ...]:
    """The body's nodes cut into layers: at the user's stage_boundary marks if there are any
    (and num_layers is None or their count + 1), else clustered by flops with small cuts."""
    from shardplan.ir.layers import cluster_graph

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
    import re

    return re.sub(r" at 0x[0-9a-f]+", "", repr(sorted((k, repr(v)) for k, v in params.items())))


# -- the update, split by stage ----------------------------------------------------------------


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
