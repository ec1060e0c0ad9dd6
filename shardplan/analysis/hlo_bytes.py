"""The memory traffic of a compiled program's contractions: the bytes every dot and
convolution (alone or fused with its neighbours) reads and writes per device.

This is the memory-bound term of the compute time both the pricer (analysis/price.py) and
the cost model (cost/model.py) use: a contraction reads its operands from memory and writes
its result on every backend (cuBLAS, the TPU's MXU, XLA:CPU's Eigen), so its traffic is the
same wherever the program is compiled, but for the width of 16-bit floats, which XLA:CPU
widens to f32 around a bf16 dot (contraction_traffic tells those bytes apart). The traffic
of elementwise and reduction fusions is not: XLA:CPU draws smaller fusions than XLA:GPU or
XLA:TPU (several times the bytes of one fusion per run of fusible ops: benchmarks/
model_check.py), so the CPU figure would price the accelerator's elementwise work at the
CPU's fusion.
Instruction bytes are counted as HloCostAnalysis counts them (operands + result), which
matches `compiled.cost_analysis()['bytes accessed']` instruction by instruction, but for a
fusion that holds a contraction only the operands its contractions read (through whatever
else is fused) count: XLA:CPU's dot fusions also take in elementwise work on the dot's
result, with that work's own operands (the gradient of a softmax fused after the dot of
`dO @ v.T` reads the probabilities and the row sums as well), traffic the other backends
run in fusions of their own, which neither side counts; and the dot's own result where more
is fused after it (tests/test_model_agrees.py::test_a_dot_fused_with_what_follows_it_is_priced_as_the_dot).
A cast to 16 bits fused before or after the dot (an f32 kernel's bf16 copy) is a 16-bit read
or write on an accelerator, as the widened bytes of XLA:CPU's bf16 dots are.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from shardplan.analysis import hlo_loops, hlo_parse, hlo_uses

CONTRACTIONS = frozenset({"dot", "convolution"})


@functools.lru_cache(maxsize=4)
def parse_module_cached(text: str) -> hlo_parse.Module:
    return hlo_parse.parse_module(text)


def _operand_names(operands: str) -> list[str]:
    return [o.split()[-1].lstrip("%") for o in hlo_parse.split_top(operands)]


def contraction_bytes(text: str) -> float:
    """Bytes per device read and written by the program's contractions (top-level dots and
    convolutions and the fusions that hold one), loop bodies times their known trip counts
    (once when unknown)."""
    return contraction_traffic(text)[0]


@functools.lru_cache(maxsize=4)
def contraction_traffic(text: str) -> tuple[float, float]:
    """(contraction_bytes, the part of them that are f32 buffers holding 16-bit floats).
    XLA:CPU computes a bf16 dot in f32 (JAX-NOTES): its operands are bf16 values converted
    to f32 before it, and where every reader converts its result back, so is the result; a
    GPU or TPU reads and writes them at 16 bits (ProgramStats.formed halves them)."""
    module = parse_module_cached(text)
    comps = module.computations
    holds = {name: any(i.opcode in CONTRACTIONS for i in instrs) for name, instrs in comps.items()}
    reads: dict[str, _FusedReads] = {}  # fused computation -> what its contractions read

    def walk(comp: str, times: int, seen: frozenset) -> tuple[float, float]:
        instrs = comps.get(comp, [])
        shapes = {i.name: i.shape for i in instrs}
        users = hlo_uses.Users(instrs)
        total = widened = 0.0
        for i in instrs:
            if i.opcode == "while":
                trips = hlo_loops.trip_count(module, i, instrs)
                body = i.attrs.get("body", "").lstrip("%")
                if body not in seen:
                    t, w = walk(body, times * (trips or 1), seen | {body})
                    total, widened = total + t, widened + w
                continue
            if i.opcode in ("call", "conditional"):
                for callee in re.findall(r"%?([\w.\-]+)", i.attrs.get("to_apply", "")
                                         + "," + i.attrs.get("branch_computations", "")):
                    if callee in comps and callee not in seen:
                        t, w = walk(callee, times, seen | {callee})
                        total, widened = total + t, widened + w
                continue
            called = i.attrs.get("calls", "").lstrip("%")
            if i.opcode == "fusion" and holds.get(called):
                if called not in reads:
                    reads[called] = _fused_reads(module, called)
                t, w = _fusion_traffic(module, i, reads[called], shapes, users)
                total, widened = total + times * t, widened + times * w
            elif i.opcode in CONTRACTIONS:
                moved = hlo_parse.nbytes(hlo_parse.arrays(i.shape))
                readers = users.direct(i.name)
                if readers and all(hlo_uses.to_narrow(module, r, i.name) for r in readers):
                    widened += times * _f32_bytes(i.shape)
                for o in _operand_names(i.operands):
                    moved += hlo_parse.nbytes(hlo_parse.arrays(shapes.get(o, "")))
                    if hlo_uses.from_narrow(module, users.get(o), shapes):
                        widened += times * _f32_bytes(shapes.get(o, ""))
                total += times * moved
        return total, widened

    return walk(module.entry, 1, frozenset({module.entry}))


@dataclasses.dataclass(frozen=True)
class _FusedReads:
    """What the contractions of a fused computation read and write: its parameters they read
    (index -> whether every path narrows it to 16 bits first, a convert fused into the dot),
    the bytes of those read only through slices (index -> bytes), and, where something else
    is fused after them, their own results (shape, whether every reader narrows it)."""

    params: dict[int, bool]
    results: tuple[tuple[str, bool], ...] | None  # None: a contraction is the fusion's root
    sliced: dict[int, int] = dataclasses.field(default_factory=dict)


_SLICES = frozenset({"dynamic-slice", "slice"})


def _sliced_params(module: hlo_parse.Module, comp: str) -> dict[int, int]:
    """Parameter index -> bytes read, for the parameters of fused computation `comp` that
    are read only through slices (a scan's layer taken from the stacked weights), directly
    or through a pad that only slices read: the TPU compiler's windowed einsum takes each
    step's two chunks of an operand from it padded, the pad's fill discarded, so such a
    slice reads the parameter's share of its bytes
    (tests/test_reshard_window.py::test_a_windowed_einsum_reads_its_sliced_operand_once)."""
    body = module.computations.get(comp, [])
    users = hlo_uses.Users(body)

    def slices(name: str) -> list | None:
        readers = users.direct(name)
        ok = readers and all(r.opcode in _SLICES and _operand_names(r.operands)[0] == name
                             for r in readers)
        return readers if ok else None

    out = {}
    for i in body:
        if i.opcode != "parameter":
            continue
        readers = users.direct(i.name)
        read = 0.0
        for r in readers:
            if r.opcode in _SLICES and _operand_names(r.operands)[0] == i.name:
                read += hlo_parse.nbytes(hlo_parse.arrays(r.shape))
            elif (r.opcode == "pad" and _operand_names(r.operands)[0] == i.name
                  and slices(r.name)):
                share = (hlo_parse.nbytes(hlo_parse.arrays(i.shape))
                         / max(1, hlo_parse.nbytes(hlo_parse.arrays(r.shape))))
                read += share * sum(hlo_parse.nbytes(hlo_parse.arrays(x.shape))
                                    for x in slices(r.name))
            else:
                read = None
                break
        if readers and read is not None:
            out[int(i.operands)] = int(read)
    return out


def _cap(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _fused_reads(module: hlo_parse.Module, comp: str) -> _FusedReads:
    """_FusedReads of fused computation `comp`: its contractions' operands followed back to
    its parameters, through whatever is fused before them. A parameter read through a slice
    (fused here or in a fusion nested here, as the TPU compiler fuses a scan's weight slice
    into the dot: test_analysis_tpu.py::test_scan_collective_counted_per_trip) counts the
    slice's bytes."""
    body = module.computations.get(comp, [])
    instrs = {i.name: i for i in body}
    users = hlo_uses.Users(body)
    dots = [i for i in body if i.opcode in CONTRACTIONS]
    stack = [(o, False, None) for i in dots for o in _operand_names(i.operands)]
    seen: set[tuple[str, bool, int | None]] = set()
    params: dict[int, bool] = {}
    caps: dict[int, int | None] = {}
    while stack:
        name, narrowed, cap = item = stack.pop()
        if item in seen or name not in instrs:
            continue
        seen.add(item)
        i = instrs[name]
        if i.opcode == "parameter":
            k = int(i.operands)
            params[k] = params.get(k, True) and narrowed
            caps[k] = None if k in caps and (caps[k] is None or cap is None) else max(
                caps.get(k) or 0, cap) if cap is not None else None
            continue
        narrowed = narrowed or (i.opcode == "convert" and hlo_uses.narrow_type(i.shape))
        operands = _operand_names(i.operands)
        if i.opcode in _SLICES:
            stack.append((operands[0], narrowed,
                          _cap(cap, hlo_parse.nbytes(hlo_parse.arrays(i.shape)))))
            continue
        nested = {}
        if i.opcode == "fusion":
            called = i.attrs.get("calls", "").lstrip("%")
            nested = _sliced_params(module, called)
        stack.extend((o, narrowed, _cap(cap, nested.get(k))) for k, o in enumerate(operands))
    root = body[-1] if body else None
    while root is not None and root.opcode in hlo_uses.RELAYOUTS:
        root = instrs.get(_operand_names(root.operands)[0])
    results = None
    if root is None or root.opcode not in CONTRACTIONS:
        results = tuple((d.shape, bool(users.direct(d.name)) and all(
            hlo_uses.to_narrow(module, r, d.name) for r in users.direct(d.name))) for d in dots)
    return _FusedReads(params, results, {k: c for k, c in caps.items() if c is not None})


def _fusion_traffic(module, fusion, reads: _FusedReads, shapes, users) -> tuple[float, float]:
    """(bytes, widened bytes) of a fusion holding contractions: the operands they read and
    the results they write, as a backend that fuses nothing else with them would move."""
    moved = widened = 0.0
    if reads.results is None:
        moved = hlo_parse.nbytes(hlo_parse.arrays(fusion.shape))
        readers = users.direct(fusion.name)
        if readers and all(hlo_uses.to_narrow(module, r, fusion.name) for r in readers):
            widened += _f32_bytes(fusion.shape)
    else:
        for shape, narrowed in reads.results:
            moved += hlo_parse.nbytes(hlo_parse.arrays(shape))
            widened += _f32_bytes(shape) if narrowed else 0
    for k, o in enumerate(_operand_names(fusion.operands)):
        if k not in reads.params:
            continue
        shape = shapes.get(o, "")
        full = hlo_parse.nbytes(hlo_parse.arrays(shape))
        read = min(reads.sliced.get(k, full), full)
        moved += read
        if reads.params[k] or hlo_uses.from_narrow(module, users.get(o), shapes):
            widened += _f32_bytes(shape) * (read / full if full else 1.0)
    return moved, widened


def _f32_bytes(shape: str) -> int:
    return hlo_parse.nbytes([(d, t) for d, t in hlo_parse.arrays(shape) if t == "f32"])


def io_bytes(text: str) -> float:
    """Bytes per device the step reads as its arguments and writes as its results: the entry
    computation's parameters and its root. Every backend pays them whatever it fuses (the
    optimizer's update reads the state and writes it back), so the compute time charges
    them with the contractions' traffic."""
    module = parse_module_cached(text)
    entry = module.computations.get(module.entry, [])
    if not entry:
        return 0.0
    read = sum(hlo_parse.nbytes(hlo_parse.arrays(i.shape)) for i in entry
               if i.opcode == "parameter")
    return float(read + hlo_parse.nbytes(hlo_parse.arrays(entry[-1].shape)))
