"""Reduction and cumulative strategies: every one compiled on 1x8 and 2x4 meshes; a split sum
leaves a partial sum, a split max all-reduces, argmax and cumulative axes stay whole."""

import jax.numpy as jnp
import pytest
from jax import lax

from shardplan.strategies import registry
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests import strategies_harness as H

X = jnp.ones((8, 8, 16), jnp.float32)
BOOLS = jnp.ones((8, 16), bool)

CASES = [
    ("sum_mid", lambda x: jnp.sum(x, axis=1), (X,), "reduce_sum"),
    ("sum_outer", lambda x: jnp.sum(x, axis=(0, 2)), (X,), "reduce_sum"),
    ("sum_all", jnp.sum, (X,), "reduce_sum"),
    ("max", lambda x: jnp.max(x, axis=1), (X,), "reduce_max"),
    ("min", lambda x: jnp.min(x, axis=(0, 2)), (X,), "reduce_min"),
    ("prod", lambda x: jnp.prod(x, axis=0), (X,), "reduce_prod"),
    ("and", lambda b: jnp.all(b, axis=1), (BOOLS,), "reduce_and"),
    ("or", lambda b: jnp.any(b, axis=0), (BOOLS,), "reduce_or"),
    ("argmax", lambda x: jnp.argmax(x, axis=1), (X,), "argmax"),
    ("argmin", lambda x: jnp.argmin(x, axis=2), (X,), "argmin"),
    ("cumsum", lambda x: jnp.cumsum(x, axis=1), (X,), "cumsum"),
    ("cumsum_reverse", lambda x: lax.cumsum(x, axis=2, reverse=True), (X,), "cumsum"),
    ("cumprod", lambda x: jnp.cumprod(x, axis=0), (X,), "cumprod"),
    ("cummax", lambda x: lax.cummax(x, axis=1), (X,), "cummax"),
    ("cummin", lambda x: lax.cummin(x, axis=1), (X,), "cummin"),
    ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, axis=2), (X,), "cumlogsumexp"),
    ("reduce_combined", lambda x, y: lax.reduce(
        (x, y), (0.0, 1.0), lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,)), (X, X), "reduce"),
]


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_compiles_to_what_it_declares(case, mesh_name, request):
    _, f, args, prim = case
    graph, node = H.single_node(f, *args, primitive=prim)
    H.check_all(node, graph, request.getfixturevalue(mesh_name))


MESH = MeshShape(("data", "model"), (2, 4))


def _strategies(f, *args, prim, mesh=MESH):
    graph, node = H.single_node(f, *args, primitive=prim)
    return node, registry.strategies_for(node, graph, mesh)


def test_split_sum_is_partial_without_comms():
    _, strategies = _strategies(lambda x: jnp.sum(x, axis=1), X, prim="reduce_sum")
    s = [s for s in strategies if s.in_specs[0] == ShardSpec.split(3, 1, "model")]
    assert len(s) == 1 and s[0].out_specs[0] == ShardSpec(((), ()), ("model",))
    assert all(not s.comms for s in strategies)
    # a partial input stays partial, joined by the axes of the reduced dimension
    s = [s for s in strategies if s.in_specs[0] == ShardSpec((("model",), (), ()), ("data",))]
    assert len(s) == 1 and s[0].out_specs[0] == ShardSpec((("model",), ()), ("data",))


def test_split_max_all_reduces_the_output():
    node, strategies = _strategies(lambda x: jnp.max(x, axis=1), X, prim="reduce_max")
    s = [s for s in strategies if s.in_specs[0] == ShardSpec((("data",), ("model",), ()))]
    assert len(s) == 1
    (c,) = s[0].comms
    assert (c.kind, c.axes, c.nbytes) == ("all-reduce", ("model",), 4 * 16 * 4)
    assert s[0].out_specs[0] == ShardSpec((("data",), ())) and s[0].flops == node.flops / 8


def test_argmax_and_cumulative_axes_stay_whole():
    for f, prim, axis in ((lambda x: jnp.argmax(x, axis=1), "argmax", 1),
                          (lambda x: jnp.cumsum(x, axis=2), "cumsum", 2)):
        _, strategies = _strategies(f, X, prim=prim)
        assert all(not s.in_specs[0].dims[axis] for s in strategies)
        assert len(strategies) > 4


def test_counts_on_1x8_and_2x4():
    m8 = MeshShape(("x",), (8,))
    assert len(_strategies(lambda x: jnp.sum(x, axis=1), X, prim="reduce_sum", mesh=m8)[1]) == 5
    assert len(_strategies(lambda x: jnp.sum(x, axis=1), X, prim="reduce_sum")[1]) == 25
    assert len(_strategies(lambda x: jnp.max(x, axis=1), X, prim="reduce_max")[1]) == 16
    assert len(_strategies(lambda x: jnp.argmax(x, axis=1), X, prim="argmax")[1]) == 9
