"""Gradient accumulation: a train step run as M micro-batches, then its update once.

The step is cut at its gradient call (shardplan.inter.split: jax.value_and_grad, jax.grad or
shardplan's drop-ins for them, made and called once inside the step, as the zoo, flax and
optax steps write it; shardplan.grad.routing_jax_gradients). What comes before the call and
depends on the state only (the differentiated arguments, casts of the parameters) runs once;
the loss function and its gradient run as a `jax.lax.scan` over M micro-batches of the batch
arguments, the loss, aux outputs and gradients summed in accumulators of at least float32;
the update (the rest of the step) runs once on the reduced values. The result is an ordinary
step with a scan, which the planner plans like any other (its body once, M trips).

How the micro-batch results combine into the step's is the step's `reduction`:

- "mean" (the default): the loss is a mean over the batch. Micro-batches are equal (the batch
  divides by M), so the mean of their means is the batch's mean: everything is summed and
  divided by M. `infer_reduction` says "mean" where the loss function visibly divides by
  the batch's size, and None where it cannot tell.
- "sum": the loss is a sum over the batch: everything is summed.
- a callable `weight(*args)`, called with the step's arguments cut to one micro-batch,
  returning a scalar: the loss is a weighted mean whose normaliser differs between
  micro-batches (a mean over the unmasked tokens): everything is combined as
  sum_k w_k x_k / sum_k w_k, which is the batch's weighted mean when w_k is micro-batch k's
  total weight (its count of unmasked tokens).

tests/test_accumulate.py shows each equal to the plain step, and "mean" wrong for the other
two. A micro-batch holds every M-th row of the batch (rows k, k + M, ...): a batch sharded
along its rows keeps each device's rows on that device in every micro-batch.

With `partial_sums=P` the accumulators gain a leading dimension of P lanes, lane j summing
the gradients of row block j of the batch, added up once after the last micro-batch: where
the plan splits the batch and the lanes over the same P devices, each device sums its own
rows' gradients and the cross-device reduction runs once per step, not once per micro-batch
(partial_sums_for reads P off a plan's batch layout).

Random numbers drawn inside the loss function (dropout) differ from the plain step's, drawn
for each micro-batch on its own: a typed PRNG key (`jax.random.key`) the loss function reads
has the micro-batch's number folded in (`jax.random.fold_in(key, k)`, k = 0 ... M - 1; with
lanes, k * P + j for lane j), so micro-batches draw independent masks; a raw uint32 key
(`jax.random.PRNGKey`) cannot be told from data and is read as it is, every micro-batch
drawing the same. The numerics equal the plain step's for a deterministic loss.

A planning driver tries M as a candidate with the plain planner, the choices from
shardplan.inter.accumulate_choices (the step's layer scan inside the micro-batch scan is
still found by TracedStep.rematerialized):

    traced = trace(fn, args, state_argnums, batch_argnums)
    reduction = the user's, else infer_reduction(fn, args, ...)  # None: M = 1 only
    for m in micro_batch_choices(traced, mesh_shape, batch_argnums):
        step_m = traced if m == 1 else accumulated(fn, args, m, reduction=reduction,
                                                   state_argnums=..., batch_argnums=...)
        plan_m = plan_step(step_m, mesh_shape, hw, options)  # as for any step (planning.intra_op)
        # optionally: p = partial_sums_for(plan_m's batch input spec, mesh_shape); when
        # p > 1 and the batch divides by m * p, plan accumulated(..., partial_sums=p) too

and runs the kept plan's step (`accumulate(fn, m, ...)` has fn's signature). A step whose
gradient function is not made inside it (one made once outside the step and closed over)
raises AccumulationError: M = 1 only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplan.inter import split as split_mod
from shardplan.ir import interpret
from shardplan.ir.trace import TracedStep, trace

Reduction = str | Callable[..., Any]
"""How micro-batch results combine: "mean", "sum" or a weight function (module docstring)."""

REDUCTIONS = ("mean", "sum")


class AccumulationError(ValueError):
    """The step cannot run as micro-batches; the message says why and what to do."""


def accumulate(fn: Callable, num_micro_batches: int, *, reduction: Reduction = "mean",
               partial_sums: int = 1, state_argnums: Sequence[int] | None = None,
               batch_argnums: Sequence[int] | None = None) -> Callable:
    """`fn` run as `num_micro_batches` micro-batches: a step with fn's arguments and outputs.

    Args:
      fn: a train step taking its gradient once, at its top level, with a gradient function
        it makes (jax.value_and_grad, jax.grad or shardplan's drop-ins).
      num_micro_batches: M; the batch's leading dimension must divide by it. M = 1 gives
        `fn` itself.
      reduction: "mean", "sum" or a weight function (see the module docstring).
      partial_sums: P; 1, or the gradients summed in P partial sums (lanes, a leading
        dimension of the accumulators), lane j over row block j of the batch, added up once
        after the last micro-batch. With the batch split along its rows over P devices and
        the lanes likewise, each device sums its own rows' gradients and the gradients are
        reduced across devices once per step instead of once per micro-batch, for an
        accumulator P times the gradients' size (one copy per device when split). The batch
        must divide by M * P.
      state_argnums, batch_argnums: as for shardplan.auto; the batch leaves split into
        micro-batches are shardplan.inter.split.micro_batch_leaves(traced, batch_argnums).

    The step is split when first called (or traced) for each signature of its arguments.
    """
    m, lanes = check_micro_batches(num_micro_batches), check_partial_sums(partial_sums)
    check_reduction(reduction)
    if m == 1:
        return fn
    splits: dict[tuple, split_mod.SplitStep] = {}

    @functools.wraps(fn)
    def accumulated_step(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), str(jnp.result_type(x))) for x in leaves))
        if key not in splits:
            splits[key] = split(fn, args, m, partial_sums=lanes, state_argnums=state_argnums,
                                batch_argnums=batch_argnums)
        s = splits[key]
        outs = run_accumulated(s, reduction, leaves, lanes)
        return jax.tree_util.tree_unflatten(s.traced.out_tree, outs)

    name = f"{getattr(fn, '__name__', 'step')}_accumulated_{m}"
    accumulated_step.__name__ = accumulated_step.__qualname__ = (
        name if lanes == 1 else f"{name}x{lanes}")
    return accumulated_step


def accumulated(fn: Callable, args: Sequence, num_micro_batches: int, *,
                reduction: Reduction = "mean", partial_sums: int = 1,
                state_argnums: Sequence[int] | None = None,
                batch_argnums: Sequence[int] | None = None) -> TracedStep:
    """The traced step of `accumulate(fn, num_micro_batches, ...)` on `args` (arrays or
    ShapeDtypeStructs): the same inputs, outputs and roles as fn's own trace, its gradient
    part a scan of M trips."""
    step = accumulate(fn, num_micro_batches, reduction=reduction, partial_sums=partial_sums,
                      state_argnums=state_argnums, batch_argnums=batch_argnums)
    return trace(step, args, state_argnums, batch_argnums)


def split(fn: Callable, args: Sequence, num_micro_batches: int, *, partial_sums: int = 1,
          state_argnums: Sequence[int] | None = None,
          batch_argnums: Sequence[int] | None = None) -> split_mod.SplitStep:
    """fn split at its gradient call, its loss function traced on one micro-batch of one
    lane (B / (M P) rows), or an AccumulationError naming what to change."""
    m, lanes = check_micro_batches(num_micro_batches), check_partial_sums(partial_sums)
    what = f"gradient accumulation over {m} micro-batches" + (
        f" of {lanes} lanes" if lanes > 1 else "")
    traced = trace(fn, args, state_argnums, batch_argnums)
    micro = split_mod.micro_batch_leaves(traced, batch_argnums)
    if not micro:
        raise AccumulationError(f"{what}: the step has no batch argument to split; pass "
                                "batch_argnums=(...)")
    for i in micro:
        rows = traced.in_avals[i].shape[0]
        if rows % (m * lanes):
            raise AccumulationError(
                f"{what}: input {traced.arg_info.input_names[i]} has leading (batch) dimension "
                f"{rows}, not divisible by {m * lanes}; choose a divisor "
                "(accumulate_choices.micro_batch_choices lists them)")
    try:
        return split_mod.split_step(fn, args, num_micro_batches=m * lanes,
                                    batch_argnums=batch_argnums, traced=traced,
                                    jax_gradients=True)
    except split_mod.PipelineSplitError as e:
        raise AccumulationError(f"{what}: {e}") from e


def check_partial_sums(partial_sums) -> int:
    if (isinstance(partial_sums, bool) or not isinstance(partial_sums, (int, np.integer))
            or partial_sums < 1):
        raise ValueError(f"partial_sums={partial_sums!r}: give a positive int (1: one sum)")
    return int(partial_sums)


def check_micro_batches(num_micro_batches) -> int:
    if (isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, (int, np.integer))
            or num_micro_batches < 1):
        raise ValueError(f"num_micro_batches={num_micro_batches!r}: give a positive int")
    return int(num_micro_batches)


def check_reduction(reduction: Reduction) -> None:
    if not (reduction in REDUCTIONS if isinstance(reduction, str) else callable(reduction)):
        raise ValueError(f"reduction={reduction!r}: use 'mean' (a loss averaged over the batch), "
                         "'sum' (summed over it) or a function of the micro-batch's arguments "
                         "returning its weight (a mean over a varying count of examples)")


# -- the accumulated computation ----------------------------------------------------------------


def accumulator_dtype(dtype) -> np.dtype:
    """The dtype values of `dtype` are summed in: the wider of float32 and their own."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


def micro_batches(x, m: int, lanes: int = 1):
    """(B, ...) -> (M, B / M, ...), or (M, lanes, B / (M lanes), ...) with lanes: row block j
    of the batch (rows j B / lanes ... (j + 1) B / lanes - 1) makes lane j, and micro-batch k
    holds every M-th row of each block from its k-th. A batch split along its rows over
    `lanes` devices keeps each device's rows there."""
    rows = x.shape[0] // (m * lanes)
    y = jnp.moveaxis(jnp.reshape(x, (lanes, rows, m, *x.shape[1:])), 2, 0)
    return y[:, 0] if lanes == 1 else y


def run_accumulated(s: split_mod.SplitStep, reduction: Reduction, leaves: Sequence,
                    lanes: int = 1) -> list:
    """The step's flat outputs from its flat inputs `leaves`: the loss function and gradient
    as a scan over s.num_micro_batches / lanes micro-batches of `lanes` lanes each (see
    accumulate's partial_sums), the update once."""
    g, m = s.forward, s.num_micro_batches // lanes

    # Before the gradient call, from the state only: run once.
    micro = set(s.micro_leaves)
    env = {v: leaves[i] for i, v in enumerate(g.inputs) if i not in micro}
    env.update((v, g.values[v].const) for v in g.consts)
    interpret.evaluate(g, s.pre_nodes, env, identity=split_mod.is_marker)

    made = {v for nid in s.body for v in g.nodes[nid].outputs}
    micro_vids = [g.inputs[i] for i in s.micro_leaves]
    diff = list(dict.fromkeys(s.diff_values))
    reads = sorted({v for nid in s.body for v in g.nodes[nid].inputs} | set(g.outputs))
    consts = [v for v in reads if v not in made and v not in diff and v not in micro_vids
              and not g.values[v].is_literal and v not in g.consts]
    run = split_mod.eval_nodes(g, s.body, (*diff, *consts, *micro_vids), g.outputs)
    const_vals = [env[v] for v in consts]
    diff_vals = [env[v] for v in diff]
    weigh = _weight_fn(s, reduction, leaves)

    keys = [k for k, v in enumerate(consts) if g.values[v].dtype.startswith("key")]

    def micro_step(xs):
        """One micro-batch (of one lane): [loss, *aux, *gradients], its weight. With typed
        PRNG keys read by the loss function, xs ends with the micro-batch's index, folded
        into each key."""
        vals = list(const_vals)
        if keys:
            xs, index = xs[:-1], xs[-1]
            for k in keys:
                vals[k] = jax.random.fold_in(vals[k], index)

        def f(*d):
            outs = run(*d, *vals, *xs)
            return outs[0], outs[1:]

        loss, vjp, aux = jax.vjp(f, *diff_vals, has_aux=True)
        grads = vjp(jnp.ones_like(loss))
        return [loss, *aux, *grads], weigh(xs)

    per_lane = micro_step if lanes == 1 else jax.vmap(micro_step)
    lead = () if lanes == 1 else (lanes,)
    zero = [jnp.zeros(lead + g.values[v].shape, accumulator_dtype(g.values[v].dtype))
            for v in (*g.outputs, *diff)]

    def body(acc, xs):
        vals, w = per_lane(list(xs))
        acc_vals, acc_w = acc
        if w is None:
            return ([a + x.astype(a.dtype) for a, x in zip(acc_vals, vals)], acc_w), None
        new = [a + _by_lane(w, x) * x.astype(a.dtype) for a, x in zip(acc_vals, vals)]
        return (new, acc_w + w), None

    xs = [micro_batches(leaves[i], m, lanes) for i in s.micro_leaves]
    if keys:  # micro-batch k of lane j is number k * lanes + j
        index = jnp.arange(m * lanes, dtype=jnp.uint32)
        xs.append(index if lanes == 1 else index.reshape(m, lanes))
    (sums, total), _ = jax.lax.scan(body, (zero, jnp.zeros(lead, jnp.float32)), xs)
    if lanes > 1:  # the one reduction of the lanes' partial sums
        sums, total = [x.sum(axis=0) for x in sums], total.sum()
    if reduction == "sum":
        reduced = sums
    else:
        denom = total if callable(reduction) else m * lanes
        reduced = [x / jnp.asarray(denom, x.dtype) for x in sums]
    dtypes = [g.values[v].dtype for v in (*g.outputs, *diff)]
    reduced = [x.astype(dt) for x, dt in zip(reduced, dtypes)]
    n_out = len(g.outputs)
    loss, aux, by_value = reduced[0], reduced[1:n_out], dict(zip(diff, reduced[n_out:]))
    grads = [by_value[v] for v in s.diff_values]

    u = s.update
    update = split_mod.eval_nodes(u, sorted(split_mod.ancestors(u, u.outputs)), u.inputs,
                                  u.outputs)
    return update(*leaves, loss, *aux, *grads)


def _by_lane(w, x):
    """Weights w (one per lane, or a scalar) shaped to multiply x (lanes first)."""
    return jnp.reshape(w, w.shape + (1,) * (x.ndim - w.ndim)).astype(x.dtype)


def _weight_fn(s: split_mod.SplitStep, reduction: Reduction, leaves: Sequence):
    """xs (the micro-batch leaves) -> micro-batch weight (float32 scalar), or None when every
    micro-batch weighs 1 (mean, sum)."""
    if not callable(reduction):
        return lambda xs: None
    slots = list(s.micro_leaves)

    def weigh(xs):
        flat = list(leaves)
        for i, x in zip(slots, xs):
            flat[i] = x
        w = reduction(*jax.tree_util.tree_unflatten(s.traced.in_tree, flat))
        if np.shape(w) != ():
            raise AccumulationError(f"the reduction's weight function returned shape "
                                    f"{np.shape(w)}; it must return a scalar (the micro-batch's "
                                    "total weight, such as its count of unmasked tokens)")
        return jnp.asarray(w, jnp.float32)

    return weigh
