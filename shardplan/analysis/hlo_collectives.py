"""The collectives of a compiled program, from its partitioned HLO (shardplan.analysis.hlo_parse):
each one's kind, groups, bytes per device and executions per run.

Collective bytes follow the ring model: for a group of n devices and a per-device buffer of
B bytes, each device sends

    all-reduce          2 (n - 1) / n * B      (B = operand bytes)
    all-gather          (n - 1) / n * B        (B = gathered result bytes)
    reduce-scatter      (n - 1) / n * B        (B = operand bytes, before the scatter)
    all-to-all          (n - 1) / n * B        (B = operand bytes)
    collective-permute  B                      (B = operand bytes)

HLO ids are positions in the program's device assignment; `parse_collectives` maps them to
`jax.Device.id` when given the assignment.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shardplan.analysis import hlo_loops, hlo_parse, hlo_uses
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


def _ring_bytes(kind: str, nbytes: int, n: int, moves: bool = True) -> float:
    """Bytes one device sends (module doc); a permute whose pairs are all i -> i sends none."""
    if kind == "collective-permute":
        return float(nbytes) if moves else 0.0
    return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n * nbytes if n > 1 else 0.0




def called(instr: hlo_parse.Instr) -> Iterator[str]:
    """The computations an instruction runs (fusions, loop bodies and conditions, branches)."""
    for key in _CALL_ATTRS:
        yield from re.findall(r"%?([^\s{},%]+)", instr.attrs.get(key, ""))


@dataclasses.dataclass(frozen=True)
class _Program:
    """A parsed module and how its HLO device ids map to devices."""

    module: hlo_parse.Module
    parts: int
    reps: int
    flat: bool
    """The header names no device counts: replica groups are device ids as written."""
    mapping: list[int] | None
    shapes: dict[str, str]
    """Instruction name -> its result shape text, over every computation."""


def _program(hlo_text: str, num_devices: int | None,
             device_assignment: Sequence[int] | None) -> _Program:
    module = hlo_parse.parse_module(hlo_text)
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
    return _Program(module, parts, reps, flat, mapping, shapes)


def _operand_bytes(prog: _Program, instr: hlo_parse.Instr) -> int | None:
    total = 0
    for op in hlo_parse.split_top(instr.operands):
        if hlo_parse.ARRAY.search(op):
            total += hlo_parse.nbytes(hlo_parse.arrays(op))
            continue
        name = op.strip().lstrip("%")
        if name not in prog.shapes:
            return None
        total += hlo_parse.nbytes(hlo_parse.arrays(prog.shapes[name]))
    return total


@dataclasses.dataclass(frozen=True)
class _Site:
    """Where the walk is: executions per run, inside a loop, trip counts known, and the
    fusion whose computation is being walked (None outside fusions)."""

    count: int
    in_loop: bool
    known: bool
    fusion: hlo_parse.Instr | None = None
    caller: str = ""
    """The computation that holds `fusion`."""


def _collective(prog: _Program, instr: hlo_parse.Instr, kind: str, result: str, site: _Site,
                users) -> CollectiveOp:
    """One collective: its groups (as devices), per-device bytes and executions (`site`)."""
    arrays = hlo_parse.arrays(result)
    if kind == "collective-permute":
        pairs = hlo_parse.permute_pairs(instr.attrs, prog.reps, prog.parts, prog.flat)
        groups = hlo_parse.components(pairs)
        moves = any(s != t for s, t in pairs)
    else:
        groups = hlo_parse.global_groups(kind, instr.attrs, prog.reps, prog.parts, prog.flat)
        moves = True
    if prog.mapping is not None:
        groups = [[prog.mapping[d] for d in g] for g in groups]
    n = max((len(g) for g in groups), default=1)
    result_bytes = hlo_parse.nbytes(arrays)
    operands = _operand_bytes(prog, instr)
    if kind == "all-gather":
        nbytes = result_bytes
    elif operands is not None:
        nbytes = operands
    else:
        nbytes = result_bytes * (n if kind == "reduce-scatter" else 1)
    meta = re.search(r'op_name="([^"]*)"', instr.attrs.get("metadata", "")
                     or (site.fusion.attrs.get("metadata", "") if site.fusion else ""))
    module = prog.module
    sliced = hlo_uses.sliced_bytes(result, users, n, module) if kind == "all-reduce" else 0
    widened = hlo_uses.widened_bytes(instr, arrays, users, module)
    shapes = tuple(d for d, _ in arrays)
    if site.fusion is not None and kind == "all-reduce" and 0 < sliced == nbytes:
        # The TPU compiler's reduce-scatter: a custom fusion of an all-reduce whose every
        # result is sliced by the device index, run as one (its collective_algorithm_config
        # names an AllReduceScatter emitter): test_analysis_tpu.py::test_reduce_scatter_*.
        kind, sliced = "reduce-scatter", 0
        fused = [d for d, _ in hlo_parse.arrays(site.fusion.shape)]
        scattered = _scattered(shapes, n)
        shapes = tuple(fused if sorted(map(math.prod, fused)) == sorted(
            map(math.prod, scattered)) else scattered)
    return CollectiveOp(
        kind=kind, shapes=shapes,
        dtypes=tuple(hlo_parse.dtype_of(t)[0] for _, t in arrays), nbytes=int(nbytes),
        groups=tuple(tuple(g) for g in groups), group_size=n,
        bytes_sent=_ring_bytes(kind, nbytes, n, moves), in_loop=site.in_loop, name=instr.name,
        count=site.count, count_known=site.known, op_name=meta.group(1) if meta else "",
        sliced_nbytes=sliced, widened_nbytes=widened,
    )


def _scattered(shapes: Sequence[tuple[int, ...]], n: int) -> list[tuple[int, ...]]:
    """Each shape with its first dimension that n divides divided by n (a scatter's result)."""
    out = []
    for d in shapes:
        k = next((i for i, x in enumerate(d) if x % n == 0), None)
        out.append(d if k is None else d[:k] + (d[k] // n,) + d[k + 1:])
    return out


def _walk(prog: _Program, comp: str, site: _Site, stack: tuple[str, ...],
          out: list[CollectiveOp], seen: set) -> None:
    """Append the collectives of computation `comp` and of what it calls to `out`.

    The TPU compiler runs an asynchronous collective as a chain of fusions (start,
    continuations, done), each holding a copy of the collective with the same channel_id:
    within the computation that holds the chain, a fused collective is counted once per
    channel_id (`seen`; test_analysis_tpu.py::test_async_collective_fusion_counted_once).
    """
    if comp in stack:
        raise ValueError(f"HLO computation {comp!r} calls itself; cannot count collectives")
    instrs = prog.module.computations.get(comp)
    if instrs is None:
        raise ValueError(f"HLO text calls computation {comp!r} but does not define it")
    done = {}
    for i in instrs:
        if i.opcode.endswith("-done"):
            for op in hlo_parse.split_top(i.operands):
                done[op.split()[-1].lstrip("%")] = i
    users = hlo_uses.Users(instrs)
    for instr in instrs:
        op = instr.opcode
        kind = op if op in KINDS else op[:-6] if op.endswith("-start") and op[:-6] in KINDS \
            else None
        channel = instr.attrs.get("channel_id")
        if kind and site.fusion is not None and channel is not None:
            key = (site.caller, site.count, channel)
            if key in seen:
                kind = None
            seen.add(key)
        if kind == op:
            out.append(_collective(prog, instr, op, instr.shape, site, users.of(instr.name)))
        elif kind:
            end = done.get(instr.name)
            out.append(_collective(prog, instr, kind, end.shape if end else instr.shape, site,
                                   users.of(end.name if end else instr.name)))
        if op in ("async-update", "async-done") or op.endswith("-done"):
            continue  # the -start already walked what it runs
        if op == "while":
            trips = hlo_loops.trip_count(prog.module, instr, instrs)
            inner = dataclasses.replace(site, count=site.count * (trips or 1), in_loop=True,
                                        known=site.known and trips is not None)
        elif op == "fusion":
            inner = dataclasses.replace(site, fusion=instr,
                                        caller=site.caller if site.fusion else comp)
        else:
            inner = site
        for callee in called(instr):
            _walk(prog, callee, inner, stack + (comp,), out, seen)


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
    prog = _program(hlo_text, num_devices, device_assignment)
    out: list[CollectiveOp] = []
    _walk(prog, prog.module.entry, _Site(1, False, True), (), out, set())
    return tuple(out)


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
