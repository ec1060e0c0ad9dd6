"""A layer's backward pass as a jaxpr of its own, for the stage's intra-op plan to be applied
inside it.

The SPMD pipeline runs the scan's layer body inside shard_map, its operands held in the layouts
the stage's plan reads them in (stage_body.stage_layers). Differentiated as it is, the body's
backward runs in the forward's layouts: each constraint transposes to the same constraint on
the cotangent, so a weight the forward reads whole gets its gradient all-reduced whole, every
layer and tick, where the plan computes it split over its output dimension from the gathered
activation and reduces nothing (benchmarks/pipeline_bench.py --spmd prices both). Here a
layer runs as a custom_vjp: its forward holds its operands (forward only: `forward_held`), and
its backward is the vjp of the layer traced as a jaxpr (residuals and cotangents its
arguments) bound again equation by equation, its operands held in the layouts the plan's
backward scan over layers reads them in (spmd_specs.body_backward_specs matches the two).

The backward's equations are numbered without the holds (`sharding_constraint`, and the
custom_vjp calls of `forward_held` a remat'd layer recomputes): the same numbers whether the
layer was traced with its forward's layouts (in the pipeline) or without (when planned).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardplan._compat import ClosedJaxpr
from shardplan.ir import interpret

_LAYOUT = frozenset({"reshard", "mesh_cast", "pvary"})  # the pipeline's shard_map adds some


def is_hold(eqn) -> bool:
    """A sharding constraint, or a forward_held call: an identity the backward does not bind
    (the plan's layouts replace the forward's, which a remat'd layer would recompute)."""
    if eqn.primitive.name == "sharding_constraint":
        return True
    inner = eqn.params.get("call_jaxpr") if eqn.primitive.name.startswith("custom_vjp") else None
    eqns = getattr(getattr(inner, "jaxpr", inner), "eqns", ())
    return len(eqns) == 1 and eqns[0].primitive.name == "sharding_constraint"


def _unnumbered(eqn) -> bool:
    return is_hold(eqn) or eqn.primitive.name in _LAYOUT


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def forward_held(x, spec):
    """`x` held in `spec` (a with_sharding_constraint) whose cotangent is left free."""
    return jax.lax.with_sharding_constraint(x, spec)


def _held_fwd(x, spec):
    return jax.lax.with_sharding_constraint(x, spec), None


def _held_bwd(spec, _, ct):
    return (ct,)


forward_held.defvjp(_held_fwd, _held_bwd)


def _held(x, spec):
    return x if spec is None else jax.lax.with_sharding_constraint(x, spec)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def numbered(closed: ClosedJaxpr) -> list[int | None]:
    """For each leaf equation of the backward jaxpr (interpret.leaf_eqns), its number among
    those that are not holds (None for a hold)."""
    out, k = [], 0
    for eqn in interpret.leaf_eqns(closed.jaxpr):
        if _unnumbered(eqn):
            out.append(None)
        else:
            out.append(k)
            k += 1
    return out


def backward_eqns(closed: ClosedJaxpr) -> list:
    """The backward jaxpr's leaf equations that are not holds, in their numbering."""
    return [e for e in interpret.leaf_eqns(closed.jaxpr) if not _unnumbered(e)]


def _vjp(forward: Callable, args: Sequence) -> tuple[list, Any, list[bool]]:
    """(forward(*args), its pullback in the floating args, which args are floating)."""
    floats = [_is_float(x) for x in args]

    def f(*fl):
        it = iter(fl)
        return forward(*[next(it) if k else x for k, x in zip(floats, args)])

    outs, vjp = jax.vjp(f, *[x for k, x in zip(floats, args) if k])
    return outs, vjp, floats


def _vjp_jaxpr(forward: Callable, args: Sequence) -> tuple[list, ClosedJaxpr, list, Any]:
    """(forward(*args), the jaxpr of its pullback: (residuals..., cotangents...) -> the
    cotangents of the floating args, the residuals, which args are floating)."""
    outs, vjp, floats = _vjp(forward, args)
    leaves, tree = jax.tree_util.tree_flatten(vjp)
    closed = jax.make_jaxpr(lambda res, ct: jax.tree_util.tree_unflatten(tree, res)(ct))(
        leaves, outs)
    return outs, closed, leaves, floats


def traced_backward(forward: Callable, avals: Sequence) -> ClosedJaxpr:
    """The backward jaxpr of `forward` (flat arguments -> flat outputs) at these abstract
    arguments (what body_backward_specs matches the plan to)."""
    found = []

    def run(*args):
        outs, closed, _, _ = _vjp_jaxpr(forward, args)
        found.append(closed)
        return outs

    jax.make_jaxpr(run)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
    return found[0]


def with_backward(forward: Callable, specs: Mapping[tuple[int, int], Any],
                  residual_specs: Mapping[int, Any] | None = None) -> Callable:
    """`forward` (flat arguments -> list of outputs) whose backward is its vjp's jaxpr bound
    again with operand j of backward equation i (numbered) held in specs[(i, j)], its result
    r in specs[(i, -1 - r)]; an argument k the backward keeps as a residual (a weight) held
    there in residual_specs[k], the layout it was read in before the loop: left free, XLA
    lays the backward loop's copy out as one reader wants it and gathers it for another at
    every iteration."""
    trees = []  # the pullback's structure, from the forward's trace (static: one shape)
    residual_specs = dict(residual_specs or {})

    @jax.custom_vjp
    def layer(*args):
        return forward(*args)

    def fwd(*args):
        outs, vjp, floats = _vjp(forward, args)
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        zeros = [None if k else np.shape(x) for k, x in zip(floats, args)]
        held = {r: residual_specs[k] for r, leaf in enumerate(leaves)
                for k, x in enumerate(args) if k in residual_specs and leaf is x}
        trees.append((tree, zeros, held))
        return outs, leaves

    def bwd(leaves, ct):
        tree, zeros, held = trees[-1]
        leaves = [_held(x, held.get(r)) for r, x in enumerate(leaves)]
        closed = jax.make_jaxpr(lambda r, c: jax.tree_util.tree_unflatten(tree, r)(c))(
            leaves, list(ct))
        number = numbered(closed)

        def operand(i, j, x):
            k = number[i]
            return _held(x, None if k is None else specs.get((k, j)))

        def result(i, r, y):
            return operand(i, -1 - r, y)

        cts = iter(interpret.eval_leaves(closed, [*leaves, *ct], operand, result, is_hold))
        return tuple(next(cts) if z is None else np.zeros(z, jax.dtypes.float0)
                     for z in zeros)

    layer.defvjp(fwd, bwd)
    return lambda *args: list(layer(*args))
