"""Every difference between supported JAX versions, in one place."""

from __future__ import annotations

import os
import sys
import warnings

import jax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh

try:  # jax >= 0.11 describes a scan's operands by a flat tree (no public name for it)
    from jax._src import flattree as _flattree
except ImportError:
    _flattree = None

ClosedJaxpr = jcore.ClosedJaxpr
Jaxpr = jcore.Jaxpr
Literal = jcore.Literal


def is_jaxpr(x) -> bool:
    return isinstance(x, (ClosedJaxpr, Jaxpr))


def open_jaxpr(x) -> tuple[Jaxpr, tuple]:
    """(jaxpr, consts) of a Jaxpr or ClosedJaxpr: remat and shard_map bodies are open."""
    if isinstance(x, ClosedJaxpr):
        return x.jaxpr, tuple(x.consts)
    return x, ()


def is_drop_var(v) -> bool:
    return type(v).__name__ == "DropVar"


def bind_eqn(eqn, invals):
    """Bind an equation again on new inputs, as jax.core.eval_jaxpr does."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    # jax < 0.7 returns (subfuns, params); newer versions return the params alone.
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    if ctx is None:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        with ctx:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
    return out if eqn.primitive.multiple_results else [out]


def scan_counts(params) -> tuple[int, int]:
    """(constants, carries) among a scan's operands, which come first in that order (the
    stacked inputs follow). Up to jax 0.10 the params say num_consts and num_carry; since
    0.11 a flat tree `ft_in` of (constants, carries, stacked inputs) does."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_params(params, jaxpr, num_consts: int) -> dict:
    """`params` of a scan for a new body `jaxpr` (a ClosedJaxpr) that reads `num_consts`
    constants, as many carries as before, then stacked inputs, and returns the carries then
    stacked outputs (tests/test_remat.py rewrites scans with it)."""
    _, num_carry = scan_counts(params)
    num_xs = len(jaxpr.jaxpr.invars) - num_consts - num_carry
    num_ys = len(jaxpr.jaxpr.outvars) - num_carry
    new = dict(params, jaxpr=jaxpr)
    if "num_consts" in params:
        new["num_consts"] = num_consts
        if "linear" in params:  # jax < 0.10 records which operands are linear
            new["linear"] = (False,) * len(jaxpr.jaxpr.invars)
        return new
    new["ft_in"] = _flattree.pack((_flattree.nones(num_consts), _flattree.nones(num_carry),
                                   _flattree.nones(num_xs)))
    new["ft_out"] = _flattree.pack((_flattree.nones(num_carry), _flattree.nones(num_ys)))
    return new


def inlined_by_jax(params) -> bool:
    """Whether JAX itself inlines a jit into its caller (`jax.jit(f, inline=True)`, as optax
    writes its tree helpers). Up to jax 0.10 it did so while tracing, leaving no equation;
    since 0.11 the equation stays, its `inline` param jax.Inline.JAX_EARLY or JAX_LATE."""
    inline = params.get("inline", False)
    return inline is True or getattr(inline, "value", None) in ("jax_early", "jax_late")


def auto_mesh(mesh):
    """The same devices and axis names as `mesh`, with every axis of type Auto."""
    types = getattr(mesh, "axis_types", None)
    if types is not None and all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def threefry_partitionable() -> bool:
    """Whether random bits can be drawn sharded with the same values (default since 0.5)."""
    try:
        return bool(jax.config.jax_threefry_partitionable)
    except AttributeError:
        return False


def cost_analysis(compiled) -> dict:
    """compiled.cost_analysis() is a dict in new JAX and a list of dicts in old."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca or {})


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn pointing at the first frame outside shardplan (the user's call of auto / search /
    the planned step), not at the line inside shardplan that found the problem. Python 3.12
    has warnings.warn(skip_file_prefixes=...); 3.11 counts the frames."""
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=(_PACKAGE,))
        return
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


__all__ = [
    "ClosedJaxpr",
    "Jaxpr",
    "Literal",
    "auto_mesh",
    "bind_eqn",
    "cost_analysis",
    "inlined_by_jax",
    "is_drop_var",
    "is_jaxpr",
    "jax",
    "open_jaxpr",
    "scan_counts",
    "scan_params",
    "threefry_partitionable",
    "warn_at_caller",
]
