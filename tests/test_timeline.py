"""The pipeline timeline (shardplan.timeline): an SPMD plan is drawn as its one program's
ticks (the schedule plan.timeline() prints), an MPMD plan as its simulated stage programs."""

import pathlib

import pytest

import shardplan
from shardplan import timeline
from shardplan.inter import schedule as schedule_mod
from tests.conftest import auto_mesh
from tests.test_emit_spmd import scanned_mlp

S, M = 4, 8


def cells(rows, num_stages, num_ticks, tick_s):
    """rows back on the tick grid: "F3", "B0", "F3B0" per stage and tick."""
    grid = [[""] * num_ticks for _ in range(num_stages)]
    for s, op, m, start, _ in rows:
        grid[s][round(start / tick_s)] += f"{op}{m}"
    return grid


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_spmd_rows_are_the_tick_table_and_its_bubble(schedule):
    grid = schedule_mod.tick_grid(S, M, schedule, "spmd")
    if schedule == "gpipe":  # a forward and a backward tick take as long: rows match ticks
        rows = timeline.spmd_rows(S, M, schedule, [1.0] * S, [1.0] * S)
        assert cells(rows, S, len(grid[0]), 1.0) == grid
        assert max(r[4] for r in rows) == 2 * (M + S - 1)
    else:  # a tick runs a forward slot (1 s) then a backward slot (2 s)
        rows = timeline.spmd_rows(S, M, schedule, [1.0] * S, [2.0] * S)
        ticks = [[""] * len(grid[0]) for _ in range(S)]
        for s, op, m, start, stop in rows:
            t, offset = divmod(start, 3.0)
            assert offset == (0.0 if op == "F" else 1.0) and stop - start == (1 if op == "F" else 2)
            ticks[s][int(t)] += f"{op}{m}"
        assert ticks == grid
        assert max(r[4] for r in rows) == 3 * (M + 2 * S - 2)
    assert sum(op == "F" for _, op, *_ in rows) == S * M == sum(op == "B" for _, op, *_ in rows)
    assert timeline.idle_fraction(rows, S) == pytest.approx(
        schedule_mod.bubble_fraction(S, M, schedule, "spmd"))
    # the MPMD simulation of the same stages is another schedule (1F1B: a smaller bubble)
    mpmd = schedule_mod.simulate(S, M, schedule, [1.0] * S, [2.0] * S)
    assert sorted(r[:3] for r in mpmd) == sorted(r[:3] for r in rows)


def test_an_spmd_plan_draws_its_ticks_not_the_mpmd_simulation(tmp_path, monkeypatch):
    step, args = scanned_mlp()
    mesh = auto_mesh((S, 2), ("stage", "data"))
    plan = shardplan.auto(step, mesh=mesh, pipeline="spmd", num_micro_batches=M,
                          schedule="1f1b", hardware="cpu", measure=False).plan(*args)
    assert plan.pipeline_kind == "spmd" and len(plan.stages) == S
    drawn = []
    real = timeline.spmd_rows
    monkeypatch.setattr(timeline, "spmd_rows", lambda *a: drawn.append(a) or real(*a))
    path = timeline.draw_plan(plan, tmp_path / "spmd.png")
    assert pathlib.Path(path).read_bytes()[:4] == b"\x89PNG"
    assert [a[:3] for a in drawn] == [(S, M, "1f1b")]
    assert shardplan.draw_timeline is timeline.draw_plan


def test_draw_timeline_checks_its_kind(tmp_path):
    with pytest.raises(ValueError, match="kind='tpu'"):
        timeline.draw_timeline([1.0, 1.0], 4, "gpipe", tmp_path / "x.png", kind="tpu")
    path = timeline.draw_timeline([1.0, 1.0], 4, "gpipe", tmp_path / "x.png", kind="spmd")
    assert pathlib.Path(path).read_bytes()[:4] == b"\x89PNG"
