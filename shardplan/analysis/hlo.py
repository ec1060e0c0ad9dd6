"""What a compiled program really does per device: its collectives, flops and memory.

The partitioned HLO (`compiled.as_text()`), `compiled.cost_analysis()` and
`compiled.memory_analysis()` are the measurements the cost model is checked against.
Collective bytes follow the ring model: for a group of n devices and a per-device
buffer of B bytes, each device sends

    all-reduce          2 (n - 1) / n * B      (B = operand bytes)
    all-gather          (n - 1) / n * B        (B = gathered result bytes)
    reduce-scatter      (n - 1) / n * B        (B = operand bytes, before the scatter)
    all-to-all          (n - 1) / n * B        (B = operand bytes)
    collective-permute  B                      (B = operand bytes)

Replica groups come in three textual forms (jax 0.10.2, Shardy or GSPMD alike): explicit
lists `{{0,1},{2,3}}` (shard_map collectives), iota lists `[2,4]<=[8]` or
`[4,2]<=[2,4]T(1,0)` (jit, inside while bodies) and mesh axes
`mesh['axis_0'=2,'axis_1'=4][, device_ids=([2,4]T(1,0))] {'axis_1'}`, with sub-axes written
`'axis_0':(pre)size` (jit elsewhere). All are expanded to explicit groups. HLO ids are
positions in the program's device assignment; `analyze` maps them to `jax.Device.id`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shardplan.strategies.spec import MeshShape

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Computations an instruction runs, by attribute name.
_CALL_ATTRS = (
    "calls", "to_apply", "body", "condition",
    "branch_computations", "true_computation", "false_computation",
)


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of the compiled program, seen from one device.

    kind: one of KINDS (an async -start/-done pair is reported once, under the plain kind).
    shapes, dtypes: the result arrays (several when operands share one collective).
    nbytes: the per-device buffer: operand bytes for all-reduce, reduce-scatter, all-to-all
        and collective-permute; result (gathered) bytes for all-gather.
    groups: the device groups, as device ids; for collective-permute, the connected
        components of its source-target pairs.
    group_size: devices per group (the largest group if sizes differ).
    bytes_sent: bytes each device sends per execution under the ring model (module doc).
    in_loop: inside a while body or condition.
    name: the HLO instruction name.
    count: executions per program run: the product of the known trip counts of the
        enclosing while loops (an unknown trip count counts as 1).
    count_known: False when some enclosing loop's trip count is unknown.
    op_name: the jax op this came from (HLO metadata), for reports.
    widened_nbytes: the bytes of f32 values that are bf16 (or f16) in the program: XLA:CPU
        runs 16-bit float arithmetic in f32 and widens what it sends with it (the operand is
        a conversion from 16 bits, or every use converts the result to 16 bits); a GPU or
        TPU sends the 16-bit values.
    sliced_nbytes: for an all-reduce, the operand bytes whose every use reads only a 1/n
        slice indexed by the device (a dynamic-slice, or on CPU a fusion taking the
        partition id): "all-reduce, keep a slice", which GPU and TPU compilers turn into a
        reduce-scatter and XLA:CPU does not (JAX-NOTES). `analysis/price.py` prices those
        bytes as the reduce-scatter a GPU/TPU would run.
    """

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    nbytes: int
    groups: tuple[tuple[int, ...], ...]
    group_size: int
    bytes_sent: float
    in_loop: bool
    name: str
    count: int = 1
    count_known: bool = True
    op_name: str = ""
    sliced_nbytes: int = 0
    widened_nbytes: int = 0

    def formed(self) -> tuple[CollectiveOp, ...]:
        """This collective as a GPU or TPU compiler runs it: bf16 values sent as bf16, and the
        sliced bytes of an all-reduce a reduce-scatter, the rest an all-reduce."""
        if self.widened_nbytes:
            nbytes = self.nbytes - self.widened_nbytes // 2
            return dataclasses.replace(
                self, widened_nbytes=0, nbytes=nbytes,
                sliced_nbytes=self.sliced_nbytes * nbytes // max(self.nbytes, 1),
                dtypes=("bfloat16",) * len(self.dtypes) if nbytes * 2 == self.nbytes
                else self.dtypes,
                bytes_sent=_ring_bytes(self.kind, nbytes, self.group_size,
                                       self.bytes_sent > 0)).formed()
        if self.kind != "all-reduce" or self.sliced_nbytes <= 0:
            return (self,)
        rest = self.nbytes - self.sliced_nbytes
        scatter = dataclasses.replace(
            self, kind="reduce-scatter", nbytes=self.sliced_nbytes, sliced_nbytes=0,
            shapes=(), dtypes=(),
            bytes_sent=_ring_bytes("reduce-scatter", self.sliced_nbytes, self.group_size))
        if rest <= 0:
            return (scatter,)
        kept = dataclasses.replace(self, nbytes=rest, sliced_nbytes=0,
                                   bytes_sent=_ring_bytes("all-reduce", rest, self.group_size))
        return (kept, scatter)


@dataclasses.dataclass(frozen=True)
class ProgramStats:
    """Per-device cost of one compiled program.

    flops, transcendentals, bytes_accessed: from `compiled.cost_analysis()` (per device
    after partitioning). argument/output/temp/alias/generated_code bytes: from
    `compiled.memory_analysis()`. peak_bytes = argument + output + temp - alias: every
    live buffer at once, counting donated (aliased) buffers once; an upper bound.
    xla_peak_bytes: XLA's own heap-simulation peak when the runtime reports it, else 0.
    """

    collectives: tuple[CollectiveOp, ...]
    flops: float
    transcendentals: float
    bytes_accessed: float
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    generated_code_bytes: int = 0
    xla_peak_bytes: int = 0
    num_devices: int = 1

    def formed(self) -> ProgramStats:
        """The program as a GPU or TPU compiler would run its collectives: every
        "all-reduce, keep a slice" a reduce-scatter (CollectiveOp.formed)."""
        ops = tuple(f for c in self.collectives for f in c.formed())
        return dataclasses.replace(self, collectives=ops)

    @property
    def bytes_sent(self) -> float:
        """Bytes each device sends per program run, summed over collectives and executions."""
        return float(sum(c.bytes_sent * c.count for c in self.collectives))

    def by_kind(self) -> dict[str, tuple[int, float]]:
        """kind -> (executions, bytes sent per device), kinds sorted by name."""
        out: dict[str, tuple[int, float]] = {}
        for c in self.collectives:
            n, b = out.get(c.kind, (0, 0.0))
            out[c.kind] = (n + c.count, b + c.bytes_sent * c.count)
        return dict(sorted(out.items()))

    def summary(self) -> str:
        mib = 2**20
        lines = [
            (f"ProgramStats over {self.num_devices} device(s), per device: "
             f"{self.flops / 1e9:.4f} GFLOP, {self.transcendentals:.0f} transcendentals, "
             f"{self.bytes_accessed / mib:.2f} MiB accessed"),
            (f"  memory: peak {self.peak_bytes / mib:.2f} MiB = argument "
             f"{self.argument_bytes / mib:.2f} + output {self.output_bytes / mib:.2f} + temp "
             f"{self.temp_bytes / mib:.2f} - alias {self.alias_bytes / mib:.2f} MiB"),
            f"  collectives: {len(self.collectives)}, {self.bytes_sent / mib:.3f} MiB sent",
        ]
        for kind, (n, b) in self.by_kind().items():
            lines.append(f"    {kind:<20} x{n:<4} {b / mib:10.3f} MiB")
        if any(not c.count_known for c in self.collectives):
            lines.append("  (some collectives sit in loops of unknown trip count: counted once)")
        return "\n".join(lines)


# ----------------------------------------------------------------------------- text parsing


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: dict[str, str]


@dataclasses.dataclass(frozen=True)
class _Module:
    computations: dict[str, list[_Instr]]
    entry: str
    num_partitions: int | None
    replica_count: int | None


_INSTR_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(]+)\s*=\s*")
_COMP_HEAD = re.compile(r"^\s*(ENTRY\s+)?%?([^\s=(]+)\s*\(.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
# A quoted string, one bracket or comma, or a run of anything else (one character per token
# would be slow on large modules; a run never contains a bracket, comma or quote).
_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"|[()\[\]{},]|[^"()\[\]{},]+')


def _close(text: str, start: int) -> int:
    """Index just past the bracket group that opens at text[start] (strings skipped)."""
    depth = 0
    for m in _TOKENS.finditer(text, start):
        depth += (m.group() in "([{") - (m.group() in ")]}")
        if depth == 0:
            return m.end()
    raise ValueError(f"unbalanced brackets in HLO text: {text[start:start + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets and double-quoted strings."""
    parts, depth, start = [], 0, 0
    for m in _TOKENS.finditer(text):
        depth += (m.group() in "([{") - (m.group() in ")]}")
        if depth == 0 and m.group() == ",":
            parts.append(text[start:m.start()].strip())
            start = m.end()
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _parse_attrs(text: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    last = None
    for part in _split_top(text):
        key, eq, value = part.partition("=")
        if not eq:
            continue
        key = key.strip()
        # `replica_groups=mesh[...], device_ids=(...) {axes}` is one value split by a comma.
        if key == "device_ids" and last == "replica_groups":
            attrs[last] += ", " + part
            continue
        attrs[key] = value.strip()
        last = key
    return attrs


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR_HEAD.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":
        j = _close(line, i)
    else:
        j = line.find(" ", i)
        if j < 0:
            return None
    shape = line[i:j]
    m2 = re.compile(r"\s*([\w\-]+)\(").match(line, j)
    if not m2:
        return None
    k = _close(line, m2.end() - 1)
    operands = line[m2.end():k - 1]
    return _Instr(m.group(1), shape, m2.group(1), operands, _parse_attrs(line[k:].lstrip(", ")))


def _header_counts(line: str) -> tuple[int | None, int | None]:
    """(num_partitions, replica_count) from the `HloModule` line; None where it is silent."""
    found = [re.search(rf"{key}=(\d+)", line) for key in ("num_partitions", "replica_count")]
    return tuple(int(m.group(1)) if m else None for m in found)


def _parse_module(text: str) -> _Module:
    comps: dict[str, list[_Instr]] = {}
    entry, current = None, None
    num_partitions = replica_count = None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            num_partitions, replica_count = _header_counts(line)
            continue
        head = _COMP_HEAD.match(line)
        if head and " = " not in line.split("(", 1)[0]:
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        instr = _parse_instr(line)
        if instr is not None:
            comps[current].append(instr)
    if entry is None:
        raise ValueError(
            "no ENTRY computation in the HLO text; pass the text of compiled.as_text() "
            "(or a module with an ENTRY computation)"
        )
    return _Module(comps, entry, num_partitions, replica_count)


def _dtype(ty: str) -> tuple[str, int]:
    """HLO element type -> (numpy-style name, bits): f32 -> float32, f8e4m3fn -> float8_e4m3fn."""
    if ty == "pred":
        return "bool", 8
    m = re.fullmatch(r"(bf|s|u|f|c)(\d+)([a-z0-9]*)", ty)
    if not m:
        raise ValueError(f"unknown HLO element type {ty!r}; teach shardplan.analysis.hlo._dtype")
    base = {"bf": "bfloat", "s": "int", "u": "uint", "f": "float", "c": "complex"}[m.group(1)]
    return base + m.group(2) + (f"_{m.group(3)}" if m.group(3) else ""), int(m.group(2))


def _arrays(shape_text: str) -> list[tuple[tuple[int, ...], str]]:
    """The array leaves of an HLO shape (tuples flattened), as (dims, HLO element type)."""
    out = []
    for m in _ARRAY.finditer(shape_text):
        if m.group(1) not in ("token", "opaque"):
            _dtype(m.group(1))
            out.append((tuple(_ints(m.group(2).replace("<=", ""))), m.group(1)))
    return out


def _nbytes(arrays: Sequence[tuple[tuple[int, ...], str]]) -> int:
    return sum(math.ceil(math.prod(d) * _dtype(t)[1] / 8) for d, t in arrays)


# ------------------------------------------------------------------------- replica groups


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _parse_iota_tile(text: str) -> np.ndarray:
    """`[a,b]` or `[a,b]T(1,0)`: iota over the reshape dims, transposed, flattened."""
    m = re.fullmatch(r"\s*\[([\d,\s]*)\]\s*(?:T\(([\d,\s]*)\))?\s*", text)
    if not m:
        raise ValueError(f"cannot read the iota tile {text!r}")
    dims = _ints(m.group(1))
    arr = np.arange(math.prod(dims), dtype=np.int64).reshape(dims)
    return (arr.transpose(_ints(m.group(2))) if m.group(2) else arr).reshape(-1)


def _device_ids(text: str) -> np.ndarray:
    """A mesh's `device_ids=(...)`: an iota tile `[2,4]T(1,0)` or the ids themselves
    (`0,2,1,3`, possibly after a `[dims]` prefix; this form was not seen from jax 0.10.2)."""
    m = re.fullmatch(r"\s*\[([\d,\s]*)\]\s*(.*)", text, flags=re.DOTALL)
    if m and (not m.group(2) or m.group(2).startswith("T(")):
        return _parse_iota_tile(text)
    return np.array(_ints(m.group(2) if m else text), dtype=np.int64)


def _mesh_groups(text: str) -> list[list[int]]:
    """`mesh['a'=2,'b'=4][, device_ids=(...)] {'b'}` (axes may be sub-axes `'a':(pre)size`)."""
    m = re.match(r"\s*mesh\[([^\]]*)\]", text)
    if not m:
        raise ValueError(f"cannot read the mesh replica groups {text!r}")
    names, sizes = [], []
    for item in _split_top(m.group(1)):
        name, _, size = item.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    rest = text[m.end():]
    devices = np.arange(math.prod(sizes), dtype=np.int64)
    if d := re.match(r"\s*,\s*device_ids=", rest):
        start = d.end()
        end = _close(rest, start)
        inner = rest[start + 1:end - 1].strip()
        devices = _device_ids(inner)
        rest = rest[end:]
    b = rest.find("{")
    if b < 0:
        raise ValueError(f"no axes {{...}} after the mesh in replica groups {text!r}")
    refs = []
    for item in _split_top(rest[b + 1:_close(rest, b) - 1]):
        am = re.fullmatch(r"""['"]?(.+?)['"]?(?::\((\d+)\)(\d+))?""", item.strip())
        if not am or am.group(1) not in names:
            raise ValueError(f"replica groups {text!r} name an axis {item!r} not in the mesh")
        dim = names.index(am.group(1))
        pre, size = (int(am.group(2)), int(am.group(3))) if am.group(2) else (1, sizes[dim])
        refs.append((dim, pre, size))
    # Split every mesh dimension into factors so that each (sub-)axis is one factor.
    factors: list[int] = []
    ref_pos: dict[int, int] = {}
    for dim, full in enumerate(sizes):
        mine = sorted((r for r in range(len(refs)) if refs[r][0] == dim),
                      key=lambda r: refs[r][1])
        prefix = 1
        for r in mine:
            _, pre, size = refs[r]
            if pre != prefix:
                factors.append(pre // prefix)
                prefix = pre
            ref_pos[r] = len(factors)
            factors.append(size)
            prefix *= size
        if prefix != full:
            factors.append(full // prefix)
    grouped = [ref_pos[r] for r in range(len(refs))]
    perm = [k for k in range(len(factors)) if k not in grouped] + grouped
    size = math.prod(factors[k] for k in grouped)
    arr = devices.reshape(tuple(factors)).transpose(perm).reshape(-1, size)
    return arr.tolist()


def _parse_groups(text: str) -> list[list[int]]:
    """Explicit `{{0,1},{2,3}}`, iota `[G,S]<=[dims]T(perm)` or mesh-axes groups; [] = all."""
    text = text.strip()
    if text.startswith("{"):
        return [_ints(g) for g in re.findall(r"\{([^{}]*)\}", text[1:-1])]
    if text.startswith("["):
        m = re.fullmatch(r"\[([\d,\s]*)\]\s*<=\s*(.*)", text)
        if not m:
            raise ValueError(f"cannot read the iota replica groups {text!r}")
        shape = _ints(m.group(1))
        return _parse_iota_tile(m.group(2)).reshape(shape[0], -1).tolist()
    if text.startswith("mesh"):
        return _mesh_groups(text)
    raise ValueError(
        f"unknown replica group format {text!r}: expected {{{{...}}}}, [G,S]<=[...] or "
        "mesh[...] {...}; extend shardplan.analysis.hlo._parse_groups"
    )


def _global_groups(
    kind: str, attrs: dict[str, str], reps: int, parts: int, flat: bool
) -> list[list[int]]:
    """Replica groups as global device ids (replica * partitions + partition), per XLA's
    collective group modes (cross-replica, cross-partition, both, or flattened ids)."""
    groups = _parse_groups(attrs.get("replica_groups", "{}"))
    channel = "channel_id" in attrs
    if flat or attrs.get("use_global_device_ids") == "true":
        return groups or [list(range(reps * parts))]
    if kind in ("all-to-all", "collective-permute") and channel:  # cross-partition
        groups = groups or [list(range(parts))]
        return [[r * parts + p for p in g] for r in range(reps) for g in groups]
    groups = groups or [list(range(reps))]
    if channel:  # cross-replica-and-partition
        return [[r * parts + p for r in g for p in range(parts)] for g in groups]
    return [[r * parts + p for r in g] for p in range(parts) for g in groups]


def _permute_pairs(
    attrs: dict[str, str], reps: int, parts: int, flat: bool
) -> list[tuple[int, int]]:
    pairs = [tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", attrs.get(
        "source_target_pairs", "{}")[1:-1])]
    if flat:
        return pairs
    if "channel_id" in attrs:
        return [(r * parts + s, r * parts + t) for r in range(reps) for s, t in pairs]
    return [(s * parts + p, t * parts + p) for p in range(parts) for s, t in pairs]


def _components(pairs: Sequence[tuple[int, int]]) -> list[list[int]]:
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, t in pairs:
        parent[find(s)] = find(t)
    comps: dict[int, list[int]] = {}
    for x in sorted(parent):
        comps.setdefault(find(x), []).append(x)
    return sorted(comps.values())


# ------------------------------------------------------------------------- collectives


def _ring_bytes(kind: str, nbytes: int, n: int, moves: bool = True) -> float:
    """Bytes one device sends (module doc); a permute whose pairs are all i -> i sends none."""
    if kind == "collective-permute":
        return float(nbytes) if moves else 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * nbytes if n > 1 else 0.0


class _Users:
    """Who reads what inside one computation: name -> the instructions that take it as an
    operand; a tuple's elements are read through get-tuple-element (index -> users)."""

    def __init__(self, instrs: Sequence[_Instr]):
        self._by_name = {i.name: i for i in instrs}
        self._users: dict[str, list[_Instr]] | None = None
        self._instrs = instrs

    def _build(self) -> dict[str, list[_Instr]]:
        if self._users is None:
            self._users = {}
            for i in self._instrs:
                for op in _split_top(i.operands):
                    self._users.setdefault(op.split()[-1].lstrip("%"), []).append(i)
        return self._users

    def of(self, name: str) -> _UseSite:
        return _UseSite(self, name)

    def direct(self, name: str) -> list[_Instr]:
        return self._build().get(name, [])

    def opcode(self, name: str) -> str:
        i = self._by_name.get(name)
        return i.opcode if i else ""

    def get(self, name: str) -> _Instr | None:
        return self._by_name.get(name)

    def shapes(self) -> dict[str, str]:
        return {name: i.shape for name, i in self._by_name.items()}


@dataclasses.dataclass(frozen=True)
class _UseSite:
    users: _Users
    name: str


_DEVICE_INDEX = ("partition-id", "replica-id")


def _reads_a_slice(user: _Instr, elements: int, n: int, users: _Users) -> bool:
    """Whether `user` keeps only a device-indexed 1/n slice of an operand of `elements`."""
    if user.opcode == "dynamic-slice":
        pass
    elif user.opcode == "fusion":
        names = [op.split()[-1].lstrip("%") for op in _split_top(user.operands)]
        if not any(users.opcode(x) in _DEVICE_INDEX for x in names):
            return False
    else:
        return False
    out = _arrays(user.shape)
    return bool(out) and all(math.prod(d) * n <= elements for d, _ in out)


def _is_conversion(instr: _Instr, module: _Module) -> bool:
    """A change of dtype only: a convert, or a one-operand fusion whose root is a convert."""
    if instr.opcode == "convert":
        return True
    if instr.opcode != "fusion" or len(_split_top(instr.operands)) != 1:
        return False
    root = _root(module, instr)
    return root is not None and root.opcode == "convert"


def _element_readers(users: _Users, name: str, k: int, is_tuple: bool) -> list[tuple[_Instr, str]]:
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


def _final_readers(pairs: list[tuple[_Instr, str]], users: _Users,
                   module: _Module) -> list[_Instr]:
    """The readers, with dtype conversions replaced by their own readers, and a further
    all-reduce over other devices (XLA:CPU reduces a sum over two mesh axes in two steps) by
    the readers of its result (a few steps at most)."""
    for _ in range(3):
        expanded = []
        for r, src in pairs:
            if _is_conversion(r, module):
                expanded += [(x, r.name) for x in users.direct(r.name)]
                continue
            if r.opcode == "all-reduce":
                names = [op.split()[-1].lstrip("%") for op in _split_top(r.operands)]
                if src in names:
                    expanded += _element_readers(users, r.name, names.index(src),
                                                 r.shape.lstrip().startswith("("))
                    continue
            expanded.append((r, src))
        pairs = expanded
    return [r for r, _ in pairs]


def _sliced_bytes(result: str, site: _UseSite, n: int, module: _Module) -> int:
    """Bytes of an all-reduce's results whose every use reads only a 1/n device slice
    (after converting its dtype, as XLA:CPU does with 16-bit results, or reducing it further
    over other devices)."""
    if n <= 1:
        return 0
    total = 0
    is_tuple = result.lstrip().startswith("(")
    for k, (dims, ty) in enumerate(_arrays(result)):
        elements = math.prod(dims)
        pairs = _element_readers(site.users, site.name, k, is_tuple)
        readers = _final_readers(pairs, site.users, module)
        if readers and all(_reads_a_slice(u, elements, n, site.users) for u in readers):
            total += _nbytes([(dims, ty)])
    return total


_NARROW = ("bf16", "f16")


def _root(module: _Module, instr: _Instr) -> _Instr | None:
    """The root of the computation a fusion calls (its last instruction)."""
    called = re.findall(r"%?([^\s{},%]+)", instr.attrs.get("calls", ""))
    body = module.computations.get(called[0]) if called else None
    return body[-1] if body else None


def _narrow_type(shape: str) -> bool:
    arrays = _arrays(shape)
    return bool(arrays) and all(t in _NARROW for _, t in arrays)


def _from_narrow(module: _Module, producer: _Instr | None, shapes: Mapping[str, str]) -> bool:
    """Whether `producer` (a convert, or a fusion whose root is one) widens 16-bit floats."""
    if producer is not None and producer.opcode == "fusion":
        body = _root(module, producer)
        if body is None:
            return False
        called = re.findall(r"%?([^\s{},%]+)", producer.attrs.get("calls", ""))[0]
        shapes = {i.name: i.shape for i in module.computations[called]}
        producer = body
    if producer is None or producer.opcode != "convert":
        return False
    source = _split_top(producer.operands)[0]
    source_shape = source if _ARRAY.search(source) else shapes.get(source.split()[-1].lstrip("%"), "")
    return _narrow_type(source_shape)


def _to_narrow(module: _Module, user: _Instr, operand: str) -> bool:
    """Whether `user` converts its `operand` to 16-bit floats before anything else reads it."""
    if user.opcode == "convert":
        return _narrow_type(user.shape)
    if user.opcode != "fusion":
        return False
    names = [op.split()[-1].lstrip("%") for op in _split_top(user.operands)]
    called = re.findall(r"%?([^\s{},%]+)", user.attrs.get("calls", ""))
    body = module.computations.get(called[0]) if called else None
    if body is None or operand not in names:
        return False
    params = {i.name for i in body if i.opcode == "parameter"
              and i.operands.strip() in {str(k) for k, x in enumerate(names) if x == operand}}
    readers = [i for i in body if any(op.split()[-1].lstrip("%") in params
                                      for op in _split_top(i.operands))]
    return bool(readers) and all(i.opcode == "convert" and _narrow_type(i.shape) for i in readers)


def _widened_bytes(instr: _Instr, arrays, users: _UseSite, module: _Module) -> int:
    """Bytes of an f32 collective whose payload is 16-bit floats widened by XLA:CPU (see
    CollectiveOp.widened_nbytes), per element: its operand comes from a conversion from 16
    bits, or (for an all-reduce, which XLA:CPU runs on the f32 result of a 16-bit dot)
    every use converts the result to 16 bits first."""
    table = users.users
    names = [op.split()[-1].lstrip("%") for op in _split_top(instr.operands)]
    shapes = table.shapes()
    is_tuple = instr.shape.lstrip().startswith("(") or len(arrays) > 1
    reduce = instr.opcode.startswith("all-reduce")
    total = 0
    for k, (dims, ty) in enumerate(arrays):
        if ty != "f32":
            continue
        narrow = len(names) == len(arrays) and _from_narrow(module, table.get(names[k]), shapes)
        if not narrow and reduce:
            if is_tuple:  # element k is read through get-tuple-element
                gte = [u for u in table.direct(users.name) if u.attrs.get("index") == str(k)]
                readers = [(r, g.name) for g in gte for r in table.direct(g.name)]
            else:
                readers = [(r, users.name) for r in table.direct(users.name)]
            narrow = bool(readers) and all(_to_narrow(module, r, x) for r, x in readers)
        if narrow:
            total += _nbytes([(dims, ty)])
    return total


def _called(instr: _Instr) -> Iterator[str]:
    for key in _CALL_ATTRS:
        yield from re.findall(r"%?([^\s{},%]+)", instr.attrs.get(key, ""))


def _trip_count(instr: _Instr) -> int | None:
    """The while loop's trip count when XLA knows it (backend_config, JSON maybe escaped)."""
    config = instr.attrs.get("backend_config", "").replace("\\", "")
    m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', config)
    return int(m.group(1)) if m else None


def parse_collectives(
    hlo_text: str,
    num_devices: int | None = None,
    device_assignment: Sequence[int] | None = None,
) -> tuple[CollectiveOp, ...]:
    """Every collective of an HLO module, in program order, counted per call site.

    num_devices: devices of the program, when the module header does not say
    (`num_partitions=` x `replica_count=`); needed to expand `replica_groups={}`. When
    the header is silent, replica groups and pairs are read as device ids directly.
    device_assignment: device id of each HLO (logical) device id; HLO ids are positions
    in the program's device assignment, not `jax.Device.id`. Identity if None.
    Collectives in while bodies are multiplied by the loop's known trip count (see
    CollectiveOp.count); every branch of a conditional is counted (an upper bound).
    """
    module = _parse_module(hlo_text)
    parts, reps = module.num_partitions, module.replica_count
    flat = parts is None and reps is None
    parts, reps = (num_devices or 1, 1) if flat else (parts or 1, reps or 1)
    if num_devices is not None and num_devices != parts * reps:
        raise ValueError(
            f"num_devices={num_devices} but the HLO module runs on {parts * reps} devices "
            f"(num_partitions={parts}, replica_count={reps}); pass num_devices=None"
        )
    mapping = None if device_assignment is None else [int(d) for d in device_assignment]
    if mapping is not None and len(mapping) < parts * reps:
        raise ValueError(
            f"device_assignment has {len(mapping)} devices, the module needs {parts * reps}"
        )
    shapes = {i.name: i.shape for c in module.computations.values() for i in c}
    out: list[CollectiveOp] = []

    def operand_bytes(instr: _Instr) -> int | None:
        total = 0
        for op in _split_top(instr.operands):
            if _ARRAY.search(op):
                total += _nbytes(_arrays(op))
                continue
            name = op.strip().lstrip("%")
            if name not in shapes:
                return None
            total += _nbytes(_arrays(shapes[name]))
        return total

    def collective(instr: _Instr, kind: str, result: str, ctx, users) -> CollectiveOp:
        count, in_loop, known = ctx
        arrays = _arrays(result)
        if kind == "collective-permute":
            pairs = _permute_pairs(instr.attrs, reps, parts, flat)
            groups = _components(pairs)
            moves = any(s != t for s, t in pairs)
        else:
            groups = _global_groups(kind, instr.attrs, reps, parts, flat)
            moves = True
        if mapping is not None:
            groups = [[mapping[d] for d in g] for g in groups]
        n = max((len(g) for g in groups), default=1)
        result_bytes = _nbytes(arrays)
        operands = operand_bytes(instr)
        if kind == "all-gather":
            nbytes = result_bytes
        elif operands is not None:
            nbytes = operands
        else:
            nbytes = result_bytes * (n if kind == "reduce-scatter" else 1)
        meta = re.search(r'op_name="([^"]*)"', instr.attrs.get("metadata", ""))
        sliced = _sliced_bytes(result, users, n, module) if kind == "all-reduce" else 0
        widened = _widened_bytes(instr, arrays, users, module)
        return CollectiveOp(
            kind=kind, shapes=tuple(d for d, _ in arrays),
            dtypes=tuple(_dtype(t)[0] for _, t in arrays), nbytes=int(nbytes),
            groups=tuple(tuple(g) for g in groups), group_size=n,
            bytes_sent=_ring_bytes(kind, nbytes, n, moves), in_loop=in_loop, name=instr.name,
            count=count, count_known=known, op_name=meta.group(1) if meta else "",
            sliced_nbytes=sliced, widened_nbytes=widened,
        )

    def walk(comp: str, ctx, stack: tuple[str, ...]) -> None:
        if comp in stack:
            raise ValueError(f"HLO computation {comp!r} calls itself; cannot count collectives")
        instrs = module.computations.get(comp)
        if instrs is None:
            raise ValueError(f"HLO text calls computation {comp!r} but does not define it")
        done = {}
        for i in instrs:
            if i.opcode.endswith("-done"):
                for op in _split_top(i.operands):
                    done[op.split()[-1].lstrip("%")] = i
        users = _Users(instrs)
        for instr in instrs:
            op = instr.opcode
            if op in KINDS:
                out.append(collective(instr, op, instr.shape, ctx, users.of(instr.name)))
            elif op.endswith("-start") and op[:-6] in KINDS:
                end = done.get(instr.name)
                out.append(collective(instr, op[:-6], end.shape if end else instr.shape, ctx,
                                      users.of(end.name if end else instr.name)))
            if op in ("async-update", "async-done") or op.endswith("-done"):
                continue  # the -start already walked what it runs
            count, _, known = ctx
            if op == "while":
                trips = _trip_count(instr)
                ctx_in = (count * (trips or 1), True, known and trips is not None)
            else:
                ctx_in = ctx
            for callee in _called(instr):
                walk(callee, ctx_in, stack + (comp,))

    walk(module.entry, (1, False, True), ())
    return tuple(out)


# ---------------------------------------------------------------------------- compiled


def _cost_numbers(cost: Any) -> tuple[float, float, float]:
    """(flops, transcendentals, bytes accessed) from cost_analysis(): a dict, a list of
    dicts (one per HLO module, older jax), or None."""
    dicts = [cost] if isinstance(cost, dict) else list(cost or [])
    keys = ("flops", "transcendentals", "bytes accessed")
    return tuple(sum(float(d.get(k) or 0.0) for d in dicts) for k in keys)


def _device_assignment(compiled: Any, num_devices: int) -> list[int] | None:
    """Device ids in the program's device-assignment order (HLO id -> jax.Device.id)."""
    runtime = getattr(compiled, "runtime_executable", None)
    devices = getattr(runtime() if runtime else None, "local_devices", list)()
    if len(devices) == num_devices:
        return [d.id for d in devices]
    import jax

    for sharding in jax.tree_util.tree_leaves(
        (compiled.input_shardings, compiled.output_shardings)
    ):
        mesh = getattr(sharding, "mesh", None)
        devices = getattr(mesh, "devices", None)
        if devices is not None and devices.size == num_devices:
            return [d.id for d in devices.flat]
    return None


def analyze(compiled: Any) -> ProgramStats:
    """Collectives, flops and memory per device of a `jax.stages.Compiled`."""
    text = compiled.as_text()
    if not text:
        raise ValueError("compiled.as_text() is empty: pass a jax.stages.Compiled from "
                         "jax.jit(f).lower(*args).compile()")
    parts, reps = _header_counts(text.split("\n", 1)[0])
    n = (parts or 1) * (reps or 1)
    collectives = parse_collectives(
        text, num_devices=n, device_assignment=_device_assignment(compiled, n)
    )
    flops, trans, accessed = _cost_numbers(compiled.cost_analysis())
    mem = compiled.memory_analysis()

    def field(name: str) -> int:
        return int(getattr(mem, name, 0) or 0)

    arg, out = field("argument_size_in_bytes"), field("output_size_in_bytes")
    temp, alias = field("temp_size_in_bytes"), field("alias_size_in_bytes")
    return ProgramStats(
        collectives=collectives, flops=flops, transcendentals=trans, bytes_accessed=accessed,
        argument_bytes=arg, output_bytes=out, temp_bytes=temp, alias_bytes=alias,
        peak_bytes=arg + out + temp - alias,
        generated_code_bytes=field("generated_code_size_in_bytes"),
        xla_peak_bytes=field("peak_memory_in_bytes"), num_devices=n,
    )


def axes_of_group(
    groups: Sequence[Sequence[int]], mesh_shape: MeshShape, device_ids_grid: Any
) -> tuple[str, ...]:
    """The mesh axes, in mesh order, along which members of a group differ.

    device_ids_grid: the mesh's device ids laid out like the mesh, e.g.
    `np.vectorize(lambda d: d.id)(mesh.devices)`. Groups that cover only part of an axis
    (a sub-axis) still name that axis; compare group_size with the axes' sizes to tell.
    """
    grid = np.asarray(device_ids_grid)
    if grid.shape != tuple(mesh_shape.sizes):
        raise ValueError(
            f"device_ids_grid has shape {grid.shape} but the mesh is "
            f"{dict(zip(mesh_shape.names, mesh_shape.sizes))}; pass the ids laid out like "
            "mesh.devices"
        )
    where = {int(d): idx for idx, d in np.ndenumerate(grid)}
    varying = [False] * grid.ndim
    for g in groups:
        missing = [d for d in g if d not in where]
        if missing:
            raise ValueError(f"devices {missing} of group {tuple(g)} are not in the mesh")
        coords = np.array([where[d] for d in g]).reshape(len(g), grid.ndim)
        for k in range(grid.ndim):
            varying[k] |= bool(len(set(coords[:, k].tolist())) > 1)
    return tuple(name for name, v in zip(mesh_shape.names, varying) if v)

