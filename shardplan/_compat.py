"""Every difference between supported JAX versions, in one place."""

from __future__ import annotations

import os
import sys
import warnings

import jax
from jax.extend import core as jcore
from jax.sharding import AxisType, Mesh

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
    "is_drop_var",
    "is_jaxpr",
    "jax",
    "open_jaxpr",
    "threefry_partitionable",
    "warn_at_caller",
]
