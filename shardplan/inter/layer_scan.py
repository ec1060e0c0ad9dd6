"""The scan over stacked layers in a loss function, the place an SPMD pipeline cuts.

A model whose layers run as one `lax.scan` over parameters stacked on a leading layer
dimension [L, ...] (flax `nn.scan`, MaxText's and praxis's layout) can be pipelined inside one
program: the stacked parameters split [S, L/S, ...] over a stage axis, the scan's carry (the
activation, batch first) cut into micro-batches. This module finds that scan in the loss's
forward jaxpr, before differentiation, and says whether an SPMD pipeline of S stages and M
micro-batches can run it and, if not, why (shardplan.search reports it; shardplan.emit.spmd
rewrites the scan).

The loss is traced twice: at full batch (the program the pipeline is spliced into) and with
the batch cut to one micro-batch (whose scan body runs on a micro-batch: jaxprs are traced
for fixed shapes). The batch is the non-differentiated arguments' leaves whose leading
dimension is the carry's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplan import _compat
from shardplan._compat import ClosedJaxpr
from shardplan.grad import intercepting

STAGE_AXIS = "stage"
"""The mesh axis an SPMD pipeline's stages lie along."""


def pipeline_mesh_shape(names: Sequence[str], sizes: Sequence[int],
                        num_stages: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The (axis names, sizes) an SPMD pipeline of `num_stages` stages runs on: the mesh's own
    if it has a `stage` axis of that size, else its devices as (stage=S, data=N/S)."""
    names, sizes = tuple(names), tuple(int(k) for k in sizes)
    n = int(np.prod(sizes))
    if STAGE_AXIS in names:
        k = sizes[names.index(STAGE_AXIS)]
        if k != num_stages:
            raise ValueError(f"the mesh's {STAGE_AXIS!r} axis has {k} devices, but "
                             f"{num_stages} pipeline stages were asked for")
        return names, sizes
    if n % num_stages:
        raise ValueError(f"{num_stages} pipeline stages do not divide the mesh's {n} devices")
    return (STAGE_AXIS, "data"), (num_stages, n // num_stages)


def stage_psum(tree, mesh):
    """jax.lax.psum over the stage axis inside the pipeline's shard_map. On XLA:CPU a psum of a
    16-bit float over the manual axis of a shard_map that leaves other mesh axes automatic
    aborts the process while compiling ("Invalid binary instruction opcode copy", jax 0.10.2;
    f32, or every axis manual, compile): there it is summed in float32 and cast back."""
    widen = _widens(mesh)

    def one(x):
        if widen and x.dtype in _NARROW:
            return jax.lax.psum(x.astype(jnp.float32), STAGE_AXIS).astype(x.dtype)
        return jax.lax.psum(x, STAGE_AXIS)

    return jax.tree_util.tree_map(one, tree)


_NARROW = (jnp.bfloat16, jnp.float16)


def _widens(mesh) -> bool:
    return mesh.devices.flat[0].platform == "cpu"


def stage_psum_dtypes(dtypes: Sequence, mesh) -> list:
    """The dtypes to pass values every stage reads whole into the pipeline's shard_map in: their
    cotangents are psums over the stages (stage_psum's reason), float32 for 16-bit floats on
    XLA:CPU."""
    return [jnp.float32 if _widens(mesh) and d in _NARROW else d for d in dtypes]


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """One scan equation of a loss jaxpr: where it is and what it runs over."""

    index: int
    """Its position among the jaxpr's top-level equations."""
    length: int
    """Layers (iterations)."""
    carry_shapes: tuple[tuple[int, ...], ...]
    xs_shapes: tuple[tuple[int, ...], ...]
    const_shapes: tuple[tuple[int, ...], ...]
    num_ys: int
    reverse: bool

    @property
    def batch(self) -> int | None:
        """The carry's common leading dimension (the batch), or None."""
        lead = {s[0] if s else None for s in self.carry_shapes}
        return lead.pop() if len(lead) == 1 else None


def find_layer_scan(closed: ClosedJaxpr) -> LayerScan | None:
    """The top-level scan over the most stacked values (bytes of its xs), or None."""
    best, best_size = None, 0
    for i, eqn in enumerate(closed.jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        p = eqn.params
        nc, nk = _compat.scan_counts(p)
        avals = [v.aval for v in eqn.invars]
        xs = avals[nc + nk:]
        size = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in xs)
        if not xs or size <= best_size:
            continue
        best_size = size
        best = LayerScan(i, int(p["length"]), tuple(tuple(a.shape) for a in avals[nc:nc + nk]),
                         tuple(tuple(a.shape) for a in xs),
                         tuple(tuple(a.shape) for a in avals[:nc]),
                         len(eqn.outvars) - nk, bool(p["reverse"]))
    return best


def spmd_obstacle(scan: LayerScan | None, num_stages: int, num_micro_batches: int) -> str | None:
    """Why an SPMD pipeline of `num_stages` stages and `num_micro_batches` micro-batches cannot
    run this scan (None: it can)."""
    if scan is None:
        return "the loss runs no scan over stacked layers (lax.scan / flax nn.scan)"
    S, M = num_stages, num_micro_batches
    if scan.length % S:
        return f"its scan runs {scan.length} layers, which {S} equal stages do not divide"
    if scan.num_ys:
        return "its scan over layers has per-layer outputs (ys), which a pipeline does not keep"
    if scan.reverse:
        return "its scan over layers runs in reverse"
    if scan.batch is None or not scan.carry_shapes:
        return (f"its scan's carry {list(scan.carry_shapes)} is not batch-first arrays of one "
                "batch size")
    if scan.batch % M:
        return f"the batch of {scan.batch} does not divide into {M} micro-batches"
    return None


@dataclasses.dataclass(frozen=True, eq=False)
class LossTrace:
    """A loss function traced on flat arguments, at full batch and at one micro-batch."""

    full: ClosedJaxpr
    micro: ClosedJaxpr | None
    out_tree: Any
    scan: LayerScan | None
    obstacle: str | None
    micro_scan: LayerScan | None
    num_stages: int = 1
    num_micro_batches: int = 1


def flat_call(args: Sequence, kwargs: dict, argnums) -> tuple[list, Callable, list[int]]:
    """A gradient call's arguments flat: (leaves, leaves -> (args, kwargs), the positions of
    the differentiated leaves)."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    nums = [a % len(args) for a in nums]  # in the order the gradients come back
    flat, tree = jax.tree_util.tree_flatten((tuple(args), dict(kwargs)))
    counts = [len(jax.tree_util.tree_leaves(a)) for a in args]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    diff = [i for a in nums for i in range(starts[a], starts[a + 1])]
    return flat, lambda leaves: jax.tree_util.tree_unflatten(tree, list(leaves)), diff


def trace_loss(fun: Callable, flat_args: Sequence, unflatten: Callable, diff: Sequence[int],
               pick: Callable[[LayerScan], tuple[int, int]]) -> LossTrace:
    """Trace `fun(*unflatten(flat_args))` (the loss function's call, its arguments flat; the
    positions `diff` differentiated) and find its scan over layers, at full batch and with the
    batch cut to one micro-batch; `pick(scan)` gives (stages, micro-batches) or raises
    ValueError. The obstacle says why an SPMD pipeline cannot run it."""
    def flat_fun(*flat):
        args, kwargs = unflatten(flat)
        return jax.tree_util.tree_leaves(fun(*args, **kwargs))

    def call(*flat):
        args, kwargs = unflatten(flat)
        return fun(*args, **kwargs)

    out_tree = jax.tree_util.tree_structure(jax.eval_shape(call, *flat_args))
    full = jax.make_jaxpr(flat_fun)(*flat_args)
    scan = find_layer_scan(full)
    try:
        S, M = pick(scan) if scan is not None else (1, 1)
    except ValueError as e:
        return LossTrace(full, None, out_tree, scan, str(e), None)
    obstacle = spmd_obstacle(scan, S, M)
    if obstacle is not None:
        return LossTrace(full, None, out_tree, scan, obstacle, None, S, M)
    B = scan.batch
    diff = set(diff)
    rows = {i for i, x in enumerate(flat_args)
            if i not in diff and np.ndim(x) >= 1 and np.shape(x)[0] == B}
    # fresh shapes without shardings: the body is re-bound inside shard_map, where the
    # arguments' mesh (all axes auto) is not the body's (the stage axis manual)
    cut = [jax.ShapeDtypeStruct((B // M, *np.shape(x)[1:]) if i in rows else np.shape(x),
                                x.dtype)
           for i, x in enumerate(flat_args)]
    if not rows:
        return LossTrace(full, None, out_tree, scan, f"no argument of the loss function has "
                         f"the scan's batch of {B} rows first", None, S, M)
    try:
        micro = jax.make_jaxpr(flat_fun)(*cut)
    except Exception as e:  # noqa: BLE001 (the reason is reported, the step runs unpipelined)
        return LossTrace(full, None, out_tree, scan, f"the loss does not trace on one "
                         f"micro-batch of {B // M} rows: {type(e).__name__}: {e}"[:300], None,
                         S, M)
    m = find_layer_scan(micro)
    want = tuple((B // M, *s[1:]) for s in scan.carry_shapes)
    obstacle = None
    if (m is None or m.index != scan.index or m.xs_shapes != scan.xs_shapes
            or m.carry_shapes != want):
        obstacle = "on one micro-batch the loss runs a different scan over layers"
    elif m.const_shapes != scan.const_shapes:
        obstacle = ("a batch-sized value enters the scan over layers as a constant (only the "
                    "carry may hold the batch)")
    return LossTrace(full, micro, out_tree, scan, obstacle, m, S, M)


class _Probed(Exception):
    """Raised inside the probe's trace once the loss function has been looked at."""


@dataclasses.dataclass
class _Probe:
    """Interceptor (shardplan.grad) that traces the loss function at the gradient call, keeps
    what it found and stops the step's trace. Mutable within one trace only."""

    pick: Callable[[LayerScan], tuple[int, int]]
    found: LossTrace | None = None

    def value_and_grad(self, fun, argnums, has_aux, args, kwargs):
        flat, unflatten, diff = flat_call(args, kwargs, argnums)
        self.found = trace_loss(fun, flat, unflatten, diff, self.pick)
        raise _Probed()

    def stage_boundary(self, x):
        return x


def probe_step(fn: Callable, args: Sequence,
               pick: Callable[[LayerScan], tuple[int, int]]) -> LossTrace | str:
    """The loss trace of the step `fn(*args)` (arrays or ShapeDtypeStructs) at its
    shardplan.value_and_grad call, or why there is none."""
    probe = _Probe(pick)

    def run(*a):
        with intercepting(probe):  # inside the traced function: jax's trace caches skip it
            try:
                fn(*a)
            except _Probed:
                pass
        return 0

    jax.make_jaxpr(run)(*args)
    if probe.found is None:
        return ("the step takes no gradient with shardplan.value_and_grad / shardplan.grad "
                "(the loss function, where the layers run, cannot be found)")
    return probe.found
