"""The `shardplan` command: search a config, bench a directory of configs, show a saved plan.

    shardplan search configs/demo.yaml [--out DIR] [--verify] [--set model.size=gpt2-1.5b]
    shardplan bench configs/bench [--out DIR]
    shardplan show shardplan-out/plan.json
    shardplan profile [--mesh 2x4] [--out my-cluster.yaml]

Planning needs no devices. To compare the plan with the hand-written baselines fairly, both are
compiled by XLA on CPU devices standing in for the cluster (as many as the mesh has, at most
64; JAX is told how many before its backend starts, which importing jax does not do) and priced
with the config's hardware profile (shardplan/analysis/price.py). What is printed and written
is shardplan.cli_render.

Exit codes: see EXIT_CODES (also in `shardplan --help`, the README and docs/cli.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import jax
import yaml

import shardplan
from shardplan import baselines as bl
from shardplan import bench, calibrate, report
from shardplan.cli_render import (
    Phases,
    consoles,
    print_bench,
    print_profile,
    print_run,
    write_outputs,
)
from shardplan.config import MAX_COMPILE_DEVICES, Config, ConfigError, load_config
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.measure import compile_and_price as price_program
from shardplan.measure import completer, cpu_mesh, expert_plans, lower_plan
from shardplan.plan import PlanFileError, load_plan
from shardplan.units import Deadline, fmt_bytes
from shardplan.workload import Workload, build_workload

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_INFEASIBLE, EXIT_TIMEOUT, EXIT_BENCH_FAILED = (
    0, 1, 2, 3, 4, 5)
EXIT_CODES = """\
exit codes:
  0  planned (bench: every config planned)
  1  internal error in shardplan (run again with --debug for the traceback, and report it)
  2  bad input: arguments, config, plan file, or the model.entry module raising or
     returning the wrong thing
  3  no plan fits the memory budget (the message says the least memory any plan needs)
  4  the search's time limit ran out before any plan was found (raise search.time_limit)
  5  bench: some configs failed (each is named, with why, in bench.md and on stderr)"""

class TimedOut(Exception):
    """The time limit ran out on every mesh before a plan was found."""


class Infeasible(Exception):
    """No mesh has a plan within the budget; `min_bytes` is the least any plan needs."""

    def __init__(self, message: str, min_bytes: float):
        super().__init__(message)
        self.min_bytes = min_bytes


# -- devices --------------------------------------------------------------------------------


def init_cpu_devices(n: int) -> int:
    """Ask JAX for at least n CPU devices (before its backend starts); returns how many exist."""
    current = jax.config.jax_num_cpu_devices
    with contextlib.suppress(RuntimeError):  # the backend is up already: keep what it has
        jax.config.update("jax_num_cpu_devices", max(n, current))
    return len(jax.devices("cpu"))


# -- search ---------------------------------------------------------------------------------


def search_options(config: Config, work: Workload, notes: list[str]):
    """The config's SearchOptions for shardplan.search (one program: pipeline planning is not
    offered by the CLI yet), measuring only where the CPU devices to compile on exist."""
    options = config.search_options()
    if options.pipeline in (True, "spmd", "mpmd") or config.search.num_micro_batches > 1:
        raise ConfigError("search.pipeline", "the shardplan command plans one program "
                          "(intra-operator parallelism) on each mesh; pipeline stages and "
                          "micro-batches are planned by shardplan.auto(step, mesh=..., "
                          "pipeline=True or 'auto') on devices. Set search.pipeline to auto or "
                          "false and search.num_micro_batches to 1", config.source)
    if "pipeline" in config.search.model_fields_set and options.pipeline == "auto":
        notes.append("search.pipeline: auto planned one program (intra-operator parallelism): "
                     "the shardplan command does not plan pipeline stages; "
                     "shardplan.auto(step, pipeline='auto') does, on devices")
    n = config.cluster.mesh.num_devices
    measure = options.measure and n <= MAX_COMPILE_DEVICES and len(jax.devices("cpu")) >= n
    return options.replace(pipeline=False, num_micro_batches=None, measure=measure,
                           state_argnums=work.state_argnums, batch_argnums=work.batch_argnums)


def plan_config(config: Config, work: Workload, phases: Phases, notes: list[str]):
    """Plan every candidate mesh, keep the cheapest: (plan, {mesh: estimate or why not})."""
    hw, budget = config.profile(), config.budget_bytes()
    options = search_options(config, work, notes)
    best, tried, infeasible = None, {}, []
    for names, sizes in config.cluster.mesh.candidates():
        label = " x ".join(f"{n}={k}" for n, k in zip(names, sizes))
        how = "trace, strategies, ILP" + (", compiling candidates" if options.measure else "")
        with phases(f"planning {work.label} on mesh {label} ({how})"):
            try:
                plan = shardplan.search(work.fn, *work.args, cluster=hw, mesh_shape=sizes,
                                        axis_names=names, options=options)
            except shardplan.InfeasibleMemory as e:
                infeasible.append(e)
                tried[label] = f"no plan fits (needs {fmt_bytes(e.min_bytes)})"
                continue
            except shardplan.SearchTimeout as e:
                tried[label] = f"time limit ran out: {str(e).splitlines()[0]}"
                continue
        tried[label] = plan.estimate.total_s
        if best is None or plan.estimate.total_s < best.estimate.total_s:
            best = plan
    if best is None and not infeasible:
        raise TimedOut(f"the time limit of {options.time_limit:g} s ran out before a plan was "
                       f"found on any mesh ({'; '.join(f'{m}: {t}' for m, t in tried.items())}); "
                       "raise search.time_limit")
    if best is None:
        least = min(e.min_bytes for e in infeasible)
        raise Infeasible(
            f"no plan fits the memory budget of {fmt_bytes(budget)} per device on "
            f"{config.cluster.mesh.num_devices} {hw.name} devices; the smallest memory any plan "
            f"needs is {fmt_bytes(least)} per device ({least:.0f} bytes). Raise "
            "cluster.memory_budget, use more devices, or shrink the model or batch.", least)
    return best, tried


# -- compile and price ----------------------------------------------------------------------


def _compile_plan(work: Workload, plan, mesh, hw, phases: Phases, notes: list[str]):
    """The plan's program compiled and priced: (stats, priced), or (None, None) for a pipeline
    plan, which is not one program."""
    n = plan.mesh.num_devices
    with phases(f"compiling the plan with XLA on {n} CPU devices"):
        try:
            step = shardplan.auto(work.fn, mesh=mesh, hardware=hw, plan=plan,
                                  donate_argnums=tuple(work.state_argnums or ()),
                                  state_argnums=work.state_argnums,
                                  batch_argnums=work.batch_argnums)
            return price_program(step.lower(*work.args), mesh, plan.mesh, hw, work.dtype)
        except Exception as e:  # e.g. a pipeline plan that is not one program
            if not plan.stages:
                raise
            notes.append(f"the pipeline plan was not compiled as one program ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:120]}); its row is the cost model's estimate")
    return None, None


def _compile_baselines(config: Config, work: Workload, plan, mesh, hw, phases: Phases,
                       notes: list[str]) -> dict[str, Any]:
    """{expert plan: its program priced, or why not}: data parallel, FSDP, Megatron / 2-D as
    an expert writes them (shardplan.measure.expert_plans: the expert's input shardings, every
    intermediate laid out by the ILP around them). The measured search compiled them already
    (plan.candidates): those are reused; the others are written and compiled here."""
    measured = {c.name: c for c in plan.candidates}
    wanted = config.output.baselines
    if wanted is None:
        wanted = (list(bl.applicable_baselines(work.step, mesh)) if work.step is not None
                  else None)
    results: dict[str, Any] = {}
    missing = [n for n in (wanted or ()) if n not in measured]
    if wanted is None or missing:
        traced = trace(work.fn, work.args, work.state_argnums, work.batch_argnums)
        graph = lift(traced.closed_jaxpr, traced.arg_info)
        options = dataclasses.replace(config.search_options(), measure=False)
        complete = completer(graph, traced, plan.mesh, hw, options, Deadline(options.time_limit),
                             device_mesh=mesh)
        written = expert_plans(graph, plan, complete=complete)
        if wanted is None:
            wanted = list(written)
        for name in wanted:
            if name in measured:
                continue
            if name not in written:
                results[name] = f"not an expert plan of this step on mesh {plan.mesh}"
                continue
            with phases(f"compiling expert plan {name}"):
                try:
                    lowered = lower_plan(graph, traced, written[name], mesh,
                                         traced.state_argnums)
                    _, results[name] = price_program(lowered, mesh, plan.mesh, hw, work.dtype)
                except Exception as e:  # noqa: BLE001 - one failing plan must not hide others
                    results[name] = (f"failed: {type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:120]}")
    for name in wanted:
        if name in measured:
            c = measured[name]
            results[name] = c.priced if c.priced is not None else f"failed: {c.error}"
    return {name: results[name] for name in wanted}


def compile_and_price(config: Config, work: Workload, plan, phases: Phases, notes: list[str],
                      want_baselines: bool):
    """Compile the plan (and the baselines) on CPU devices, price each: (plan stats, priced
    plan, {baseline: priced or why not}, compile seconds)."""
    hw = config.profile()
    n = plan.mesh.num_devices
    have = len(jax.devices("cpu"))
    if have < n:
        notes.append(f"not compiled: JAX runs {have} CPU devices and the mesh needs {n} (it was "
                     "started before shardplan could ask for more)")
        return None, None, {}, 0.0
    start = time.perf_counter()
    mesh = cpu_mesh(plan.mesh)
    stats, priced = _compile_plan(work, plan, mesh, hw, phases, notes)
    results = (_compile_baselines(config, work, plan, mesh, hw, phases, notes)
               if want_baselines else {})
    return stats, priced, results, time.perf_counter() - start


def run_search(config: Config, *, verify: bool = False, phases: Phases):
    """Plan a config and compare it: a report.Run."""
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
    label, e = report.model_estimate(plan)
    if verify and stats is not None and e is not None:
        verification = report.verification(plan, label, e, stats, priced,
                                             config.profile().forms_reduce_scatter)
    if priced is not None and not plan.stages:
        plan = report.compiled_plan(plan, priced)  # one memory figure per program
    hw = config.profile()
    return report.Run(
        label=work.label, description=config.description, hardware=hw.name,
        budget=config.budget_bytes(), plan=plan, num_params=work.num_params, dtype=work.dtype,
        priced_plan=priced, searched=_searched(plan, priced), baselines=baselines, meshes=tried,
        verification=verification,
        search_s=search_s, compile_s=compile_s, schedule=config.search.schedule,
        num_micro_batches=config.search.num_micro_batches, notes=tuple(notes))


def _searched(plan, priced):
    """The searched plan alone, priced: the measured selection's "searched" candidate, else
    the plan itself (nothing was measured: the plan is the searched one)."""
    if not plan.candidates:
        return priced
    return next((c.priced for c in plan.candidates if c.name == "searched"), None)


# -- commands -------------------------------------------------------------------------------


def cmd_search(args) -> int:
    config = load_config(args.config, args.set or ())
    out, err = consoles(args.quiet)
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
    configs = _bench_configs(args.dir, args.set or ())  # every config is checked up front
    out, err = consoles(args.quiet)
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
        except (Infeasible, TimedOut) as e:
            why = "no plan fits" if isinstance(e, Infeasible) else "time limit"
            rows.append(bench.BenchRow(name, None, config.model.label, mesh,
                                        config.cluster.hardware, f"{why}: {e}",
                                        time.perf_counter() - start))
            continue
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - one failing config must not stop the others
            rows.append(bench.BenchRow(name, None, config.model.label, mesh,
                                        config.cluster.hardware,
                                        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                                        time.perf_counter() - start))
            continue
        write_outputs(config, run, os.path.join(out_dir, name))
        rows.append(bench.BenchRow(name, run, seconds=time.perf_counter() - start))
    md, csv_path = bench.write_bench(rows, out_dir)
    print_bench(rows, out)
    out.print(f"wrote {md}, {csv_path}")
    failed = [r for r in rows if r.run is None]
    if failed:
        print(f"shardplan: {len(failed)} of {len(rows)} bench configs failed: "
              + "; ".join(f"{r.config} ({r.error})" for r in failed), file=sys.stderr)
        return EXIT_BENCH_FAILED
    return EXIT_OK


def cmd_show(args) -> int:
    if not os.path.isfile(args.plan):
        raise ConfigError(None, f"plan file {args.plan!r} does not exist")
    try:
        plan = load_plan(args.plan)
    except PlanFileError as e:
        raise ConfigError(None, f"not a plan file shardplan can read: {e}") from None
    out, _ = consoles()
    out.print(plan.summary(), markup=False, highlight=False)
    return EXIT_OK


def cmd_profile(args) -> int:
    if args.devices < 1:
        raise ConfigError(None, f"--devices must be >= 1, got {args.devices}")
    init_cpu_devices(args.devices)  # before the backend starts; ignored by GPU and TPU runs
    devices = len(jax.devices())
    try:
        mesh = calibrate.profile_mesh(args.mesh, devices)
    except ValueError as e:
        raise ConfigError(None, str(e)) from None
    out, err = consoles(args.quiet)
    cal = calibrate.measure_profile(mesh, name=args.name, repeats=args.repeats,
                                    progress=lambda m: err.print(f"[dim]{m}[/]"))
    path = args.out or f"{cal.profile.name}.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cal.profile.to_dict(), f, sort_keys=False)
    print_profile(cal, out)
    out.print(f"wrote {path}: use it with hardware={path!r} or cluster.hardware: {path}")
    return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardplan", description="Auto-parallelization planner "
                                "for JAX train steps.", epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true",
                   help="show Python tracebacks (of errors in the config or entry as well)")
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
    r = sub.add_parser("profile", help="measure this machine's devices and links; write a "
                       "hardware profile YAML the planner loads")
    r.add_argument("--mesh", help="mesh to measure the links of, e.g. 2x4 (default: hosts x "
                   "devices across processes, else one axis over every device)")
    r.add_argument("--devices", type=int, default=8,
                   help="CPU devices to run when the backend is the CPU (default 8)")
    r.add_argument("--name", help="the profile's name (default: <device kind>-measured)")
    r.add_argument("--out", help="YAML file to write (default: <name>.yaml)")
    r.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the "
                   "fastest counts (default 3)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    r.set_defaults(func=cmd_profile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardplan` console script; returns the exit code."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage error
        return int(e.code or 0)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - no traceback reaches the terminal without --debug
        if args.debug:
            traceback.print_exc()
        code, text = _exit_code(e)
        print(text, file=sys.stderr)
        return code


def _exit_code(e: Exception) -> tuple[int, str]:
    """(exit code, message) of an exception that ended a command."""
    if isinstance(e, (ConfigError, PlanFileError)):
        return EXIT_USAGE, f"shardplan: error: {e}"
    if isinstance(e, Infeasible):
        return EXIT_INFEASIBLE, f"shardplan: {e}"
    if isinstance(e, TimedOut):
        return EXIT_TIMEOUT, f"shardplan: {e}"
    first = (str(e).splitlines() or [""])[0]
    return EXIT_INTERNAL, (f"shardplan: internal error: {type(e).__name__}: {first}\n"
                           "run again with --debug for the traceback")


if __name__ == "__main__":
    sys.exit(main())
