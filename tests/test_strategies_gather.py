"""gather and scatter strategies: every one compiled on 1x8 and 2x4 meshes for embedding
lookups and their gradients, take_along_axis (batching dimensions) and cross-entropy picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardplan.ir.lift import lift
from shardplan.strategies import registry
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests import strategies_harness as H

TABLE = jnp.ones((32, 16), jnp.float32)
IDS = jnp.ones((8, 8), jnp.int32)
X = jnp.ones((8, 16), jnp.float32)
LABELS = jnp.ones((8,), jnp.int32)


def _node(f, args, prim):
    graph = lift(jax.make_jaxpr(f)(*args))
    (node,) = [n for n in graph.nodes if n.primitive == prim]
    return graph, node


CASES = [
    ("embedding", lambda t, i: t[i], (TABLE, IDS), "gather"),
    ("take_columns", lambda t, i: jnp.take(t, i, axis=1), (jnp.ones((16, 32)), IDS), "gather"),
    ("take_along_axis", lambda x, l: jnp.take_along_axis(x, l[:, None], axis=1), (X, LABELS),
     "gather"),
    ("pick_labels", lambda x, l: x[jnp.arange(8), l], (X, LABELS), "gather"),
    ("embedding_grad", jax.grad(lambda t, i: jnp.sum(t[i] ** 2)), (TABLE, IDS), "scatter-add"),
    ("take_along_axis_grad",
     jax.grad(lambda x, l: jnp.sum(jnp.take_along_axis(x, l[:, None], axis=1))), (X, LABELS),
     "scatter-add"),
    ("scatter_add_rows", lambda x, i, u: x.at[i].add(u),
     (TABLE, jnp.ones((8,), jnp.int32), jnp.ones((8, 16))), "scatter-add"),
    ("scatter_set_rows", lambda x, i, u: x.at[i].set(u),
     (TABLE, jnp.ones((8,), jnp.int32), jnp.ones((8, 16))), "scatter"),
    ("scatter_mul_rows", lambda x, i, u: x.at[i].multiply(u),
     (TABLE, jnp.ones((8,), jnp.int32), jnp.ones((8, 16))), "scatter-mul"),
]


def _inputs(node, graph):
    """Random inputs whose index arrays hold distinct in-range indices (set order is then
    well defined); literals None."""
    xs = H.random_inputs(node, graph)
    rng = np.random.default_rng(3)
    for k, vid in enumerate(node.inputs):
        v = graph.value(vid)
        if xs[k] is not None and "int" in v.dtype:
            xs[k] = rng.permutation(v.size).reshape(v.shape).astype(v.dtype) % 8
            if node.primitive == "scatter":
                xs[k] = rng.permutation(v.size).reshape(v.shape).astype(v.dtype)
    return xs


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_compiles_to_what_it_declares(case, mesh_name, request):
    _, f, args, prim = case
    graph, node = _node(f, args, prim)
    strategies = H.check_all(node, graph, request.getfixturevalue(mesh_name), _inputs(node, graph))
    assert len(strategies) >= 2


MESH = MeshShape(("data", "model"), (2, 4))


def test_embedding_lookup_splits_the_batch_the_hidden_or_the_vocabulary_dimension():
    graph, node = _node(lambda t, i: t[i], (TABLE, IDS), "gather")
    strategies = registry.strategies_for(node, graph, MESH)
    assert len(strategies) == 25  # each axis: batch, sequence, hidden, vocabulary or nothing
    by_in = {s.in_specs: s.out_specs[0] for s in strategies}
    # the table replicated, the ids split by batch: the output split by batch
    rep, ids = ShardSpec.replicated(2), ShardSpec.split(3, 0, "data")
    assert by_in[(rep, ids)] == ShardSpec.split(3, 0, "data")
    # the table split by hidden columns: the output's hidden dimension follows
    assert by_in[(ShardSpec.split(2, 1, "model"), ids)] == ShardSpec((("data",), (), ("model",)))
    # the vocabulary (indexed) dimension split: each device looks up the rows it holds and
    # the output is a partial sum over the axis (Megatron's vocab-parallel embedding)
    vocab = ShardSpec.split(2, 0, "model")
    assert by_in[(vocab, ids)] == ShardSpec.split(3, 0, "data").with_partial(("model",))
    assert all(s.out_specs[0].partial == s.in_specs[0].dims[0] for s in strategies)


def test_embedding_gradient_is_a_partial_sum_over_the_batch_axes():
    graph, node = _node(jax.grad(lambda t, i: jnp.sum(t[i] ** 2)), (TABLE, IDS), "scatter-add")
    strategies = registry.strategies_for(node, graph, MESH)
    s = [s for s in strategies if s.in_specs[1] == ShardSpec.split(3, 0, "data")
         and not s.in_specs[0].used_axes()]
    assert len(s) == 1
    assert s[0].out_specs[0] == ShardSpec.replicated(2).with_partial(("data",))
    assert s[0].comms == ()


def test_overwriting_scatters_never_split_their_updates():
    graph, node = _node(lambda x, i, u: x.at[i].set(u),
                        (TABLE, jnp.ones((8,), jnp.int32), jnp.ones((8, 16))), "scatter")
    strategies = registry.strategies_for(node, graph, MESH)
    assert all(not s.in_specs[1].used_axes() and not s.out_specs[0].partial for s in strategies)
    assert len(strategies) == 9  # each axis: the rows, the columns or nothing
