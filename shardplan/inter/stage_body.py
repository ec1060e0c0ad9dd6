"""The stage body of an SPMD pipeline: the scan's own layer run over one stage's layers, every
value the activation passes through, each layer's operands, its matmuls' results and its
backward held in the layouts of the stage's intra-op plan (the plan's carry specs and
operand_specs, shardplan.inter.spmd_specs), and the keys the plan files those layouts under.
Found and traced by shardplan.inter.layer_scan; run by shardplan.emit.spmd and spmd_1f1b."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from shardplan import _compat
from shardplan._compat import ClosedJaxpr
from shardplan.inter import layer_backward
from shardplan.ir import interpret


def held(values: Sequence, specs: Sequence | None, lead: int = 0) -> list:
    """`values` (activations: the scan's carries, or stacks of them with `lead` leading
    dimensions) constrained to the carries' PartitionSpecs (None: left to XLA). Inside the
    pipeline every value the activation passes through is held so: XLA gives a loop's carry
    the layout of its initial value, and one unconstrained value lets the layout of the
    outside (the embedding's output) into the loops, to be resharded at every layer."""
    if specs is None:
        return list(values)
    return [jax.lax.with_sharding_constraint(v, jax.sharding.PartitionSpec(*[None] * lead, *p))
            for v, p in zip(values, specs)]


def post_key(i: int) -> int:
    """The key an SPMD plan's operand_specs give leaf equation i after the scan over layers
    (the head and loss): negative, where the layer body's equations have their own index."""
    return -1 - i


BACKWARD = 1 << 20
"""backward_key(i) = BACKWARD + i."""


def backward_key(i: int) -> int:
    """The key an SPMD plan's operand_specs give equation i of the layer's backward
    (shardplan.inter.layer_backward numbering), beyond the layer body's own equations."""
    return BACKWARD + i


STACKED = 1 << 21
"""stacked_key(k) = STACKED + k."""


def stacked_key(k: int) -> int:
    """The key an SPMD plan's operand_specs give (operand 0) the layout, per layer, its backward
    keeps the scan's stacked parameter k in (spmd_specs.stacked_specs)."""
    return STACKED + k


def split_operand_specs(specs: Mapping[tuple[int, int], Any]) -> tuple[dict, dict, dict]:
    """An SPMD plan's operand layouts as (the layer body's {(equation, operand): spec}, the
    equations after the scan's (post_key), the layer's backward's (backward_key; the stacked
    parameters' under (-1 - k, 0), stacked_key))."""
    body = {k: v for k, v in specs.items() if 0 <= k[0] < BACKWARD}
    post = {(post_key(k[0]), k[1]): v for k, v in specs.items() if k[0] < 0}
    back = {(k[0] - BACKWARD, k[1]): v for k, v in specs.items() if BACKWARD <= k[0] < STACKED}
    back.update({(-1 - (k[0] - STACKED), 0): v for k, v in specs.items() if k[0] >= STACKED})
    return body, post, back


def backward_stacked(backward_specs: Mapping | None) -> dict[int, Any]:
    """{k: spec} of the stacked parameters among a layer's backward layouts
    (split_operand_specs)."""
    return {-1 - i: v for (i, _), v in (backward_specs or {}).items() if i < 0}


def constrained(specs: Mapping[tuple[int, int], Any], forward_only: bool = False) -> Callable:
    """operand(i, j, x) for interpret.eval_leaves / run_leaves: `x` held in specs[(i, j)]
    (`forward_only`: its cotangent left free, layer_backward.forward_held)."""
    hold = layer_backward.forward_held if forward_only else jax.lax.with_sharding_constraint

    def operand(i, j, x):
        spec = specs.get((i, j))
        return x if spec is None else hold(x, spec)
    return operand


def _free(i, j, x):
    return x


def layer_backward_jaxpr(micro_eqn) -> ClosedJaxpr:
    """The backward jaxpr of one layer of the scan `micro_eqn` (as stage_layers runs it with
    backward layouts; layer_backward numbers its equations)."""
    body = micro_eqn.params["jaxpr"]
    return layer_backward.traced_backward(
        lambda *ins: interpret.eval_leaves(body, ins, _free), body.in_avals)


def held_cotangent(values: Sequence, specs: Sequence | None, lead: int = 0) -> list:
    """`values` themselves, their cotangents constrained as `held` constrains activations:
    where a loop reads a stack of them per tick (GPipe's outputs, whose cotangent comes from
    the head at full batch, split over the batch rows), the stack is laid out once before the
    loop instead of gathered at every tick."""
    if specs is None:
        return list(values)
    return [_ct_held(v, jax.sharding.PartitionSpec(*[None] * lead, *p))
            for v, p in zip(values, specs)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _ct_held(x, spec):
    return x


def _ct_held_fwd(x, spec):
    return x, None


def _ct_held_bwd(spec, _, ct):
    return (jax.lax.with_sharding_constraint(ct, spec),)


_ct_held.defvjp(_ct_held_fwd, _ct_held_bwd)


def parameter_read_specs(micro_eqn, operand_specs: Mapping | None) -> dict[int, Any]:
    """{k: spec}: the layout the layer first reads its stacked parameter k (the scan's xs, in
    order) in, from `operand_specs` ((leaf equation, operand) -> spec)."""
    body = micro_eqn.params["jaxpr"].jaxpr
    first = len(body.invars) - (len(micro_eqn.invars) - sum(_compat.scan_counts(micro_eqn.params)))
    specs: dict[int, Any] = {}
    for i, j, k in interpret.leaf_readers(body):
        spec = (operand_specs or {}).get((i, j))
        if k >= first and spec is not None:
            specs.setdefault(k - first, spec)
    return specs


def held_parameters(micro_eqn, stacked: Sequence, operand_specs: Mapping | None,
                    backward_specs: Mapping | None = None) -> list:
    """A stage's stacked parameters (the scan's xs, [layers, ...]) held once, before the
    pipeline's loop, in the layout the layer first reads each in, or where the plan's
    backward keeps it (`backward_specs`, backward_stacked) in that (forward only: their
    gradients' layout is the backward's). Without it XLA hoists the layers' reads of them out
    of the loop of ticks into a loop of its own, whose collectives XLA:CPU may run in another
    order on different devices than the step's other collectives (a deadlock)."""
    specs = {**parameter_read_specs(micro_eqn, operand_specs),
             **backward_stacked(backward_specs)}
    return [x if k not in specs else layer_backward.forward_held(
        x, jax.sharding.PartitionSpec(None, *specs[k])) for k, x in enumerate(stacked)]


def stage_layers(micro_eqn, num_layers: int, carry_specs: Sequence | None = None,
                 operand_specs: Mapping[tuple[int, int], Any] | None = None,
                 backward_specs: Mapping[tuple[int, int], Any] | None = None):
    """layers(consts, carry, xs) -> carry: the scan's own body over `num_layers` layers (one
    stage's), traced again rather than re-bound: inside shard_map the body's types must say
    which values vary over the stage axis. `carry_specs` (PartitionSpecs over the mesh's
    other axes, or None): the layout every layer takes and gives its carry in, the intra-op
    plan's (left alone, XLA's propagation may split a micro-batch's hidden dimension instead
    of its rows and gather it at every layer). `operand_specs` ((equation index in the body,
    operand index) -> PartitionSpec; result r under operand -1 - r): the layouts the plan's
    layer reads its operands in (the stage's intra-op plan applied inside the layer;
    spmd_specs.body_operand_specs).
    `backward_specs` ((equation of the layer's backward, operand) -> PartitionSpec): the
    layouts the plan's backward reads its operands in; given, the layer's backward is its own
    jaxpr held in them (shardplan.inter.layer_backward; spmd_specs.body_backward_specs)."""
    given, back = dict(operand_specs or {}), dict(backward_specs or {})
    operand = constrained(given, forward_only=bool(back))
    body, (nc, nk) = micro_eqn.params["jaxpr"], _compat.scan_counts(micro_eqn.params)

    def hold(c):
        return held(c, carry_specs)

    def result(i, r, y):
        return operand(i, -1 - r, y)

    def apply(*ins):
        return (interpret.eval_leaves(body, ins, operand, result) if given or back
                else interpret.eval_jaxpr(body, ins))

    if back:  # the parameters (the scan's xs) kept for the backward as held before the loop
        first = len(body.in_avals) - len(micro_eqn.invars) + nc + nk
        kept = {**parameter_read_specs(micro_eqn, given), **backward_stacked(back)}
        apply = layer_backward.with_backward(
            apply, {k: v for k, v in back.items() if k[0] >= 0},
            {first + k: spec for k, spec in kept.items()})

    def layers(consts, carry, xs):
        def one(c, x):
            outs = apply(*consts, *hold(c), *x)
            return hold(outs[:nk]), None

        # the layers' result held too: else XLA lays the loop's carry out as a reader outside
        # wants it (the outputs' stack, split as the head reads it) and gathers it back at
        # every layer and before every ppermute
        # (tests/test_emit_spmd.py::test_the_forward_loop_gathers_the_activation_once_per_layer_and_tick)
        return hold(jax.lax.scan(one, hold(carry), list(xs), length=num_layers,
                                 unroll=micro_eqn.params["unroll"])[0])

    return layers
