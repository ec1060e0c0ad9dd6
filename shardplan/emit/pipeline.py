"""The MPMD pipeline runtime: per stage a forward, a backward and an update program, each
jitted on the stage's submesh, driven by a GPipe or 1F1B schedule from the host.

Activations and their gradients move between submeshes with jax.device_put. The forward
program returns jax.vjp's function (a pytree of residuals, kept on the stage's devices until
the backward program takes it back), so nothing is recomputed. Gradients accumulate over
micro-batches inside the backward program; the update runs once per step on each stage.
Every call is dispatched asynchronously: the host never waits between stages, only when the
caller reads a result.
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

from shardplan import distributed
from shardplan.inter import schedule as schedule_mod
from shardplan.inter import split as split_mod
from shardplan.inter import stage_io
from shardplan.inter import update as update_mod
from shardplan.inter.submesh import STAGE_AXES
from shardplan.strategies.spec import MeshShape, ShardSpec

# -- the runtime ----------------------------------------------------------------------------------


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


class PipelineRuntime:
    """Runs a split step as a pipeline: stage s runs `ios[s]` on `meshes[s]`, its inputs laid
    out by `specs[s]` (forward value id -> PartitionSpec on the stage mesh)."""

    def __init__(self, split: split_mod.SplitStep, ios: Sequence[stage_io.StageIO],
                 meshes: Sequence, specs: Sequence[Mapping[int, P]], schedule: str):
        distributed.refuse_mpmd_pipeline()
        self.split, self.ios, self.meshes = split, tuple(ios), tuple(meshes)
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

    def _prepare(self, leaf_on) -> dict[tuple[int, int], jax.Array]:
        """(stage, value) -> the stage's inputs computed from the state (its prep nodes)."""
        prepared: dict[tuple[int, int], jax.Array] = {}
        for s, io in enumerate(self.ios):
            if io.prep:
                prog, ins, outs = self._program(("prep", s), lambda s=s: self._prep(s))
                vals = prog(*[leaf_on(s, self._input_index[v]) for v in ins])
                prepared.update({(s, v): x for v, x in zip(outs, vals)})
        return prepared

    # -- one step -----------------------------------------------------------------------------

    def __call__(self, *args):
        sp = self.split
        leaves = self._check_args(args)
        S = self.num_stages
        placed: dict[tuple[int, int], jax.Array] = {}

        def leaf_on(s, i):
            if (s, i) not in placed:
                placed[(s, i)] = jax.device_put(leaves[i], self.leaf_sharding(s, i))
            return placed[(s, i)]

        prepared = self._prepare(leaf_on)

        acts: dict[tuple[int, int, int], jax.Array] = {}

        def value(s, v, m):
            if v in self._input_index:
                return leaf_on(s, self._input_index[v])
            k = self._diff_index.get(v)
            if k is not None and sp.diff_sources[k] is not None:
                return leaf_on(s, sp.diff_sources[k])
            if (s, v) in prepared:
                return prepared[(s, v)]
            return acts.pop((v, m, s))

        residuals, acc = {}, [None] * S
        cot_parts: dict[tuple[int, int], list] = collections.defaultdict(list)
        finals: dict[int, list] = collections.defaultdict(list)
        final_set = set(sp.forward.outputs)
        for kind, s, m in self._order:
            io = self.ios[s]
            fouts = stage_io.float_outs(sp, io)
            oouts = stage_io.other_outs(sp, io)
            if kind == "F":
                prog = self._program(("F", s), lambda s=s: self._forward(s))
                diff = [value(s, v, m) for v in io.diff_in]
                const = [value(s, v, m) for v in io.const_in]
                m_arg = jax.device_put(np.int32(m), NamedSharding(self.meshes[s], P()))
                outs, others, vjp = prog(diff, const, m_arg)
                residuals[(s, m)] = vjp
                for v, x in zip((*fouts, *oouts), (*outs, *others)):
                    if v in final_set:
                        finals[v].append(x)
                    for t in self._readers.get(v, ()):
                        acts[(v, m, t)] = jax.device_put(x, self.value_sharding(t, v))
            else:
                parts = [cot_parts.pop((v, m), []) for v in fouts]
                if acc[s] is None:
                    acc[s] = self._program(("0", s), lambda s=s: self._zeros(s))()
                prog = self._program(("B", s), lambda s=s: self._backward(s))
                acc[s], act_cots = prog(residuals.pop((s, m)), parts, acc[s])
                a_vals = [v for v in io.diff_in if v not in self._diff_index]
                for v, c in zip(a_vals, act_cots):
                    p = self._producer[v]
                    cot_parts[(v, m)].append(jax.device_put(c, self._sharding(
                        p, self.specs[s].get(v, P()), c.shape)))
        return self._finish(leaves, leaf_on, acc, finals)

    def _finish(self, leaves, leaf_on, acc, finals):
        """Sum the gradients of parameters several stages read, average the loss and aux over
        micro-batches, and run the update on each stage."""
        sp = self.split
        g = sp.forward
        grads = self._gradients(acc)
        means = [jnp.mean(jnp.stack(finals[v]), axis=0) for v in g.outputs]
        return self._update(leaf_on, grads, means)

    def _gradients(self, acc) -> list:
        """Each parameter's gradient on its home stage: the sum of every reading stage's."""
        sp = self.split
        g = sp.forward
        grads = []
        for k, d in enumerate(sp.diff_values):
            h = self.diff_home[k]
            total = None
            for s, io in enumerate(self.ios):
                ds = [v for v in io.diff_in if v in self._diff_index]
                if d not in ds:
                    continue
                x = acc[s][ds.index(d)]
                if s != h:
                    x = jax.device_put(x, self.value_sharding(h, d))
                total = x if total is None else total + x
            if total is None:
                val = g.values[d]
                total = jax.device_put(np.zeros(val.shape, val.dtype), self.value_sharding(h, d))
            grads.append(total)
        return grads

    def _update(self, leaf_on, grads, means):
        """Run the update on each stage: the reductions, then each stage's part; the step's
        outputs."""
        sp = self.split
        u = sp.update
        pos = sp.update_inputs()
        role: dict[int, tuple[str, int]] = {}
        for name, rng in pos.items():
            for k, idx in enumerate(rng):
                role[u.inputs[idx]] = (name, k)
        computed: dict[int, jax.Array] = {}

        def value(s, v):
            if v in computed:
                return jax.device_put(computed[v], NamedSharding(self.meshes[s], P()))
            name, k = role[v]
            if name == "step":
                return leaf_on(s, k)
            if name == "grads":
                h = self.diff_home[k]
                x = grads[k]
                return x if h == s else jax.device_put(x, self.value_sharding(s, sp.diff_values[k]))
            x = means[0] if name == "loss" else means[1 + k]
            return jax.device_put(x, NamedSharding(self.meshes[s], P()))

        for s, part in enumerate(self.update.reduce):
            if not part.outputs:
                continue
            prog = self._program(("R", s), lambda p=part: self._update_part(p, [None] * len(p.outputs)))
            outs = prog(*[value(s, v) for v in part.inputs])
            computed.update(zip(part.outputs, outs))
        out_leaves: list = [None] * len(u.outputs)
        ties = sp.traced.arg_info.ties
        for s, part in enumerate(self.update.apply):
            if not part.outputs:
                continue

            def shardings(s=s, part=part):
                out = []
                for v in part.outputs:
                    j = u.outputs.index(v)
                    i = ties[j]
                    shape = u.values[v].shape
                    out.append(self.leaf_sharding(s, i) if i is not None
                               else self._sharding(s, P(), shape))
                return out

            prog = self._program(("A", s), lambda p=part, f=shardings: self._update_part(p, f()))
            outs = prog(*[value(s, v) for v in part.inputs])
            got = dict(zip(part.outputs, outs))
            for j, v in enumerate(u.outputs):
                if self.update.output_stage[j] == s:
                    out_leaves[j] = got[v]
        return jax.tree_util.tree_unflatten(sp.traced.out_tree, out_leaves)


# -- a planned pipeline on devices ---------------------------------------------------------------


def stage_meshes(device_mesh, stages: Sequence) -> list:
    """A jax Mesh (axes host, device) for each stage (its submesh_shape and devices ids), over
    the devices of `device_mesh`."""
    if device_mesh is None or isinstance(device_mesh, MeshShape):
        raise ValueError("this pipeline was planned without devices (a MeshShape): plan it "
                         "on a jax.sharding.Mesh to run it")
    by_id = {d.id: d for d in np.asarray(device_mesh.devices).flat}
    axis = jax.sharding.AxisType.Auto
    return [jax.sharding.Mesh(np.array([by_id[i] for i in st.devices]).reshape(
        st.submesh_shape), STAGE_AXES, axis_types=(axis, axis)) for st in stages]


def emit_pipeline(split: split_mod.SplitStep, ios: Sequence[stage_io.StageIO],
                  specs: Sequence[Mapping[int, ShardSpec]], stages: Sequence, device_mesh,
                  schedule: str) -> PipelineRuntime:
    """The runtime of a planned pipeline (shardplan.inter.planner.PipelinePlan's fields): stage
    s runs ios[s] on the submesh of stages[s], its inputs laid out by specs[s]."""
    partition_specs = [{v: s.to_partition_spec() for v, s in sp.items()} for sp in specs]
    return PipelineRuntime(split, ios, stage_meshes(device_mesh, stages), partition_specs,
                           schedule)
