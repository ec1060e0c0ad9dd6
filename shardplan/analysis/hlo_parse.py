"""The partitioned HLO text of a compiled program, parsed: computations, instructions (name,
result shape, opcode, operands, attributes) and replica groups.

Replica groups come in three textual forms (jax 0.10.2, Shardy or GSPMD alike): explicit
lists `{{0,1},{2,3}}` (shard_map collectives), iota lists `[2,4]<=[8]` or
`[4,2]<=[2,4]T(1,0)` (jit, inside while bodies) and mesh axes
`mesh['axis_0'=2,'axis_1'=4][, device_ids=([2,4]T(1,0))] {'axis_1'}`, with sub-axes written
`'axis_0':(pre)size` (jit elsewhere). All are expanded to explicit groups.

This reads `compiled.as_text()`, not jaxlib's HLO objects: those
(`compiled.runtime_executable().hlo_modules()`, in the private `jaxlib._hlo`) give an
instruction's name, opcode, operands and users, but not its shape, replica groups or
attributes, which is what is read here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    shape: str
    opcode: str
    operands: str
    attrs: dict[str, str]


@dataclasses.dataclass(frozen=True)
class Module:
    computations: dict[str, list[Instr]]
    entry: str
    num_partitions: int | None
    replica_count: int | None


_INSTR_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=(]+)\s*=\s*")


_OPERAND_COMMENT = re.compile(r"/\*[^*]*\*/")


_COMP_HEAD = re.compile(r"^\s*(ENTRY\s+)?%?([^\s=(]+)\s*\(.*\{\s*$")


ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


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


def split_top(text: str) -> list[str]:
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
    for part in split_top(text):
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


def _parse_instr(line: str) -> Instr | None:
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
    # XLA marks every fifth operand with a comment (`/*index=5*/%x`): dropped, so that an
    # operand's last word is its name (tests/test_analysis_hlo.py::test_operand_comments_are_not_names)
    operands = _OPERAND_COMMENT.sub("", line[m2.end():k - 1])
    return Instr(m.group(1), shape, m2.group(1), operands, _parse_attrs(line[k:].lstrip(", ")))


def header_counts(line: str) -> tuple[int | None, int | None]:
    """(num_partitions, replica_count) from the `HloModule` line; None where it is silent."""
    found = [re.search(rf"{key}=(\d+)", line) for key in ("num_partitions", "replica_count")]
    return tuple(int(m.group(1)) if m else None for m in found)


def parse_module(text: str) -> Module:
    comps: dict[str, list[Instr]] = {}
    entry, current = None, None
    num_partitions = replica_count = None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            num_partitions, replica_count = header_counts(line)
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
    return Module(comps, entry, num_partitions, replica_count)


def dtype_of(ty: str) -> tuple[str, int]:
    """HLO element type -> (numpy-style name, bits): f32 -> float32, f8e4m3fn -> float8_e4m3fn."""
    if ty == "pred":
        return "bool", 8
    m = re.fullmatch(r"(bf|s|u|f|c)(\d+)([a-z0-9]*)", ty)
    if not m:
        raise ValueError(f"unknown HLO element type {ty!r}; teach shardplan.analysis.hlo._dtype")
    base = {"bf": "bfloat", "s": "int", "u": "uint", "f": "float", "c": "complex"}[m.group(1)]
    return base + m.group(2) + (f"_{m.group(3)}" if m.group(3) else ""), int(m.group(2))


def arrays(shape_text: str) -> list[tuple[tuple[int, ...], str]]:
    """The array leaves of an HLO shape (tuples flattened), as (dims, HLO element type)."""
    out = []
    for m in ARRAY.finditer(shape_text):
        if m.group(1) not in ("token", "opaque"):
            dtype_of(m.group(1))
            out.append((tuple(_ints(m.group(2).replace("<=", ""))), m.group(1)))
    return out


def nbytes(arrays: Sequence[tuple[tuple[int, ...], str]]) -> int:
    return sum(math.ceil(math.prod(d) * dtype_of(t)[1] / 8) for d, t in arrays)


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
    for item in split_top(m.group(1)):
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
    for item in split_top(rest[b + 1:_close(rest, b) - 1]):
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


def parse_groups(text: str) -> list[list[int]]:
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


def global_groups(
    kind: str, attrs: dict[str, str], reps: int, parts: int, flat: bool
) -> list[list[int]]:
    """Replica groups as global device ids (replica * partitions + partition), per XLA's
    collective group modes (cross-replica, cross-partition, both, or flattened ids)."""
    groups = parse_groups(attrs.get("replica_groups", "{}"))
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


def permute_pairs(
    attrs: dict[str, str], reps: int, parts: int, flat: bool
) -> list[tuple[int, int]]:
    pairs = [tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", attrs.get(
        "source_target_pairs", "{}")[1:-1])]
    if flat:
        return pairs
    if "channel_id" in attrs:
        return [(r * parts + s, r * parts + t) for r in range(reps) for s, t in pairs]
    return [(s * parts + p, t * parts + p) for p in range(parts) for s, t in pairs]


def components(pairs: Sequence[tuple[int, int]]) -> list[list[int]]:
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
