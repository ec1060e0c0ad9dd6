"""Lift a closed jaxpr into a Graph: one node per equation, call-like sub-jaxprs inlined,
loops (scan, while, cond) inlined once with their nodes run `trips` times (a body planned once
for every iteration), manual regions (shard_map) and per-element combiners kept as single
nodes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardplan import _compat
from shardplan.ir import primitives
from shardplan.ir.graph import Body, Graph, Loop, Node, Role, Value, dtype_itemsize

# Call-like primitives (the primitive table's "call" family), whose body computes exactly the
# equation's outputs from its inputs: inlined. Every other primitive with a sub-jaxpr (scan,
# while, cond, shard_map, and reduce / reduce_window / scatter whose body is a per-element
# combiner) is kept as one node with its sub-graphs attached.
CALLS = frozenset(n for n, i in primitives.PRIMITIVES.items() if i.family == "call")


@dataclasses.dataclass(frozen=True)
class ArgInfo:
    """What each flat input is, and which flat input each flat output carries back."""

    roles: tuple[Role, ...]
    ties: tuple[int | None, ...]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()


# Loops whose bodies are inlined: their pseudo-nodes (entry and exit of a loop) have these
# primitive names and no equation.
LOOPS = frozenset({"scan", "while", "cond"})


@dataclasses.dataclass(frozen=True)
class LiftOptions:
    """loops: inline loop bodies (False keeps each loop one opaque node, as the pipeline
    splitter needs); while_trips: iterations a while loop of unknown trip count is priced at."""

    loops: bool = True
    while_trips: float = 1.0


class _Builder:
    def __init__(self, options: LiftOptions = LiftOptions()):
        self.values: list[Value] = []
        self.nodes: list[Node] = []
        self.consts: list[int] = []
        self.loops: list[Loop | None] = []
        self.options = options
        self.dtypes: dict = {}

    def pseudo(self, primitive: str, inputs, outputs, trips: float, loop: int, prefix: str,
               **params) -> int:
        """A loop's entry or exit: no equation, no work; it gives the planner a spec to choose."""
        ins = tuple(v for v in inputs if not self.values[v].is_literal)
        self.nodes.append(Node(len(self.nodes), primitive, ins, tuple(outputs), params, 0.0,
                               name=prefix, trips=trips, loop=loop))
        return len(self.nodes) - 1

    def new_value(self, aval, *, const=None, is_literal=False) -> int:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        named = self.dtypes.get(dtype)  # str() of a dtype is slow, and there are few dtypes
        if named is None:
            named = self.dtypes[dtype] = (str(dtype), dtype_itemsize(dtype))
        vid = len(self.values)
        self.values.append(Value(vid, shape, *named, const, is_literal))
        return vid


def _sub_jaxprs(params) -> list[tuple[str, object]]:
    """Every (Closed)Jaxpr among an equation's params, in tuples too, in sorted key order."""
    found = []
    for key in sorted(params):
        val = params[key]
        if _compat.is_jaxpr(val):
            found.append((key, val))
        elif isinstance(val, (tuple, list)):
            found.extend((key, v) for v in val if _compat.is_jaxpr(v))
    return found


def _inlinable(eqn, subs) -> bool:
    if eqn.primitive.name not in CALLS:
        return False
    # custom_jvp/vjp calls carry one body; any extra jaxpr-valued params are derivative rules.
    subs = [s for s in subs if s[0] in ("jaxpr", "call_jaxpr", "fun_jaxpr")] or subs
    if len(subs) != 1:
        return False
    jaxpr, _ = _compat.open_jaxpr(subs[0][1])
    return len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars)


def _name_of(eqn, prefix: str) -> str:
    try:
        stack = str(eqn.source_info.name_stack)
    except AttributeError:
        stack = ""
    return "/".join(p for p in (prefix, stack) if p)


def inlined_body(eqn) -> tuple | None:
    """(jaxpr, consts) of the call-like sub-jaxpr lift inlines for `eqn`, or None."""
    subs = _sub_jaxprs(eqn.params)
    if not subs or not _inlinable(eqn, subs):
        return None
    body = [x for x in subs if x[0] in ("jaxpr", "call_jaxpr", "fun_jaxpr")] or subs
    return _compat.open_jaxpr(body[0][1])


def _lift_into(b: _Builder, jaxpr, consts, in_ids: Sequence[int], prefix: str,
               trips: float = 1.0, loop: int | None = None) -> list[int]:
    env: dict = {}

    def read(atom) -> int:
        if isinstance(atom, _compat.Literal):
            return b.new_value(atom.aval, const=atom.val, is_literal=True)
        return env[atom]

    for var, c in zip(jaxpr.constvars, consts):
        vid = b.new_value(var.aval, const=c)
        b.consts.append(vid)
        env[var] = vid
    for var, vid in zip(jaxpr.invars, in_ids):
        env[var] = vid

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        inlined = inlined_body(eqn)
        if inlined is not None:
            sub, sub_consts = inlined
            # a jit JAX inlines itself is part of its caller: its body's nodes are named as
            # the caller's on every JAX version (tests/test_golden_plans.py keys them by name)
            name = "" if _compat.inlined_by_jax(eqn.params) else str(
                eqn.params.get("name", eqn.primitive.name))
            outs = _lift_into(b, sub, sub_consts, ins,
                              "/".join(p for p in (_name_of(eqn, prefix), name) if p),
                              trips, loop)
            for var, vid in zip(eqn.outvars, outs):
                if not _compat.is_drop_var(var):
                    env[var] = vid
            continue
        if b.options.loops and eqn.primitive.name in LOOPS:
            outs = _lift_loop(b, eqn, ins, _name_of(eqn, prefix), trips, loop)
            for var, vid in zip(eqn.outvars, outs):
                if not _compat.is_drop_var(var):
                    env[var] = vid
            continue
        outs = [b.new_value(v.aval) for v in eqn.outvars]
        for var, vid in zip(eqn.outvars, outs):
            if not _compat.is_drop_var(var):
                env[var] = vid
        subgraphs = tuple(_lift_standalone(j) for _, j in _sub_jaxprs(eqn.params))
        in_shapes = [b.values[i].shape for i in ins]
        out_shapes = [b.values[i].shape for i in outs]
        plain = {k: v for k, v in eqn.params.items() if not _compat.is_jaxpr(v)
                 and not (isinstance(v, (tuple, list)) and any(_compat.is_jaxpr(x) for x in v))}
        if subgraphs and primitives.info(eqn.primitive.name).flops is None:
            fl = _control_flow_flops(eqn.primitive.name, eqn.params, subgraphs)
        else:
            fl = primitives.flops(eqn.primitive.name, in_shapes, out_shapes, eqn.params)
        b.nodes.append(Node(len(b.nodes), eqn.primitive.name, tuple(ins), tuple(outs), plain,
                            fl, subgraphs, eqn, _name_of(eqn, prefix), trips, loop))
    return [read(a) for a in jaxpr.outvars]


def _lift_body(b: _Builder, closed, in_ids: Sequence[int], prefix: str, trips: float,
               loop: int) -> Body:
    jaxpr, consts = _compat.open_jaxpr(closed)
    start = len(b.nodes)
    outs = _lift_into(b, jaxpr, consts, in_ids, prefix, trips, loop)
    return Body(tuple(in_ids), tuple(outs), tuple(range(start, len(b.nodes))))


def _lift_loop(b: _Builder, eqn, ins: list[int], prefix: str, trips: float,
               parent: int | None) -> list[int]:
    """Inline a scan, while or cond: entry pseudo-nodes give each carry (and each slice of a
    stacked input) its own value inside the loop, the bodies are lifted once with their trip
    count, and exit pseudo-nodes produce the loop's results."""
    prim, params = eqn.primitive.name, eqn.params
    lid = len(b.loops)
    b.loops.append(None)  # reserved: nested loops take the ids after this one
    results = [b.new_value(v.aval) for v in eqn.outvars]
    enter, leave = [], []
    if prim == "cond":
        ops = ins[1:]
        bodies = tuple(_lift_body(b, br, ops, prefix, trips, lid) for br in params["branches"])
        for k, r in enumerate(results):
            outs = [body.outvars[k] for body in bodies]
            leave.append(b.pseudo("cond_merge", outs, (r,), trips, lid, prefix))
        num_carry, inner = 0, trips
    else:
        if prim == "scan":
            nc, num_carry = _compat.scan_counts(params)
            inner = trips * float(params["length"])
            init, xs = ins[nc:nc + num_carry], ins[nc + num_carry:]
            closed = params["jaxpr"]
            consts = ins[:nc]
        else:
            cnc, bnc = params["cond_nconsts"], params["body_nconsts"]
            inner = trips * float(b.options.while_trips)
            num_carry = len(ins) - cnc - bnc
            init, xs = ins[cnc + bnc:], []
            closed = params["body_jaxpr"]
            consts = ins[cnc:cnc + bnc]
        body_avals = _compat.open_jaxpr(closed)[0].invars
        carries = []
        for k, v in enumerate(init):
            c = b.new_value(body_avals[len(consts) + k].aval)
            enter.append(b.pseudo("loop_carry", (v,), (c,), inner, lid, prefix))
            carries.append(c)
        slices = []
        for k, v in enumerate(xs):
            x = b.new_value(body_avals[len(consts) + num_carry + k].aval)
            enter.append(b.pseudo("loop_slice", (v,), (x,), inner, lid, prefix))
            slices.append(x)
        bodies = ()
        if prim == "while":
            cond_consts = ins[:params["cond_nconsts"]]
            bodies += (_lift_body(b, params["cond_jaxpr"], [*cond_consts, *carries], prefix,
                                  inner, lid),)
        body = _lift_body(b, closed, [*consts, *carries, *slices], prefix, inner, lid)
        bodies += (body,)
        for k, r in enumerate(results[:num_carry]):
            leave.append(b.pseudo("loop_result", (carries[k],), (r,), trips, lid, prefix))
        for k, r in enumerate(results[num_carry:]):
            leave.append(b.pseudo("loop_stack", (body.outvars[num_carry + k],), (r,), inner,
                                  lid, prefix))
    b.loops[lid] = Loop(lid, prim, eqn, parent, inner / trips if trips else inner, tuple(ins),
                        tuple(results), bodies, tuple(enter), tuple(leave), num_carry)
    return results


def _control_flow_flops(prim: str, params, subgraphs: tuple[Graph, ...]) -> float:
    if prim == "scan":
        return float(params.get("length", 1)) * sum(g.flops for g in subgraphs)
    if prim == "cond":
        return max(g.flops for g in subgraphs)
    return sum(g.flops for g in subgraphs)  # while: trip count unknown, counted once


def _lift_standalone(sub) -> Graph:
    jaxpr, consts = _compat.open_jaxpr(sub)
    n_in, n_out = len(jaxpr.invars), len(jaxpr.outvars)
    info = ArgInfo((Role.OTHER,) * n_in, (None,) * n_out)
    return _lift_jaxpr(jaxpr, consts, info)


def _lift_jaxpr(jaxpr, consts, info: ArgInfo, options: LiftOptions = LiftOptions()) -> Graph:
    b = _Builder(options)
    in_ids = [b.new_value(v.aval) for v in jaxpr.invars]
    outs = _lift_into(b, jaxpr, consts, in_ids, "")
    return Graph(tuple(b.values), tuple(b.nodes), tuple(in_ids), tuple(outs),
                 tuple(info.roles), tuple(info.ties), tuple(info.input_names),
                 tuple(info.output_names), tuple(b.consts), tuple(b.loops))


def lift(closed_jaxpr, arg_info: ArgInfo | None = None,
         options: LiftOptions = LiftOptions()) -> Graph:
    """The Graph of a ClosedJaxpr; `arg_info` gives roles and state ties (default: all OTHER)."""
    jaxpr, consts = _compat.open_jaxpr(closed_jaxpr)
    if arg_info is None:
        arg_info = ArgInfo((Role.OTHER,) * len(jaxpr.invars), (None,) * len(jaxpr.outvars))
    if len(arg_info.roles) != len(jaxpr.invars) or len(arg_info.ties) != len(jaxpr.outvars):
        raise ValueError(
            f"arg_info describes {len(arg_info.roles)} inputs and {len(arg_info.ties)} outputs, "
            f"but the jaxpr has {len(jaxpr.invars)} and {len(jaxpr.outvars)}")
    return _lift_jaxpr(jaxpr, consts, arg_info, options)
