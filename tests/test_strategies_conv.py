"""Convolution and pooling strategies: every one compiled on 1x8 and 2x4 meshes, for NCHW and
NHWC layouts, the convolutions of both gradients, grouped convolutions and pooling."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from shardplan.ir.lift import lift
from shardplan.strategies import registry
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests import strategies_harness as H

X = jnp.ones((8, 8, 8, 8), jnp.float32)  # NCHW: batch 8, 8 channels, 8x8
W = jnp.ones((8, 8, 3, 3), jnp.float32)  # OIHW


def _conv(x, w, **kw):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", **kw)


def _nth(f, args, prim, k):
    """The graph of f(*args) and its k-th node of `prim` (gradients hold several convs)."""
    graph = lift(jax.make_jaxpr(f)(*args))
    return graph, [n for n in graph.nodes if n.primitive == prim][k]


XH = jnp.ones((8, 8, 8, 16), jnp.float32)  # NHWC: batch 8, 8x8, 16 channels


def _nhwc_loss(groups):
    def loss(x, w):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=groups,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(y ** 2)
    return loss


def _max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")


CONV = "conv_general_dilated"
CASES = [
    ("nchw", lambda: _nth(_conv, (X, W), CONV, 0)),
    ("nhwc_strided", lambda: _nth(
        lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                              dimension_numbers=("NHWC", "HWIO", "NHWC")),
        (jnp.ones((8, 8, 8, 8)), jnp.ones((3, 3, 8, 16))), CONV, 0)),
    ("weight_grad", lambda: _nth(jax.grad(lambda x, w: jnp.sum(_conv(x, w)), argnums=1),
                                 (X, W), CONV, -1)),
    ("input_grad", lambda: _nth(jax.grad(lambda x, w: jnp.sum(_conv(x, w))), (X, W), CONV, -1)),
    ("grouped", lambda: _nth(lambda x, w: _conv(x, w, feature_group_count=2),
                             (X, jnp.ones((8, 4, 3, 3))), CONV, 0)),
    ("depthwise", lambda: _nth(lambda x, w: _conv(x, w, feature_group_count=8),
                               (X, jnp.ones((8, 1, 3, 3))), CONV, 0)),
    # flax's layout (NHWC, HWIO); the weight gradients are batch-grouped convolutions
    ("depthwise_weight_grad", lambda: _nth(jax.grad(_nhwc_loss(16), argnums=1),
                                           (XH, jnp.ones((3, 3, 1, 16))), CONV, -1)),
    ("depthwise_input_grad", lambda: _nth(jax.grad(_nhwc_loss(16)),
                                          (XH, jnp.ones((3, 3, 1, 16))), CONV, -1)),
    # the input gradient's kernel: a reshape that transposes (its `dimensions`) as it goes
    ("depthwise_kernel_reshape", lambda: _nth(jax.grad(_nhwc_loss(16)),
                                              (XH, jnp.ones((3, 3, 1, 16))), "reshape", 1)),
    ("grouped_weight_grad", lambda: _nth(jax.grad(_nhwc_loss(8), argnums=1),
                                         (XH, jnp.ones((3, 3, 2, 16))), CONV, -1)),
    ("grouped_input_grad", lambda: _nth(jax.grad(_nhwc_loss(4)),
                                        (XH, jnp.ones((3, 3, 4, 16))), CONV, -1)),
    ("max_pool", lambda: _nth(_max_pool, (X,), "reduce_window_max", 0)),
    ("avg_pool", lambda: _nth(
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 1, 2, 2), (1, 1, 1, 1), "SAME"),
        (X,), "reduce_window_sum", 0)),
    ("max_pool_grad", lambda: _nth(jax.grad(lambda x: jnp.sum(_max_pool(x))), (X,),
                                   "select_and_scatter_add", 0)),
]


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_compiles_to_what_it_declares(case, mesh_name, request):
    graph, node = case[1]()
    strategies = H.check_all(node, graph, request.getfixturevalue(mesh_name))
    assert len(strategies) >= (1 if case[0].startswith("grouped") else 2)


MESH = MeshShape(("data", "model"), (2, 4))


def test_conv_roles_follow_dimension_numbers():
    graph, node = _nth(_conv, (X, W), CONV, 0)
    strategies = registry.strategies_for(node, graph, MESH)
    assert len(strategies) == 16  # each axis: batch, out features, in features, nothing
    by_in = {s.in_specs: s for s in strategies}
    # input-feature split: the output is a partial sum
    s = by_in[(ShardSpec.split(4, 1, "model"), ShardSpec.split(4, 1, "model"))]
    assert s.out_specs[0] == ShardSpec.replicated(4).with_partial(("model",))
    # batch x output-feature split
    s = by_in[(ShardSpec.split(4, 0, "data"), ShardSpec.split(4, 0, "model"))]
    assert s.out_specs[0] == ShardSpec((("data",), ("model",), (), ()))
    assert s.flops == node.flops / 8


def test_weight_gradient_splitting_the_batch_is_partial():
    graph, node = _nth(jax.grad(lambda x, w: jnp.sum(_conv(x, w)), argnums=1), (X, W), CONV, -1)
    by_in = {s.in_specs: s for s in registry.strategies_for(node, graph, MESH)}
    s = by_in[(ShardSpec.split(4, 0, "data"), ShardSpec.split(4, 0, "data"))]
    assert s.out_specs[0] == ShardSpec.replicated(4).with_partial(("data",))


def test_depthwise_convs_split_batch_and_channels():
    """A depthwise convolution splits its batch and its channels (its groups, one each);
    other feature-grouped ones run replicated (XLA gathers their split batch or groups)."""
    graph, node = _nth(lambda x, w: _conv(x, w, feature_group_count=8),
                       (X, jnp.ones((8, 1, 3, 3))), CONV, 0)
    strategies = registry.strategies_for(node, graph, MESH)
    assert len(strategies) == 9  # each axis: batch, channels or nothing
    by_in = {s.in_specs: s for s in strategies}
    s = by_in[(ShardSpec.split(4, 1, "model"), ShardSpec.split(4, 0, "model"))]
    assert s.out_specs[0] == ShardSpec.split(4, 1, "model")
    assert s.flops == node.flops / 4
    graph, node = _nth(lambda x, w: _conv(x, w, feature_group_count=2),
                       (X, jnp.ones((8, 4, 3, 3))), CONV, 0)
    assert len(registry.strategies_for(node, graph, MESH)) == 1


def test_depthwise_weight_gradient_splits_channels_or_sums_the_batch():
    """The weight gradient of a depthwise convolution (batch-grouped: its lhs batch is the
    input's channels, its lhs features the input's batch) splits the channels, or the batch
    with a partial sum as a dot's contracting dimension, where no mesh axis is left idle."""
    graph, node = _nth(jax.grad(_nhwc_loss(16), argnums=1), (XH, jnp.ones((3, 3, 1, 16))),
                       CONV, -1)
    assert node.params["batch_group_count"] == 16
    by_name = {s.name: s for s in registry.strategies_for(node, graph, MESH)}
    s = by_name["conv group:data+model"]
    assert s.in_specs == (ShardSpec.split(4, 3, ("data", "model")),) * 2
    assert s.out_specs[0] == ShardSpec.split(4, 3, ("data", "model"))
    s = by_name["conv in:data group:model"]
    assert s.in_specs == (ShardSpec((("data",), (), (), ("model",))),) * 2
    assert s.out_specs[0] == ShardSpec.split(4, 3, "model").with_partial(("data",))
    assert "conv in:model" not in by_name  # data left idle: XLA sums over it too


def test_depthwise_kernel_reshape_keeps_the_channel_split():
    """The depthwise input gradient reshapes the kernel [3, 3, 1, C] -> [3, 3, 1, C, 1] ->
    (transposed by `dimensions`) [3, 3, C, 1]: a channel split follows the channels."""
    graph, node = _nth(jax.grad(_nhwc_loss(16)), (XH, jnp.ones((3, 3, 1, 16))), "reshape", 1)
    assert node.params["dimensions"] is not None
    outs = {s.in_specs[0]: s.out_specs[0] for s in registry.strategies_for(node, graph, MESH)}
    assert outs[ShardSpec.split(5, 3, "model")] == ShardSpec.split(4, 2, "model")


def test_pooling_keeps_windowed_dimensions_whole():
    graph, node = _nth(_max_pool, (X,), "reduce_window_max", 0)
    strategies = registry.strategies_for(node, graph, MESH)
    assert all(not s.in_specs[0].dims[2] and not s.in_specs[0].dims[3] for s in strategies)
    assert len(strategies) == 9
