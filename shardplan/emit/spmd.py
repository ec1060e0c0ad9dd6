"""The SPMD pipeline: a scan over stacked layers run as a pipeline inside ONE jit program (GPipe
here; 1F1B in shardplan.emit.spmd_1f1b).

Where the rewrite hooks in: `shardplan.value_and_grad` (the step's gradient call). While the
planned step is traced, a `PipelinedGrad` interceptor (shardplan.grad.intercepting) receives
the loss function and its arguments, traces the loss (shardplan.inter.layer_scan: at full
batch and on one micro-batch), replaces its scan over layers by `pipelined_scan`, and
differentiates the rewritten loss with jax.value_and_grad. Everything else in the loss
(embedding, head, the loss itself) and in the step (the optimizer update) runs outside the
pipeline on all devices, under the intra-op plan's shardings.

`pipelined_scan`: the stacked parameters [L, ...] are reshaped [S, L/S, ...] and split over
the mesh's `stage` axis, the carry (the activation) cut into M micro-batches, and a loop of
M + S - 1 ticks runs inside `jax.shard_map`, manual over the stage axis only (the other mesh
axes stay auto, so sharding propagation and constraints act inside; the layers hold the
carry and read their operands in the stage's intra-op plan's layouts, the plan's
`constraints` and `operand_specs`): at tick t stage s runs
its L/S layers (the scan's own body) on micro-batch t - s and hands the result to stage s + 1
with `lax.ppermute`. The last stage collects the outputs; a psum over the stage axis gives
them to every stage. The backward pass is JAX's autodiff through the loop: each ppermute
transposes to the reverse permute, so the backward runs the same schedule mirrored (GPipe).
Where the plan's backward lays out a parameter's gradient otherwise than autodiff of the
forward's layouts would, a layer's backward runs as its own jaxpr in the plan's backward
layouts (shardplan.inter.layer_backward; the plan's operand_specs under stage_body.BACKWARD).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardplan import _compat
from shardplan.emit import spmd_1f1b
from shardplan.grad import intercepting
from shardplan.inter import layer_scan, stage_body
from shardplan.ir import interpret

STAGE_AXIS = layer_scan.STAGE_AXIS


def pipeline_mesh(mesh: Mesh, num_stages: int) -> Mesh:
    """`mesh` itself if it has a `stage` axis (of num_stages devices), else its devices in
    order laid out as (stage=S, data=N/S): consecutive devices share a stage."""
    names, sizes = layer_scan.pipeline_mesh_shape(tuple(mesh.axis_names),
                                                  tuple(mesh.devices.shape), num_stages)
    if tuple(names) == tuple(mesh.axis_names):
        return _compat.auto_mesh(mesh)
    return Mesh(np.asarray(mesh.devices).reshape(sizes), names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def pipelined_scan(eqn, ins: Sequence, micro_eqn, mesh: Mesh, num_stages: int,
                   num_micro_batches: int, carry_specs: Sequence | None = None,
                   operand_specs: Mapping | None = None,
                   backward_specs: Mapping | None = None) -> list:
    """The outputs of scan `eqn` on `ins`, computed by a GPipe pipeline over the mesh's stage
    axis. `micro_eqn` is the same scan traced on one micro-batch (its body runs per tick);
    `carry_specs`, `operand_specs`: the PartitionSpecs its layers hold the carry in and read
    their operands in (stage_body.stage_layers)."""
    p = eqn.params
    S, M, L = num_stages, num_micro_batches, int(p["length"])
    nc, nk = _compat.scan_counts(p)
    consts, carry, xs = list(ins[:nc]), list(ins[nc:nc + nk]), list(ins[nc + nk:])
    B = carry[0].shape[0]
    layers = stage_body.stage_layers(micro_eqn, L // S, carry_specs, operand_specs,
                                     backward_specs)

    carry_m = [c.reshape(M, B // M, *c.shape[1:]) for c in carry]
    xs_s = [x.reshape(S, L // S, *x.shape[1:]) for x in xs]
    ticks = M + S - 1
    forward = [(i, i + 1) for i in range(S - 1)]

    # the cotangent of an input every stage reads whole is a psum over the stages: in float32
    # where a 16-bit one would abort XLA:CPU (layer_scan.stage_psum)
    dtypes = [x.dtype for x in (*consts, *carry_m)]
    wide = layer_scan.stage_psum_dtypes(dtypes, mesh)

    def hold(values, lead=0):  # the activation in the plan's layout everywhere it goes
        return stage_body.held(values, carry_specs, lead)

    def stage(consts, carry_m, xs_s):
        consts = [x.astype(d) for x, d in zip(consts, dtypes)]
        carry_m = hold([x.astype(d) for x, d in zip(carry_m, dtypes[len(consts):])], 1)
        s = jax.lax.axis_index(STAGE_AXIS)
        local = [x[0] for x in xs_s]
        if backward_specs:
            local = stage_body.held_parameters(micro_eqn, local, operand_specs, backward_specs)
        first, last = s == 0, s == S - 1

        def tick(t, loop):
            state, outs = loop
            fresh = [jax.lax.dynamic_index_in_dim(c, jnp.minimum(t, M - 1), keepdims=False)
                     for c in carry_m]
            inp = hold([jnp.where(first, f, x) for f, x in zip(fresh, state)])
            y = layers(consts, inp, local)
            m = t - (S - 1)
            write = last & (m >= 0)
            at = jnp.clip(m, 0, M - 1)
            # one slot written, never the stack read or selected whole (a select over the
            # stack every tick, or a read of it, XLA lays out split and gathers back every
            # tick); before its micro-batch (m < 0) slot 0 is
            # written zeros, and its own write comes later; other stages write zeros
            outs = [jax.lax.dynamic_update_index_in_dim(o, jnp.where(write, v, 0), at, 0)
                    for o, v in zip(outs, y)]
            state = hold([jax.lax.ppermute(v, STAGE_AXIS, forward) for v in y])
            return state, outs

        state = hold([jnp.zeros_like(c[0]) for c in carry_m])
        outs = hold([jnp.zeros_like(c) for c in carry_m], 1)
        _, outs = jax.lax.fori_loop(0, ticks, tick, (state, outs))
        outs = stage_body.held_cotangent(outs, carry_specs, 1)
        return layer_scan.stage_psum(outs, mesh)  # nonzero on the last stage only

    # check_vma=False: with it on, jax 0.10.2 fails an internal assertion (ManualAxisType) in
    # the JVP of the re-bound layer body; unchecked, an unsplit input's cotangent is summed
    # over the stages and the outputs' psum transposes as it should (the tests compare).
    run = jax.shard_map(stage, mesh=mesh, in_specs=(P(), P(), P(STAGE_AXIS)), out_specs=P(),
                        axis_names=frozenset({STAGE_AXIS}), check_vma=False)
    outs = run([x.astype(d) for x, d in zip(consts, wide)],
               [x.astype(d) for x, d in zip(carry_m, wide[len(consts):])], xs_s)
    return [o.reshape(B, *o.shape[2:]) for o in outs]


@dataclasses.dataclass(frozen=True)
class PipelinedGrad:
    """Interceptor (shardplan.grad) that runs the loss's scan over layers as an SPMD pipeline
    and differentiates the rewritten loss; stage boundaries are ignored (stages are equal)."""

    mesh: Mesh
    num_stages: int
    num_micro_batches: int
    schedule: str = "gpipe"
    carry_specs: tuple | None = None
    """PartitionSpecs the stage body holds the scan's carries in (None: XLA propagates)."""
    operand_specs: tuple = ()
    """((body equation, operand), PartitionSpec) pairs: the layouts the layer reads its
    operands in, the stage's intra-op plan (empty: XLA propagates)."""

    def value_and_grad(self, fun, argnums, has_aux, args, kwargs):
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        flat, unflatten, diff = layer_scan.flat_call(args, kwargs, argnums)
        lt = layer_scan.trace_loss(fun, flat, unflatten, diff,
                                   lambda _: (self.num_stages, self.num_micro_batches))
        if lt.obstacle is not None:
            raise ValueError(f"SPMD pipeline: {lt.obstacle}; plan with pipeline=False")
        diff_tree = jax.tree_util.tree_structure(tuple(args[a % len(args)] for a in nums))
        body_specs, post_specs, back_specs = stage_body.split_operand_specs(
            dict(self.operand_specs))
        # post_specs: 1F1B's (its head runs in the loop); GPipe's runs as traced
        if self.schedule == "1f1b":
            loss, grads = spmd_1f1b.pipelined_loss_and_grad(
                lt, flat, diff, self.mesh, self.num_stages, self.num_micro_batches,
                self.carry_specs, body_specs, post_specs, back_specs)
            out = jax.tree_util.tree_unflatten(lt.out_tree, [loss])
            grads = jax.tree_util.tree_unflatten(diff_tree, grads)
            return ((out[0], out[1]) if has_aux else out,
                    grads[0] if isinstance(argnums, int) else grads)
        micro_eqn = lt.micro.jaxpr.eqns[lt.micro_scan.index]

        def rewrite(eqn, ins):
            return pipelined_scan(eqn, ins, micro_eqn, self.mesh, self.num_stages,
                                  self.num_micro_batches, self.carry_specs, body_specs,
                                  back_specs)

        def loss(diff_args):
            leaves = list(flat)
            for i, x in zip(diff, jax.tree_util.tree_leaves(diff_args)):
                leaves[i] = x
            outs = interpret.eval_jaxpr(lt.full, leaves, {lt.scan.index: rewrite})
            out = jax.tree_util.tree_unflatten(lt.out_tree, outs)
            return (out[0], out[1]) if has_aux else out

        diff_args = tuple(args[a % len(args)] for a in nums)
        value, grads = jax.value_and_grad(loss, has_aux=has_aux)(diff_args)
        return value, (grads[0] if isinstance(argnums, int) else grads)

    def stage_boundary(self, x):
        return x


def emit_spmd(fn, mesh: Mesh, num_stages: int, num_micro_batches: int, in_shardings,
              out_shardings=None, donate_argnums=(), schedule: str = "gpipe",
              carry_specs: Sequence | None = None, operand_specs: Mapping | None = None):
    """The step `fn` as one jax.jit whose shardplan.value_and_grad call runs an SPMD pipeline
    on `mesh` (which has the stage axis), GPipe or 1F1B (shardplan.emit.spmd_1f1b);
    `carry_specs` (PartitionSpecs, the plan's): the layout of the activation in the stages;
    `operand_specs` ((body equation, operand) -> PartitionSpec): the layouts inside a layer."""
    interceptor = PipelinedGrad(mesh, num_stages, num_micro_batches, schedule,
                                None if carry_specs is None else tuple(carry_specs),
                                tuple(sorted((operand_specs or {}).items())))

    def step(*args):
        with intercepting(interceptor):
            return fn(*args)

    return jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings,
                   donate_argnums=donate_argnums)


def emit_plan(fn, plan, mesh: Mesh, donate_argnums=()):
    """The SPMD pipeline `plan` (shardplan.planning.spmd_pipeline: its `constraints` the carries' specs by
    position, its `operand_specs` the layouts inside a layer by (body equation, operand)) of
    the step `fn` as one jax.jit on the pipeline mesh `mesh`: (jitted, the plan placed on
    `mesh`)."""
    placed = dataclasses.replace(plan, device_mesh=mesh)
    carries = [plan.constraints[k].to_partition_spec() for k in sorted(plan.constraints)]
    operands = {k: route[-1].to_partition_spec() for k, route in plan.operand_specs.items()
                if route}
    jitted = emit_spmd(fn, mesh, len(plan.stages), plan.num_micro_batches,
                       placed.in_shardings, placed.out_shardings, tuple(donate_argnums),
                       plan.schedule, carries or None, operands)
    return jitted, placed
