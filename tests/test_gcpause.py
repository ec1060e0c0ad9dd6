"""The collector is paused while a step is planned, and as it was afterwards."""

import gc

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan import cluster, gcpause


def test_paused_restores_the_collector_even_on_error():
    assert gc.isenabled()
    with pytest.raises(ValueError), gcpause.paused():
        assert not gc.isenabled()
        with gcpause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner block leaves the outer's pause
        raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()


def test_search_plans_with_the_collector_paused(monkeypatch):
    seen = []
    real = cluster.trace

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(cluster, "trace", spy)

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2))(w)

    shardplan.search(step, jax.ShapeDtypeStruct((64, 64), jnp.float32),
                     jax.ShapeDtypeStruct((32, 64), jnp.float32), cluster="cpu", mesh_shape=(8,))
    assert seen == [False]
    assert gc.isenabled()
