"""Moves between stage submeshes (shardplan.emit.transfer) and their price
(shardplan.inter.transfer_cost): the scatter program that moves a value between submeshes of
different shapes, run in one process on 8 CPU devices (the 2-process runs are in
tests/test_multihost_mpmd.py), checked against the value, its collective-permutes' bytes in
the compiled program against the price's, and the price over the profile's links."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.analysis import hlo_collectives
from shardplan.cost.hardware import HardwareProfile
from shardplan.emit import transfer
from shardplan.inter import transfer_cost

VALUE = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
# name: (source devices, shape, spec; destination devices, shape, spec; value)
CASES = {
    "2 -> 4, other layout": ([0, 1], (1, 2), P(None, "device"), [4, 5, 6, 7], (2, 2),
                             P("host", "device"), VALUE),
    "booleans, back": ([6, 7], (2, 1), P("host"), [2, 3], (1, 2), P("device"), VALUE > 10),
    "4 -> 2": ([0, 1, 4, 5], (2, 2), P("host", "device"), [2, 3], (1, 2), P(None, "device"),
               VALUE),
    "overlapping": ([0, 1, 2, 3], (2, 2), P("host"), [2, 3, 4, 5, 6, 7], (3, 2),
                    P(None, "device"), VALUE[:6]),
    "to replicated": ([0, 1, 2, 3], (2, 2), P("host"), [3, 4], (1, 2), P(), VALUE),
}


def _mesh(ids, shape):
    devices = jax.devices()
    return Mesh(np.asarray([devices[i] for i in ids]).reshape(shape), ("host", "device"),
                axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.mark.parametrize("name", list(CASES))
def test_scatter_moves_each_destination_device_its_block_only(name):
    src_ids, src_shape, src_spec, dst_ids, dst_shape, dst_spec, value = CASES[name]
    src, dst = _mesh(src_ids, src_shape), NamedSharding(_mesh(dst_ids, dst_shape), dst_spec)
    mover = transfer.Mover()
    x = jax.device_put(value, NamedSharding(src, src_spec))
    y = mover._scatter(x, src, dst, value.shape, value.dtype)
    assert y.sharding.is_equivalent_to(dst, value.ndim)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    # The program's collectives: ppermutes only (no all-reduce of the whole value), one per
    # round, each device sending one destination block.
    (program,) = [p for k, p in mover._programs.items() if k[0] == "scatter"]
    union = sorted(set(src_ids) | set(dst_ids))
    arg = jax.ShapeDtypeStruct((len(union), *value.shape), value.dtype, sharding=NamedSharding(
        Mesh(np.asarray([jax.devices()[i] for i in union]), (transfer.UNION,)),
        P(transfer.UNION)))
    ops = hlo_collectives.parse_collectives(program.lower(arg).compile().as_text(), len(union))
    assert {op.kind for op in ops} <= {"collective-permute"}, ops
    receivers = len(set(dst_ids) - set(src_ids))
    rounds = -(-receivers // len(src_ids))
    assert len(ops) == rounds
    block = int(np.prod(dst.shard_shape(value.shape))) * value.dtype.itemsize
    widened = 4 // value.dtype.itemsize  # booleans cross as int32
    assert all(op.nbytes == block * widened for op in ops), [op.nbytes for op in ops]
    # ... which is what the price counts where the value is spread over the destination's
    # devices (as the stage DP assumes; a destination replicated in part receives more)
    if block * len(dst_ids) == value.nbytes:
        hw = HardwareProfile.two_level(4, intra_bandwidth=1e9, inter_bandwidth=1e9,
                                       intra_latency=0.0, inter_latency=0.0)
        mv = transfer_cost.move(value.nbytes, src_ids, src_shape, dst_ids, dst_shape, hw)
        n = len(src_ids)
        gather = (n - 1) * value.nbytes / n / 1e9
        assert mv.program == "scatter"
        assert mv.seconds == pytest.approx(gather + rounds * block / 1e9)


def test_moves_are_priced_over_the_link_they_cross():
    hw = HardwareProfile.two_level(4, intra_bandwidth=1e11, inter_bandwidth=1e9,
                                   intra_latency=1e-6, inter_latency=1e-5)
    V = 8e6
    same_host = transfer_cost.move(V, [0, 1], (1, 2), [2, 3], (1, 2), hw)
    across = transfer_cost.move(V, [2, 3], (1, 2), [4, 5], (1, 2), hw)
    assert (same_host.program, same_host.inter_host) == ("permute", False)
    assert same_host.seconds == pytest.approx(1e-6 + V / 2 / 1e11)
    assert (across.program, across.inter_host) == ("permute", True)
    assert across.seconds == pytest.approx(1e-5 + V / 2 / 1e9)
    # other shapes: gathered inside the source host, then 2 rounds of blocks across hosts
    wide = transfer_cost.move(V, [0, 1], (1, 2), [4, 5, 6, 7], (1, 4), hw)
    assert (wide.program, wide.inter_host) == ("scatter", True)
    assert wide.seconds == pytest.approx((1e-6 + V / 2 / 1e11) + 2 * (1e-5 + V / 4 / 1e9))
    assert transfer_cost.move(V, [0, 1], (1, 2), [1, 0], (2, 1), hw).seconds == 0.0
    fwd, back = transfer_cost.boundary(V, [0, 1, 2, 3], (1, 4), [4, 5], (1, 2), hw)
    assert fwd.program == back.program == "scatter" and fwd.seconds != back.seconds


def test_the_profile_s_hosts_against_the_processes():
    from types import SimpleNamespace

    devices = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    assert not transfer_cost.hosts_differ_from_processes(HardwareProfile.two_level(4), devices)
    assert transfer_cost.hosts_differ_from_processes(HardwareProfile.two_level(8), devices)
    assert transfer_cost.hosts_differ_from_processes(HardwareProfile.two_level(2), devices)
