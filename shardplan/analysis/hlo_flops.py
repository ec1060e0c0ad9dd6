"""The flops a compiled program's while loops run beyond their first iteration.

`compiled.cost_analysis()` counts a while body once, whatever its trip count (checked on
jax 0.10.2: a scan of 10 matmuls reports the flops of one). A scan over layers, a pipeline's
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

from shardplan.analysis import hlo_parse
from shardplan.analysis.hlo_collectives import called, trip_count

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
        rhs = hlo_parse.arrays(shapes.get(_operand_names(instr)[1], ""))
        kernel = math.prod(rhs[0][0]) if rhs else 1
        out_features = max(hlo_parse.arrays(instr.shape)[0][0][-1:] or [1])
        return 2.0 * _elements(instr.shape) * kernel / max(out_features, 1)
    if op in _ELEMENTWISE:
        return float(_elements(instr.shape))
    if op in ("reduce", "reduce-window"):
        first = _operand_names(instr)[0]
        return float(_elements(shapes.get(first, "")))
    return 0.0


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
        for instr in self.module.computations.get(comp, ()):
            total += instr_flops(instr, self.shapes)
            if instr.opcode in ("reduce", "reduce-window", "scatter", "select-and-scatter",
                                "sort", "all-reduce", "reduce-scatter"):
                continue  # their called computations are per-element reducers, counted above
            trips = trip_count(instr) if instr.opcode == "while" and with_trips else None
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
