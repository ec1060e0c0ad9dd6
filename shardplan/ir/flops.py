"""Flops formulas: pure functions (in_shapes, out_shapes, params) -> flops. Which primitive
uses which is the table in shardplan/ir/primitives.py.

The numbers follow XLA's cost analysis of the compiled CPU program (`compiled.cost_analysis()
["flops"]`), so the graph's flops can be checked against compiled programs: tests/
test_ir_primitives.py measures them. XLA counts transcendental evaluations apart, and
counts ops JAX or XLA expand (erf_inv, cumsum, select_and_scatter) by what they expand to.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Shape = tuple[int, ...]
FlopsRule = Callable[[Sequence[Shape], Sequence[Shape], dict], float]


def size(shape: Shape) -> int:
    return math.prod(shape)


def zero(ins, outs, params) -> float:
    """Ops that only move or reinterpret data, and pure transcendentals (counted apart)."""
    return 0.0


def elementwise(ins, outs, params) -> float:
    """One flop per output element: the default, also of primitives the table does not know."""
    return float(sum(size(o) for o in outs))


def per_element(k: float) -> FlopsRule:
    """k flops per element of the first output (ops JAX expands into k elementwise ops)."""
    def rule(ins, outs, params) -> float:
        return k * size(outs[0])
    rule.__doc__ = f"{k} flops per output element"
    return rule


def constant(k: float) -> FlopsRule:
    """k flops whatever the shapes (work on a single key)."""
    def rule(ins, outs, params) -> float:
        return float(k)
    return rule


def dot_general(ins, outs, params) -> float:
    """A multiply and an add per output element and contracted position."""
    (lc, _), _ = params["dimension_numbers"]
    contract = math.prod(ins[0][d] for d in lc)
    return 2.0 * size(outs[0]) * contract


def _taps(in_size: int, out_size: int, k_size: int, stride: int, lo: int, lhs_dil: int,
          rhs_dil: int) -> int:
    """(output, kernel) position pairs of one spatial dimension that read a real input element
    (not padding, not a hole of lhs dilation): XLA counts only these multiply-adds."""
    o = np.arange(out_size)[:, None]
    k = np.arange(k_size)[None, :]
    pos = o * stride + k * rhs_dil - lo
    valid = (pos >= 0) & (pos <= (in_size - 1) * lhs_dil) & (pos % lhs_dil == 0)
    return int(valid.sum())


def conv(ins, outs, params) -> float:
    lhs, rhs, out = ins[0], ins[1], outs[0]
    dn = params.get("dimension_numbers")
    if dn is None:
        return 2.0 * size(out) * (size(rhs) // max(rhs[0], 1))
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    nsp = len(lhs_spec) - 2
    strides = params.get("window_strides") or (1,) * nsp
    padding = params.get("padding") or ((0, 0),) * nsp
    lhs_dil = params.get("lhs_dilation") or (1,) * nsp
    rhs_dil = params.get("rhs_dilation") or (1,) * nsp
    taps = 1
    for d in range(nsp):
        taps *= _taps(lhs[lhs_spec[2 + d]], out[out_spec[2 + d]], rhs[rhs_spec[2 + d]],
                      strides[d], padding[d][0], lhs_dil[d], rhs_dil[d])
    return 2.0 * out[out_spec[0]] * out[out_spec[1]] * rhs[rhs_spec[1]] * taps


def reduction(ins, outs, params) -> float:
    """N elements reduced to M take N - M combines."""
    return float(max(size(ins[0]) - size(outs[0]), 0)) if ins else 0.0


def combined_reduction(ins, outs, params) -> float:
    """lax.reduce with its own combiner (a jaxpr): the combiner's equations once per element
    reduced away."""
    body = params.get("jaxpr")
    n = len(getattr(getattr(body, "jaxpr", body), "eqns", ())) or 1
    return n * reduction(ins, outs, params)


def arg_reduction(ins, outs, params) -> float:
    """argmax/argmin combine (value, index) pairs: 9 flops per combine for floats (7 for
    integers; the formula sees no dtypes)."""
    return 9.0 * reduction(ins, outs, params)


def _scan(n: int) -> int:
    """Flops of one row of a cumulative op of length n, as XLA CPU runs it: a reduce-window
    of width n, which its ReduceWindowRewriter cuts into blocks of 16 (padded) once n > 16,
    scans the block totals the same way, and adds them back."""
    if n <= 16:
        return n * (n - 1)
    blocks = -(-n // 16)
    carry = blocks * (blocks - 1) + blocks - 1 if blocks <= 16 else _scan(blocks)
    return 16 * 15 * blocks + carry + 16 * blocks


def cumulative(k: float = 1.0) -> FlopsRule:
    """cumsum and friends along params["axis"]; k flops per combine (8 for cumlogsumexp)."""
    def rule(ins, outs, params) -> float:
        shape = ins[0]
        n = shape[params["axis"]]
        return k * _scan(n) * (size(shape) // max(n, 1))
    return rule


def sort(ins, outs, params) -> float:
    """N ceil(log2 N) over all N elements of the first operand, whatever the dimension and
    the number of operands (XLA's HandleSort)."""
    n = size(ins[0])
    return float(n * math.ceil(math.log2(n))) if n > 1 else 0.0


def integer_pow(ins, outs, params) -> float:
    """x ** y by repeated squaring: floor(log2 |y|) squarings and popcount(|y|) - 1 products,
    and one division for y < 0."""
    y = int(params["y"])
    a = abs(y)
    muls = a.bit_length() - 1 + a.bit_count() - 1 if a else 0
    return float((muls + (y < 0)) * size(outs[0]))


def polynomial(ins, outs, params) -> float:
    """Horner's rule over the coefficients (the operands after x): unrolled (up to `unroll`
    of them, 8 by default) a multiply and an add for each past the first, per element; past
    that a scan over all of them from zero."""
    n = len(ins) - 1
    unroll = params.get("unroll") or 8
    return 2.0 * (n - 1 if n <= unroll else n) * size(outs[0])


def _mode(params) -> str:
    mode = params.get("mode")
    return getattr(mode, "name", str(mode))


def gather(ins, outs, params) -> float:
    """Free, except out of bounds filled (mode FILL_OR_DROP, jnp's default): a select per
    output element and 4 checks per index coordinate less one per index vector."""
    if "FILL_OR_DROP" not in _mode(params):
        return 0.0
    idx = ins[1]
    vectors = size(idx[:-1]) if idx else 1
    return float(size(outs[0]) + 4 * size(idx) - vectors)


def scatter_combine(ins, outs, params) -> float:
    """scatter-add, -mul, -min, -max: one combine per update element (and, mode CLIP, one
    clamp per index coordinate)."""
    return float(size(ins[-1])) + scatter(ins, outs, params)


def scatter(ins, outs, params) -> float:
    """A scatter that replaces: free (and, mode CLIP, one clamp per index coordinate)."""
    return float(size(ins[1])) if "CLIP" in _mode(params) and len(ins) > 1 else 0.0


def reduce_window(ins, outs, params) -> float:
    window = math.prod(params.get("window_dimensions") or (1,))
    return float(size(outs[0])) * max(window - 1, 0)


def select_and_scatter(ins, outs, params) -> float:
    """Max-pool gradients as XLA CPU expands them: per source element, (7 + rank) flops for
    each of window - 1 (value, index) comparisons and one add."""
    dims = params.get("window_dimensions") or (1,)
    window = math.prod(dims)
    return float(size(ins[0])) * ((7 + len(dims)) * (window - 1) + 1)


def random_bits(ins, outs, params) -> float:
    """Partitionable threefry: 143 integer ops per 32-bit word, and 2 more per dimension for
    the word's counter. XLA:CPU runs the rounds in a while loop of 5 trips: cost_analysis()
    counts its body once, 45 + 2 x ndim per word, and the other 4 trips add 100 per word
    (what analysis/hlo.py adds as loop_flops and the pricer charges;
    tests/test_ir_primitives.py::test_flops_match_xla)."""
    out = outs[0]
    return float(size(out)) * (143 + 2 * len(out))


def random_split(ins, outs, params) -> float:
    """Threefry per new key: 144 ops each and 53 to set up (the rounds' loop at its 5 trips,
    as random_bits; tests/test_ir_primitives.py::test_flops_match_xla)."""
    return 144.0 * size(outs[0]) + 53.0


def threefry2x32(ins, outs, params) -> float:
    """About 41 integer ops per pair of 32-bit words."""
    return 41.0 * size(outs[0])
