"""shardplan.search on a cluster without devices: mesh_shape="auto" plans every 1-D and 2-D
mesh and keeps the cheapest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardplan
from shardplan.planning.job import mesh_shapes


def _mlp(batch=64, width=256):
    def step(w1, w2, x):
        def loss(w1, w2):
            return jnp.sum((jax.nn.relu(x @ w1) @ w2) ** 2)
        g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
        return w1 - 0.1 * g1, w2 - 0.1 * g2

    args = (jax.ShapeDtypeStruct((width, width * 4), np.float32),
            jax.ShapeDtypeStruct((width * 4, width), np.float32),
            jax.ShapeDtypeStruct((batch, width), np.float32))
    return step, args


def test_mesh_shapes_are_the_1d_and_2d_factorisations():
    assert mesh_shapes(8) == [(("devices",), (8,)), (("data", "model"), (2, 4)),
                              (("data", "model"), (4, 2))]
    assert mesh_shapes(6, ("dp", "tp")) == [(("tp",), (6,)), (("dp", "tp"), (2, 3)),
                                            (("dp", "tp"), (3, 2))]
    assert mesh_shapes(7) == [(("devices",), (7,))]


def test_auto_mesh_keeps_the_cheapest_and_names_every_mesh():
    step, args = _mlp()
    plans = {}
    for names, sizes in mesh_shapes(8):
        plans[sizes] = shardplan.search(step, *args, cluster="a100-80gb", mesh_shape=sizes,
                                        axis_names=names, state_argnums=(0, 1),
                                        batch_argnums=(2,), time_limit=20, deterministic=True)
    best = shardplan.search(step, *args, cluster="a100-80gb-8", mesh_shape="auto",
                            state_argnums=(0, 1), batch_argnums=(2,), time_limit=60,
                            deterministic=True)
    cheapest = min(p.estimate.total_s for p in plans.values())
    assert best.estimate.total_s == pytest.approx(cheapest, rel=1e-6)
    note = best.notes[-1]
    assert note.startswith("mesh_shape='auto': planned devices=8: ")
    assert "data=2 x model=4" in note and "data=4 x model=2" in note and "kept" in note


def test_auto_mesh_needs_a_device_count_and_at_most_two_names():
    step, args = _mlp()
    with pytest.raises(ValueError, match="names no device count"):
        shardplan.search(step, *args, cluster="a100-80gb", mesh_shape="auto")
    with pytest.raises(ValueError, match="at most 2 names"):
        shardplan.search(step, *args, cluster="a100-80gb-8", mesh_shape="auto",
                         axis_names=("a", "b", "c"))
    with pytest.raises(ValueError, match="or 'auto'"):
        shardplan.search(step, *args, cluster="a100-80gb-8", mesh_shape="best")


def test_auto_mesh_with_no_plan_that_fits_says_so():
    step, args = _mlp()
    with pytest.raises(shardplan.InfeasibleMemory):
        shardplan.search(step, *args, cluster="a100-80gb-8", mesh_shape="auto",
                         memory_budget=1024, time_limit=30, deterministic=True)


@pytest.mark.parametrize("shape,names", [((8,), ("devices",)), ((2, 4), ("data", "model"))])
def test_batch_input_is_split_on_its_batch_dimension_where_it_ties(shape, names):
    """Every split of x costs the same here (elementwise, then a full sum; x large enough
    that reading it whole costs more than the sums' latency): the user expects the batch
    split, and gets it (it was P(None, 'devices'))."""
    def step(w, x):
        g = jnp.tanh(x).sum() * w
        return w - 0.1 * g, jnp.tanh(x).mean()

    args = (jax.ShapeDtypeStruct((64,), np.float32),
            jax.ShapeDtypeStruct((16384, 16384), np.float32))
    plan = shardplan.search(step, *args, cluster="a100-80gb", mesh_shape=shape,
                            axis_names=names, state_argnums=(0,), batch_argnums=(1,))
    spec = plan.input_specs[1]
    assert spec.dims[0] and not any(spec.dims[1:]), spec
