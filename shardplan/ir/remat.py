"""Rematerialize scanned layers: a jaxpr-to-jaxpr rewrite of a differentiated scan.

Reverse-mode AD of `lax.scan` (flax `nn.scan`, MaxText's and levanter's layer stacks) gives a
forward scan F that stacks its residuals as ys, and the transposed scan B (the other direction,
same length) that reads them back as xs, one row per iteration. The rewrite makes F stack only
its carry at the start of each iteration (the layer's input) and gives B, before its own body,
a copy of F's body run on (that carry row, F's xs row, F's consts): B recomputes each layer's
residuals from the layer's input, as `jax.checkpoint` around the layer would, and the stacked
residuals are no longer kept between the passes. Row i of a stacked value is iteration i's in
either direction, so the recomputed residuals are the ones B read.

A pair is rewritten only when it is recognised (F's ys read directly as B's xs, equal lengths,
opposite directions, F's body without effects) and when the bytes F stops stacking exceed the
bytes of the carry rows it stacks instead; everything else is left as it was. The jaxpr's
inputs and outputs do not change, so a plan of the rewritten step runs on the user's arguments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jax.extend import core as jcore

from shardplan import _compat


@dataclasses.dataclass(frozen=True)
class Remat:
    """What `rematerialize` did: the rewritten jaxpr, how many scan pairs it rewrote, the
    bytes (whole arrays) of the forward scans' stacked outputs it dropped, and of the stacked
    carries (layer inputs) the transposed scans read instead."""

    closed_jaxpr: object
    pairs: int
    saved_bytes: int
    carry_bytes: int


def rematerialize(closed) -> Remat:
    """The ClosedJaxpr `closed` with every recognised forward / transposed scan pair rewritten
    (inside calls and loop bodies too); `closed` itself when none is."""
    stats = [0, 0, 0]
    try:
        jaxpr = _rewrite(closed.jaxpr, stats)
        if not stats[0]:
            return Remat(closed, 0, 0, 0)
        new = jcore.ClosedJaxpr(jaxpr, closed.consts)
        jcore.check_jaxpr(new.jaxpr)
    except Exception as e:  # noqa: BLE001 - a rewrite that does not type-check is not used
        _compat.warn_at_caller(f"shardplan: the scanned layers are planned as written: "
                               f"rematerializing them failed ({type(e).__name__}: "
                               f"{str(e)[:200]})")
        return Remat(closed, 0, 0, 0)
    return Remat(new, stats[0], stats[1], stats[2])


def nbytes(aval) -> int:
    return math.prod(aval.shape) * aval.dtype.itemsize


# -- the walk ----------------------------------------------------------------------------------


def _rewrite(jaxpr, stats: list) -> jcore.Jaxpr:
    """`jaxpr` (open) with its sub-jaxprs rewritten, then its own scan pairs."""
    eqns = [_rewrite_params(e, stats) for e in jaxpr.eqns]
    changed = any(a is not b for a, b in zip(eqns, jaxpr.eqns))
    while True:
        pair = _find_pair(eqns, jaxpr.outvars)
        if pair is None:
            break
        eqns = _apply(eqns, jaxpr.outvars, *pair, stats)
        changed = True
    if not changed:
        return jaxpr
    return jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects,
                       jaxpr.debug_info)


def _rewrite_params(eqn, stats: list):
    """`eqn` with each ClosedJaxpr in its params rewritten (same inputs and outputs)."""
    params, changed = {}, False
    for key, val in eqn.params.items():
        if isinstance(val, jcore.ClosedJaxpr):
            new = _rewrite(val.jaxpr, stats)
            if new is not val.jaxpr:
                val, changed = jcore.ClosedJaxpr(new, val.consts), True
        elif isinstance(val, tuple) and any(isinstance(v, jcore.ClosedJaxpr) for v in val):
            vals = []
            for v in val:
                new = _rewrite(v.jaxpr, stats) if isinstance(v, jcore.ClosedJaxpr) else None
                if new is not None and new is not v.jaxpr:
                    v, changed = jcore.ClosedJaxpr(new, v.consts), True
                vals.append(v)
            val = tuple(vals)
        params[key] = val
    return eqn.replace(params=params) if changed else eqn


def _users(eqns: Sequence, outvars: Sequence) -> dict:
    """var -> [(eqn index, operand index)], the jaxpr's outputs as eqn index None."""
    users: dict = {}
    for i, e in enumerate(eqns):
        for k, v in enumerate(e.invars):
            if not isinstance(v, _compat.Literal):
                users.setdefault(v, []).append((i, k))
    for k, v in enumerate(outvars):
        if not isinstance(v, _compat.Literal):
            users.setdefault(v, []).append((None, k))
    return users


def _is_scan(eqn) -> bool:
    return eqn.primitive.name == "scan" and isinstance(eqn.params.get("jaxpr"), jcore.ClosedJaxpr)


def _find_pair(eqns: Sequence, outvars: Sequence):
    """(F index, B index, {B operand index: F ys index}) of the first pair worth rewriting."""
    made = {}
    for i, e in enumerate(eqns):
        for k, v in enumerate(e.outvars):
            made[v] = (i, k)
    users = _users(eqns, outvars)
    for j, b in enumerate(eqns):
        if not _is_scan(b):
            continue
        xs_at = sum(_compat.scan_counts(b.params))
        by_f: dict[int, dict[int, int]] = {}
        for p in range(xs_at, len(b.invars)):
            src = made.get(b.invars[p]) if not isinstance(b.invars[p], _compat.Literal) else None
            if src is None or not _is_scan(eqns[src[0]]):
                continue
            f = eqns[src[0]]
            f_carry = _compat.scan_counts(f.params)[1]
            if src[1] >= f_carry:
                by_f.setdefault(src[0], {})[p] = src[1] - f_carry
        for i, residuals in sorted(by_f.items()):
            if _recognised(eqns[i], b) and _gain(eqns[i], b, j, residuals, users) > 0:
                return i, j, residuals
    return None


def _recognised(f, b) -> bool:
    fp, bp = f.params, b.params
    body = fp["jaxpr"].jaxpr
    return (fp["length"] == bp["length"] and bool(fp["reverse"]) != bool(bp["reverse"])
            and not body.effects and not any(e.effects for e in body.eqns))


def _live(jaxpr, outs) -> set:
    """The variables of `jaxpr` that the atoms `outs` are computed from (themselves too)."""
    live = {v for v in outs if not isinstance(v, _compat.Literal)}
    for e in reversed(jaxpr.eqns):
        if any(v in live for v in e.outvars):
            live.update(v for v in e.invars if not isinstance(v, _compat.Literal))
    return live


def _carry_rows(f, residuals: dict[int, int]) -> dict[int, int | None]:
    """For each carry of F the recomputation of `residuals` reads: the ys index F already
    stacks it at (its body emits the carry input as a y), or None."""
    body, (nc, ncar) = f.params["jaxpr"].jaxpr, _compat.scan_counts(f.params)
    ys = body.outvars[ncar:]
    live = _live(body, [ys[y] for y in residuals.values()])
    return {k: next((y for y, v in enumerate(ys) if v is c), None)
            for k, c in enumerate(body.invars[nc:nc + ncar]) if c in live}


def _gain(f, b, j: int, residuals: dict[int, int], users: dict) -> int:
    """Bytes F stops stacking minus the bytes of the carry rows it stacks anew."""
    (nc, ncar), length = _compat.scan_counts(f.params), f.params["length"]
    rows = _carry_rows(f, residuals)
    kept_rows = {y for y in rows.values() if y is not None}
    freed = 0
    for y in set(residuals.values()) - kept_rows:
        out = f.outvars[ncar + y]
        if all(u[0] == j and u[1] in residuals for u in users.get(out, [])):
            freed += nbytes(out.aval)
    body = f.params["jaxpr"].jaxpr
    added = sum(length * nbytes(body.invars[nc + k].aval) for k, y in rows.items() if y is None)
    return freed - added


# -- the rewrite -------------------------------------------------------------------------------


def _apply(eqns: list, outvars: Sequence, i: int, j: int, residuals: dict[int, int],
           stats: list) -> list:
    f, b = eqns[i], eqns[j]
    f_body, f_consts = f.params["jaxpr"].jaxpr, f.params["jaxpr"].consts
    (nc, ncar), length = _compat.scan_counts(f.params), f.params["length"]

    # F stacks the carry inputs the recomputation reads (where it does not already)
    rows = _carry_rows(f, residuals)
    f_outs, f_body_outs = list(f.outvars), list(f_body.outvars)
    carry_stacks = {}
    for k, y in rows.items():
        if y is None:
            c = f_body.invars[nc + k]
            f_body_outs.append(c)
            f_outs.append(jcore.Var(jcore.unmapped_aval(length, 0, c.aval)))
            carry_stacks[k] = f_outs[-1]
        else:
            carry_stacks[k] = f.outvars[ncar + y]

    # B: F's consts as more consts, the carry rows and F's xs as more xs
    b_body, b_consts = b.params["jaxpr"].jaxpr, b.params["jaxpr"].consts
    bnc, bcar = _compat.scan_counts(b.params)
    b_ins, b_vars = list(b.invars), list(b_body.invars)
    consts_in, consts_var = b_ins[:bnc], b_vars[:bnc]
    carry_in, carry_var = b_ins[bnc:bnc + bcar], b_vars[bnc:bnc + bcar]
    xs_in, xs_var = [], []
    subst = {}
    for p in range(bnc + bcar, len(b_ins)):
        if p not in residuals:
            xs_in.append(b_ins[p])
            xs_var.append(b_vars[p])

    def operand(outer, body_var, ins: list, vars_: list):
        """B's body variable reading `outer` (one it reads already, or a new operand)."""
        for o, v in zip(ins, vars_):
            if o is outer:
                return v
        ins.append(outer)
        vars_.append(jcore.Var(body_var.aval))
        return vars_[-1]

    rename: dict = {}
    for k, outer in enumerate(f.invars[:nc]):
        rename[f_body.invars[k]] = (outer if isinstance(outer, _compat.Literal)
                                    else operand(outer, f_body.invars[k], consts_in, consts_var))
    for k, stack in carry_stacks.items():
        rename[f_body.invars[nc + k]] = operand(stack, f_body.invars[nc + k], xs_in, xs_var)
    for k, outer in enumerate(f.invars[nc + ncar:]):
        rename[f_body.invars[nc + ncar + k]] = operand(outer, f_body.invars[nc + ncar + k],
                                                       xs_in, xs_var)
    const_vars = [jcore.Var(v.aval) for v in f_body.constvars]
    rename.update(zip(f_body.constvars, const_vars))
    live = _live(f_body, [f_body.outvars[ncar + y] for y in residuals.values()])
    recompute = [_copy_eqn(e, rename) for e in f_body.eqns if any(v in live for v in e.outvars)]
    for p, y in residuals.items():
        subst[b_vars[p]] = _read(rename, f_body.outvars[ncar + y])
    body_eqns = recompute + [e.replace(invars=[_read(subst, v) for v in e.invars])
                             for e in b_body.eqns]
    body_outs = [_read(subst, v) for v in b_body.outvars]
    b_ins_new = [*consts_var, *carry_var, *xs_var]
    new_body = _dce(jcore.Jaxpr(
        [*b_body.constvars, *const_vars], b_ins_new, body_outs, body_eqns, _effects(body_eqns),
        _debug_info(b_body, len(b_ins_new), len(body_outs))))
    new_b = b.replace(invars=[*consts_in, *carry_in, *xs_in], params=_compat.scan_params(
        b.params, jcore.ClosedJaxpr(new_body, [*b_consts, *f_consts]), len(consts_in)))

    # F stacks only the ys something still reads
    eqns = [*eqns[:j], new_b, *eqns[j + 1:]]
    users = _users(eqns, outvars)
    keep = [k for k in range(ncar, len(f_outs)) if f_outs[k] in users]
    f_body_new = _dce(jcore.Jaxpr(
        f_body.constvars, f_body.invars, [*f_body_outs[:ncar], *(f_body_outs[k] for k in keep)],
        f_body.eqns, f_body.effects, _debug_info(f_body, len(f_body.invars), ncar + len(keep))))
    stats[1] += sum(nbytes(v.aval) for k, v in enumerate(f_outs) if k >= ncar and k not in keep)
    stats[2] += sum(nbytes(v.aval) for v in carry_stacks.values())
    new_f = f.replace(
        outvars=[*f_outs[:ncar], *(f_outs[k] for k in keep)],
        params=_compat.scan_params(f.params, jcore.ClosedJaxpr(f_body_new, f_consts), nc))
    stats[0] += 1
    return [*eqns[:i], new_f, *eqns[i + 1:]]


def _read(env: dict, atom):
    return atom if isinstance(atom, _compat.Literal) else env.get(atom, atom)


def _copy_eqn(eqn, rename: dict):
    """`eqn` reading renamed variables and writing fresh ones (added to `rename`)."""
    outs = []
    for v in eqn.outvars:
        new = jcore.DropVar(v.aval) if _compat.is_drop_var(v) else jcore.Var(v.aval)
        rename[v] = new
        outs.append(new)
    return eqn.replace(invars=[_read(rename, v) for v in eqn.invars], outvars=outs)


def _effects(eqns: Sequence):
    out = set()
    for e in eqns:
        out |= set(e.effects)
    return frozenset(out)


def _dce(jaxpr) -> jcore.Jaxpr:
    """`jaxpr` without the equations none of its outputs need (effects are kept)."""
    live = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    kept = []
    for e in reversed(jaxpr.eqns):
        if e.effects or any(v in live for v in e.outvars):
            kept.append(e)
            live.update(v for v in e.invars if not isinstance(v, _compat.Literal))
    kept.reverse()
    if len(kept) == len(jaxpr.eqns):
        return jaxpr
    return jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, kept, _effects(kept),
                       jaxpr.debug_info)


def _debug_info(jaxpr, num_in: int, num_out: int):
    """`jaxpr`'s debug info for a jaxpr of `num_in` inputs and `num_out` outputs (the names
    and result paths of the rewritten body are unknown)."""
    info = jaxpr.debug_info
    return info._replace(arg_names=None if info.arg_names is None else ("",) * num_in,
                         result_paths=None)


