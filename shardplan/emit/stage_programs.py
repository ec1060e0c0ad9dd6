"""The programs of the MPMD pipeline's stages, each jitted on its stage's submesh: a forward
that returns jax.vjp's function (its residuals stay on the stage's devices until the backward
takes them back, so nothing is recomputed), a backward that accumulates the parameter
gradients over micro-batches, the update's parts, and the layouts of every value on every
stage. shardplan.emit.pipeline drives them.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.emit import transfer
from shardplan.inter import schedule as schedule_mod
from shardplan.inter import split as split_mod
from shardplan.inter import stage_io
from shardplan.inter import update as update_mod

# -- layouts and programs -------------------------------------------------------------------------


def fit_spec(spec: P, shape: Sequence[int], mesh) -> P:
    """`spec` if every dimension it splits divides over `mesh`'s axes, else replicated."""
    for dim, axes in zip(shape, tuple(spec)):
        if axes is None:
            continue
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if any(a not in mesh.shape for a in names):
            return P()
        if dim % int(np.prod([mesh.shape[a] for a in names])):
            return P()
    return spec


class StagePrograms:
    """The programs and layouts of a split step's stages: stage s runs `ios[s]` on
    `meshes[s]`, its values laid out by `specs[s]` (forward value id -> PartitionSpec on the
    stage mesh). `mine[s]`: whether this process owns a device of stage s (it runs stage s's
    programs)."""

    def __init__(self, split: split_mod.SplitStep, ios: Sequence[stage_io.StageIO],
                 meshes: Sequence, specs: Sequence[Mapping[int, P]], schedule: str):
        self.split, self.ios, self.meshes = split, tuple(ios), tuple(meshes)
        me = jax.process_index()
        self.mine = tuple(me in transfer.process_of(m.devices.flat) for m in self.meshes)
        self.multi_controller = len(transfer.process_of(
            d for m in self.meshes for d in m.devices.flat)) > 1
        self._mover = transfer.Mover()
        self.specs = tuple(dict(s) for s in specs)
        self.schedule = schedule
        self.num_stages = S = len(self.ios)
        g = split.forward
        self._order = schedule_mod.dispatch_order(S, split.num_micro_batches, schedule)
        self._input_index = {v: i for i, v in enumerate(g.inputs)}
        self._diff_index = {v: k for k, v in enumerate(split.diff_values)}
        self._producer: dict[int, int] = {}
        for s, io in enumerate(self.ios):
            for nid in io.nodes:
                for v in g.nodes[nid].outputs:
                    self._producer[v] = s
        self._readers: dict[int, list[int]] = collections.defaultdict(list)
        for s, io in enumerate(self.ios):
            for v in (*io.diff_in, *io.const_in):
                if v in self._producer:
                    self._readers[v].append(s)
        self.diff_home = tuple(
            next((s for s, io in enumerate(self.ios) if d in io.diff_in), 0)
            for d in split.diff_values)
        self.update = update_mod.split_update(split, self.diff_home, S)
        self._leaf_specs = self._place_leaves()
        self._programs: dict = {}

    # -- layouts ------------------------------------------------------------------------------

    def _sharding(self, s: int, spec: P, shape) -> NamedSharding:
        return NamedSharding(self.meshes[s], fit_spec(spec, shape, self.meshes[s]))

    def _place_leaves(self) -> dict[tuple[int, int], P]:
        """The layout of step input i on stage s: a differentiated parameter's planned spec,
        optimizer state like the parameter whose update reads it, anything else replicated
        (the batch whole: each micro-batch is cut from it inside the forward program)."""
        sp = self.split
        specs: dict[tuple[int, int], P] = {}
        for s, io in enumerate(self.ios):
            for d in io.diff_in:
                k = self._diff_index.get(d)
                if k is not None and sp.diff_sources[k] is not None:
                    specs.setdefault((s, sp.diff_sources[k]), self.specs[s].get(d, P()))
        u, ties = sp.update, sp.traced.arg_info.ties
        tied_out = {i: j for j, i in enumerate(ties) if i is not None}
        shapes = [tuple(a.shape) for a in sp.traced.in_avals]
        sources = {src for src in sp.diff_sources if src is not None}
        for k, src in enumerate(sp.diff_sources):
            if src is None or src not in tied_out:
                continue
            s = self.diff_home[k]
            part = update_mod.update_slice(u, [u.outputs[tied_out[src]]], set())
            for v in part.inputs:
                i = u.inputs.index(v) if v in u.inputs else None
                if (i is not None and i < sp.num_inputs and i not in sources
                        and shapes[i] == shapes[src]):
                    specs.setdefault((s, i), specs.get((s, src), P()))
        return specs

    def leaf_sharding(self, s: int, i: int) -> NamedSharding:
        shape = self.split.traced.in_avals[i].shape
        return self._sharding(s, self._leaf_specs.get((s, i), P()), shape)

    def value_sharding(self, s: int, v: int) -> NamedSharding:
        return self._sharding(s, self.specs[s].get(v, P()), self.split.forward.values[v].shape)

    # -- programs -----------------------------------------------------------------------------

    def _program(self, key, build):
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    def _forward(self, s: int):
        sp, io = self.split, self.ios[s]
        g = sp.forward
        fn = stage_io.stage_function(sp, io)
        micro = set(sp.micro_leaves)
        cut = {k: self.value_sharding(s, v) for k, v in enumerate(io.const_in)
               if self._input_index.get(v) in micro}
        size = {k: g.values[io.const_in[k]].shape[0] for k in cut}

        def fwd(diff, const, m):
            const = list(const)
            for k, sharding in cut.items():
                piece = jax.lax.dynamic_slice_in_dim(const[k], m * size[k], size[k], axis=0)
                const[k] = jax.lax.with_sharding_constraint(piece, sharding)
            outs, vjp, others = jax.vjp(lambda *d: fn(list(d), const), *diff, has_aux=True)
            return outs, others, vjp

        return jax.jit(fwd)

    def _backward(self, s: int):
        """bwd(vjp, cotangent parts, acc) -> (acc + parameter gradients, activation
        gradients); the cotangents of an output read by several stages are summed here."""
        sp, io = self.split, self.ios[s]
        g = sp.forward
        fouts = stage_io.float_outs(sp, io)
        seed = 1.0 / sp.num_micro_batches
        d_pos = [k for k, v in enumerate(io.diff_in) if v in self._diff_index]
        a_pos = [k for k, v in enumerate(io.diff_in) if v not in self._diff_index]
        grad_shardings = [self.value_sharding(s, io.diff_in[k]) for k in d_pos]
        loss = sp.loss_value

        def cotangents(parts):
            cots = []
            for v, got in zip(fouts, parts):
                val = g.values[v]
                c = functools.reduce(jnp.add, got) if got else jnp.zeros(val.shape, val.dtype)
                if v == loss:
                    c = c + jnp.asarray(seed, val.dtype)
                cots.append(c)
            return cots

        def bwd(vjp, parts, acc):
            grads = vjp(cotangents(parts))
            d = [jax.lax.with_sharding_constraint(a + grads[k], sh)
                 for a, k, sh in zip(acc, d_pos, grad_shardings)]
            return d, [grads[k] for k in a_pos]

        return jax.jit(bwd, donate_argnums=(2,))

    def _zeros(self, s: int):
        """The gradient accumulators of stage s, zero, laid out like its parameters."""
        g, io = self.split.forward, self.ios[s]
        ds = [v for v in io.diff_in if v in self._diff_index]
        shardings = [self.value_sharding(s, v) for v in ds]

        def zeros():
            return [jnp.zeros(g.values[v].shape, g.values[v].dtype) for v in ds]

        return jax.jit(zeros, out_shardings=shardings)

    def _update_part(self, part: update_mod.UpdatePart, out_shardings):
        run = split_mod.eval_nodes(self.split.update, part.nodes, part.inputs, part.outputs)

        def fn(*vals):
            outs = run(*vals)
            return [o if sh is None else jax.lax.with_sharding_constraint(o, sh)
                    for o, sh in zip(outs, out_shardings)]

        return jax.jit(fn)

    def _prep(self, s: int):
        sp, io = self.split, self.ios[s]
        g = sp.forward
        outs = self._prep_targets(s)
        ins = sorted({v for nid in io.prep for v in g.nodes[nid].inputs if v in self._input_index})
        run = split_mod.eval_nodes(g, io.prep, ins, [stage_io.prep_source(sp, v) for v in outs])
        shardings = [self.value_sharding(s, v) for v in outs]

        def fn(*vals):
            return [jax.lax.with_sharding_constraint(o, sh) for o, sh in zip(run(*vals), shardings)]

        return jax.jit(fn), ins, outs

    def _prep_targets(self, s: int) -> list[int]:
        io = self.ios[s]
        pre = set(self.split.pre_nodes)
        producers = self.split.forward.producers()
        return [v for v in (*io.diff_in, *io.const_in)
                if v in producers and producers[v][0] in pre
                and not (v in self._diff_index
                         and self.split.diff_sources[self._diff_index[v]] is not None)]

    def _check_args(self, args) -> list:
        """The flat arguments, if they are the pytree and shapes the pipeline was planned for."""
        sp = self.split
        leaves, tree = jax.tree_util.tree_flatten(args)
        if tree != sp.traced.in_tree:
            raise ValueError(f"the pipeline was planned for arguments {sp.traced.in_tree}, got "
                             f"{tree}: plan it again for these arguments")
        for name, x, a in zip(sp.traced.arg_info.input_names, leaves, sp.traced.in_avals):
            if tuple(np.shape(x)) != tuple(a.shape):
                raise ValueError(f"argument {name} has shape {tuple(np.shape(x))}, the pipeline "
                                 f"was planned for {tuple(a.shape)}: plan it again for these "
                                 "arguments")
        return leaves
