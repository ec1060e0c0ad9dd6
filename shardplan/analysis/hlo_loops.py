"""How many times a while loop of the partitioned HLO runs.

XLA:CPU writes the trip count it knows into the loop's backend_config
(`"known_trip_count":{"n":"6"}`); the TPU compiler replaces the backend_config of a while
and writes none. There the count is read from the loop itself, in the form every scan and
fori_loop lowers to: an induction variable in tuple element k, set to a constant before
the loop, stepped by a constant in the body, compared with a constant in the condition
(tests/test_analysis_tpu.py::test_scan_collective_counted_per_trip).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from shardplan.analysis import hlo_parse

_KNOWN = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
# Instructions that pass a scalar through unchanged.
_PASS = frozenset({"copy", "bitcast", "convert", "reshape"})
_FLIP = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "EQ": "EQ", "NE": "NE"}


def known_trip_count(instr: hlo_parse.Instr) -> int | None:
    """The trip count written in the loop's backend_config (JSON, maybe escaped)."""
    m = _KNOWN.search(instr.attrs.get("backend_config", "").replace("\\", ""))
    return int(m.group(1)) if m else None


def trip_count(module: hlo_parse.Module, instr: hlo_parse.Instr,
               caller: Sequence[hlo_parse.Instr]) -> int | None:
    """The trip count of while loop `instr` (an instruction of the computation `caller`): the
    one in its backend_config, else the one its induction variable gives; None if unknown."""
    known = known_trip_count(instr)
    if known is not None:
        return known
    try:
        return _induction_trips(module, instr, {i.name: i for i in caller})
    except (KeyError, IndexError, ValueError):
        return None


def _name(operand: str) -> str:
    return operand.split()[-1].lstrip("%")


def _operands(instr: hlo_parse.Instr) -> list[str]:
    return [_name(o) for o in hlo_parse.split_top(instr.operands)]


def _through(by_name: dict[str, hlo_parse.Instr], name: str) -> hlo_parse.Instr:
    """The instruction that makes `name`'s value, past copies and bitcasts."""
    instr = by_name[name]
    while instr.opcode in _PASS:
        instr = by_name[_operands(instr)[0]]
    return instr


def _constant(instr: hlo_parse.Instr) -> int:
    if instr.opcode != "constant" or hlo_parse.arrays(instr.shape)[0][0]:
        raise ValueError("not a scalar constant")
    return int(instr.operands.strip())


def _element(instr: hlo_parse.Instr) -> int:
    """k for a get-tuple-element of the loop's parameter."""
    if instr.opcode != "get-tuple-element":
        raise ValueError("not a tuple element")
    return int(instr.attrs["index"])


def _induction_trips(module: hlo_parse.Module, loop: hlo_parse.Instr,
                     caller: dict[str, hlo_parse.Instr]) -> int | None:
    cond_name = loop.attrs["condition"].lstrip("%")
    body_name = loop.attrs["body"].lstrip("%")
    cond = {i.name: i for i in module.computations[cond_name]}
    root = module.computations[cond_name][-1]
    if root.opcode != "compare":
        return None
    a, b = (_through(cond, x) for x in _operands(root))
    direction = root.attrs.get("direction", "")
    if a.opcode == "constant":
        a, b, direction = b, a, _FLIP.get(direction, "")
    k, limit = _element(a), _constant(b)
    init_tuple = _through(caller, _operands(loop)[0])
    if init_tuple.opcode != "tuple":
        return None
    start = _constant(_through(caller, _operands(init_tuple)[k]))
    body = {i.name: i for i in module.computations[body_name]}
    out = module.computations[body_name][-1]
    if out.opcode != "tuple":
        return None
    update = _through(body, _operands(out)[k])
    if update.opcode not in ("add", "subtract"):
        return None
    x, y = (_through(body, o) for o in _operands(update))
    if x.opcode == "constant" and update.opcode == "add":
        x, y = y, x
    if _element(x) != k:
        return None
    step = _constant(y) * (1 if update.opcode == "add" else -1)
    return _count(start, limit, step, direction)


def _count(start: int, limit: int, step: int, direction: str) -> int | None:
    """Iterations of `for (i = start; i <direction> limit; i += step)`."""
    if step > 0 and direction in ("LT", "LE", "NE"):
        end = limit + (1 if direction == "LE" else 0)
    elif step < 0 and direction in ("GT", "GE", "NE"):
        end = limit - (1 if direction == "GE" else 0)
    else:
        return None
    if direction == "NE" and (limit - start) % step:
        return None
    return max(0, math.ceil((end - start) / step))
