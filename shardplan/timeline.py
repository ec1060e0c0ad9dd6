"""A Gantt chart of a pipeline schedule under the cost model (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from shardplan.inter.schedule import simulate, split_stage_time, tick_grid
from shardplan.options import DEFAULTS
from shardplan.plan import Plan


def stage_durations(stage_times: Sequence) -> tuple[list[float], list[float]]:
    """(forward, backward) seconds per stage from floats (forward + backward of one
    micro-batch, split as shardplan.inter.schedule.split_stage_time does) or pairs."""
    fwd, bwd = [], []
    for i, t in enumerate(stage_times):
        if isinstance(t, (tuple, list)):
            if len(t) != 2:
                raise ValueError(f"stage {i}: give (forward, backward) seconds, got {t!r}")
            f, b = float(t[0]), float(t[1])
        else:
            f, b = split_stage_time(float(t))
        if not (f >= 0 and b >= 0):
            raise ValueError(f"stage {i}: times must be >= 0 seconds, got {t!r}")
        fwd.append(f)
        bwd.append(b)
    if not fwd:
        raise ValueError("stage_times is empty: give one time per stage")
    return fwd, bwd


def spmd_rows(num_stages: int, num_micro_batches: int, schedule: str,
              forward_s: Sequence[float], backward_s: Sequence[float]
              ) -> list[tuple[int, str, int, float, float]]:
    """(stage, "F" | "B", micro-batch, start, end) of an SPMD pipeline's operations: its
    stages run in lockstep, tick by tick (shardplan.inter.schedule.tick_grid), each tick as
    long as the slowest stage's work in it. GPipe: M + S - 1 forward ticks, then as many
    backward ones; 1F1B: M + 2S - 2 ticks of a forward slot then a backward slot."""
    S = int(num_stages)
    f, b = max(forward_s), max(backward_s)
    grid = tick_grid(S, num_micro_batches, schedule, "spmd")
    both = schedule == "1f1b"
    forward_ticks = len(grid[0]) if both else len(grid[0]) // 2
    rows = []
    for s, row in enumerate(grid):
        for t, cell in enumerate(row):
            if both:
                start = t * (f + b)
            else:
                start = t * f if t < forward_ticks else forward_ticks * f + (t - forward_ticks) * b
            for kind, m in re.findall(r"([FB])(\d+)", cell):
                at = start + f if both and kind == "B" else start
                rows.append((s, kind, int(m), at, at + (f if kind == "F" else b)))
    rows.sort(key=lambda r: (r[3], r[0], r[1]))
    return rows


def draw_timeline(stage_times: Sequence, num_micro_batches: int, schedule: str, path,
                  title: str | None = None, kind: str = "mpmd") -> str:
    """Write a PNG Gantt chart of `schedule` ("1f1b" or "gpipe") over `num_micro_batches`:
    one row per stage, forward boxes light and backward boxes dark, numbered by micro-batch.
    `kind` "mpmd" simulates one program per stage, each starting an operation when its input
    is ready (shardplan.inter.schedule.simulate); "spmd" draws the one-program pipeline's
    ticks (spmd_rows). Returns the path written."""
    # matplotlib is heavy and only needed to draw: imported here, lazily. A bare Figure draws
    # with Agg and touches no global pyplot state.
    from matplotlib.figure import Figure

    if kind not in ("mpmd", "spmd"):
        raise ValueError(f"kind={kind!r}: use 'mpmd' or 'spmd'")
    fwd, bwd = stage_durations(stage_times)
    S = len(fwd)
    draw = spmd_rows if kind == "spmd" else simulate
    rows = draw(S, num_micro_batches, schedule, fwd, bwd)
    end = max(r[4] for r in rows) or 1.0
    scale, unit = _unit(end)
    fig = Figure(figsize=(max(6.0, min(24.0, 0.35 * len(rows) / max(S, 1) + 4)), 0.6 * S + 1.5))
    ax = fig.add_subplot(1, 1, 1)
    colors = {"F": "#9ecae1", "B": "#3182bd"}
    for s, op, m, start, stop in rows:
        ax.broken_barh([(start * scale, (stop - start) * scale)], (s - 0.4, 0.8),
                       facecolors=colors[op], edgecolors="black", linewidth=0.5)
        if stop > start:
            ax.text((start + stop) / 2 * scale, s, str(m), ha="center", va="center", fontsize=7,
                    color="black" if op == "F" else "white")
    bubble = idle_fraction(rows, S)
    ax.set_yticks(range(S))
    ax.set_yticklabels([f"stage {s}" for s in range(S)])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, end * scale)
    how = "SPMD, one program" if kind == "spmd" else "MPMD, one program per stage"
    ax.set_title(title or f"{schedule} ({how}): {S} stages x {num_micro_batches} "
                 f"micro-batches, step {end * scale:.3g} {unit}, bubble {bubble:.0%}")
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=100, format="png")
    return path


def idle_fraction(rows: Sequence[tuple[int, str, int, float, float]], num_stages: int) -> float:
    """The share of the stages' time from 0 to the last operation's end that they are idle."""
    end = max(r[4] for r in rows)
    busy = sum(stop - start for _, _, _, start, stop in rows)
    return 1.0 - busy / (num_stages * end) if end > 0 else 0.0


def draw_plan(plan: Plan, path, title: str | None = None) -> str:
    """The timeline of a pipelined plan's stages over one step, from the cost model: an MPMD
    plan's simulated schedule, an SPMD plan's ticks (the schedule of plan.timeline())."""
    if not plan.stages:
        raise ValueError("this plan has no pipeline stages to draw")
    kind = "spmd" if plan.pipeline_kind == "spmd" else "mpmd"
    return draw_timeline([s.estimate.total_s for s in plan.stages], plan.num_micro_batches,
                         plan.schedule or DEFAULTS.schedule, path, title, kind)


def draw_pipeline(pipeline, path) -> str:
    """The timeline of a shardplan.inter.planner.PipelinePlan (its stages' forward and
    backward times); returns the path."""
    return draw_timeline(pipeline.stage_times, pipeline.num_micro_batches, pipeline.schedule,
                         path)


def _unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"
