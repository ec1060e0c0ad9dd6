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
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan import distributed
from shardplan.inter import split as split_mod
from shardplan.plan import Plan
from shardplan.strategies.spec import MeshShape

if TYPE_CHECKING:
    from shardplan.inter.planner import Candidate

SCHEDULES = ("1f1b", "gpipe")
STAGE_AXES = ("host", "device")  # a stage's submesh: hosts x devices per host


# -- schedules ------------------------------------------------------------------------------------


def stage_ops(num_stages: int, num_micro_batches: int, schedule: str) -> list[list[tuple[str, int]]]:
    """Each stage's ("F" | "B", micro-batch) operations in the order it runs them.

    GPipe: every forward, then every backward. 1F1B (PipeDream-flush): stage s runs
    min(S - s - 1, B) forwards, then alternates one forward and one backward, then drains
    the backwards; it keeps at most S - s micro-batches of activations alive.
    """
    S, B = int(num_stages), int(num_micro_batches)
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    if S < 1 or B < 1:
        raise ValueError(f"num_stages ({S}) and num_micro_batches ({B}) must be >= 1")
    out = []
    for s in range(S):
        if schedule == "gpipe":
            out.append([("F", m) for m in range(B)] + [("B", m) for m in range(B)])
            continue
        warm = min(S - s - 1, B)
        ops = [("F", m) for m in range(warm)]
        for k in range(B - warm):
            ops += [("F", warm + k), ("B", k)]
        ops += [("B", m) for m in range(B - warm, B)]
        out.append(ops)
    return out


def simulate(num_stages: int, num_micro_batches: int, schedule: str,
             forward_s: Sequence[float], backward_s: Sequence[float]
             ) -> list[tuple[int, str, int, float, float]]:
    """(stage, "F" | "B", micro-batch, start, end) of every operation when each stage runs its
    operations in order and each waits for its inputs: F(s, m) for F(s - 1, m), B(s, m) for
    B(s + 1, m). Sorted by start time (a valid dispatch order)."""
    per_stage = stage_ops(num_stages, num_micro_batches, schedule)
    S = num_stages
    end: dict[tuple[int, str, int], float] = {}
    pos = [0] * S
    free = [0.0] * S
    rows = []
    remaining = sum(len(ops) for ops in per_stage)
    while remaining:
        progressed = False
        for s in range(S):
            while pos[s] < len(per_stage[s]):
                kind, m = per_stage[s][pos[s]]
                dep = (s - 1, "F", m) if kind == "F" else (s + 1, "B", m)
                if kind == "F" and s == 0 or kind == "B" and s == S - 1:
                    dep = None
                if dep is not None and dep not in end:
                    break
                start = max(free[s], end[dep] if dep is not None else 0.0)
                dur = forward_s[s] if kind == "F" else backward_s[s]
                end[(s, kind, m)] = free[s] = start + dur
                rows.append((s, kind, m, start, start + dur))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the schedules above
            raise RuntimeError("pipeline schedule deadlocks")
    rows.sort(key=lambda r: (r[3], r[0], r[1]))
    return rows


def dispatch_order(num_stages: int, num_micro_batches: int, schedule: str
                   ) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) in the order the host dispatches them: by start time in the
    schedule with a backward taking twice a forward."""
    rows = simulate(num_stages, num_micro_batches, schedule, [1.0] * num_stages,
                    [2.0] * num_stages)
    return [(k, s, m) for s, k, m, _, _ in rows]


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

    def __init__(self, split: split_mod.SplitStep, ios: Sequence[split_mod.StageIO],
                 meshes: Sequence, specs: Sequence[Mapping[int, P]], schedule: str = "1f1b"):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
        distributed.refuse_mpmd_pipeline()
        self.split, self.ios, self.meshes = split, tuple(ios), tuple(meshes)
        self.specs = tuple(dict(s) for s in specs)
        self.schedule = schedule
        self.num_stages = S = len(self.ios)
        g = split.forward
        self._order = dispatch_order(S, split.num_micro_batches, schedule)
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
        self.update = split_mod.split_update(split, self.diff_home, S)
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
            part = split_mod.update_slice(u, [u.outputs[tied_out[src]]], set())
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
        fn = split_mod.stage_function(sp, io)
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
        fouts = split_mod.float_outs(sp, io)
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

    def _update_part(self, part: split_mod.UpdatePart, out_shardings):
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
        run = split_mod.eval_nodes(g, io.prep, ins, [split_mod.prep_source(sp, v) for v in outs])
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

    # -- one step -----------------------------------------------------------------------------

    def __call__(self, *args):
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
        S = self.num_stages
        placed: dict[tuple[int, int], jax.Array] = {}

        def leaf_on(s, i):
            if (s, i) not in placed:
                placed[(s, i)] = jax.device_put(leaves[i], self.leaf_sharding(s, i))
            return placed[(s, i)]

        prepared: dict[tuple[int, int], jax.Array] = {}
        for s, io in enumerate(self.ios):
            if io.prep:
                prog, ins, outs = self._program(("prep", s), lambda s=s: self._prep(s))
                vals = prog(*[leaf_on(s, self._input_index[v]) for v in ins])
                prepared.update({(s, v): x for v, x in zip(outs, vals)})

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
            fouts = split_mod.float_outs(sp, io)
            oouts = split_mod.other_outs(sp, io)
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
        means = [jnp.mean(jnp.stack(finals[v]), axis=0) for v in g.outputs]

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


# -- the planned pipeline ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PipelinePlan:
    """A planned pipeline: the Plan (with stages), how it was chosen, and how to run it."""

    plan: Plan
    split: split_mod.SplitStep
    ios: tuple[split_mod.StageIO, ...]
    specs: tuple[dict, ...]
    """Per stage: forward value id -> ShardSpec of the stage's inputs on its submesh."""
    stage_times: tuple[tuple[float, float], ...]
    """Per stage (forward, backward) seconds of one micro-batch (backward = 2/3 of the cost)."""
    schedule: str
    chosen: Candidate
    alternatives: tuple[Candidate, ...]
    notes: tuple[str, ...]
    device_mesh: Any = None
    _cache: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def num_stages(self) -> int:
        return len(self.ios)

    @property
    def num_micro_batches(self) -> int:
        return self.split.num_micro_batches

    def stage_meshes(self) -> list:
        """A jax Mesh (axes host, device) for each stage, from the plan's device mesh."""
        if self.device_mesh is None or isinstance(self.device_mesh, MeshShape):
            raise ValueError("this pipeline was planned without devices (a MeshShape): plan it "
                             "on a jax.sharding.Mesh to run it")
        by_id = {d.id: d for d in np.asarray(self.device_mesh.devices).flat}
        axis = jax.sharding.AxisType.Auto
        return [jax.sharding.Mesh(np.array([by_id[i] for i in st.devices]).reshape(
            st.submesh_shape), STAGE_AXES, axis_types=(axis, axis)) for st in self.plan.stages]

    def runtime(self) -> PipelineRuntime:
        if "runtime" not in self._cache:
            specs = [{v: s.to_partition_spec() for v, s in sp.items()} for sp in self.specs]
            self._cache["runtime"] = PipelineRuntime(
                self.split, self.ios, self.stage_meshes(), specs, self.schedule)
        return self._cache["runtime"]

    def run(self, *args):
        """One step on the pipeline: the same pytree fn(*args) returns."""
        return self.runtime()(*args)

    __call__ = run

    def explain(self) -> str:
        """Why this many stages: the chosen plan and the alternatives' estimated step times."""
        return "\n".join(self.notes)

    def timeline(self, path) -> str:
        """A PNG Gantt chart of the schedule under the cost model; returns the path."""
        from shardplan import timeline

        return timeline.draw_timeline(self.stage_times, self.num_micro_batches, self.schedule,
                                      path)
