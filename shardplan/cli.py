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

import _thread
import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence

import jax
import yaml

from shardplan import bench, calibrate
from shardplan.analysis import targets
from shardplan.cli_render import (
    Phases,
    consoles,
    plain,
    print_bench,
    print_profile,
    print_run,
    shown,
    write_outputs,
)
from shardplan.cli_run import Infeasible, TimedOut, init_cpu_devices, run_search
from shardplan.config import MAX_COMPILE_DEVICES, Config, ConfigError, load_config
from shardplan.plan_file import PlanFileError, load_plan

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_INFEASIBLE, EXIT_TIMEOUT, EXIT_BENCH_FAILED = (
    0, 1, 2, 3, 4, 5)
EXIT_INTERRUPTED = 130
EXIT_CODES = """\
exit codes:
  0  planned (bench: every config planned)
  1  internal error in shardplan (run again with --debug for the traceback, and report it)
  2  bad input: arguments, config, plan file, or the model.entry module raising or
     returning the wrong thing
  3  no plan fits the memory budget (the message says the least memory any plan needs)
  4  the search's time limit ran out before any plan was found (raise search.time_limit)
  5  bench: some configs failed (each is named, with why, in bench.md and on stderr)
  130  interrupted (Ctrl-C)"""

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
    out.print(f"wrote {shown(', '.join(written))}")
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
        err.rule(shown(f"{name}: {config.model.label} on {config.cluster.hardware}"))
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
    out.print(f"wrote {shown(md)}, {shown(csv_path)}")
    failed = [r for r in rows if r.run is None]
    if failed:
        print(plain(f"shardplan: {len(failed)} of {len(rows)} bench configs failed: "
                    + "; ".join(f"{r.config} ({r.error})" for r in failed)), file=sys.stderr)
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
    # the summary shows the file's text inert (Plan.summary); plain() again, as a safety net
    out.print(plain(plan.summary()), markup=False, highlight=False)
    return EXIT_OK


def cmd_profile(args) -> int:
    if args.devices < 1:
        raise ConfigError(None, f"--devices must be >= 1, got {args.devices}")
    if args.repeats < 1:
        raise ConfigError(None, f"--repeats must be >= 1 (timed runs per measurement), got "
                          f"{args.repeats}")
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
    out.print(shown(f"wrote {path}: use it with hardware={path!r} or cluster.hardware: {path}"))
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
        with _interrupts():
            return args.func(args)
    except KeyboardInterrupt:
        _interrupted()
        return EXIT_INTERRUPTED  # not reached
    except Exception as e:  # noqa: BLE001 - no traceback reaches the terminal without --debug
        if args.debug:
            traceback.print_exc()
        code, text = _exit_code(e)
        # the message quotes files and arguments: shown inert (tests/test_hardening.py)
        print(plain(text), file=sys.stderr)
        return code


GRACE_S = 3.0
"""Seconds an interrupt has to unwind (its `finally` blocks remove temporary files) before
the process ends anyway."""


@contextlib.contextmanager
def _interrupts():
    """Ctrl-C ends the command with exit 130 and one line: it raises KeyboardInterrupt and the
    stack unwinds to main. Python prints and drops an exception raised inside a callback of
    the garbage collector (XLA's runs often), so one dropped there is raised again in the main
    thread; and if the process has not ended within GRACE_S, a timer ends it. A second Ctrl-C
    ends it at once. A SIGINT ignored by whoever started us (a background job) stays ignored
    (tests/test_hardening.py::test_ctrl_c_while_compiling_exits_130)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        yield
        return
    state = {"fired": False, "again": False}

    def on_sigint(signum, frame):
        if state["fired"] and not state["again"]:
            _interrupted()  # a second Ctrl-C
        if not state["fired"]:
            timer = threading.Timer(GRACE_S, _interrupted)
            timer.daemon = True
            timer.start()
        state.update(fired=True, again=False)
        raise KeyboardInterrupt

    def on_unraisable(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and state["fired"]:
            state["again"] = True
            # on_sigint again soon, from another thread: by then the main thread runs its
            # own code, not this hook (a handler run inside the hook would be dropped too)
            threading.Timer(0.01, _thread.interrupt_main).start()
            return
        previous_hook(unraisable)

    previous, previous_hook = signal.signal(signal.SIGINT, on_sigint), sys.unraisablehook
    sys.unraisablehook = on_unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook


_ANNOUNCED = threading.Lock()


def _interrupted() -> None:
    """Say so once (from the main thread or the grace timer, whichever is first) and exit 130."""
    if _ANNOUNCED.acquire(blocking=False):
        print("shardplan: interrupted", file=sys.stderr)
        _exit_now(EXIT_INTERRUPTED)
    threading.Event().wait()  # the other is exiting the process


def _exit_now(code: int) -> None:
    """Flush and end the process at once. An interrupt leaves XLA compiling on its own
    threads; tearing the interpreter down under them segfaults, so the usual exit (atexit,
    finalizers) is skipped. The `finally` blocks between the interrupt and here have run:
    temporary files are gone (tests/test_hardening.py::test_ctrl_c_while_compiling_exits_130)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _exit_code(e: Exception) -> tuple[int, str]:
    """(exit code, message) of an exception that ended a command."""
    if isinstance(e, (ConfigError, PlanFileError, targets.TargetError)):
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
