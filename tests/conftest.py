"""Tests run on 8 CPU devices, set before anything touches a device."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests plan afresh: no plan from an earlier run (or another test) is read from disk. The
# cache tests pass their own directories.
os.environ.setdefault("SHARDPLAN_CACHE", "off")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

import pytest


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"expected 8 CPU devices, got {len(devs)}"
    return devs


def auto_mesh(shape, names):
    """A mesh with Auto axes, as the planner uses."""
    from jax.sharding import AxisType

    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


@pytest.fixture
def mesh8():
    return auto_mesh((8,), ("x",))


@pytest.fixture
def mesh2x4():
    return auto_mesh((2, 4), ("data", "model"))
