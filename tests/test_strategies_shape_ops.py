"""Data-movement strategies: every one compiled on 1x8 and 2x4 meshes; splits follow the
dimensions through transposes, broadcasts and reshapes, cut dimensions stay whole."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from shardplan.strategies import registry, shape_ops
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests import strategies_harness as H

A = jnp.ones((8, 16), jnp.float32)
X = jnp.ones((8, 16, 8), jnp.float32)
I = jnp.int32(2)

CASES = [
    ("transpose", lambda x: x.transpose(2, 0, 1), (X,), "transpose"),
    ("squeeze", lambda x: lax.squeeze(x, (1,)), (jnp.ones((8, 1, 16)),), "squeeze"),
    ("expand_dims", lambda a: lax.expand_dims(a, (1,)), (A,), "broadcast_in_dim"),
    ("broadcast_new_dim", lambda v: jnp.broadcast_to(v, (8, 16)), (jnp.ones(16),),
     "broadcast_in_dim"),
    ("broadcast_size1", lambda c: jnp.broadcast_to(c, (8, 16)), (jnp.ones((8, 1)),),
     "broadcast_in_dim"),
    ("broadcast_literal", lambda: jnp.full((8, 16), 3.0), (), "broadcast_in_dim"),
    ("reshape_merge", lambda x: x.reshape(128, 8), (X,), "reshape"),
    ("reshape_split", lambda x: x.reshape(8, 4, 4, 8), (X,), "reshape"),
    ("reshape_major_split", lambda a: a.reshape(2, 4, 16), (A,), "reshape"),
    ("reshape_unit_dims", lambda x: x.reshape(8, 1, 16), (A,), "reshape"),
    ("reshape_flatten", lambda x: x.reshape(-1), (X,), "reshape"),
    ("slice", lambda a: lax.slice(a, (2, 0), (6, 16)), (A,), "slice"),
    ("slice_strided", lambda a: lax.slice(a, (0, 0), (8, 16), (1, 2)), (A,), "slice"),
    ("dynamic_slice", lambda a, i: lax.dynamic_slice(a, (i, 0), (4, 16)), (A, I),
     "dynamic_slice"),
    ("dynamic_update_slice", lambda a, u, i: lax.dynamic_update_slice(a, u, (0, i)),
     (A, jnp.ones((8, 4)), I), "dynamic_update_slice"),
    ("pad", lambda a: lax.pad(a, 0.0, [(1, 2, 0), (0, 0, 0)]), (A,), "pad"),
    ("pad_interior", lambda a: lax.pad(a, 0.0, [(0, 0, 0), (0, 0, 1)]), (A,), "pad"),
    ("rev", lambda a: lax.rev(a, (1,)), (A,), "rev"),
    ("iota", lambda: lax.broadcasted_iota(jnp.int32, (8, 16), 1), (), "iota"),
    ("concatenate", lambda a, b: jnp.concatenate([a, b], axis=1), (A, A), "concatenate"),
    ("split", lambda a: lax.split(a, (4, 12), axis=1), (A,), "split"),
    ("sort", lambda a: lax.sort(a, dimension=1), (A,), "sort"),
    ("sort_two_operands", lambda a, b: lax.sort((a, b), dimension=0, num_keys=1), (A, A),
     "sort"),
    ("stack", lambda a, b: jnp.stack([a, b], axis=1), (A, A), "stack"),
    ("stack_last", lambda a, b: jnp.stack([a, b], axis=-1), (A, A), "stack"),
    ("unstack", lambda x: lax.unstack(x, axis=2), (jnp.ones((8, 16, 2)),), "unstack"),
    ("tile", lambda a: jnp.tile(a, (1, 2)), (A,), "tile"),
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
    return registry.strategies_for(node, graph, mesh)


def test_reshape_map_keeps_splits_of_major_dimensions_only():
    assert shape_ops.reshape_map((8, 16, 8), (128, 8)) == {0: 0, 2: 1}
    assert shape_ops.reshape_map((8, 16, 8), (8, 4, 4, 8)) == {0: 0, 1: 1, 2: 3}
    assert shape_ops.reshape_map((8, 1, 16), (8, 16)) == {0: 0, 2: 1}
    assert shape_ops.reshape_map((8, 16), (2, 4, 16)) == {0: 0, 1: 2}


def test_reshape_refuses_splits_that_do_not_survive():
    outs = {s.in_specs[0]: s.out_specs[0]
            for s in _strategies(lambda x: x.reshape(128, 8), X, prim="reshape")}
    assert ShardSpec.split(3, 1, "model") not in outs  # a minor dimension of the merged group
    assert outs[ShardSpec.split(3, 0, "model")] == ShardSpec.split(2, 0, "model")
    # 8 rows over 8 devices would leave (2, 4) -> (2,) with 4 rows each: refused
    outs = {s.in_specs[0]: s.out_specs[0] for s in _strategies(
        lambda a: a.reshape(2, 4, 16), A, prim="reshape", mesh=MeshShape(("x",), (8,)))}
    assert ShardSpec.split(2, 0, "x") not in outs


def test_cut_dimensions_stay_whole():
    for f, args, prim, whole in [
        (lambda a: lax.slice(a, (2, 0), (6, 16)), (A,), "slice", 0),
        (lambda a: lax.pad(a, 0.0, [(0, 0, 0), (1, 1, 0)]), (A,), "pad", 1),
        (lambda a: lax.rev(a, (0,)), (A,), "rev", 0),
        (lambda a, b: jnp.concatenate([a, b], axis=1), (A, A), "concatenate", 1),
        (lambda a: lax.sort(a, dimension=0), (A,), "sort", 0),
    ]:
        strategies = _strategies(f, *args, prim=prim)
        assert len(strategies) > 2
        assert all(not s.in_specs[0].dims[whole] for s in strategies), prim


def test_broadcast_may_split_new_dimensions():
    strategies = _strategies(lambda v: jnp.broadcast_to(v, (8, 16)), jnp.ones(16),
                             prim="broadcast_in_dim")
    s = [s for s in strategies if s.out_specs[0] == ShardSpec.split(2, 0, "data")]
    assert len(s) == 1 and s[0].in_specs[0] == ShardSpec.replicated(1)


def test_counts_on_1x8_and_2x4():
    m8 = MeshShape(("x",), (8,))
    assert len(_strategies(lambda x: x.transpose(2, 0, 1), X, prim="transpose", mesh=m8)) == 5
    assert len(_strategies(lambda x: x.transpose(2, 0, 1), X, prim="transpose")) == 25
    assert len(_strategies(lambda x: x.reshape(128, 8), X, prim="reshape", mesh=m8)) == 4
    assert len(_strategies(lambda a: lax.slice(a, (2, 0), (6, 16)), A, prim="slice")) == 4


def test_partial_sums_pass_through_linear_movements_only():
    def partials(f, *args, prim):
        return [s for s in _strategies(f, *args, prim=prim) if s.in_specs[0].partial]
    assert partials(lambda x: x.transpose(2, 0, 1), X, prim="transpose")
    assert partials(lambda x: x.reshape(128, 8), X, prim="reshape")
    assert not partials(lambda a: lax.pad(a, 1.0, [(1, 1, 0), (0, 0, 0)]), A, prim="pad")
    assert not partials(lambda a: lax.sort(a, dimension=1), A, prim="sort")
    assert not jax.tree.leaves(partials(lambda: jnp.full((8, 16), 3.0), prim="broadcast_in_dim"))


def test_an_uninitialised_array_is_built_in_any_split():
    """lax.empty has no values to compare: each device allocates its piece, no collective."""
    graph, node = H.single_node(lambda: lax.empty((8, 16), jnp.float32), primitive="empty")
    found = registry.strategies_for(node, graph, MESH)
    assert len(found) > 1 and not any(s.comms for s in found)
