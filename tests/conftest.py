"""Tests run on 8 CPU devices, set before anything touches a device."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile-only TPU devices run nothing, so test workers may each load libtpu (it otherwise
# refuses a second process while one holds its lock file).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
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


def tpu_mesh(profile: str, shape, names):
    """Compile-only TPU devices of `profile`'s slice in a mesh of `shape` (the real TPU
    compiler, deviceless: programs compile, nothing runs); the test is skipped without libtpu
    (`pip install -e ".[dev,tpu]"`, as `make test` installs)."""
    from shardplan.analysis import targets
    from shardplan.cost.hardware import get_profile
    from shardplan.strategies.spec import MeshShape

    if targets.libtpu_version() is None:
        pytest.skip("libtpu is not installed (the TPU compiler): pip install -e '.[dev,tpu]'")
    return targets.tpu_mesh(get_profile(profile), MeshShape(tuple(names), tuple(shape)))


@pytest.fixture(scope="session")
def tpu_v5e_2x4():
    """A 2x4 (data, model) mesh of compile-only TPU v5e chips: the v5e:2x4 slice."""
    return tpu_mesh("tpu-v5e", (2, 4), ("data", "model"))
