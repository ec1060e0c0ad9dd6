"""Drop-in `grad` / `value_and_grad` that let the pipeline planner find the loss function and
where its gradients flow into the update, and `stage_boundary`, a manual stage cut.

Outside the planner these are exactly jax.grad / jax.value_and_grad and the identity: nothing
is recorded. The planner traces the step inside `intercepting(...)`, a scoped context (a
contextvar set only for that trace, no module state), in which a call is handed to the
context instead: to capture the loss function's forward pass, or to feed given loss and
gradients into the rest of the step (the update). See shardplan.inter.split.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np

# named scopes that mark values in the planner's traces (they survive in eqn name stacks)
BOUNDARY_SCOPE = "shardplan_stage_boundary"
GRAD_ARGS_SCOPE = "shardplan_grad_args"


class Interceptor(Protocol):
    """What the planner's tracing context does with a gradient call (see inter.split)."""

    def value_and_grad(self, fun: Callable, argnums: int | tuple[int, ...], has_aux: bool,
                       args: tuple, kwargs: dict) -> tuple[Any, Any]: ...

    def stage_boundary(self, x: Any) -> Any: ...


_ACTIVE: contextvars.ContextVar[Interceptor | None] = contextvars.ContextVar(
    "shardplan_gradient_interceptor", default=None)
# jax's own, kept before routing_jax_gradients replaces the module attributes
_JAX_VALUE_AND_GRAD, _JAX_GRAD = jax.value_and_grad, jax.grad
# whether jax.value_and_grad / jax.grad called on this thread go to the interceptor
_ROUTE_JAX: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "shardplan_route_jax_gradients", default=False)
_ROUTING_LOCK = threading.Lock()
_ROUTING_DEPTH = [0]  # open routing_jax_gradients blocks, any thread


@contextlib.contextmanager
def intercepting(interceptor: Interceptor) -> Iterator[Interceptor]:
    """Route shardplan.grad / value_and_grad / stage_boundary calls to `interceptor` while the
    block runs (the planner's trace of the step); restored on exit, also on errors."""
    token = _ACTIVE.set(interceptor)
    try:
        yield interceptor
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def routing_jax_gradients() -> Iterator[None]:
    """While the block runs on this thread, jax.value_and_grad and jax.grad act as shardplan's
    (handed to the active interceptor), so that a step written with jax's gradient can be cut
    at it (gradient accumulation: shardplan.inter.accumulate). Calls are routed when the
    function is made inside the block and looked up as `jax.value_and_grad` /
    `jax.grad` (as steps, flax.nnx.value_and_grad and equinox.filter_value_and_grad do);
    gradients taken inside the loss function stay jax's. The module attributes are swapped
    while any block is open; other threads still get jax's own (the routing flag is per
    thread). tests/test_accumulate.py::test_a_step_written_with_jax_value_and_grad_accumulates.
    """
    with _ROUTING_LOCK:
        if _ROUTING_DEPTH[0] == 0:
            jax.value_and_grad, jax.grad = _routed_value_and_grad, _routed_grad
        _ROUTING_DEPTH[0] += 1
    token = _ROUTE_JAX.set(True)
    try:
        yield
    finally:
        _ROUTE_JAX.reset(token)
        with _ROUTING_LOCK:
            _ROUTING_DEPTH[0] -= 1
            if _ROUTING_DEPTH[0] == 0:
                jax.value_and_grad, jax.grad = _JAX_VALUE_AND_GRAD, _JAX_GRAD


def _unrouted(f: Callable) -> Callable:
    """f called with routing off: gradients inside the loss function are jax's."""

    @functools.wraps(f)
    def call(*args, **kwargs):
        token = _ROUTE_JAX.set(False)
        try:
            return f(*args, **kwargs)
        finally:
            _ROUTE_JAX.reset(token)

    return call


@functools.wraps(_JAX_VALUE_AND_GRAD)
def _routed_value_and_grad(fun, *args, **kwargs):
    if _ROUTE_JAX.get() and _ACTIVE.get() is not None:
        return _unrouted(value_and_grad(fun, *args, **kwargs))
    return _JAX_VALUE_AND_GRAD(fun, *args, **kwargs)


@functools.wraps(_JAX_GRAD)
def _routed_grad(fun, *args, **kwargs):
    if _ROUTE_JAX.get() and _ACTIVE.get() is not None:
        return _unrouted(grad(fun, *args, **kwargs))
    return _JAX_GRAD(fun, *args, **kwargs)


def _normalize_argnums(argnums: int | Sequence[int]) -> int | tuple[int, ...]:
    if isinstance(argnums, int):
        return argnums
    argnums = tuple(argnums)
    if not argnums or not all(isinstance(a, int) for a in argnums):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}")
    return argnums


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False,
                   reduce_axes: Sequence = ()) -> Callable[..., tuple[Any, Any]]:
    """jax.value_and_grad (same signature and results), marking the loss function and where its
    gradients flow into the update so that shardplan can pipeline the step.

    Under pipelining the step runs in micro-batches and the loss is the mean of the
    micro-batch losses: it equals the single-device loss when `fun`'s loss is a mean over the
    batch (as the zoo's losses are).
    """
    argnums = _normalize_argnums(argnums)
    kwargs_jax = {"argnums": argnums, "has_aux": has_aux, "holomorphic": holomorphic,
                  "allow_int": allow_int}
    if reduce_axes:
        kwargs_jax["reduce_axes"] = reduce_axes
    plain = _JAX_VALUE_AND_GRAD(fun, **kwargs_jax)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        active = _ACTIVE.get()
        if active is None:
            return plain(*args, **kwargs)
        if holomorphic or allow_int:
            raise NotImplementedError("pipelining supports real-valued gradients only: drop "
                                      "holomorphic=True / allow_int=True or plan without "
                                      "pipeline stages (pipeline=False)")
        return active.value_and_grad(fun, argnums, has_aux, args, kwargs)

    return wrapped


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False,
         reduce_axes: Sequence = ()) -> Callable:
    """jax.grad (same signature and results), marked for pipelining like value_and_grad."""
    vg = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, reduce_axes)

    @functools.wraps(fun)
    def wrapped(*args, **kwargs):
        if _ACTIVE.get() is None:
            return _JAX_GRAD(fun, argnums=_normalize_argnums(argnums), has_aux=has_aux,
                            holomorphic=holomorphic, allow_int=allow_int,
                            **({"reduce_axes": reduce_axes} if reduce_axes else {}))(
                *args, **kwargs)
        (value, grads) = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def stage_boundary(x):
    """Identity on a pytree; under the pipeline planner, a cut between layers of the forward
    pass (the backward pass is cut at the same place). Use it between the model's blocks to
    choose the layers the stage DP groups into stages."""
    active = _ACTIVE.get()
    if active is None:
        return x
    return active.stage_boundary(x)


def mark(x, scope: str):
    """An identity every leaf of `x` passes through, recognisable in a jaxpr: an
    optimization_barrier equation under the named scope `scope`."""
    leaves, tree = jax.tree_util.tree_flatten(x)
    if not leaves:
        return x
    with jax.named_scope(scope):
        leaves = jax.lax.optimization_barrier(list(leaves))
    return jax.tree_util.tree_unflatten(tree, list(leaves))


# -- the pipeline planner's interceptors (used by shardplan.inter.split) ------------------------


class PipelineSplitError(ValueError):
    """The step cannot be split into pipeline stages; the message says why and what to do."""


class CapturedLoss(Exception):
    """Raised inside the step's trace when the loss function has run: carries its outputs."""

    def __init__(self, outputs):
        super().__init__("shardplan internal: loss function captured")
        self.outputs = outputs


@dataclasses.dataclass
class CaptureForward:
    """Interceptor for the forward trace: mark the differentiated args, run the loss function,
    stop the step there. Mutable only within one trace (it records what it saw)."""

    argnums: Any = None
    has_aux: bool = False
    grad_tree: Any = None
    out_tree: Any = None

    def value_and_grad(self, fun, argnums, has_aux, args, kwargs):
        nums = (argnums,) if isinstance(argnums, int) else argnums
        for a in nums:
            if not -len(args) <= a < len(args):
                raise ValueError(f"argnums {argnums} out of range for {len(args)} arguments")
        diff = tuple(args[a] for a in nums)
        marked = mark(diff, GRAD_ARGS_SCOPE)
        new_args = list(args)
        for a, x in zip(nums, marked):
            new_args[a] = x
        self.argnums, self.has_aux = argnums, has_aux
        self.grad_tree = jax.tree_util.tree_structure(
            marked[0] if isinstance(argnums, int) else marked)
        out = fun(*new_args, **kwargs)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError("value_and_grad(has_aux=True) needs the function to return a "
                                f"(loss, aux) pair, got {type(out).__name__}")
            loss, aux = out
        else:
            loss, aux = out, None
        if np.shape(loss) != ():
            raise TypeError(f"the loss must be a scalar, got shape {np.shape(loss)}")
        leaves, self.out_tree = jax.tree_util.tree_flatten(aux)
        raise CapturedLoss([loss, *leaves])

    def stage_boundary(self, x):
        return mark(x, BOUNDARY_SCOPE)


@dataclasses.dataclass
class ReplayUpdate:
    """Interceptor for the update trace: the gradient call returns the given values."""

    loss: Any
    aux: Any
    grads: Any
    has_aux: bool
    calls: int = 0

    def value_and_grad(self, fun, argnums, has_aux, args, kwargs):
        self.calls += 1
        if self.calls > 1:
            raise PipelineSplitError("the step calls shardplan.value_and_grad / grad more than "
                                     "once; pipelining needs one gradient computation per step")
        value = (self.loss, self.aux) if self.has_aux else self.loss
        return value, self.grads

    def stage_boundary(self, x):
        return x
