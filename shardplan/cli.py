"""The `shardplan` command: search a config, bench a directory of configs, show a saved plan.

    shardplan search configs/demo.yaml [--out DIR] [--verify] [--set model.size=gpt2-1.5b]
    shardplan bench configs/bench [--out DIR]
    shardplan show shardplan-out/plan.json

Planning needs no devices. To compare the plan with the hand-written baselines fairly, both are
compiled by XLA on CPU devices standing in for the cluster (as many as the mesh has, at most
64; JAX is told how many before its backend starts, so jax is imported lazily) and priced with
the config's hardware profile (shardplan/analysis/price.py).

Exit codes: 0 planned; 2 bad config or arguments; 3 no plan fits the memory budget.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from shardplan.config import MAX_COMPILE_DEVICES, Config, ConfigError, load_config
from shardplan.measure import compile_for_analysis

EXIT_OK, EXIT_USAGE, EXIT_INFEASIBLE = 0, 2, 3


class Infeasible(Exception):
    """No mesh has a plan within the budget; `min_bytes` is the least any plan needs."""

    def __init__(self, message: str, min_bytes: float):
        super().__init__(message)
        self.min_bytes = min_bytes


# -- progress -------------------------------------------------------------------------------


class Phases:
    """A spinner naming the running phase with its elapsed time; each finished phase is logged
    with its time (planning a large model takes minutes: the user sees which phase it is in)."""

    def __init__(self, console):
        self.console = console

    @contextlib.contextmanager
    def __call__(self, text: str):
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        start = time.perf_counter()
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        live = self.console.is_terminal
        try:
            with (Progress(*columns, console=self.console, transient=True) if live
                  else contextlib.nullcontext()) as progress:
                if live:
                    progress.add_task(text, total=None)
                else:
                    self.console.print(f"{text} ...")
                yield
        except BaseException:
            self.console.print(f"[red]x[/red] {text} (failed after "
                               f"{time.perf_counter() - start:.1f} s)")
            raise
        self.console.print(f"[green]done[/green] {text} ({time.perf_counter() - start:.1f} s)")


def _consoles(quiet: bool = False):
    from rich.console import Console

    out = Console(width=None if sys.stdout.isatty() else 200)  # logs: no wrapped tables
    err = Console(stderr=True, quiet=quiet)
    return out, err


# -- the workload ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
    """The step to plan, with abstract args; `step` is set when it is a zoo-style TrainStep
    (the baselines need its state/batch layout)."""

    label: str
    fn: Any
    args: tuple
    state_argnums: tuple[int, ...] | None
    batch_argnums: tuple[int, ...] | None
    step: Any = None
    num_params: int = 0
    dtype: str = "float32"


def build_workload(config: Config) -> Workload:
    """The config's train step with ShapeDtypeStruct args (nothing allocated)."""
    import jax

    from shardplan.ir.trace import abstractify
    from shardplan.models import base as models_base

    m = config.model
    if m.name is not None:
        from shardplan import models

        try:
            step = models.get_model(m.name, m.size, abstract=True, batch_size=m.batch_size,
                                    **m.zoo_overrides())
        except (ValueError, TypeError) as e:
            raise ConfigError("model", f"cannot build {m.label}: {e}", config.source) from None
    else:
        module, _, attr = m.entry.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError("model.entry", f"cannot load {m.entry!r}: {e}; it must name a "
                              "function importable from the current directory or PYTHONPATH",
                              config.source) from None
        step = obj(**m.kwargs)
    if isinstance(step, models_base.TrainStep):
        args = jax.tree.map(abstractify, step.args)
        dtype = m.dtype or str(getattr(step.config, "dtype", None) or "float32")
        step = dataclasses.replace(step, args=args)
        return Workload(m.label if m.name else step.name, step.fn, args, step.state_argnums,
                        step.batch_argnums, step, step.num_params, dtype)
    if isinstance(step, tuple) and len(step) == 2 and callable(step[0]):
        fn, args = step
        args = jax.tree.map(abstractify, tuple(args))
        n = sum(int(getattr(x, "size", 0)) for x in jax.tree.leaves(args))
        return Workload(m.label, fn, args, None, None, None, n, m.dtype or "float32")
    raise ConfigError("model.entry", f"{m.entry} returned {type(step).__name__}; return a "
                      "shardplan.models.TrainStep or a (fn, args) tuple", config.source)


# -- devices --------------------------------------------------------------------------------


def init_cpu_devices(n: int) -> int:
    """Ask JAX for at least n CPU devices (before its backend starts); returns how many exist."""
    import jax

    current = jax.config.jax_num_cpu_devices
    with contextlib.suppress(RuntimeError):  # the backend is up already: keep what it has
        jax.config.update("jax_num_cpu_devices", max(n, current))
    return len(jax.devices("cpu"))


def cpu_mesh(names: Sequence[str], sizes: Sequence[int]):
    """An Auto-axes mesh over the first CPU devices."""
    import math

    import jax
    import numpy as np

    devices = jax.devices("cpu")[: math.prod(sizes)]
    return jax.sharding.Mesh(np.asarray(devices).reshape(tuple(sizes)), tuple(names),
                             axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _device_grid(mesh):
    import numpy as np

    return np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)


# -- search ---------------------------------------------------------------------------------


def _search_kwargs(config: Config) -> dict:
    """Options for shardplan.search; pipeline options only once search takes them."""
    import shardplan

    s = config.search
    kwargs: dict[str, Any] = {"time_limit": s.time_limit, "seed": s.seed, "workers": s.workers}
    accepted = inspect.signature(shardplan.search).parameters
    for key in ("pipeline", "num_micro_batches", "schedule"):
        if key in accepted:
            kwargs[key] = getattr(s, key)
    if s.measure:
        import jax

        n = config.cluster.mesh.num_devices
        kwargs["measure"] = n <= MAX_COMPILE_DEVICES and len(jax.devices("cpu")) >= n
    return kwargs


def plan_config(config: Config, work: Workload, phases: Phases, notes: list[str]):
    """Plan every candidate mesh, keep the cheapest: (plan, {mesh: estimate or why not})."""
    import shardplan
    from shardplan.units import fmt_bytes

    hw, budget = config.profile(), config.budget_bytes()
    kwargs = _search_kwargs(config)
    s = config.search
    if (s.pipeline is True or s.num_micro_batches > 1) and "pipeline" not in kwargs:
        notes.append("search.pipeline / num_micro_batches are not used yet: shardplan.search "
                     "plans intra-operator parallelism only in this version")
    best, tried, infeasible = None, {}, []
    for names, sizes in config.cluster.mesh.candidates():
        label = " x ".join(f"{n}={k}" for n, k in zip(names, sizes))
        how = "trace, strategies, ILP" + (", compiling candidates" if kwargs.get("measure") else "")
        with phases(f"planning {work.label} on mesh {label} ({how})"):
            try:
                plan = shardplan.search(
                    work.fn, *work.args, cluster=hw, mesh_shape=sizes, axis_names=names,
                    memory_budget=budget, state_argnums=work.state_argnums,
                    batch_argnums=work.batch_argnums, **kwargs)
            except shardplan.InfeasibleMemory as e:
                infeasible.append(e)
                tried[label] = f"no plan fits (needs {fmt_bytes(e.min_bytes)})"
                continue
        tried[label] = plan.estimate.total_s
        if best is None or plan.estimate.total_s < best.estimate.total_s:
            best = plan
    if best is None:
        least = min(e.min_bytes for e in infeasible)
        raise Infeasible(
            f"no plan fits the memory budget of {fmt_bytes(budget)} per device on "
            f"{config.cluster.mesh.num_devices} {hw.name} devices; the smallest memory any plan "
            f"needs is {fmt_bytes(least)} per device ({least:.0f} bytes). Raise "
            "cluster.memory_budget, use more devices, or shrink the model or batch.", least)
    return best, tried


def compile_and_price(config: Config, work: Workload, plan, phases: Phases, notes: list[str],
                      want_baselines: bool):
    """Compile the plan (and the baselines) on CPU devices, price each: (plan stats, priced
    plan, {baseline: priced or why not}, compile seconds)."""
    import jax

    import shardplan
    from shardplan import baselines as bl
    from shardplan.analysis import hlo
    from shardplan.analysis.price import price

    hw = config.profile()
    n = plan.mesh.num_devices
    have = len(jax.devices("cpu"))
    if have < n:
        notes.append(f"not compiled: JAX runs {have} CPU devices and the mesh needs {n} (it was "
                     "started before shardplan could ask for more)")
        return None, None, {}, 0.0
    start = time.perf_counter()
    mesh = cpu_mesh(plan.mesh.names, plan.mesh.sizes)
    grid = _device_grid(mesh)
    donate = tuple(work.state_argnums or ())
    stats = priced = None
    with phases(f"compiling the plan with XLA on {n} CPU devices"):
        try:
            step = shardplan.auto(work.fn, mesh=mesh, hardware=hw, plan=plan,
                                  donate_argnums=donate, state_argnums=work.state_argnums,
                                  batch_argnums=work.batch_argnums)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # donation warnings of abstract args
                stats = hlo.analyze(compile_for_analysis(step.lower(*work.args)))
        except Exception as e:  # e.g. a pipeline plan that is not one program
            if not plan.stages:
                raise
            notes.append(f"the pipeline plan was not compiled as one program ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]}); its row is the cost model's estimate")
    if stats is not None:
        priced = price(stats, plan.mesh, grid, hw, work.dtype)
    results: dict[str, Any] = {}
    if want_baselines:
        if work.step is None:
            notes.append("baselines skipped: model.entry returned (fn, args), and the baselines "
                         "need a TrainStep (which args are params, optimizer state and batch)")
            names = []
        else:
            names = list(config.output.baselines or bl.applicable_baselines(work.step, mesh))
        for name in names:
            with phases(f"compiling baseline {name}"):
                try:
                    ins, outs = bl.baseline_shardings(name, work.step, mesh)
                    jitted = jax.jit(work.fn, in_shardings=ins, out_shardings=outs,
                                     donate_argnums=donate)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        b_stats = hlo.analyze(compile_for_analysis(jitted.lower(*work.args)))
                except Exception as e:  # noqa: BLE001 - one failing baseline must not hide the others
                    results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    continue
            results[name] = price(b_stats, plan.mesh, grid, hw, work.dtype)
    return stats, priced, results, time.perf_counter() - start


def run_search(config: Config, *, verify: bool = False, phases: Phases):
    """Plan a config and compare it: a report.Run."""
    from shardplan import report

    notes: list[str] = []
    with phases(f"building {config.model.label} (abstract inputs)"):
        work = build_workload(config)
    start = time.perf_counter()
    plan, tried = plan_config(config, work, phases, notes)
    search_s = time.perf_counter() - start
    n = plan.mesh.num_devices
    compile_ok = n <= MAX_COMPILE_DEVICES
    stats = priced = None
    baselines: dict = {}
    compile_s = 0.0
    if (config.output.compare or verify) and not compile_ok:
        notes.append(f"not compiled: the mesh has {n} devices, more than the "
                     f"{MAX_COMPILE_DEVICES} CPU devices XLA is asked to stand in for; the "
                     "figures are the cost model's")
    elif config.output.compare or verify:
        stats, priced, baselines, compile_s = compile_and_price(
            config, work, plan, phases, notes, want_baselines=config.output.compare)
    verification = None
    if verify and stats is not None:
        e = plan.estimate
        if config.profile().forms_reduce_scatter:
            stats = stats.formed()  # as a GPU/TPU compiler runs it, like the pricing
        verification = report.Verification(
            e.comm_bytes, stats.bytes_sent, e.peak_bytes, stats.peak_bytes, e.compute_s,
            priced.compute_s, stats.by_kind())
    hw = config.profile()
    return report.Run(
        label=work.label, description=config.description, hardware=hw.name,
        budget=config.budget_bytes(), plan=plan, num_params=work.num_params, dtype=work.dtype,
        priced_plan=priced, baselines=baselines, meshes=tried, verification=verification,
        search_s=search_s, compile_s=compile_s, schedule=config.search.schedule,
        num_micro_batches=config.search.num_micro_batches, notes=tuple(notes))


# -- printing -------------------------------------------------------------------------------


def print_run(run, console) -> None:
    """The plan's summary, its estimate against the budget, and the comparison table."""
    from rich.markup import escape
    from rich.table import Table

    from shardplan import report
    from shardplan.units import fmt_bytes, fmt_seconds

    plan, e = run.plan, run.plan.estimate
    console.print(f"[bold]{escape(run.label)}[/bold] on [bold]{run.hardware}[/bold], mesh "
                  f"[bold]{run.mesh}[/bold] ({plan.mesh.num_devices} devices), "
                  f"{run.num_params / 1e6:,.1f} M parameters, {run.dtype}")
    if len(run.meshes) > 1:
        tried = ", ".join(f"{m}: {fmt_seconds(t) if isinstance(t, float) else t}"
                          for m, t in run.meshes.items())
        console.print(f"meshes tried (estimated step): {tried}")
    console.print(plan.summary(), markup=False, highlight=False)
    fits = "fits" if run.fits(e.peak_bytes) else "DOES NOT FIT"
    console.print(f"estimate: {fmt_seconds(e.total_s)} per step, peak {fmt_bytes(e.peak_bytes)} "
                  f"per device against a budget of {fmt_bytes(run.budget)}: {fits}")
    if run.priced_plan is not None or run.baselines:
        t = Table(title=f"plan vs baselines: XLA-compiled on CPU devices, priced as {run.hardware}")
        for c in report.COMPARISON_HEADER:
            t.add_column(c, justify="left" if c == "program" else "right")
        for row in report.comparison_rows(run):
            t.add_row(*(escape(c) for c in row))
        console.print(t)
        if run.ratio() is not None:
            console.print(run.ratio_text())
    if run.verification is not None:
        t = Table(title="predicted vs compiled (the plan)")
        for c in ("quantity", "predicted", "compiled", "compiled / predicted"):
            t.add_column(c)
        for row in report.verification_rows(run.verification):
            t.add_row(*row)
        for kind, (count, sent) in run.verification.collectives.items():
            t.add_row(f"  {kind} x{count}", "", fmt_bytes(sent), "")
        console.print(t)
    for note in run.notes:
        console.print(f"note: {escape(note)}")


def write_outputs(config: Config, run, out_dir: str) -> list[str]:
    """plan.json (and comparison.json), report.md and its plots."""
    import json

    from shardplan import report

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
                "estimate": run.plan.estimate.to_dict(),
                "plan": run.priced_plan.to_dict() if run.priced_plan else None,
                "baselines": {k: v if isinstance(v, str) else v.to_dict()
                              for k, v in run.baselines.items()},
                "ratio_plan_over_best_baseline": run.ratio(),
                "best_baseline": (run.best_baseline() or [None])[0],
                "best_baseline_fits": run.best_fits(), "meshes": dict(run.meshes),
                "notes": list(run.notes),
            }, f, indent=1)
        written.append(path)
    written += report.write_report(run, out_dir, formats)
    return written


# -- commands -------------------------------------------------------------------------------


def cmd_search(args) -> int:
    config = load_config(args.config, args.set or ())
    out, err = _consoles(args.quiet)
    n = config.cluster.mesh.num_devices
    if n <= MAX_COMPILE_DEVICES and (config.output.compare or args.verify or config.search.measure):
        init_cpu_devices(n)
    run = run_search(config, verify=args.verify, phases=Phases(err))
    print_run(run, out)
    out_dir = args.out or config.output.dir
    written = write_outputs(config, run, out_dir)
    out.print(f"wrote {', '.join(written)}")
    return EXIT_OK


def _bench_configs(directory: str, overrides: Sequence[str]) -> list[tuple[str, Config]]:
    if not os.path.isdir(directory):
        raise ConfigError(None, f"bench directory {directory!r} does not exist")
    files = sorted(f for f in os.listdir(directory) if f.endswith((".yaml", ".yml")))
    if not files:
        raise ConfigError(None, f"no .yaml configs in {directory!r}")
    return [(os.path.splitext(f)[0], load_config(os.path.join(directory, f), overrides))
            for f in files]


def cmd_bench(args) -> int:
    from rich.markup import escape
    from rich.table import Table

    from shardplan import report

    configs = _bench_configs(args.dir, args.set or ())  # every config is checked up front
    out, err = _consoles(args.quiet)
    sizes = [c.cluster.mesh.num_devices for _, c in configs]
    init_cpu_devices(min(MAX_COMPILE_DEVICES, max(sizes)))
    phases = Phases(err)
    out_dir = args.out or "bench-out"
    rows = []
    for name, config in configs:
        err.rule(f"{name}: {config.model.label} on {config.cluster.hardware}")
        start = time.perf_counter()
        mesh = " x ".join(map(str, config.cluster.mesh.shape or (config.cluster.mesh.devices,)))
        try:
            run = run_search(config, phases=phases)
        except Infeasible as e:
            rows.append(report.BenchRow(name, None, config.model.label, mesh,
                                        config.cluster.hardware, f"no plan fits: {e}",
                                        time.perf_counter() - start))
            continue
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - one failing config must not stop the others
            rows.append(report.BenchRow(name, None, config.model.label, mesh,
                                        config.cluster.hardware,
                                        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                                        time.perf_counter() - start))
            continue
        write_outputs(config, run, os.path.join(out_dir, name))
        rows.append(report.BenchRow(name, run, seconds=time.perf_counter() - start))
    md, csv_path = report.write_bench(rows, out_dir)
    t = Table(title="shardplan bench: step time, plan vs baselines (XLA-compiled, priced)")
    for c in report.BENCH_HEADER:
        t.add_column(c)
    for r in rows:
        t.add_row(*(escape(c) for c in report.bench_cells(r)))
    out.print(t)
    ratios = [r.run.ratio() for r in rows if r.run is not None]
    g = report.geomean([x for x in ratios if x])
    if g is not None:
        out.print(f"geometric mean of plan / best baseline: {g:.3f}")
    out.print(f"wrote {md}, {csv_path}")
    return EXIT_OK


def cmd_show(args) -> int:
    import json

    from shardplan.plan import load_plan

    if not os.path.isfile(args.plan):
        raise ConfigError(None, f"plan file {args.plan!r} does not exist")
    try:
        plan = load_plan(args.plan)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ConfigError(None, f"{args.plan} is not a plan saved by shardplan: "
                          f"{type(e).__name__}: {e}") from None
    out, _ = _consoles()
    out.print(plan.summary(), markup=False, highlight=False)
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardplan", description="Auto-parallelization planner "
                                "for JAX train steps.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search", help="plan a config and compare it with the baselines")
    s.add_argument("config", help="a YAML config (see configs/)")
    s.add_argument("--out", help="output directory (default: the config's output.dir)")
    s.add_argument("--verify", action="store_true",
                   help="compare predicted and compiled communication and memory of the plan")
    s.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.size=gpt2-1.5b (repeatable)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    s.set_defaults(func=cmd_search)
    b = sub.add_parser("bench", help="plan every config of a directory; bench.md, bench.csv")
    b.add_argument("dir", help="a directory of YAML configs (e.g. configs/bench)")
    b.add_argument("--out", help="output directory (default bench-out): bench.md, bench.csv "
                   "and one report directory per config")
    b.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a key in every config (repeatable)")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    b.set_defaults(func=cmd_bench)
    w = sub.add_parser("show", help="print a saved plan's summary")
    w.add_argument("plan", help="a plan.json written by shardplan search")
    w.set_defaults(func=cmd_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardplan` console script; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error
        return int(e.code or 0)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"shardplan: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Infeasible as e:
        print(f"shardplan: {e}", file=sys.stderr)
        return EXIT_INFEASIBLE
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
