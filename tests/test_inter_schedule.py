"""Pipeline schedules: every operation once in dependency order, 1F1B's memory against
GPipe's in the same time, and the timeline drawn from the simulation."""

import struct

import pytest

from shardplan import timeline
from shardplan.inter import schedule as pl
from shardplan.options import BACKWARD_PER_FORWARD, SearchOptions


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("S,B", [(1, 3), (2, 4), (4, 2), (4, 8)])
def test_schedule_runs_every_op_once_in_dependency_order(schedule, S, B):
    order = pl.dispatch_order(S, B, schedule)
    assert sorted(order) == sorted((k, s, m) for s in range(S) for m in range(B) for k in "FB")
    done = set()
    for kind, s, m in order:
        if kind == "F":
            assert s == 0 or ("F", s - 1, m) in done
        else:
            assert ("F", s, m) in done and (s == S - 1 or ("B", s + 1, m) in done)
        done.add((kind, s, m))


@pytest.mark.parametrize("S,B", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_keeps_fewer_micro_batches_alive_in_the_same_time(S, B):
    for s, ops in enumerate(pl.stage_ops(S, B, "1f1b")):
        alive = peak = 0
        for kind, _ in ops:
            alive += 1 if kind == "F" else -1
            peak = max(peak, alive)
        assert peak == min(S - s, B)
    gpipe = [max(r[4] for r in pl.simulate(S, B, sch, [1.0] * S, [BACKWARD_PER_FORWARD] * S))
             for sch in ("gpipe", "1f1b")]
    assert gpipe[0] == gpipe[1] == (S + B - 1) * 3.0  # the same bubble: (S - 1) / (S + B - 1)


def test_timeline_png(tmp_path):
    path = timeline.draw_timeline([1e-3, (1e-3, 3e-3)], 4, "1f1b", tmp_path / "t.png")
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert width > 300 and height > 100
    with pytest.raises(ValueError, match="forward, backward"):
        timeline.draw_timeline([(1.0, 2.0, 3.0)], 2, "gpipe", tmp_path / "x.png")


def test_schedule_is_checked_once_with_the_options():
    with pytest.raises(ValueError, match="unknown schedule"):
        SearchOptions(schedule="zb")
    with pytest.raises(ValueError, match="unknown schedule"):
        pl.stage_ops(2, 2, "zb")
    assert pl.split_stage_time(3.0) == (1.0, 2.0)
