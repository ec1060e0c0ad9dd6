"""price(): compiled programs with known collectives, priced by hand with the alpha-beta model."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.analysis import hlo
from shardplan.analysis.price import price
from shardplan.cost.hardware import HardwareProfile
from shardplan.strategies.spec import MeshShape
from tests.conftest import auto_mesh

# hosts of 4 devices: on a 2x4 (data, model) mesh, 'model' stays in a host, 'data' crosses
HW = HardwareProfile.two_level(4, intra_bandwidth=100e9, inter_bandwidth=10e9,
                               intra_latency=2e-6, inter_latency=20e-6, peak_flops=2e12,
                               peak_flops_f32=1e12)
ROWS, COLS = 64, 256  # f32 block per device: 64 x 256 x 4 B = 64 KiB


def _compile(fn, mesh, in_spec, out_spec, shape=(2 * ROWS, 4 * COLS)):
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec)
    x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, in_spec))
    return jax.jit(body).lower(x).compile()


def _priced(compiled, mesh, dtype="float32"):
    stats = hlo.analyze(compiled)
    grid = np.vectorize(lambda d: d.id)(mesh.devices)
    return stats, price(stats, MeshShape.of(mesh), grid, HW, dtype)


def _ring(n, nbytes, bandwidth, latency, factor=2):
    """All-reduce (factor 2) or one-pass (factor 1) ring time by hand."""
    return factor * (n - 1) * latency + factor * (n - 1) / n * nbytes / bandwidth


@pytest.fixture
def mesh(devices):
    return auto_mesh((2, 4), ("data", "model"))


def test_all_reduce_inside_a_host(mesh):
    compiled = _compile(lambda x: jax.lax.psum(x, "model"), mesh, P("data", "model"),
                        P("data", None))
    stats, priced = _priced(compiled, mesh)
    [c] = [c for c in stats.collectives if c.kind == "all-reduce"]
    nbytes = ROWS * COLS * 4
    assert c.nbytes == nbytes and c.group_size == 4
    expected = _ring(4, nbytes, 100e9, 2e-6)
    assert priced.comm_s == pytest.approx(expected, rel=1e-9)
    assert priced.per_kind["all-reduce"].seconds == pytest.approx(expected, rel=1e-9)
    assert priced.bytes_sent == pytest.approx(2 * 3 / 4 * nbytes)


def test_all_reduce_across_hosts_runs_at_the_slow_link(mesh):
    compiled = _compile(lambda x: jax.lax.psum(x, "data"), mesh, P("data", "model"),
                        P(None, "model"))
    _, priced = _priced(compiled, mesh)
    assert priced.comm_s == pytest.approx(_ring(2, ROWS * COLS * 4, 10e9, 20e-6), rel=1e-9)


def test_all_reduce_over_both_axes_is_one_ring_at_the_slowest_link(mesh):
    compiled = _compile(lambda x: jax.lax.psum(x, ("data", "model")), mesh,
                        P("data", "model"), P(None, None))
    _, priced = _priced(compiled, mesh)
    assert priced.comm_s == pytest.approx(_ring(8, ROWS * COLS * 4, 10e9, 20e-6), rel=1e-9)


def test_collective_permute_pays_one_step_of_its_link(mesh):
    def shift(x):
        return jax.lax.ppermute(x, "data", perm=[(0, 1), (1, 0)])

    compiled = _compile(shift, mesh, P("data", "model"), P("data", "model"))
    _, priced = _priced(compiled, mesh)
    nbytes = ROWS * COLS * 4
    assert priced.per_kind["collective-permute"].seconds == pytest.approx(
        20e-6 + nbytes / 10e9, rel=1e-9)


def test_compute_is_flops_over_the_dtype_peak_plus_contraction_and_io_traffic(mesh):
    w = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P(("data", "model"))))
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    stats, priced = _priced(compiled, mesh)
    flops = 2 * (64 // 8) * 256 * 512
    assert stats.flops == pytest.approx(flops, rel=0.01)
    # the dot reads x's and w's shards and writes its result: the memory-bound term
    moved = 4 * ((64 // 8) * 256 + 256 * 512 + (64 // 8) * 512)
    assert stats.contraction_bytes == moved
    # the step reads its arguments and writes its result: x's and w's shards in, the
    # result's shard out (the same bytes here as the dot's)
    assert stats.io_bytes == moved
    memory = (moved + stats.io_bytes) / HW.mem_bandwidth
    assert priced.compute_s == pytest.approx(stats.flops / 1e12 + memory)
    assert priced.comm_s == 0.0 and priced.per_kind == {}
    _, half = _priced(compiled, mesh, dtype="bfloat16")
    assert half.compute_s == pytest.approx(stats.flops / 2e12 + memory)
    assert priced.total_s == priced.compute_s
    assert priced.peak_bytes == stats.peak_bytes > 0


def test_each_execution_in_a_loop_is_priced(mesh):
    def step(i, y):
        return jax.lax.psum(jax.lax.pcast(y, "model", to="varying"), "model") * 0.5

    def body(x):
        return jax.lax.fori_loop(0, 3, step, jax.lax.psum(x, "model"))

    compiled = _compile(body, mesh, P("data", "model"), P("data", None))
    stats, priced = _priced(compiled, mesh)
    runs = sum(c.count for c in stats.collectives if c.kind == "all-reduce")
    assert runs == 4  # one before the loop, three in it
    assert priced.comm_s == pytest.approx(4 * _ring(4, ROWS * COLS * 4, 100e9, 2e-6), rel=1e-9)
    assert math.isclose(priced.per_kind["all-reduce"].count, 4)
