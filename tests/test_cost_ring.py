"""The ring model: bytes and steps of each collective, alpha-beta time over mesh axes and
their links."""

import pytest

from shardplan.cost import ring as C
from shardplan.cost.hardware import HardwareProfile, Link
from shardplan.strategies.base import Collective, Strategy
from shardplan.strategies.spec import MeshShape

M8 = MeshShape(("x",), (8,))
M24 = MeshShape(("d", "m"), (2, 4))


def test_ring_formulas():
    b = 1000.0
    assert C.bytes_sent("all-reduce", b, 4) == 2 * 3 / 4 * b
    assert C.bytes_sent("all-gather", b, 4) == 3 / 4 * b
    assert C.bytes_sent("reduce-scatter", b, 4) == 3 / 4 * b
    assert C.bytes_sent("all-to-all", b, 4) == 3 / 4 * b
    assert C.bytes_sent("collective-permute", b, 4) == b == C.bytes_sent("permute", b, 2)
    assert all(C.bytes_sent(k, b, 1) == 0 for k in C.KINDS)
    assert [C.latency_steps(k, 8) for k in C.KINDS] == [14, 7, 7, 7, 1]
    with pytest.raises(ValueError, match="unknown collective kind 'all-sum'"):
        C.bytes_sent("all-sum", b, 2)


def test_collective_time_alpha_beta():
    links = {"x": Link(bandwidth=1e9, latency=1e-6)}
    t = C.collective_time("all-reduce", 8e6, ("x",), M8, links)
    assert t == pytest.approx(14 * 1e-6 + 2 * 7 / 8 * 8e6 / 1e9)
    assert C.collective_time("all-gather", 8e6, "x", M8, links) == pytest.approx(7e-6 + 7e-3)
    assert C.collective_time("all-gather", 0, "x", M8, links) == 0.0
    one = MeshShape(("x", "y"), (8, 1))
    assert C.collective_time("all-reduce", 1e6, ("y",), one, {"y": Link(1.0, 1.0)}) == 0.0


def test_several_axes_use_the_slowest_link_and_the_whole_group():
    slow, fast = Link(1e9, 1e-5), Link(1e11, 1e-6)
    links = {"d": slow, "m": fast}
    t = C.collective_time("all-gather", 8e6, ("d", "m"), M24, links)
    assert t == pytest.approx(7 * 1e-5 + 7 / 8 * 8e6 / 1e9)
    assert C.slowest_link(("m", "d"), M24, links) == slow
    with pytest.raises(KeyError, match=r"no link for mesh axis \['m'\]"):
        C.collective_time("all-gather", 1.0, ("d", "m"), M24, {"d": slow})
    with pytest.raises(ValueError, match="mesh axis 'z' is not in the mesh"):
        C.collective_time("all-gather", 1.0, ("z",), M24, links)


def test_an_axis_across_hosts_is_slower():
    prof = HardwareProfile.two_level(4, intra_bandwidth=1e11, inter_bandwidth=1e10)
    links = prof.axis_links(M24)
    t_d = C.collective_time("all-reduce", 1e6, "d", M24, links)  # 2 devices, across hosts
    t_m = C.collective_time("all-reduce", 1e6, "m", M24, links)  # 4 devices, one host
    assert t_d > 5 * t_m


def test_strategy_comm_time_sums_its_collectives():
    links = {"d": Link(1e9, 0.0), "m": Link(2e9, 0.0)}
    comms = (Collective("all-reduce", ("m",), 4000), Collective("all-gather", ("d",), 2000))
    s = Strategy("s", (), (), 0.0, comms)
    assert C.strategy_comm_time(s, M24, links) == pytest.approx(6000 / 2e9 + 1000 / 1e9)
    assert C.comms_bytes(comms, M24) == 6000 + 1000
