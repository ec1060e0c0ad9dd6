"""The MPMD pipeline runtime: per stage a forward, a backward and an update program, each
jitted on the stage's submesh (shardplan.emit.stage_programs), driven by a GPipe or 1F1B
schedule from the host.

Activations and their gradients move between submeshes with jax.device_put, or under
multi-controller JAX (jax.distributed) with a collective program over both submeshes
(shardplan.emit.transfer): there each process runs the programs of the stages whose submesh
holds one of its devices, and every process walks the same static schedule, so the transfers
of two processes pair up. Gradients accumulate over micro-batches inside the backward
program; the update runs once per step on each stage. Every call is dispatched
asynchronously: the host never waits between stages, only when the caller reads a result.
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
from shardplan.emit.stage_programs import StagePrograms, fit_spec
from shardplan.inter import split as split_mod
from shardplan.inter import stage_io
from shardplan.inter.submesh import STAGE_AXES
from shardplan.strategies.spec import MeshShape, ShardSpec

__all__ = ["PipelineRuntime", "emit_pipeline", "fit_spec", "stage_meshes"]


class PipelineRuntime(StagePrograms):
    """Runs a split step as a pipeline: stage s runs `ios[s]` on `meshes[s]`, its inputs laid
    out by `specs[s]` (forward value id -> PartitionSpec on the stage mesh).

    Under multi-controller JAX this process runs only the programs of the stages whose
    submesh holds one of its devices (`self.mine`); the values of the other stages are global
    arrays without local shards here."""

    def _prepare(self, leaf_on) -> dict[tuple[int, int], jax.Array]:
        """(stage, value) -> the stage's inputs computed from the state (its prep nodes)."""
        prepared: dict[tuple[int, int], jax.Array] = {}
        for s, io in enumerate(self.ios):
            if io.prep:
                prog, ins, outs = self._program(("prep", s), lambda s=s: self._prep(s))
                args = [leaf_on(s, self._input_index[v]) for v in ins]
                vals = prog(*args) if self.mine[s] else [None] * len(outs)
                prepared.update({(s, v): x for v, x in zip(outs, vals)})
        return prepared

    # -- the step's inputs and outputs --------------------------------------------------------

    def _leaf_readers(self) -> dict[int, set[int]]:
        """Step input i -> the stages that read it (forward, prep, update)."""
        sp, readers = self.split, collections.defaultdict(set)
        for s, io in enumerate(self.ios):
            for v in (*io.diff_in, *io.const_in):
                k = self._diff_index.get(v)
                if v in self._input_index:
                    readers[self._input_index[v]].add(s)
                elif k is not None and sp.diff_sources[k] is not None:
                    readers[sp.diff_sources[k]].add(s)
            for nid in io.prep:
                for v in sp.forward.nodes[nid].inputs:
                    if v in self._input_index:
                        readers[self._input_index[v]].add(s)
        pos = sp.update_inputs()["step"]
        step_in = {sp.update.inputs[idx]: k for k, idx in enumerate(pos)}
        for s, part in enumerate((*self.update.reduce, *self.update.apply)):
            for v in part.inputs:
                if v in step_in:
                    readers[step_in[v]].add(s % self.num_stages)
        return readers

    def input_stage(self, i: int) -> int:
        """The stage whose submesh step input i is expected on: where the step returns it (the
        state), else the first stage that reads it."""
        ties = self.split.traced.arg_info.ties
        for j, t in enumerate(ties):
            if t == i:
                return self.update.output_stage[j]
        return min(self._leaf_readers().get(i, {0}))

    @functools.cached_property
    def in_shardings(self) -> tuple[NamedSharding, ...]:
        """Each step input's sharding on its stage's submesh (input_stage): what the runtime
        moves nothing for."""
        return tuple(self.leaf_sharding(self.input_stage(i), i)
                     for i in range(len(self.split.traced.in_avals)))

    def output_sharding(self, j: int) -> NamedSharding:
        """Step output j's sharding: the state on its stage's submesh like the input it
        replaces; the loss and other outputs replicated on their stage's submesh, under
        multi-controller on every device of every stage (so every process can read them)."""
        s, i = self.update.output_stage[j], self.split.traced.arg_info.ties[j]
        if i is not None:
            return self.leaf_sharding(s, i)
        if self.multi_controller:
            return NamedSharding(self._all_devices, P())
        return NamedSharding(self.meshes[s], P())

    @functools.cached_property
    def _all_devices(self):
        devices = sorted({d for m in self.meshes for d in m.devices.flat},
                         key=lambda d: (d.process_index, d.id))
        return jax.sharding.Mesh(np.asarray(devices), ("devices",),
                                 axis_types=(jax.sharding.AxisType.Auto,))

    @property
    def out_shardings(self) -> tuple[NamedSharding, ...]:
        return tuple(self.output_sharding(j) for j in range(len(self.split.update.outputs)))

    # -- moving values ------------------------------------------------------------------------

    def _move(self, x, s: int, sharding: NamedSharding, val) -> jax.Array:
        """Value `x` of stage s (graph value `val`: its shape and dtype) laid out as `sharding`."""
        return self._mover.move(x, self.meshes[s], sharding, val.shape, val.dtype)

    def _place(self, x, sharding: NamedSharding, aval) -> jax.Array:
        """A step input laid out as `sharding`. Under multi-controller, a committed jax.Array
        is a global array (its sharding the same in every process) and is moved; host data
        and uncommitted arrays are a full copy, equal in every process, and are placed."""
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, len(aval.shape)):
            return x
        if not self.multi_controller:
            return jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and x.committed:
            return self._mover.move(x, x.sharding, sharding, aval.shape, aval.dtype)
        return transfer.from_host(np.asarray(x, aval.dtype), sharding)

    # -- one step -----------------------------------------------------------------------------

    def __call__(self, *args):
        sp = self.split
        g = sp.forward
        leaves = self._check_args(args)
        placed: dict[tuple[int, int], jax.Array] = {}
        avals = sp.traced.in_avals

        def leaf_on(s, i):
            if (s, i) not in placed:
                placed[(s, i)] = self._place(leaves[i], self.leaf_sharding(s, i), avals[i])
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

        residuals, acc = {}, [None] * self.num_stages
        cot_parts: dict[tuple[int, int], list] = collections.defaultdict(list)
        finals: dict[int, list] = collections.defaultdict(list)
        final_set = set(g.outputs)
        for kind, s, m in self._order:
            io = self.ios[s]
            fouts = stage_io.float_outs(sp, io)
            oouts = stage_io.other_outs(sp, io)
            if kind == "F":
                prog = self._program(("F", s), lambda s=s: self._forward(s))
                diff = [value(s, v, m) for v in io.diff_in]
                const = [value(s, v, m) for v in io.const_in]
                outs, others = [None] * len(fouts), [None] * len(oouts)
                if self.mine[s]:
                    m_arg = transfer.from_host(np.int32(m), NamedSharding(self.meshes[s], P()))
                    outs, others, residuals[(s, m)] = prog(diff, const, m_arg)
                for v, x in zip((*fouts, *oouts), (*outs, *others)):
                    if v in final_set:
                        finals[v].append(x)
                    for t in self._readers.get(v, ()):
                        acts[(v, m, t)] = self._move(x, s, self.value_sharding(t, v), g.values[v])
            else:
                parts = [cot_parts.pop((v, m), []) for v in fouts]
                a_vals = [v for v in io.diff_in if v not in self._diff_index]
                act_cots = [None] * len(a_vals)
                if self.mine[s]:
                    if acc[s] is None:
                        acc[s] = self._program(("0", s), lambda s=s: self._zeros(s))()
                    prog = self._program(("B", s), lambda s=s: self._backward(s))
                    acc[s], act_cots = prog(residuals.pop((s, m)), parts, acc[s])
                for v, c in zip(a_vals, act_cots):
                    p = self._producer[v]
                    cot_parts[(v, m)].append(self._move(c, s, self._sharding(
                        p, self.specs[s].get(v, P()), g.values[v].shape), g.values[v]))
        return self._finish(leaf_on, acc, finals)

    def _finish(self, leaf_on, acc, finals):
        """Sum the gradients of parameters several stages read, average the loss and aux over
        micro-batches, and run the update on each stage."""
        g = self.split.forward
        means = []
        for v in g.outputs:
            s = self._producer.get(v, 0)
            means.append((s, jnp.mean(jnp.stack(finals[v]), axis=0) if self.mine[s] else None))
        return self._update(leaf_on, self._gradients(acc), means)

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
                x = acc[s][ds.index(d)] if self.mine[s] else None
                if s != h:
                    x = self._move(x, s, self.value_sharding(h, d), g.values[d])
                if self.mine[h]:
                    total = x if total is None else total + x
            if total is None:
                val = g.values[d]
                total = transfer.from_host(np.zeros(val.shape, val.dtype),
                                           self.value_sharding(h, d))
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
        computed: dict[int, tuple[int, jax.Array]] = {}

        def value(s, v):
            whole = NamedSharding(self.meshes[s], P())
            if v in computed:
                src, x = computed[v]
                return self._move(x, src, whole, u.values[v])
            name, k = role[v]
            if name == "step":
                return leaf_on(s, k)
            if name == "grads":
                h = self.diff_home[k]
                d = sp.diff_values[k]
                return grads[k] if h == s else self._move(
                    grads[k], h, self.value_sharding(s, d), sp.forward.values[d])
            src, x = means[0] if name == "loss" else means[1 + k]
            return self._move(x, src, whole, u.values[v])

        def run(key, s, part, build):
            ins = [value(s, v) for v in part.inputs]
            if not self.mine[s]:
                return [None] * len(part.outputs)
            return self._program((key, s), build)(*ins)

        for s, part in enumerate(self.update.reduce):
            if part.outputs:
                outs = run("R", s, part, lambda p=part: self._update_part(
                    p, [None] * len(p.outputs)))
                computed.update((v, (s, x)) for v, x in zip(part.outputs, outs))
        out_leaves: list = [None] * len(u.outputs)
        ties = sp.traced.arg_info.ties
        for s, part in enumerate(self.update.apply):
            if not part.outputs:
                continue

            def shardings(s=s, part=part):
                out = []
                for v in part.outputs:
                    i = ties[u.outputs.index(v)]
                    out.append(self.leaf_sharding(s, i) if i is not None
                               else self._sharding(s, P(), u.values[v].shape))
                return out

            got = dict(zip(part.outputs, run("A", s, part, lambda p=part, f=shardings:
                                             self._update_part(p, f()))))
            for j, v in enumerate(u.outputs):
                if self.update.output_stage[j] == s:
                    out_leaves[j] = self._output(j, s, got[v], u.values[v])
        return jax.tree_util.tree_unflatten(sp.traced.out_tree, out_leaves)

    def _output(self, j: int, s: int, x, val):
        """Step output j as the step returns it (output_sharding): moved to every device under
        multi-controller if it is not state; an array without local shards in a process that
        owns none of its devices."""
        sharding = self.output_sharding(j)
        if self.split.traced.arg_info.ties[j] is None and self.multi_controller:
            return self._move(x, s, sharding, val)
        return x if self.mine[s] else transfer.empty(val.shape, val.dtype, sharding)


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
