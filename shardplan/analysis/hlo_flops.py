"""The flops a compiled program's while loops run beyond their first iteration.

`compiled.cost_analysis()` counts a while body once, whatever its trip count (a scan of
matmuls reports the flops of one: tests/test_analysis_hlo_flops.py::
test_a_scan_costs_its_unrolled_layers). A scan over layers, a pipeline's
loop of ticks, an optimizer's loop: all would look 1/trips as dear as they run. This module
counts the flops of the partitioned HLO itself (HloCostAnalysis's rules for the ops that
matter: a dot is 2 x result elements x contracted size; an elementwise op or a reduce one flop
per element; transcendentals are not flops, as there), walking fusions and loops with the
known trip counts (shardplan.analysis.hlo_collectives reads them the same way), and
`loop_extra_flops` gives what the loops add beyond one iteration: the number to add to
cost_analysis()'s flops (shardplan.analysis.hlo.analyze does).
"""

from __future__ import annotations

import math
import re

import numpy as np

from shardplan.analysis import hlo_loops, hlo_parse
from shardplan.analysis.hlo_collectives import called

# One flop per result element (HloCostAnalysis: elementwise arithmetic; transcendentals such
# as exp, log, tanh are counted apart, not as flops).
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "compare",
    "select", "and", "or", "xor", "not", "remainder", "power", "clamp", "sign", "floor",
    "ceil", "round-nearest-afz", "round-nearest-even", "atan2",
})


def _elements(shape_text: str) -> int:
    return sum(math.prod(d) for d, _ in hlo_parse.arrays(shape_text))


def _operand_names(instr: hlo_parse.Instr) -> list[str]:
    return [op.split()[-1].lstrip("%") for op in hlo_parse.split_top(instr.operands)]


def _dims(attr: str) -> list[int]:
    return [int(x) for x in attr.strip("{}").split(",") if x.strip()]


def instr_flops(instr: hlo_parse.Instr, shapes: dict[str, str]) -> float:
    """The flops of one instruction itself (not of the computations it calls)."""
    op = instr.opcode
    if op == "dot":
        lhs = _operand_names(instr)[0]
        arr = hlo_parse.arrays(shapes.get(lhs, ""))
        if not arr:
            return 0.0
        dims = arr[0][0]
        k = math.prod(dims[i] for i in _dims(instr.attrs.get("lhs_contracting_dims", "{}")))
        return 2.0 * _elements(instr.shape) * k
    if op == "convolution":
        return _convolution_flops(instr, shapes)
    if op in _ELEMENTWISE:
        return float(_elements(instr.shape))
    if op in ("reduce", "reduce-window"):
        first = _operand_names(instr)[0]
        return float(_elements(shapes.get(first, "")))
    return 0.0


def _window(instr: hlo_parse.Instr, spatial: int) -> list[dict[str, int | tuple[int, int]]]:
    """Per spatial dimension: size, stride, padding (low, high), lhs and rhs dilation, from
    `window={size=3x3 stride=2x2 pad=0_1x0_1 lhs_dilate=... rhs_dilate=...}`."""
    if not spatial:
        return []
    fields = dict(f.split("=", 1) for f in instr.attrs.get("window", "{}").strip("{}").split()
                  if "=" in f)

    def per_dim(key: str, default: str) -> list[str]:
        return fields.get(key, "x".join([default] * spatial)).split("x")

    out = []
    for size, stride, pad, lhs, rhs in zip(per_dim("size", "1"), per_dim("stride", "1"),
                                           per_dim("pad", "0_0"), per_dim("lhs_dilate", "1"),
                                           per_dim("rhs_dilate", "1")):
        lo, hi = (int(x) for x in pad.split("_"))
        out.append({"size": int(size), "stride": int(stride), "pad": (lo, hi),
                    "lhs": int(lhs), "rhs": int(rhs)})
    return out


def _valid_taps(n_in: int, n_out: int, w: dict) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that read a real input
    element: not padding, not a hole of the input's dilation (HloCostAnalysis counts so)."""
    extent = (n_in - 1) * w["lhs"] + 1
    starts = np.arange(n_out, dtype=np.int64) * w["stride"] - w["pad"][0]
    taps = 0
    for k in range(w["size"]):
        p = starts + k * w["rhs"]
        taps += int(np.count_nonzero((p >= 0) & (p < extent) & (p % w["lhs"] == 0)))
    return taps


def _convolution_flops(instr: hlo_parse.Instr, shapes: dict[str, str]) -> float:
    """2 x output batch x output features x input features per group x valid taps, read
    through `dim_labels` (`b01f_01io->b01f`). The TPU compiler writes every dot as a
    convolution, a batched dot as a base-dilated one (`0bf_0io->0bf`, window
    `size=4 stride=3 lhs_dilate=4`: one real tap per output position);
    test_analysis_tpu.py::test_flops_match_the_analytic_count."""
    labels = re.fullmatch(r"(\w+)_(\w+)->(\w+)", instr.attrs.get("dim_labels", ""))
    lhs_name, rhs_name = _operand_names(instr)[:2]
    lhs = hlo_parse.arrays(shapes.get(lhs_name, ""))
    rhs = hlo_parse.arrays(shapes.get(rhs_name, ""))
    out = hlo_parse.arrays(instr.shape)
    if not (labels and lhs and rhs and out):
        return 0.0
    lhs_l, rhs_l, out_l = labels.groups()
    lhs_d, rhs_d, out_d = lhs[0][0], rhs[0][0], out[0][0]
    spatial = sorted(c for c in out_l if c.isdigit())
    windows = _window(instr, len(spatial))
    taps = math.prod(_valid_taps(lhs_d[lhs_l.index(c)], out_d[out_l.index(c)], w)
                     for c, w in zip(spatial, windows))
    return 2.0 * out_d[out_l.index("b")] * out_d[out_l.index("f")] * rhs_d[rhs_l.index("i")] * taps


class _Counter:
    def __init__(self, module: hlo_parse.Module):
        self.module = module
        self.shapes = {i.name: i.shape for c in module.computations.values() for i in c}
        self.memo: dict[tuple[str, bool], float] = {}

    def flops(self, comp: str, with_trips: bool, stack: tuple[str, ...] = ()) -> float:
        key = (comp, with_trips)
        if key in self.memo:
            return self.memo[key]
        if comp in stack:
            raise ValueError(f"HLO computation {comp!r} calls itself; cannot count flops")
        total = 0.0
        instrs = self.module.computations.get(comp, ())
        for instr in instrs:
            total += instr_flops(instr, self.shapes)
            if instr.opcode in ("reduce", "reduce-window", "scatter", "select-and-scatter",
                                "sort", "all-reduce", "reduce-scatter"):
                continue  # their called computations are per-element reducers, counted above
            trips = (hlo_loops.trip_count(self.module, instr, instrs)
                     if instr.opcode == "while" and with_trips else None)
            inner = sum(self.flops(c, with_trips, stack + (comp,)) for c in called(instr))
            total += inner * (trips or 1)
        self.memo[key] = total
        return total


def loop_extra_flops(hlo_text: str) -> float:
    """Flops the program's while loops run beyond one iteration each (known trip counts; an
    unknown one counts once): what cost_analysis() leaves out."""
    counter = _Counter(hlo_parse.parse_module(hlo_text))
    entry = counter.module.entry
    return counter.flops(entry, True) - counter.flops(entry, False)


def program_flops(hlo_text: str) -> float:
    """The program's flops per device by this module's rules, loops at their trip counts."""
    counter = _Counter(hlo_parse.parse_module(hlo_text))
    return counter.flops(counter.module.entry, True)
