"""What a planning driver tries of gradient accumulation (shardplan.inter.accumulate): the
numbers of micro-batches worth planning on a mesh, the step's reduction where its loss
function shows it, and the partial sums matching a plan's batch layout."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from shardplan import _compat
from shardplan.inter import accumulate
from shardplan.inter import split as split_mod
from shardplan.ir.trace import TracedStep, trace
from shardplan.strategies.spec import MeshShape

# -- the step's reduction, read off its loss function -------------------------------------------


def infer_reduction(fn: Callable, args: Sequence, *,
                    state_argnums: Sequence[int] | None = None,
                    batch_argnums: Sequence[int] | None = None) -> str | None:
    """"mean" when the loss function divides by a number proportional to the batch's rows (a
    mean over the batch, as jnp.mean writes it), else None: a sum, a mean over a count read
    from the data (masked tokens) and a loss without batch dependent constants look alike,
    and the caller must say which (accumulate's `reduction`).

    Read from the scalar constants of the loss function traced on the whole batch and on a
    1 / f part of it (f the batch's least divisor above 1): "mean" when those that differ
    pair up as x_whole = f x_part (a divisor) or x_part / f (its reciprocal). A step that
    cannot be split (AccumulationError) has no reduction to read: None."""
    try:
        rows = batch_size(trace(fn, args, state_argnums, batch_argnums), batch_argnums)
        f = next((d for d in range(2, (rows or 0) + 1) if rows % d == 0), None)
        if f is None:
            return None
        consts = [_loss_constants(accumulate.split(fn, args, k, state_argnums=state_argnums,
                                                   batch_argnums=batch_argnums))
                  for k in (1, f)]
    except accumulate.AccumulationError:
        return None
    only_whole, only_part = consts[0] - consts[1], consts[1] - consts[0]
    if not only_whole or sum(only_whole.values()) != sum(only_part.values()):
        return None
    left = list(only_part.elements())
    for x in only_whole.elements():
        match = next((y for y in left if math.isclose(x, f * y, rel_tol=1e-6)
                      or math.isclose(x, y / f, rel_tol=1e-6)), None)
        if match is None:
            return None
        left.remove(match)
    return "mean"


def _loss_constants(s: split_mod.SplitStep) -> collections.Counter:
    """The nonzero numeric scalar literals the loss function's equations read (inside loops
    and calls too), rounded to 7 significant digits."""
    g = s.forward
    found: collections.Counter = collections.Counter()

    def add(value):
        v = np.asarray(value)
        if v.shape == () and np.issubdtype(v.dtype, np.number) and v != 0:
            found[float(f"{float(v):.7g}")] += 1

    def walk(jaxpr):
        jaxpr, _ = _compat.open_jaxpr(jaxpr)
        for eqn in jaxpr.eqns:
            for x in eqn.invars:
                if isinstance(x, _compat.Literal):
                    add(x.val)
            for sub in _sub_jaxprs(eqn.params):
                walk(sub)

    for nid in s.body:
        node = g.nodes[nid]
        for v in node.inputs:
            if g.values[v].is_literal:
                add(g.values[v].const)
        if node.eqn is not None:
            for sub in _sub_jaxprs(node.eqn.params):
                walk(sub)
    return found


def _sub_jaxprs(params) -> list:
    return [x for val in params.values()
            for x in (val if isinstance(val, (tuple, list)) else (val,)) if _compat.is_jaxpr(x)]


# -- what the driver tries -----------------------------------------------------------------------


def batch_size(traced: TracedStep, batch_argnums: Sequence[int] | None = None) -> int | None:
    """The leading dimension the batch leaves share (what micro-batches divide), or None
    when the step has no batch leaf."""
    leaves = split_mod.micro_batch_leaves(traced, batch_argnums)
    sizes = {traced.in_avals[i].shape[0] for i in leaves}
    if not sizes:
        return None
    if len(sizes) > 1:
        raise accumulate.AccumulationError(
            f"the batch arguments have leading dimensions {sorted(sizes)}; micro-batches need "
            "one batch size: pass batch_argnums=(...)")
    return sizes.pop()


def data_parallel_width(batch: int, mesh_shape) -> int:
    """The most devices a batch of `batch` rows splits over evenly: the largest product of a
    subset of the mesh's axes dividing it."""
    sizes = _mesh_sizes(mesh_shape)
    widths = {math.prod(c) for r in range(len(sizes) + 1)
              for c in itertools.combinations(sizes, r)}
    return max(w for w in widths if batch % w == 0)


def micro_batch_choices(traced: TracedStep, mesh_shape,
                        batch_argnums: Sequence[int] | None = None) -> list[int]:
    """The numbers of micro-batches M worth planning for `traced` on a mesh of `mesh_shape`
    (a MeshShape, jax Mesh or tuple of axis sizes), ascending from 1: M divides the batch B,
    and each micro-batch still splits over as many devices as the whole batch does
    (B / M is a multiple of data_parallel_width(B, mesh)). [1] for a step without batch."""
    b = batch_size(traced, batch_argnums)
    if not b:
        return [1]
    width = data_parallel_width(b, mesh_shape)
    return [m for m in range(1, b // width + 1) if b % (m * width) == 0]


def _mesh_sizes(mesh_shape) -> tuple[int, ...]:
    if isinstance(mesh_shape, MeshShape):
        return tuple(mesh_shape.sizes)
    if hasattr(mesh_shape, "axis_names"):
        return tuple(MeshShape.of(mesh_shape).sizes)
    return tuple(int(n) for n in mesh_shape)


def partial_sums_for(batch_spec, mesh_shape) -> int:
    """The lanes (accumulate's partial_sums) matching a plan's batch layout: the devices
    the batch's leading dimension is split over in `batch_spec` (a PartitionSpec or tuple:
    the product of the sizes of the mesh axes named in its first entry), 1 when whole."""
    first = next(iter(batch_spec), None)
    if first is None:
        return 1
    names = (first,) if isinstance(first, str) else tuple(first)
    shape = mesh_shape if isinstance(mesh_shape, MeshShape) else MeshShape.of(mesh_shape)
    return shape.size(names)
