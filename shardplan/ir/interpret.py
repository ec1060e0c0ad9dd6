"""THE jaxpr interpreter: run a lifted graph's equations again, loops included, with hooks
that may constrain every value and operand (the emitter pins planned layouts through them).

Loops are bound again, not unrolled: a scan runs as `lax.scan`, a while as `lax.while_loop`,
a cond as `lax.switch`, each with a body that interprets the loop's inlined nodes, so the
hooks reach the values inside the body on every iteration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax

from shardplan import _compat
from shardplan.ir import lift, primitives
from shardplan.ir.graph import Graph, Loop, Node


class Hooks(Protocol):
    def value(self, vid: int, x: Any) -> Any:
        """The value `vid` as the program should hold it (e.g. under a sharding constraint)."""

    def operand(self, node_id: int, index: int, x: Any) -> Any:
        """Operand `index` of node `node_id` as the node should read it."""


class NoHooks:
    def value(self, vid: int, x: Any) -> Any:
        return x

    def operand(self, node_id: int, index: int, x: Any) -> Any:
        return x


def read(graph: Graph, env: dict, v: int):
    """Value `v` from `env`, or its constant for a literal."""
    val = graph.values[v]
    return val.const if val.is_literal else env[v]


NO_HOOKS = NoHooks()


def evaluate(graph: Graph, node_ids: Sequence[int], env: dict, hooks: Hooks = NO_HOOKS,
             level: int | None = None, identity: Callable[[Node], bool] | None = None) -> dict:
    """Run the nodes `node_ids` (program order) of loop level `level` (None: the top), reading
    and writing `env` (value id -> array or tracer). A node of a nested loop runs that loop
    whole, once, where its first node appears. Nodes `identity` picks pass their inputs on,
    in loop bodies too (the pipeline splitter's stage marks; the model's own sharding
    constraints, which the emitter replaces by the plan's)."""
    done: set[int] = set()
    for nid in node_ids:
        node = graph.nodes[nid]
        if node.loop != level:
            lid = node.loop
            while lid is not None and graph.loops[lid].parent != level:
                lid = graph.loops[lid].parent
            if lid is not None and lid not in done:
                done.add(lid)
                _run_loop(graph, graph.loops[lid], env, hooks, identity)
            continue
        if node.eqn is None:  # a pseudo-node of this level's own loop: structure only
            continue
        ins = [hooks.operand(nid, i, read(graph, env, v)) for i, v in enumerate(node.inputs)]
        outs = ins if identity is not None and identity(node) else _compat.bind_eqn(node.eqn, ins)
        for v, out in zip(node.outputs, outs):
            env[v] = hooks.value(v, out)
    return env


def run(graph: Graph, flat_args: Sequence, hooks: Hooks = NO_HOOKS,
        identity: Callable[[Node], bool] | None = None) -> list:
    """The graph's flat outputs from its flat inputs (nodes `identity` picks pass their inputs
    on: evaluate)."""
    env = dict(zip(graph.inputs, flat_args))
    for v in graph.consts:
        env[v] = graph.values[v].const
    evaluate(graph, range(len(graph.nodes)), env, hooks, identity=identity)
    return [read(graph, env, v) for v in graph.outputs]


def _body_fn(graph: Graph, loop: Loop, b: int, env: dict, hooks: Hooks, bound: Sequence[int],
             outs_to: Sequence[int], identity: Callable[[Node], bool] | None = None):
    """A function of the values bound to `bound` (body invars) returning the body's outvars,
    each passed through hooks.value of the matching `outs_to` value (its layout outside)."""
    body = loop.bodies[b]

    def fn(*vals):
        inner = dict(env)  # outer values (loop constants) are read by closure
        for v, x in zip(bound, vals):
            inner[v] = hooks.value(v, x)
        evaluate(graph, body.nodes, inner, hooks, loop.id, identity)
        outs = [read(graph, inner, v) for v in body.outvars]
        return [hooks.value(t, x) if t is not None else x
                for t, x in zip(outs_to, outs)]

    return fn


def _run_loop(graph: Graph, loop: Loop, env: dict, hooks: Hooks,
              identity: Callable[[Node], bool] | None = None) -> None:
    ops = [read(graph, env, v) for v in loop.operands]
    params = loop.eqn.params
    carries = loop.carry_values(graph)
    nc = loop.num_carry
    if loop.kind == "cond":
        branches = [_body_fn(graph, loop, b, env, hooks, (), loop.results, identity)
                    for b in range(len(loop.bodies))]
        outs = jax.lax.switch(ops[0], [lambda f=f: f() for f in branches])
    else:
        init_at = len(ops) - len(loop.enter)  # the operands end with the carries, then xs
        init = [hooks.value(c, hooks.operand(n, 0, x))
                for c, n, x in zip(carries, loop.enter, ops[init_at:init_at + nc])]
        if loop.kind == "scan":
            xs = [hooks.operand(n, 0, x) for n, x in zip(loop.enter[nc:], ops[init_at + nc:])]
            slices = [graph.nodes[n].outputs[0] for n in loop.enter[nc:]]
            fn = _body_fn(graph, loop, 0, env, hooks, (*carries, *slices),
                          (*carries, *[None] * (len(loop.results) - nc)), identity)

            def step(carry, x):
                outs = fn(*carry, *(x or ()))
                ys = [hooks.operand(n, 0, y) for n, y in zip(loop.leave[nc:], outs[nc:])]
                return outs[:nc], ys

            final, ys = jax.lax.scan(step, init, xs or None, length=params["length"],
                                     reverse=params["reverse"], unroll=params["unroll"])
            outs = [*final, *ys]
        else:
            cond = _body_fn(graph, loop, 0, env, hooks, carries, (None,), identity)
            fn = _body_fn(graph, loop, 1, env, hooks, carries, carries, identity)
            outs = jax.lax.while_loop(lambda c: cond(*c)[0], lambda c: fn(*c), init)
    for k, (r, x) in enumerate(zip(loop.results, outs)):
        if k < nc:
            x = hooks.operand(loop.leave[k], 0, x)
        env[r] = hooks.value(r, x)


def eval_jaxpr(closed, args: Sequence, override: dict[int, Callable] | None = None) -> list:
    """The outputs of a ClosedJaxpr on `args`, its top-level equations bound again; equation i
    in `override` runs `override[i](eqn, inputs) -> outputs` instead (the SPMD pipeline's
    rewrite of a scan over layers)."""
    jaxpr, consts = _compat.open_jaxpr(closed)
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    run_eqns(jaxpr.eqns, env, override)
    return [read_var(env, v) for v in jaxpr.outvars]


def read_var(env: dict, v):
    """A jaxpr variable's value from `env` (a Literal's own value)."""
    return v.val if isinstance(v, _compat.Literal) else env[v]


def run_eqns(eqns: Sequence, env: dict, override: dict[int, Callable] | None = None) -> dict:
    """Bind `eqns` again in order, reading and writing `env` (jaxpr variable -> value);
    `override` as for eval_jaxpr, by position in `eqns`."""
    override = override or {}
    for i, eqn in enumerate(eqns):
        ins = [read_var(env, v) for v in eqn.invars]
        outs = override[i](eqn, ins) if i in override else _compat.bind_eqn(eqn, ins)
        for v, x in zip(eqn.outvars, outs):
            if not _compat.is_drop_var(v):
                env[v] = x
    return env


def _entered(eqn):
    """The body of a call run equation by equation; None for a call bound whole (the table's
    call="whole": its derivative rule is its own)."""
    whole = primitives.info(eqn.primitive.name).call == "whole"
    return None if whole else lift.inlined_body(eqn)


def leaf_eqns(jaxpr) -> list:
    """The equations of an (open) jaxpr (or a list of equations) in program order, entering
    the calls lift inlines (jit, remat, ...; custom_jvp/vjp calls stay one equation): what
    eval_leaves and run_leaves number."""
    out = []
    for eqn in getattr(jaxpr, "eqns", jaxpr):
        inner = _entered(eqn)
        out.extend([eqn] if inner is None else leaf_eqns(inner[0]))
    return out


def leaf_readers(jaxpr) -> list[tuple[int, int, int]]:
    """(leaf equation i, operand j, k): leaf equation i (leaf_eqns' numbering) reads the open
    jaxpr's input k as its operand j, through the calls it enters."""
    out: list[tuple[int, int, int]] = []

    def walk(eqns, where: dict, at: int) -> int:
        for eqn in eqns:
            inner = _entered(eqn)
            if inner is None:
                out.extend((at, j, where[v]) for j, v in enumerate(eqn.invars)
                           if not isinstance(v, _compat.Literal) and v in where)
                at += 1
            else:
                sub = inner[0]
                inner_where = {w: where[v] for w, v in zip(sub.invars, eqn.invars)
                               if not isinstance(v, _compat.Literal) and v in where}
                at = walk(sub.eqns, inner_where, at)
        return at

    walk(jaxpr.eqns, {v: k for k, v in enumerate(jaxpr.invars)}, 0)
    return out


def eval_leaves(closed, args: Sequence, operand: Callable,
                result: Callable | None = None, skip: Callable | None = None) -> list:
    """The outputs of a (Closed)Jaxpr on `args`, the calls lift inlines entered (a remat
    entered under jax.checkpoint with its policy: it still recomputes), and leaf equation i
    (leaf_eqns' numbering) reading `operand(i, j, x)` as its operand j (and giving
    `result(i, k, y)` as its result k; a leaf equation `skip(eqn)` says is an identity, not
    bound: its operands are its results): layouts applied to the values inside a layer."""
    jaxpr, consts = _compat.open_jaxpr(closed)
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    run_leaves(jaxpr.eqns, env, operand, result=result, skip=skip)
    return [read_var(env, v) for v in jaxpr.outvars]


def run_leaves(eqns: Sequence, env: dict, operand: Callable, start: int = 0,
               result: Callable | None = None, skip: Callable | None = None) -> dict:
    """Bind `eqns` again in order as eval_leaves does (calls entered, leaf equation i counted
    from `start` reading `operand(i, j, x)`, giving `result(i, k, y)`, those `skip` says
    identities), reading and writing `env`."""
    at = start
    for eqn in eqns:
        ins = [read_var(env, v) for v in eqn.invars]
        inner = _entered(eqn)
        if inner is None and skip is not None and skip(eqn):
            outs = ins
            at += 1
        elif inner is None:
            outs = _compat.bind_eqn(eqn, [operand(at, j, x) for j, x in enumerate(ins)])
            if result is not None:
                outs = [result(at, k, y) for k, y in enumerate(outs)]
            at += 1
        else:
            sub, sub_consts = inner

            def call(*a, sub=sub, sub_consts=sub_consts, at=at):
                inner_env = dict(zip(sub.constvars, sub_consts))
                inner_env.update(zip(sub.invars, a))
                run_leaves(sub.eqns, inner_env, operand, at, result, skip)
                return [read_var(inner_env, v) for v in sub.outvars]

            if primitives.info(eqn.primitive.name).call == "checkpoint":
                call = jax.checkpoint(call, prevent_cse=eqn.params.get("prevent_cse", True),
                                      policy=eqn.params.get("policy"))
            outs = call(*ins)
            at += len(leaf_eqns(sub))
        for v, x in zip(eqn.outvars, outs):
            if not _compat.is_drop_var(v):
                env[v] = x
    return env
