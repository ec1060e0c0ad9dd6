"""How a collective's result is read in the partitioned HLO: the bytes of an all-reduce whose
every reader keeps only its device's slice (a reduce-scatter on GPU and TPU), and the f32
bytes that are bf16 in the program (XLA:CPU widens 16-bit floats). See CollectiveOp in
shardplan.analysis.hlo_collectives."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

from shardplan.analysis import hlo_parse


class Users:
    """Who reads what inside one computation: name -> the instructions that take it as an
    operand; a tuple's elements are read through get-tuple-element (index -> users)."""

    def __init__(self, instrs: Sequence[hlo_parse.Instr]):
        self._by_name = {i.name: i for i in instrs}
        self._users: dict[str, list[hlo_parse.Instr]] | None = None
        self._instrs = instrs

    def _build(self) -> dict[str, list[hlo_parse.Instr]]:
        if self._users is None:
            self._users = {}
            for i in self._instrs:
                for op in hlo_parse.split_top(i.operands):
                    self._users.setdefault(op.split()[-1].lstrip("%"), []).append(i)
        return self._users

    def of(self, name: str) -> UseSite:
        return UseSite(self, name)

    def direct(self, name: str) -> list[hlo_parse.Instr]:
        return self._build().get(name, [])

    def opcode(self, name: str) -> str:
        i = self._by_name.get(name)
        return i.opcode if i else ""

    def get(self, name: str) -> hlo_parse.Instr | None:
        return self._by_name.get(name)

    def shapes(self) -> dict[str, str]:
        return {name: i.shape for name, i in self._by_name.items()}


@dataclasses.dataclass(frozen=True)
class UseSite:
    users: Users
    name: str


_DEVICE_INDEX = ("partition-id", "replica-id")


def _reads_a_slice(user: hlo_parse.Instr, operand: str, elements: int, n: int, users: Users,
                   module: hlo_parse.Module) -> bool:
    """Whether `user` keeps only a device-indexed 1/n slice of its `operand` of `elements`: a
    dynamic-slice; a fusion taking the device index whose results are 1/n of it; or a fusion
    that reads it only through dynamic-slices of 1/n of it (XLA:CPU hoists the device's offset
    out of a loop and fuses the slice with what it feeds, e.g. the dynamic-update-slice that
    stacks a scan's per-layer gradients)."""
    if user.opcode == "dynamic-slice":
        return _small(user.shape, elements, n)
    if user.opcode != "fusion":
        return False
    names = [op.split()[-1].lstrip("%") for op in hlo_parse.split_top(user.operands)]
    if any(users.opcode(x) in _DEVICE_INDEX for x in names) and _small(user.shape, elements, n):
        return True
    called = re.findall(r"%?([^\s{},%]+)", user.attrs.get("calls", ""))
    body = module.computations.get(called[0]) if called else None
    if body is None or operand not in names:
        return False
    bound = {str(k) for k, x in enumerate(names) if x == operand}
    params = {i.name for i in body if i.opcode == "parameter" and i.operands.strip() in bound}
    readers = [i for i in body if any(op.split()[-1].lstrip("%") in params
                                      for op in hlo_parse.split_top(i.operands))]
    return bool(readers) and all(i.opcode == "dynamic-slice" and _small(i.shape, elements, n)
                                 and hlo_parse.split_top(i.operands)[0].split()[-1].lstrip("%")
                                 in params for i in readers)


def _small(shape: str, elements: int, n: int) -> bool:
    """Whether every array of `shape` is at most 1/n of `elements`."""
    out = hlo_parse.arrays(shape)
    return bool(out) and all(math.prod(d) * n <= elements for d, _ in out)


def _is_conversion(instr: hlo_parse.Instr, module: hlo_parse.Module) -> bool:
    """A change of dtype only: a convert, or a one-operand fusion whose root is a convert."""
    if instr.opcode == "convert":
        return True
    if instr.opcode != "fusion" or len(hlo_parse.split_top(instr.operands)) != 1:
        return False
    root = _root(module, instr)
    return root is not None and root.opcode == "convert"


def _element_readers(users: Users, name: str, k: int, is_tuple: bool) -> list[tuple[hlo_parse.Instr, str]]:
    """(reader, the value it reads) for element k of `name`'s result (through
    get-tuple-element when it is a tuple; a tuple read whole is returned as its reader)."""
    direct = users.direct(name)
    if not is_tuple:
        return [(u, name) for u in direct]
    out = []
    for u in direct:
        if u.opcode != "get-tuple-element":
            return [(u, name)]
        if u.attrs.get("index") == str(k):
            out += [(r, u.name) for r in users.direct(u.name)]
    return out


def _final_readers(pairs: list[tuple[hlo_parse.Instr, str]], users: Users,
                   module: hlo_parse.Module) -> list[tuple[hlo_parse.Instr, str]]:
    """(reader, the value it reads), with dtype conversions replaced by their own readers, and a further
    all-reduce over other devices (XLA:CPU reduces a sum over two mesh axes in two steps) by
    the readers of its result (a few steps at most)."""
    for _ in range(3):
        expanded = []
        for r, src in pairs:
            if _is_conversion(r, module):
                expanded += [(x, r.name) for x in users.direct(r.name)]
                continue
            if r.opcode == "all-reduce":
                names = [op.split()[-1].lstrip("%") for op in hlo_parse.split_top(r.operands)]
                if src in names:
                    expanded += _element_readers(users, r.name, names.index(src),
                                                 r.shape.lstrip().startswith("("))
                    continue
            expanded.append((r, src))
        pairs = expanded
    return pairs


def sliced_bytes(result: str, site: UseSite, n: int, module: hlo_parse.Module) -> int:
    """Bytes of an all-reduce's results whose every use reads only a 1/n device slice
    (after converting its dtype, as XLA:CPU does with 16-bit results, or reducing it further
    over other devices)."""
    if n <= 1:
        return 0
    total = 0
    is_tuple = result.lstrip().startswith("(")
    for k, (dims, ty) in enumerate(hlo_parse.arrays(result)):
        elements = math.prod(dims)
        pairs = _element_readers(site.users, site.name, k, is_tuple)
        readers = _final_readers(pairs, site.users, module)
        if readers and all(_reads_a_slice(u, src, elements, n, site.users, module)
                           for u, src in readers):
            total += hlo_parse.nbytes([(dims, ty)])
    return total


_NARROW = ("bf16", "f16")


def _root(module: hlo_parse.Module, instr: hlo_parse.Instr) -> hlo_parse.Instr | None:
    """The root of the computation a fusion calls (its last instruction)."""
    called = re.findall(r"%?([^\s{},%]+)", instr.attrs.get("calls", ""))
    body = module.computations.get(called[0]) if called else None
    return body[-1] if body else None


def narrow_type(shape: str) -> bool:
    """Whether every array of `shape` is a 16-bit float."""
    arrays = hlo_parse.arrays(shape)
    return bool(arrays) and all(t in _NARROW for _, t in arrays)


RELAYOUTS = frozenset({"bitcast", "reshape", "copy", "transpose"})


def from_narrow(module: hlo_parse.Module, producer: hlo_parse.Instr | None,
                shapes: Mapping[str, str]) -> bool:
    """Whether `producer` (a convert, or a fusion whose root is one, maybe bitcast, copied or
    transposed after it) widens 16-bit floats."""
    if producer is not None and producer.opcode == "fusion":
        body = _root(module, producer)
        if body is None:
            return False
        called = re.findall(r"%?([^\s{},%]+)", producer.attrs.get("calls", ""))[0]
        instrs = {i.name: i for i in module.computations[called]}
        shapes = {name: i.shape for name, i in instrs.items()}
        while body is not None and body.opcode in RELAYOUTS:
            body = instrs.get(hlo_parse.split_top(body.operands)[0].split()[-1].lstrip("%"))
        producer = body
    if producer is None or producer.opcode != "convert":
        return False
    source = hlo_parse.split_top(producer.operands)[0]
    source_shape = source if hlo_parse.ARRAY.search(source) else shapes.get(source.split()[-1].lstrip("%"), "")
    return narrow_type(source_shape)


def to_narrow(module: hlo_parse.Module, user: hlo_parse.Instr, operand: str) -> bool:
    """Whether `user` converts its `operand` to 16-bit floats before anything else reads it."""
    if user.opcode == "convert":
        return narrow_type(user.shape)
    if user.opcode != "fusion":
        return False
    names = [op.split()[-1].lstrip("%") for op in hlo_parse.split_top(user.operands)]
    called = re.findall(r"%?([^\s{},%]+)", user.attrs.get("calls", ""))
    body = module.computations.get(called[0]) if called else None
    if body is None or operand not in names:
        return False
    params = {i.name for i in body if i.opcode == "parameter"
              and i.operands.strip() in {str(k) for k, x in enumerate(names) if x == operand}}
    readers = [i for i in body if any(op.split()[-1].lstrip("%") in params
                                      for op in hlo_parse.split_top(i.operands))]
    return bool(readers) and all(i.opcode == "convert" and narrow_type(i.shape) for i in readers)


def widened_bytes(instr: hlo_parse.Instr, arrays, users: UseSite, module: hlo_parse.Module) -> int:
    """Bytes of an f32 collective whose payload is 16-bit floats widened by XLA:CPU (see
    CollectiveOp.widened_nbytes), per element: its operand comes from a conversion from 16
    bits, or (for an all-reduce, which XLA:CPU runs on the f32 result of a 16-bit dot)
    every use converts the result to 16 bits first."""
    table = users.users
    names = [op.split()[-1].lstrip("%") for op in hlo_parse.split_top(instr.operands)]
    shapes = table.shapes()
    is_tuple = instr.shape.lstrip().startswith("(") or len(arrays) > 1
    reduce = instr.opcode.startswith("all-reduce")
    total = 0
    for k, (dims, ty) in enumerate(arrays):
        if ty != "f32":
            continue
        narrow = len(names) == len(arrays) and from_narrow(module, table.get(names[k]), shapes)
        if not narrow and reduce:
            if is_tuple:  # element k is read through get-tuple-element
                gte = [u for u in table.direct(users.name) if u.attrs.get("index") == str(k)]
                readers = [(r, g.name) for g in gte for r in table.direct(g.name)]
            else:
                readers = [(r, users.name) for r in table.direct(users.name)]
            narrow = bool(readers) and all(to_narrow(module, r, x) for r, x in readers)
        if narrow:
            total += hlo_parse.nbytes([(dims, ty)])
    return total
