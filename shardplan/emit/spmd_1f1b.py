"""The SPMD pipeline's 1F1B schedule: forward and backward of different micro-batches
interleaved in one loop inside shard_map, the loss's gradient reaching the last stage.

The loss traced on one micro-batch (shardplan.inter.layer_scan) is cut at its scan over
layers into `pre` (the equations before it: embedding, ...), the scan, and `post` (the
equations after it: head, loss). `pre` runs for every micro-batch before the loop (vmapped;
what does not depend on the batch rows, the scan's constants and stacked parameters, once).
In the loop of M + 2S - 2 ticks, at tick t stage s runs the forward of micro-batch t - s on
its L/S layers, keeping its input (a ring of 2S - 1 slots), and the backward of micro-batch
t - (2S - 2 - s): jax.vjp of its layers at the kept input (recomputed, as remat does) pulled
back from the cotangent stage s + 1 sent the tick before; the last stage runs `post` and its
vjp on the output it has just made (the cotangent 1/M: the loss is the mean of the
micro-batch losses). Activations go forward and cotangents backward with lax.ppermute every
tick. The gradients of `pre` are pulled back once after the loop from the cotangents stage 0
collected; those of the layers and of `post` are accumulated in the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardplan import _compat
from shardplan.inter.layer_scan import STAGE_AXIS, LossTrace, stage_psum
from shardplan.inter.stage_body import constrained, held, held_parameters, stage_layers
from shardplan.ir import interpret


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def float_vjp(fun: Callable, *args):
    """(fun(*args), back): back(ct) gives the cotangents of `args`' floating leaves, None for
    the others (integers, PRNG keys: not differentiated)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    floats = [_is_float(x) for x in leaves]

    def g(*fl):
        it = iter(fl)
        return fun(*jax.tree_util.tree_unflatten(tree, [next(it) if f else x
                                                        for f, x in zip(floats, leaves)]))

    out, vjp = jax.vjp(g, *[x for f, x in zip(floats, leaves) if f])

    def back(ct):
        it = iter(vjp(ct))
        return jax.tree_util.tree_unflatten(tree, [next(it) if f else None for f in floats])

    return out, back


def _zero_ct(x):
    """The cotangent of `x` for a jax.vjp function: zeros, float0 for non-floats."""
    if _is_float(x):
        return jnp.zeros_like(x)
    return np.zeros(np.shape(x), dtype=jax.dtypes.float0)


def _add(a, b):
    return a if b is None else a + b


class Cut:
    """The micro-batch loss jaxpr cut at its scan over layers: which values `post` reads."""

    def __init__(self, lt: LossTrace, rows: Sequence[int]):
        jaxpr = lt.micro.jaxpr
        k = lt.micro_scan.index
        self.consts = dict(zip(jaxpr.constvars, lt.micro.consts))
        self.pre, self.scan, self.post = jaxpr.eqns[:k], jaxpr.eqns[k], jaxpr.eqns[k + 1:]
        p = self.scan.params
        nc, nk = _compat.scan_counts(p)
        self.scan_consts = self.scan.invars[:nc]
        self.scan_carry = self.scan.invars[nc:nc + nk]
        self.scan_xs = self.scan.invars[nc + nk:]
        self.scan_out = self.scan.outvars[:nk]
        self.outvars = jaxpr.outvars
        defined = {v for e in self.post for v in e.outvars}
        read = [v for e in self.post for v in e.invars] + list(jaxpr.outvars)
        live, seen = [], set(self.scan_out) | defined | set(self.consts)
        for v in read:
            if not isinstance(v, _compat.Literal) and v not in seen:
                seen.add(v)
                live.append(v)
        position = {v: i for i, v in enumerate(jaxpr.invars)}
        # post reads: step arguments whole (parameters), step arguments cut to the
        # micro-batch (rows), and values pre computed (per micro-batch)
        self.post_args = [v for v in live if v in position and position[v] not in rows]
        self.post_rows = [v for v in live if v in position and position[v] in rows]
        self.post_pre = [v for v in live if v not in position]
        self.invars = jaxpr.invars
        self.position = position

    def run_pre(self, flat, wanted):
        env = dict(self.consts)
        env.update(zip(self.invars, flat))
        interpret.run_eqns(self.pre, env)
        return [interpret.read_var(env, v) for v in wanted]

    def run_post(self, y, args, rows, pre, specs: Mapping | None = None):
        """The loss's equations after the scan, reading their operands in `specs` ({(leaf
        equation, operand): PartitionSpec}, the plan's; stage_body.post_key)."""
        env = dict(self.consts)
        env.update(zip(self.scan_out, y))
        env.update(zip(self.post_args, args))
        env.update(zip(self.post_rows, rows))
        env.update(zip(self.post_pre, pre))
        interpret.run_leaves(self.post, env, constrained(specs or {}))
        return [interpret.read_var(env, v) for v in self.outvars]


def pipelined_loss_and_grad(lt: LossTrace, flat: Sequence, diff: Sequence[int], mesh: Mesh,
                            num_stages: int, num_micro_batches: int,
                            carry_specs: Sequence | None = None,
                            operand_specs: Mapping | None = None,
                            post_specs: Mapping | None = None,
                            backward_specs: Mapping | None = None):
    """(loss, gradient leaves of the flat positions `diff`) of the traced loss, by a 1F1B
    SPMD pipeline over the mesh's stage axis; `carry_specs`: the PartitionSpecs the layers
    hold the carry in, `operand_specs` the layouts a layer reads its operands in
    (stage_body.stage_layers), `post_specs` those the head and loss read theirs in (every
    tick, on one micro-batch: the micro-batch plan's)."""
    S, M = num_stages, num_micro_batches
    B = lt.scan.batch
    L = lt.scan.length
    rows = [i for i, x in enumerate(flat) if i not in set(diff) and np.ndim(x) >= 1
            and np.shape(x)[0] == B and i in _rows_of(lt, flat)]
    cut = Cut(lt, rows)
    if len(cut.outvars) != 1:
        raise ValueError("SPMD pipeline, 1F1B: the loss function returns auxiliary values "
                         "(has_aux with leaves); use schedule='gpipe'")
    layers = stage_layers(cut.scan, L // S, carry_specs, operand_specs, backward_specs)
    diff = list(diff)
    dpos = {i: k for k, i in enumerate(diff)}

    def flat_with(dleaves, micro_rows=None):
        out = list(flat)
        for i, x in zip(diff, dleaves):
            out[i] = x
        if micro_rows is not None:
            for i, x in zip(rows, micro_rows):
                out[i] = x
        return out

    row_stacks = [flat[i].reshape(M, B // M, *np.shape(flat[i])[1:]) for i in rows]

    def pre_all(dleaves):
        per = jax.vmap(lambda *r: cut.run_pre(flat_with(dleaves, r),
                                              [*cut.scan_carry, *cut.post_pre]))(*row_stacks)
        once = cut.run_pre(flat_with(dleaves, [r[0] for r in row_stacks]),
                           [*cut.scan_consts, *cut.scan_xs])
        return per, once

    dleaves = [flat[i] for i in diff]
    (per, once), pre_back = float_vjp(pre_all, dleaves)
    nk, nc = len(cut.scan_carry), len(cut.scan_consts)
    carry_m, pre_m = per[:nk], per[nk:]
    consts, xs = once[:nc], once[nc:]
    xs_s = [x.reshape(S, L // S, *x.shape[1:]) for x in xs]
    post_args = [flat_with(dleaves)[cut.position[v]] for v in cut.post_args]
    post_rows = [flat[cut.position[v]].reshape(M, B // M, *np.shape(flat[cut.position[v]])[1:])
                 for v in cut.post_rows]
    K = min(M, 2 * S - 1)
    ticks = M + 2 * S - 2
    fwd_pairs = [(i, i + 1) for i in range(S - 1)]
    bwd_pairs = [(i + 1, i) for i in range(S - 1)]

    def hold(values, lead=0):  # the activation and its cotangent in the plan's layout
        return held(values, carry_specs, lead)

    def stage(consts, carry_m, xs_s, post_args, post_rows, pre_m):
        carry_m = hold(carry_m, 1)
        s = jax.lax.axis_index(STAGE_AXIS)
        local = [x[0] for x in xs_s]
        if backward_specs:
            local = held_parameters(cut.scan, local, operand_specs, backward_specs)
        first, last = s == 0, s == S - 1

        def pick(stack, m):
            return jax.lax.dynamic_index_in_dim(stack, jnp.clip(m, 0, M - 1), keepdims=False)

        def put(stack, m, value, ok):  # the slot chosen, not the stack (spmd.pipelined_scan)
            at = jnp.clip(m, 0, M - 1)
            old = jax.lax.dynamic_index_in_dim(stack, at, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(stack, jnp.where(ok, value, old), at, 0)

        def tick(t, loop):
            (act, cot, ring, g_local, g_consts, g_args, g_pre, g_carry, loss) = loop
            # forward of micro-batch t - s
            mf = t - s
            ok_f = (mf >= 0) & (mf < M)
            inp = hold([jnp.where(first, pick(c, mf), a) for c, a in zip(carry_m, act)])
            y = layers(consts, inp, local)
            slot = jnp.clip(mf, 0, M - 1) % K
            ring = [jnp.where(ok_f, jax.lax.dynamic_update_index_in_dim(r, x, slot, 0), r)
                    for r, x in zip(ring, inp)]
            # the last stage: the micro-batch's loss and its cotangent (1/M of the mean)
            outs, post_back = float_vjp(
                lambda y, a, p: cut.run_post(y, a, [pick(r, mf) for r in post_rows], p,
                                             post_specs),
                y, post_args, [pick(p, mf) for p in pre_m])
            dy, d_args, d_pre = post_back([jnp.full_like(outs[0], 1.0 / M)])
            on_last = last & ok_f
            loss = loss + jnp.where(on_last, outs[0] / M, 0.0)
            g_args = [_add(g, jnp.where(on_last, d, 0) if d is not None else None)
                      for g, d in zip(g_args, d_args)]
            g_pre = [g if d is None else put(g, mf, d, on_last) for g, d in zip(g_pre, d_pre)]
            # backward of micro-batch t - (2S - 2 - s), from its kept input
            mb = t - (2 * S - 2 - s)
            ok_b = (mb >= 0) & (mb < M)
            kept = [jax.lax.dynamic_index_in_dim(r, jnp.clip(mb, 0, M - 1) % K, keepdims=False)
                    for r in ring]
            ct = [jnp.where(last, a, b) for a, b in zip(dy, cot)]
            # the parameters held again for this tick's backward: else XLA gives it the copy
            # this tick's forward reads split, and gathers a weight at every layer
            _, back = float_vjp(layers, consts, kept, held_parameters(
                cut.scan, local, operand_specs, backward_specs) if backward_specs else local)
            d_consts, d_in, d_local = back(ct)
            g_local = [g if d is None else g + jnp.where(ok_b, d, 0)
                       for g, d in zip(g_local, d_local)]
            g_consts = [g if d is None else g + jnp.where(ok_b, d, 0)
                        for g, d in zip(g_consts, d_consts)]
            g_carry = [put(g, mb, d, first & ok_b) for g, d in zip(g_carry, d_in)]
            act = hold([jax.lax.ppermute(v, STAGE_AXIS, fwd_pairs) for v in y])
            cot = hold([jax.lax.ppermute(jnp.where(ok_b, d, 0), STAGE_AXIS, bwd_pairs)
                        for d in d_in])
            return act, cot, ring, g_local, g_consts, g_args, g_pre, g_carry, loss

        zeros = hold([jnp.zeros_like(c[0]) for c in carry_m])
        init = (zeros, zeros, hold([jnp.zeros((K, *c.shape[1:]), c.dtype) for c in carry_m], 1),
                [jnp.zeros_like(x) for x in local],
                [jnp.zeros_like(c) if _is_float(c) else None for c in consts],
                [jnp.zeros_like(a) if _is_float(a) else None for a in post_args],
                [jnp.zeros_like(p) if _is_float(p) else None for p in pre_m],
                [jnp.zeros_like(c) for c in carry_m], jnp.zeros((), jnp.float32))
        out = jax.lax.fori_loop(0, ticks, tick, init)
        _, _, _, g_local, g_consts, g_args, g_pre, g_carry, loss = out
        total = [stage_psum(v, mesh) for v in (g_consts, g_args, g_pre, g_carry, loss)]
        return ([g[None] for g in g_local], *total)

    run = jax.shard_map(stage, mesh=mesh,
                        in_specs=(P(), P(), P(STAGE_AXIS), P(), P(), P()),
                        out_specs=(P(STAGE_AXIS), P(), P(), P(), P(), P()),
                        axis_names=frozenset({STAGE_AXIS}), check_vma=False)
    g_xs, g_consts, g_args, g_pre, g_carry, loss = run(consts, carry_m, xs_s, post_args,
                                                      post_rows, pre_m)
    g_xs = [g.reshape(L, *g.shape[2:]) for g in g_xs]
    cts = ([*g_carry, *[g if g is not None else _zero_ct(p) for g, p in zip(g_pre, pre_m)]],
           [*[g if g is not None else _zero_ct(c) for g, c in zip(g_consts, consts)],
            *[g if _is_float(x) else _zero_ct(x) for g, x in zip(g_xs, xs)]])
    grads = list(pre_back(cts)[0])
    for v, g in zip(cut.post_args, g_args):
        k = dpos.get(cut.position[v])
        if k is not None and g is not None:
            grads[k] = g if grads[k] is None else grads[k] + g
    grads = [g if g is not None else _zero_ct(flat[i]) for g, i in zip(grads, diff)]
    return loss, grads


def _rows_of(lt: LossTrace, flat) -> set[int]:
    """The flat positions that trace_loss cut to a micro-batch (shape differs there)."""
    return {i for i, (a, x) in enumerate(zip(lt.micro.in_avals, flat))
            if tuple(a.shape) != tuple(np.shape(x))}
