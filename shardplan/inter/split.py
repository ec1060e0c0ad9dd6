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
import contextlib
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

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
    routing_jax_gradients,
)
from shardplan.ir import interpret
from shardplan.ir.graph import Graph, Node, Role
from shardplan.ir.lift import ArgInfo, LiftOptions, lift
from shardplan.ir.trace import TracedStep, trace

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
               traced: TracedStep | None = None, jax_gradients: bool = False) -> SplitStep:
    """Trace `fn(*args)` (arrays or ShapeDtypeStructs) and split it at its
    shardplan.value_and_grad / shardplan.grad call, for `num_micro_batches` micro-batches;
    with `jax_gradients`, at a jax.value_and_grad / jax.grad call too
    (shardplan.grad.routing_jax_gradients: gradient accumulation cuts steps as users write
    them; pipelines keep to shardplan's marks)."""
    args = tuple(args)
    if traced is None:
        traced = trace(fn, args, state_argnums, batch_argnums)
    B = int(num_micro_batches)
    if B < 1:
        raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
    micro = micro_batch_leaves(traced, batch_argnums)
    capture = CaptureForward()
    with routing_jax_gradients() if jax_gradients else contextlib.nullcontext():
        forward = _trace_forward(fn, traced, _micro_avals(traced, micro, B), capture,
                                 jax_gradients)
        cut = _cut_forward(forward, micro)
        update = _trace_update(fn, traced, capture, forward, cut["diff_values"])
    return SplitStep(traced, B, micro, forward, cut["diff_values"], cut["diff_sources"],
                     cut["diff_inputs"], capture.grad_tree, capture.has_aux, capture.out_tree,
                     cut["pre"], cut["body"], cut["boundaries"], update)


def _micro_avals(traced: TracedStep, micro: Sequence[int], B: int) -> list:
    """The step's input avals with the batch leaves cut to one micro-batch of B."""
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
    return small


def _trace_forward(fn, traced: TracedStep, avals: Sequence, capture: CaptureForward,
                   jax_gradients: bool = False) -> Graph:
    """The forward graph: the step up to its gradient call, then the loss function (on one
    micro-batch), captured by `capture`."""

    def forward_fn(*flat):
        step_args = jax.tree_util.tree_unflatten(traced.in_tree, list(flat))
        with intercepting(capture):
            try:
                fn(*step_args)
            except CapturedLoss as c:
                return c.outputs
        if jax_gradients:
            raise PipelineSplitError(
                "the step never called a gradient function made inside it (jax.value_and_grad, "
                "jax.grad, or shardplan's drop-ins for them): make the gradient function in "
                "the step, not once outside it, so the loss function can be found")
        raise PipelineSplitError(
            "the step never called shardplan.value_and_grad or shardplan.grad: write the "
            "gradient with those (drop-ins for jax's) so the pipeline planner can find the "
            "loss function, or plan without pipeline stages (pipeline=False)")

    closed = jax.make_jaxpr(forward_fn)(*avals)
    return lift(closed, ArgInfo(traced.arg_info.roles, (None,) * len(closed.jaxpr.outvars),
                                traced.arg_info.input_names), OPAQUE_LOOPS)


def _cut_forward(forward: Graph, micro: Sequence[int]) -> dict:
    """Where the forward graph is cut: the marked gradient call (its differentiated values and
    their step inputs), the nodes before it, the loss function's body and its stage marks."""
    marks = [n for n in forward.nodes if n.primitive == "optimization_barrier"
             and GRAD_ARGS_SCOPE in n.name]
    if len(marks) != 1:
        raise PipelineSplitError(f"found {len(marks)} marked gradient calls in the step; "
                                 "call shardplan.value_and_grad once, at the step's top level "
                                 "(not inside jit, scan or vmap)")
    barrier = marks[0]
    inputs = {v: i for i, v in enumerate(forward.inputs)}
    needed = ancestors(forward, forward.outputs)
    pre = ancestors(forward, barrier.inputs) | {barrier.id}
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
    for v in forward.outputs[1:]:
        if not np.issubdtype(np.dtype(forward.values[v].dtype), np.floating):
            raise PipelineSplitError(f"an aux output has dtype {forward.values[v].dtype}: "
                                     "pipelining averages aux over micro-batches, which needs "
                                     "floating values")
    return {"diff_values": tuple(barrier.outputs),
            "diff_sources": tuple(inputs.get(v) for v in barrier.inputs),
            "diff_inputs": tuple(barrier.inputs), "pre": tuple(sorted(pre)), "body": body,
            "boundaries": tuple(k for k, nid in enumerate(body)
                                if is_marker(forward.nodes[nid])
                                and BOUNDARY_SCOPE in forward.nodes[nid].name)}


def _trace_update(fn, traced: TracedStep, capture: CaptureForward, forward: Graph,
                  diff_values: Sequence[int]) -> Graph:
    """The update graph: the step again, its gradient call returning the given loss, aux and
    gradients (inputs after the step's own)."""
    grad_avals = [jax.ShapeDtypeStruct(forward.values[v].shape, forward.values[v].dtype)
                  for v in diff_values]
    loss_aval = jax.ShapeDtypeStruct((), forward.values[forward.outputs[0]].dtype)
    aux_structs = [jax.ShapeDtypeStruct(forward.values[v].shape, forward.values[v].dtype)
                   for v in forward.outputs[1:]]
    n_in, n_aux = len(traced.in_avals), len(aux_structs)

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

    full_structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in traced.in_avals]
    closed_u, out_shape = jax.make_jaxpr(update_fn, return_shape=True)(
        *full_structs, loss_aval, *aux_structs, *grad_avals)
    want = [(tuple(a.shape), str(a.dtype)) for a in traced.out_avals]
    got = [(tuple(a.shape), str(a.dtype)) for a in out_shape]
    if want != got:
        raise PipelineSplitError("the step's outputs change shape when the loss function runs "
                                 "on a micro-batch (does the aux output depend on the batch "
                                 "size?); return batch-independent aux or use "
                                 "num_micro_batches=1")
    roles = (*traced.arg_info.roles, *(Role.OTHER,) * (1 + n_aux),
             *(Role.STATE,) * len(diff_values))
    return lift(closed_u, ArgInfo(roles, traced.arg_info.ties), OPAQUE_LOOPS)


def ancestors(graph: Graph, values: Iterable[int]) -> set[int]:
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
    nodes of `graph` in order with the one jaxpr interpreter (shardplan's marks run as
    identities)."""
    in_vids, out_vids = tuple(in_vids), tuple(out_vids)

    def run(*vals):
        env = dict(zip(in_vids, vals))
        env.update((v, graph.values[v].const) for v in graph.consts)
        interpret.evaluate(graph, node_ids, env, identity=is_marker)
        return [interpret.read(graph, env, v) for v in out_vids]

    return run


def is_float(graph: Graph, v: int) -> bool:
    return np.issubdtype(np.dtype(graph.values[v].dtype), np.inexact)
