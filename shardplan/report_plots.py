"""report.md's plots (matplotlib Figures, Agg) and the writing of the report's files: the
step time and memory of every program compared, the plan's cost per layer, a pipeline's
timeline. The tables and the text are shardplan.report's."""

from __future__ import annotations

import os
from collections.abc import Sequence

from shardplan import timeline
from shardplan.plan import Plan
from shardplan.report import (
    Run,
    cost_by_layer,
    memory_rows,
    mesh_str,
    model_estimate,
    report_markdown,
)
from shardplan.report_snippet import StepCall
from shardplan.units import fmt_bytes


def _figure(figsize):
    """A bare matplotlib Figure and its axes: drawn with Agg, no global pyplot state.
    matplotlib is heavy and only needed to draw: imported here, lazily."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.add_subplot(1, 1, 1)


def plot_layer_costs(plan: Plan, path: str) -> str | None:
    """Stacked compute / communication time per layer of the plan: the cost model's step,
    divided among the layers (report.cost_by_layer), so the bars add up to it."""
    rows = cost_by_layer(plan)
    if not rows:
        return None
    fig, ax = _figure((max(6.0, 0.35 * len(rows) + 2), 3.6))
    xs = range(len(rows))
    comp = [r[1] * 1e3 for r in rows]
    comm = [r[2] * 1e3 for r in rows]
    ax.bar(xs, comp, label="compute", color="#4C72B0")
    ax.bar(xs, comm, bottom=comp, label="communication", color="#DD8452")
    ax.set_xticks(list(xs), [r[0] for r in rows], rotation=60, ha="right", fontsize=8)
    label, e = model_estimate(plan)
    ax.set_ylabel("ms per step (cost model)")
    whole = f"; {e.total_s * 1e3:.3g} ms per step in all" if e is not None else ""
    ax.set_title(f"{label.removesuffix(' (cost model)')} cost per layer, mesh {mesh_str(plan)}"
                 f"\n(the cost model's step{whole})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_memory(run: Run, path: str) -> str:
    """Peak memory per device of every program compared, against the budget: the plan's one
    figure (compiled once compiled, labelled so), not also its estimate."""
    rows = memory_rows(run)
    fig, ax = _figure((7, 0.5 * len(rows) + 1.5))
    top = max([r[4] for r in rows] + [1.0])
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10),
                                           ("B", 1)) if top >= s)
    values = [r[4] / scale for r in rows]
    colors = ["#55A868" if run.fits(r[4]) else "#C44E52" for r in rows]
    ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    title = f"{run.label} on {run.hardware}, mesh {run.mesh}"
    if run.budget <= 3 * top:
        ax.axvline(run.budget / scale, color="black", linestyle="--",
                   label=f"budget {fmt_bytes(run.budget)}")
        ax.legend(loc="lower right")
    else:
        title += f"\n(budget {fmt_bytes(run.budget)} per device, off the scale)"
    ax.set_xlabel(f"peak memory per device ({unit})")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_step_times(run: Run, path: str) -> str:
    """Stacked compute / communication step time of every program compared."""
    rows = run.rows()
    fig, ax = _figure((7, 0.5 * len(rows) + 1.5))
    comp = [r[1] * 1e3 for r in rows]
    comm = [r[2] * 1e3 for r in rows]
    ys = range(len(rows))
    ax.barh(ys, comp, color="#4C72B0", label="compute")
    ax.barh(ys, comm, left=comp, color="#DD8452", label="communication")
    ax.set_yticks(list(ys), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per step on {run.hardware}")
    ax.set_title(f"{run.label}, mesh {run.mesh}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_timeline(run: Run, path: str) -> str | None:
    """The pipeline schedule of a staged plan (shardplan.timeline, from the cost model)."""
    timeline.draw_plan(run.plan, path)
    return path if os.path.exists(path) else None


# -- report.md ------------------------------------------------------------------------------


def write_report(run: Run, out_dir: str, formats: Sequence[str] = ("json", "md", "png"),
                 call: StepCall | None = None) -> list[str]:
    """Write report.md (and its PNG plots) into out_dir; returns the paths written. `call`:
    how the step is called, for the report's "use this plan" snippet."""
    os.makedirs(out_dir, exist_ok=True)
    written: list[str] = []
    images: list[tuple[str, str]] = []
    if "png" in formats:
        for title, fname, fn in (
            ("Step time: plan vs baselines", "step_time.png", lambda p: plot_step_times(run, p)),
            ("Memory per device against the budget", "memory.png", lambda p: plot_memory(run, p)),
            ("Plan cost per layer", "cost_per_layer.png", lambda p: plot_layer_costs(run.plan, p)),
        ):
            path = fn(os.path.join(out_dir, fname))
            if path:
                written.append(path)
                images.append((title, fname))
        if run.plan.stages:
            path = plot_timeline(run, os.path.join(out_dir, "timeline.png"))
            if path:
                written.append(path)
                images.append(("Pipeline timeline", "timeline.png"))
    if "md" in formats:
        path = os.path.join(out_dir, "report.md")
        with open(path, "w") as f:
            f.write(report_markdown(run, images, call))
        written.append(path)
    return written
