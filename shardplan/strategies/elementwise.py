"""Elementwise ops: operands and outputs share one split; linear ones pass partial sums through."""

from __future__ import annotations

from collections.abc import Sequence

from shardplan.ir.graph import Graph, Node, Value
from shardplan.strategies import common
from shardplan.strategies.base import Rule, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs

ELEMENTWISE = (
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "bessel_i0e", "bessel_i1e", "cbrt", "ceil", "clamp", "clz", "complex", "conj",
    "convert_element_type", "copy", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv",
    "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma", "igamma_grad_a", "igammac",
    "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "mulhi", "ne", "neg", "nextafter", "not", "or", "polygamma",
    "population_count", "pow", "real", "reduce_precision", "regularized_incomplete_beta", "rem",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh", "xor", "zeta",
    # bitcasts between dtypes of one size; others change the shape and fall back to replicated
    "bitcast_convert_type",
    # identities whose own sharding the plan replaces
    "sharding_constraint", "reshard",
)

# One-operand ops that commute with a sum: the partial sum passes through. add/sub/add_any
# of two partial sums would too (sum(a_i) + sum(b_i) == sum(a_i + b_i)), but XLA's SPMD
# partitioner reduces each operand before the add (measured, jax 0.10.2: `a @ b + c @ d`
# with the contraction split all-reduces both products), so offering it would price one
# all-reduce where the program runs two.
_SUM_LINEAR = frozenset({"neg", "copy", "convert_element_type", "real", "imag", "conj"})


def operand_spec(value: Value, shape: Sequence[int], spec: ShardSpec) -> ShardSpec | None:
    """The spec of an operand of an elementwise op whose output has `shape` and `spec`:
    scalars and size-1 (implicitly broadcast) dimensions replicated, None if not elementwise."""
    if value.ndim == 0:
        return ShardSpec(())
    if value.ndim != len(shape):
        return None
    dims = []
    for size, out_size, d in zip(value.shape, shape, spec.dims):
        if size == out_size:
            dims.append(d)
        elif size == 1:
            dims.append(())
        else:
            return None
    return ShardSpec(tuple(dims))


def shared_spec_strategies(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """One strategy per split of the first output, every operand and output following it."""
    ins, outs = common.in_values(node, graph), common.out_values(node, graph)
    if not outs:
        return []
    shape = outs[0].shape
    found = []
    for spec in enumerate_specs(shape, mesh, common.MAX_SPLIT_DIMS):
        specs = [operand_spec(v, shape, spec) for v in (*ins, *outs)]
        if any(s is None for s in specs):
            continue
        found.append(common.make(node, graph, mesh, specs[:len(ins)], specs[len(ins):]))
    return [s for s in found if s is not None]


def linear_carriers(node: Node, graph: Graph) -> list[tuple[int, ...]]:
    """The sets of inputs that may carry a partial sum into this elementwise node."""
    n = len(node.inputs)
    if node.primitive in _SUM_LINEAR:
        return [tuple(range(n))]
    if node.primitive == "mul":
        return [(k,) for k in range(n)]
    if node.primitive == "div":
        return [(0,)]
    return []


def elementwise_rule(node: Node, graph: Graph, mesh: MeshShape) -> list[Strategy]:
    """Shared splits, then the partial-passthrough variants of linear ops."""
    bases = shared_spec_strategies(node, graph, mesh)
    found = list(bases)
    for carriers in linear_carriers(node, graph):
        found += common.partial_passthrough(node, graph, mesh, bases, carriers)
    return found


def rules() -> dict[str, Rule]:
    return {p: elementwise_rule for p in ELEMENTWISE}
