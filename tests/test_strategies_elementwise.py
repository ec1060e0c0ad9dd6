"""Elementwise strategies: every one compiled on 1x8 and 2x4 meshes against the unsharded op
and the HLO's collectives; partial sums pass only through linear ops."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from shardplan.strategies import registry
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests import strategies_harness as H

F = jnp.ones((8, 16), jnp.float32)
B = jnp.ones((8, 16), bool)
ROW = jnp.ones((1, 16), jnp.float32)


def _grad_add_any():
    return jax.grad(lambda x: jnp.sum(jnp.sin(x) * x)), (F,)


# (id, f, args, primitive, input range)
CASES = [
    ("add", lambda a, b: a + b, (F, F), "add", None),
    ("sub_bcast_row", lambda a, b: a - b, (F, ROW), "sub", None),
    ("mul", lambda a, b: a * b, (F, F), "mul", None),
    ("mul_literal", lambda a: a * 2.0, (F,), "mul", None),
    ("div", lambda a, b: a / b, (F, F), "div", None),
    ("neg", lambda a: -a, (F,), "neg", None),
    ("add_any", *_grad_add_any(), "add_any", None),
    ("exp", jnp.exp, (F,), "exp", None),
    ("log", jnp.log, (F,), "log", None),
    ("log1p", jnp.log1p, (F,), "log1p", None),
    ("expm1", jnp.expm1, (F,), "expm1", None),
    ("tanh", jnp.tanh, (F,), "tanh", None),
    ("logistic", jax.nn.sigmoid, (F,), "logistic", None),
    ("sqrt", jnp.sqrt, (F,), "sqrt", None),
    ("rsqrt", lax.rsqrt, (F,), "rsqrt", None),
    ("abs", jnp.abs, (F,), "abs", (-1.0, 1.0)),
    ("sign", jnp.sign, (F,), "sign", (-1.0, 1.0)),
    ("integer_pow", lambda a: a ** 3, (F,), "integer_pow", None),
    ("pow", lambda a, b: a ** b, (F, F), "pow", None),
    ("max", jnp.maximum, (F, F), "max", None),
    ("min_scalar", lambda a, s: jnp.minimum(a, s), (F, jnp.float32(1.0)), "min", None),
    ("erf", lax.erf, (F,), "erf", None),
    ("erf_inv", lax.erf_inv, (F,), "erf_inv", (-0.9, 0.9)),
    ("sin", jnp.sin, (F,), "sin", None),
    ("cos", jnp.cos, (F,), "cos", None),
    ("square", jnp.square, (F,), "square", None),
    ("lt", lambda a, b: a < b, (F, F), "lt", None),
    ("eq", lambda a, b: a == b, (F, F), "eq", None),
    ("and", jnp.logical_and, (B, B), "and", None),
    ("not", jnp.logical_not, (B,), "not", None),
    ("select_n", lambda c, a, b: lax.select_n(c, a, b), (B, F, F), "select_n", None),
    ("select_n_scalar_pred", lambda c, a, b: lax.select_n(c, a, b),
     (jnp.bool_(True), F, F), "select_n", None),
    ("clamp", lambda lo, a, hi: lax.clamp(lo, a, hi), (jnp.float32(0.7), F, jnp.float32(1.2)),
     "clamp", None),
    ("nextafter", jnp.nextafter, (F, F), "nextafter", None),
    ("is_finite", jnp.isfinite, (F,), "is_finite", None),
    ("convert_f32_bf16", lambda a: a.astype(jnp.bfloat16), (F,), "convert_element_type", None),
    ("convert_f32_i32", lambda a: a.astype(jnp.int32), (F,), "convert_element_type", None),
    ("reduce_precision", lambda a: lax.reduce_precision(a, 5, 10), (F,), "reduce_precision",
     None),
    ("copy", lambda a: jnp.array(a, copy=True), (F,), "copy", None),
]


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_compiles_to_what_it_declares(case, mesh_name, request):
    _, f, args, prim, rng = case
    mesh = request.getfixturevalue(mesh_name)
    graph, node = H.single_node(f, *args, primitive=prim)
    low, high = rng or (0.5, 1.5)
    xs = H.random_inputs(node, graph, low=low, high=high)
    strategies = H.check_all(node, graph, mesh, xs)
    assert len(strategies) >= 3  # replicated and a split of each dimension at least


def _strategies(f, *args, prim, mesh=None):
    mesh = mesh or MeshShape(("data", "model"), (2, 4))
    graph, node = H.single_node(f, *args, primitive=prim)
    return registry.strategies_for(node, graph, mesh)


def _partials(strategies):
    return [s for s in strategies if any(x.partial for x in (*s.in_specs, *s.out_specs))]


def test_counts_on_1x8_and_2x4():
    m8 = MeshShape(("x",), (8,))
    # 3 splits on 1x8 (replicated, rows, columns) and 9 on 2x4, plus partial sums
    assert len(_strategies(jnp.exp, F, prim="exp", mesh=m8)) == 3
    assert len(_strategies(jnp.exp, F, prim="exp")) == 9
    assert len(_strategies(lambda a, b: a + b, F, F, prim="add", mesh=m8)) == 3
    assert len(_strategies(lambda a, b: a + b, F, F, prim="add")) == 9
    assert len(_strategies(jnp.negative, F, prim="neg", mesh=m8)) == 4
    assert len(_strategies(jnp.negative, F, prim="neg")) == 16


def test_partial_sums_pass_only_through_linear_ops():
    assert not _partials(_strategies(jnp.exp, F, prim="exp"))
    assert not _partials(_strategies(lambda a: a + 1.0, F, prim="add"))  # a literal is no sum
    assert not _partials(_strategies(lambda a: a.astype(jnp.int32), F,
                                     prim="convert_element_type"))
    # A partial sum is reduced before a widening convert (XLA reduces a dot's partial result
    # where the dot makes it: a bf16 weight gradient is all-reduced in bf16, then widened to
    # its f32 parameter's dtype); a narrowing one carries it
    bf16 = jax.ShapeDtypeStruct(F.shape, jnp.bfloat16)
    assert not _partials(_strategies(lambda a: a.astype(jnp.float32), bf16,
                                     prim="convert_element_type"))
    assert _partials(_strategies(lambda a: a.astype(jnp.bfloat16), F,
                                 prim="convert_element_type"))
    # XLA reduces both operands of an add before adding: no partial sum passes through it
    assert not _partials(_strategies(lambda a, b: a + b, F, F, prim="add"))
    negs = _partials(_strategies(jnp.negative, F, prim="neg"))
    assert negs and all(s.in_specs[0].partial == s.out_specs[0].partial for s in negs)
    muls = _partials(_strategies(lambda a, b: a * b, F, F, prim="mul"))
    assert muls and all(sum(bool(x.partial) for x in s.in_specs) == 1 for s in muls)
    divs = _partials(_strategies(lambda a, b: a / b, F, F, prim="div"))
    assert divs and all(s.in_specs[0].partial and not s.in_specs[1].partial for s in divs)


def test_broadcast_operand_follows_only_its_full_dimensions():
    for s in _strategies(lambda a, b: a - b, F, ROW, prim="sub"):
        assert s.in_specs[1].dims[0] == () and s.in_specs[1].dims[1] == s.out_specs[0].dims[1]


def test_flops_are_divided_by_the_devices_that_share_the_work():
    graph, node = H.single_node(lambda a, b: a * b, F, F, primitive="mul")
    mesh = MeshShape(("data", "model"), (2, 4))
    assert node.flops > 0
    strategies = registry.strategies_for(node, graph, mesh)
    for s in strategies:
        assert s.flops == pytest.approx(node.flops / s.out_specs[0].num_shards(mesh))
    split = ShardSpec((("data",), ("model",)))
    assert any(s.out_specs[0] == split and s.flops == node.flops / 8 for s in strategies)
