"""What the `shardplan` command prints and writes: the progress of its phases, a run's
summary and comparison tables, the bench table, a measured profile, plan.json / comparison.json /
report.md."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardplan import bench, files, progress, progress_display, report, report_plots
from shardplan.config import Config
from shardplan.cost import ring
from shardplan.units import fmt_bytes, fmt_seconds
from shardplan.workload import build_workload


def shown(x) -> str:
    """Text a file or the user gave (notes, names, labels, paths) for a rich console: control
    characters shown as their escapes (files.printable), rich markup escaped, so it prints as
    written and cannot drive the terminal (tests/test_hardening.py)."""
    return escape(files.printable(x, keep=""))


def plain(text: str) -> str:
    """Text already rendered (Plan.summary) or printed with markup off: its lines kept, any
    other control character shown as its escape."""
    return files.printable(text, keep="\n")


class Phases:
    """The command's phases on `console`: on a terminal live (progress_display: the running
    phase, the planner's phases inside it and the solver's bound and gap, as `reporter`, which
    the command hands to the planner), elsewhere a line as each starts; each finished phase is
    logged with its time. A quiet console shows nothing (planning a large model takes minutes:
    the user sees which phase it is in)."""

    def __init__(self, console):
        self.console = console
        self.reporter = progress_display.for_console(console)

    @contextlib.contextmanager
    def __call__(self, text: str, done: int | None = None, total: int | None = None):
        start = time.perf_counter()
        text = progress_display.phase_text(text, done, total)
        if self.reporter is progress.SILENT:
            self.console.print(f"{shown(text)} ...")
        try:
            with progress.phase(self.reporter, text):
                yield
        except BaseException:
            self.console.print(f"[red]x[/red] {shown(text)} (failed after "
                               f"{time.perf_counter() - start:.1f} s)")
            raise
        self.console.print(f"[green]done[/green] {shown(text)} "
                           f"({time.perf_counter() - start:.1f} s)")


def consoles(quiet: bool = False) -> tuple[Console, Console]:
    """(stdout console, stderr console for progress; silent when quiet)."""
    out = Console(width=None if sys.stdout.isatty() else 200)  # logs: no wrapped tables
    err = Console(stderr=True, quiet=quiet)
    return out, err


def print_run(run, console) -> None:
    """The plan's summary, its estimate against the budget, and the comparison table."""
    plan = run.plan
    console.print(f"[bold]{shown(run.label)}[/bold] on [bold]{shown(run.hardware)}[/bold], mesh "
                  f"[bold]{shown(run.mesh)}[/bold] ({plan.mesh.num_devices} devices), "
                  f"{run.num_params / 1e6:,.1f} M parameters, {run.dtype}")
    if len(run.meshes) > 1:
        tried = ", ".join(f"{m}: {fmt_seconds(t) if isinstance(t, float) else t}"
                          for m, t in run.meshes.items())
        console.print(f"meshes tried (estimated step): {shown(tried)}")
    console.print(plain(plan.summary()), markup=False, highlight=False)
    peak, source = run.plan_peak()
    fits = "fits" if run.fits(peak) else "DOES NOT FIT"
    console.print(f"plan: {fmt_seconds(run.plan_total())} per step, peak {fmt_bytes(peak)} "
                  f"per device ({source}) against a budget of {fmt_bytes(run.budget)}: {fits}")
    if run.priced_plan is not None or run.baselines:
        t = Table(title=f"plan vs baselines: compiled by {shown(report.compiled_by(run))}, "
                  f"priced as {shown(run.hardware)}")
        for c in report.COMPARISON_HEADER:
            t.add_column(c, justify="left" if c == "program" else "right")
        for row in report.comparison_rows(run):
            t.add_row(*(shown(c) for c in row))
        console.print(t)
        if run.ratio() is not None:
            console.print(shown(run.ratio_text()))
    if run.verification is not None:
        t = Table(title=f"predicted vs compiled ({shown(run.verification.of)})")
        for c in ("quantity", "predicted", "compiled", "compiled / predicted"):
            t.add_column(c)
        for row in report.verification_rows(run.verification):
            t.add_row(*(shown(c) for c in row))
        for kind, (count, sent) in run.verification.collectives.items():
            t.add_row(f"  {shown(kind)} x{count}", "", fmt_bytes(sent), "")
        console.print(t)
    for note in run.notes:
        console.print(f"note: {shown(note)}")


def write_outputs(config: Config, run, out_dir: str) -> list[str]:
    """plan.json (and comparison.json), report.md and its plots."""
    os.makedirs(out_dir, exist_ok=True)
    formats = config.output.formats
    written = []
    if "json" in formats:
        path = os.path.join(out_dir, "plan.json")
        run.plan.save(path)
        written.append(path)
        path = os.path.join(out_dir, "comparison.json")
        with open(path, "w") as f:
            json.dump({
                "config": config.model_dump(mode="json"), "hardware": run.hardware,
                "budget": run.budget, "mesh": run.mesh, "search_s": run.search_s,
                "estimate": _model_dict(run.plan),
                "memory": {"peak_bytes": run.plan_peak()[0], "source": run.plan_peak()[1],
                           "fits": run.fits(run.plan_peak()[0])},
                "plan": run.priced_plan.to_dict() if run.priced_plan else None,
                "baselines": {k: v if isinstance(v, str) else v.to_dict()
                              for k, v in run.baselines.items()},
                "ratio_plan_over_best_baseline": run.ratio(),
                "best_baseline": (run.best_baseline() or [None])[0],
                "best_baseline_fits": run.best_fits(), "meshes": dict(run.meshes),
                "notes": list(run.notes),
            }, f, indent=1)
        written.append(path)
    call = step_call(config) if "md" in formats else None
    written += report_plots.write_report(run, out_dir, formats, call=call)
    return written


def step_call(config: Config) -> report.StepCall:
    """How the config's step is called, for the report's "use this plan" snippet: its
    arguments named by its signature; for a zoo model, the lines that build it with arrays."""
    work = build_workload(config)
    source: list[str] = []
    call = report.StepCall.of(work.fn, len(work.args), work.state_argnums)
    m = config.model
    if m.name is not None:
        kwargs = ([f"batch_size={m.batch_size!r}"] if m.batch_size is not None else [])
        kwargs += [f"{k}={v!r}" for k, v in sorted(m.zoo_overrides().items())]
        given = ", ".join(call.args)
        source = ["# the config's model, with arrays",
                  f"ts = shardplan.models.get_model({', '.join([repr(m.name), repr(m.size), *kwargs])})",
                  "train_step = ts.fn",
                  f"{given}{',' if len(call.args) == 1 else ''} = ts.args"]
    return dataclasses.replace(call, source=tuple(source))


def _model_dict(plan) -> dict | None:
    """The cost model's figures of the comparison, and whose they are (report.model_estimate)."""
    label, e = report.model_estimate(plan)
    return None if e is None else {"of": label.removesuffix(" (cost model)"), **e.to_dict()}


def print_bench(rows: Sequence[bench.BenchRow], console) -> None:
    """The bench table and the geometric mean of plan / best baseline."""
    t = Table(title="shardplan bench: step time, plan vs baselines (XLA-compiled, priced)")
    for c in bench.BENCH_HEADER:
        t.add_column(c)
    for r in rows:
        t.add_row(*(shown(c) for c in bench.bench_cells(r)))
    console.print(t)
    for line in bench.summary(rows):
        console.print(shown(line))


def print_profile(cal, console) -> None:
    """What `shardplan profile` measured: the profile's figures and each axis' fitted link
    against its samples (the ring model's prediction beside the measured time)."""
    p = cal.profile
    console.print(f"[bold]{shown(p.name)}[/bold] ({p.backend}): {p.devices_per_host} devices "
                  f"per host, {fmt_bytes(p.memory_bytes)} each")
    console.print(f"  matmul: {p.peak_flops / 1e12:.3g} TFLOP/s bf16, "
                  f"{p.peak_flops_f32 / 1e12:.3g} TFLOP/s f32 per device; memory "
                  f"{p.mem_bandwidth / 1e9:.3g} GB/s")
    table = Table("axis", "kind", "buffer", "measured", "model", "link")
    for s in cal.samples:
        link = cal.links[s.axis]
        model = (ring.latency_steps(s.kind, s.group_size) * link.latency
                 + ring.bytes_sent(s.kind, s.nbytes, s.group_size) / link.bandwidth)
        table.add_row(f"{shown(s.axis)} ({s.group_size})", s.kind, fmt_bytes(s.nbytes),
                      fmt_seconds(s.seconds), fmt_seconds(model),
                      f"{link.bandwidth / 1e9:.3g} GB/s, {link.latency * 1e6:.3g} us")
    if cal.samples:
        console.print(table)
    for note in cal.notes:
        console.print(f"[yellow]warning:[/yellow] {shown(note)}")
