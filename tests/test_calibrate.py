"""`shardplan profile`: the machine measured, a profile written that the planner loads, and the
ring model fitted to the timed collectives."""

import math

import jax
import numpy as np
import pytest
import yaml

import shardplan
from shardplan import calibrate, cli
from shardplan.cost import ring
from shardplan.cost.hardware import get_profile
from tests.conftest import auto_mesh


def _sample(kind, nbytes, n, link):
    seconds = (ring.latency_steps(kind, n) * link[1]
               + ring.bytes_sent(kind, nbytes, n) / link[0])
    return calibrate.Sample(kind, "x", nbytes, n, seconds)


def test_fit_link_recovers_the_ring_model():
    link = (5e9, 20e-6)
    samples = [_sample(k, b, 4, link) for k in calibrate.KINDS for b in (4096, 2**20, 2**24)]
    fitted = calibrate.fit_link(samples)
    assert fitted.bandwidth == pytest.approx(link[0], rel=1e-6)
    assert fitted.latency == pytest.approx(link[1], rel=1e-6)


def test_fit_link_without_a_visible_bandwidth_stays_positive():
    # every message takes the same time: no bytes term can be seen
    samples = [calibrate.Sample("all-reduce", "x", b, 2, 1e-3) for b in (4096, 8192)]
    fitted = calibrate.fit_link(samples)
    assert fitted.bandwidth > 0 and math.isfinite(fitted.bandwidth)


def test_collectives_are_timed_on_the_buffer_the_cost_model_counts():
    mesh = auto_mesh((2, 4), ("data", "model"))
    s = calibrate.time_collective(mesh, "model", "all-gather", 2**16, repeats=1)
    assert (s.kind, s.axis, s.group_size, s.nbytes) == ("all-gather", "model", 4, 2**16)
    assert s.seconds > 0
    assert not calibrate.crosses_hosts(mesh, "model")  # one process


def test_cli_profile_writes_a_profile_the_planner_uses(tmp_path, capsys):
    out = tmp_path / "here.yaml"
    code = cli.main(["profile", "--mesh", "2x4", "--out", str(out), "--repeats", "1",
                     "--name", "this-vm", "-q"])
    assert code == cli.EXIT_OK
    printed = capsys.readouterr().out
    assert "this-vm" in printed and "collective-permute" in printed and str(out) in printed
    data = yaml.safe_load(out.read_text())
    assert data["name"] == "this-vm" and data["backend"] == "cpu"
    assert data["forms_reduce_scatter"] is False
    profile = get_profile(str(out))
    assert profile.peak_flops > 1e6 and profile.mem_bandwidth > 1e6
    assert profile.intra_host.bandwidth > 1e6 and profile.devices_per_host == len(jax.devices())
    assert "measured by `shardplan profile`" in profile.source

    def f(w, x):
        return (x @ w).sum()

    plan = shardplan.search(f, np.ones((64, 64), np.float32), np.ones((32, 64), np.float32),
                            mesh_shape=(8,), cluster=profile, measure=False)
    assert plan.hardware == "this-vm"


def test_cli_profile_rejects_a_mesh_of_the_wrong_size(capsys):
    assert cli.main(["profile", "--mesh", "3x3", "-q"]) == cli.EXIT_USAGE
    assert "has 9 devices" in capsys.readouterr().err
    assert cli.main(["profile", "--mesh", "two", "-q"]) == cli.EXIT_USAGE
