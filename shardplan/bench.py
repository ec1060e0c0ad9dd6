"""The benchmark's tables: one row per config (`shardplan bench`), bench.md and bench.csv."""

from __future__ import annotations

import csv
import dataclasses
import math
import os
from collections.abc import Sequence

from shardplan import report
from shardplan.analysis.price import PricedStep
from shardplan.units import fmt_seconds

BENCH_HEADER = ("config", "model", "mesh", "hardware", "searched", "plan",
                *report.BASELINE_ORDER, "searched / best", "plan / best", "fits", "search s")


CSV_HEADER = ("config", "model", "mesh", "hardware", "searched_s", "plan_s",
              *(f"{b}_s" for b in report.BASELINE_ORDER), "searched_over_best", "plan_over_best",
              "fits", "search_s", "config_s")


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One config of the benchmark: a report.Run, or why there is none."""

    config: str
    run: report.Run | None = None
    model: str = ""
    mesh: str = ""
    hardware: str = ""
    error: str = ""
    seconds: float = 0.0
    """Wall-clock seconds for the whole config (planning and compiling)."""


def bench_cells(row: BenchRow, csv_numbers: bool = False) -> list[str]:
    """A bench row's cells (times in ms; raw seconds and bytes for the CSV)."""
    def t(x):
        if x is None:
            return ""
        return f"{x:.6g}" if csv_numbers else fmt_seconds(x)

    run = row.run
    if run is None:
        return [row.config, row.model, row.mesh, row.hardware, "", row.error,
                *[""] * len(report.BASELINE_ORDER), "", "", "", f"{row.seconds:.1f}"]
    base = []
    for name in report.BASELINE_ORDER:
        p = run.baselines.get(name)
        if isinstance(p, PricedStep):
            base.append(t(p.total_s) + ("" if run.fits(p.peak_bytes) or csv_numbers else " (OOM)"))
        else:
            base.append("" if csv_numbers or p is None else "-")
    plan_cell = t(run.plan_total())
    if run.priced_plan is None and not csv_numbers:
        plan_cell += " (est.)"
    searched = run.searched
    searched_cell = "" if searched is None else t(searched.total_s) + (
        "" if run.fits(searched.peak_bytes) or csv_numbers else " (OOM)")

    def ratio_cell(ratio):
        cell = "" if ratio is None else f"{ratio:.3f}"
        if ratio is not None and not run.best_fits() and not csv_numbers:
            cell += " (none fits)"
        return cell

    peak = run.priced_plan.peak_bytes if run.priced_plan else run.plan.estimate.peak_bytes
    return [row.config, run.label, run.mesh, run.hardware, searched_cell, plan_cell, *base,
            ratio_cell(run.searched_ratio()), ratio_cell(run.ratio()),
            "yes" if run.fits(peak) else "no", f"{run.search_s:.1f}"]


def write_bench(rows: Sequence[BenchRow], out_dir: str) -> tuple[str, str]:
    """bench.md and bench.csv in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "bench.md")
    csv_path = os.path.join(out_dir, "bench.csv")
    lines = ["# shardplan bench", "",
             ("Step time per config: the plan and each applicable expert plan compiled by XLA "
              "on CPU devices and priced with the config's hardware profile (`(est.)`: not "
              "compiled, the cost model's estimate; `(OOM)`: over the memory budget). "
              "`searched`: the searched plan alone (`measure=False`); `plan`: what the "
              "measured selection kept. Expert plans as an expert writes them: data parallel "
              "its input shardings, FSDP and Megatron/2-D their input shardings with every "
              "intermediate laid out around them. `/ best`: over the fastest expert plan that "
              "fits (`none fits`: over the fastest, none of which fits); below 1 the plan "
              "wins; `fits`: the compiled plan fits the budget."),
             ""]
    lines += report.md_table(BENCH_HEADER, [bench_cells(r) for r in rows])
    lines += ["", *summary(rows)]
    errors = [r for r in rows if r.error]
    if errors:
        lines += ["", "## Errors", "", *(f"- {r.config}: {r.error}" for r in errors)]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_HEADER)
        for r in rows:
            w.writerow(bench_cells(r, csv_numbers=True) + [f"{r.seconds:.1f}"])
    return md, csv_path


def summary(rows: Sequence[BenchRow]) -> list[str]:
    """The geometric means of searched / best and plan / best over the configs that have them."""
    out = []
    for what, ratio in (("searched plan alone", "searched_ratio"), ("kept plan", "ratio")):
        g = geomean([getattr(r.run, ratio)() for r in rows if r.run is not None])
        if g is not None:
            out.append(f"Geometric mean of {what} / best expert plan: {g:.3f}")
    return out


def geomean(xs: Sequence[float]) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None
