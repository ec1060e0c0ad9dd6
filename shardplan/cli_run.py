"""Running one config for the `shardplan` command: plan it on each candidate mesh, compile the
plan and the hand-written baselines on CPU devices standing in for the cluster, price them with
the config's hardware profile. The command itself (arguments, exit codes, bench) is
shardplan.cli; what is printed and written, shardplan.cli_render."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax

import shardplan
from shardplan import baselines as bl
from shardplan import fingerprint, report
from shardplan import hints as hints_mod
from shardplan.analysis import targets
from shardplan.cli_render import Phases
from shardplan.config import MAX_COMPILE_DEVICES, Config, ConfigError
from shardplan.ir.lift import LiftOptions, lift
from shardplan.ir.trace import trace
from shardplan.planning import depth, remat, select
from shardplan.planning.compiled import compile_and_price as price_program
from shardplan.planning.expert_plans import expert_plans
from shardplan.planning.job import Job
from shardplan.units import fmt_bytes
from shardplan.workload import Workload, build_workload


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
    """The config's SearchOptions for shardplan.search (one program: the CLI plans no
    pipelines), measuring only where the CPU devices to compile on exist."""
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
    measure = options.measure and can_compile(config.profile(), n)
    return options.replace(pipeline=False, num_micro_batches=None, measure=measure,
                           state_argnums=work.state_argnums, batch_argnums=work.batch_argnums)


def can_compile(hw, n: int) -> bool:
    """Whether programs for `n` devices of `hw` can be compiled here: on compile-only devices
    of a TPU slice (any size), or on up to MAX_COMPILE_DEVICES CPU devices JAX runs."""
    if not targets.why_not_tpu(hw) and hw.backend == "tpu":
        return True
    return n <= MAX_COMPILE_DEVICES and len(jax.devices("cpu")) >= n


def plan_config(config: Config, work: Workload, phases: Phases, notes: list[str]):
    """Plan every candidate mesh, keep the cheapest: (plan, {mesh: estimate or why not})."""
    hw, budget = config.profile(), config.budget_bytes()
    options = search_options(config, work, notes)
    meshes = config.cluster.mesh.candidates()
    # Several meshes: compared by the cost model (within 10% of the compiled programs:
    # tests/test_model_agrees.py), the candidates compiled on the kept one only (compiling
    # is the dear part of a search: once per candidate, not once per candidate and mesh).
    per_mesh = options.replace(measure=False)
    best, tried, infeasible = None, {}, []
    for k, (names, sizes) in enumerate(meshes):
        label = " x ".join(f"{n}={k}" for n, k in zip(names, sizes))
        how = "trace, strategies, ILP"
        with phases(f"planning {work.label} on mesh {label} ({how})",
                    *((k + 1, len(meshes)) if len(meshes) > 1 else ())):
            try:
                plan = shardplan.search(work.fn, *work.args, cluster=hw, mesh_shape=sizes,
                                        axis_names=names, options=per_mesh,
                                        progress=phases.reporter)
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
    if options.measure:
        label = " x ".join(f"{n}={k}" for n, k in zip(best.mesh.names, best.mesh.sizes))
        best = measured(config, work, best, options, phases)
        how = next((c.extrapolated for c in best.candidates if c.extrapolated), "")
        if how:
            notes.append(f"the plan and the expert plans priced as compiled: {how} (each "
                         "figure a + b x layers; see each candidate in the plan's notes)")
        if len(meshes) > 1:
            notes.append(f"meshes compared by the cost model; the plan and the expert plans "
                         f"compiled and priced on the kept mesh ({label})")
    return best, tried


# -- measured selection ---------------------------------------------------------------------

def shallow_copies(config: Config, work: Workload, period: int = 1) -> depth.Shallow | None:
    """The config's zoo step rebuilt with fewer layers (at depth.cut_depths of its layers'
    `period`), traced and lifted (shardplan.planning.depth), where it has `num_layers` and at least
    depth.MIN_LAYERS of them."""
    layers = _layers(config, work)
    if layers is None:
        return None
    first, second = depth.cut_depths(period)
    traced, graphs = [], []
    for k in (first, second):
        model = config.model.model_copy(
            update={"overrides": {**config.model.overrides, "num_layers": k}})
        cut = build_workload(config.model_copy(update={"model": model}))
        t = _traced(cut)
        traced.append(t)
        graphs.append(lift(t.closed_jaxpr, t.arg_info,
                           LiftOptions(while_trips=config.search_options().while_trips)))
    return depth.Shallow(layers, first, tuple(traced), tuple(graphs), period)


def _layers(config: Config, work: Workload) -> int | None:
    """The zoo step's `num_layers` where it has at least depth.MIN_LAYERS of them."""
    layers = getattr(getattr(work.step, "config", None), "num_layers", None)
    if config.model.name is None or not isinstance(layers, int) or layers < depth.MIN_LAYERS:
        return None
    return layers


def measured(config: Config, work: Workload, plan, options, phases: Phases):
    """The searched plan (planned without measuring) and the expert plans compiled on CPU
    devices and priced, the cheapest kept (shardplan.planning.select): each candidate
    compiled on two cut-down copies of a deep zoo step and extrapolated (shardplan.planning.depth),
    in full otherwise. A plan of the rematerialized or accumulated step is measured by
    shardplan.search."""
    hw = config.profile()
    label = " x ".join(f"{n}={k}" for n, k in zip(plan.mesh.names, plan.mesh.sizes))
    if plan.remat or plan.grad_accumulation > 1:
        with phases(f"planning {work.label} on mesh {label} again, compiling candidates"):
            return shardplan.search(work.fn, *work.args, cluster=hw, mesh_shape=plan.mesh.sizes,
                                    axis_names=plan.mesh.names, options=options,
                                    progress=phases.reporter)
    options = options.replace(hints=hints_mod.with_boxes(options.hints, work.args,
                                                         options.model_constraints))
    job = Job.make(_traced(work), plan.mesh, hw, options, progress=phases.reporter)
    traced, graph = job.traced, job.graph
    mesh, _ = targets.compile_mesh(hw, plan.mesh)
    shallow, repeats = None, depth.layer_period(graph)
    if _layers(config, work) is not None and repeats is not None:
        a, b = depth.cut_depths(repeats[1])
        with phases(f"building {work.label} cut down to {a} and {b} layers"):
            shallow = shallow_copies(config, work, repeats[1])
    compile_one = depth.compiler(graph, traced, shallow, mesh, hw, traced.state_argnums)
    with phases(f"compiling and pricing the candidates on mesh {label}"):
        kept = select.select(job, plan, compile_one=compile_one,
                             completion_s=options.time_limit)
    return dataclasses.replace(kept, search_s=plan.search_s + kept.search_s,
                               fingerprint=fingerprint.of_step(traced, plan.mesh))


def _traced(work: Workload):
    """The workload's step traced."""
    return trace(work.fn, work.args, work.state_argnums, work.batch_argnums)


# -- compile and price ----------------------------------------------------------------------


def _compile_plan(work: Workload, plan, mesh, hw, phases: Phases, notes: list[str],
                  need_stats: bool = False):
    """The plan's program compiled and priced: (stats, priced), or (None, None) for a pipeline
    plan, which is not one program. The measured search's price is reused (stats None where it
    was extrapolated from shallow copies, shardplan.planning.depth), unless `need_stats`."""
    n = plan.mesh.num_devices
    mine = fingerprint.plan_fingerprint(plan)
    for c in plan.candidates:  # the measured search compiled it already
        if (c.priced is not None and (c.stats is not None or not need_stats)
                and fingerprint.plan_fingerprint(c.plan) == mine):
            return c.stats, c.priced
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
    an expert writes them (shardplan.planning.expert_plans: the expert's input shardings, every
    intermediate laid out by the ILP around them). The measured search compiled them already
    (plan.candidates): those are reused; the others are written and compiled here (on shallow
    copies of a deep zoo step where it applies: shardplan.planning.depth)."""
    measured = {c.name: c for c in plan.candidates}
    wanted = config.output.baselines
    if wanted is None:
        wanted = (list(bl.applicable_baselines(work.step, mesh)) if work.step is not None
                  else None)
    results: dict[str, Any] = {}
    missing = [n for n in (wanted or ()) if n not in measured]
    if wanted is None or missing:
        options = dataclasses.replace(config.search_options(), measure=False)
        job = Job.make(_traced(work), plan.mesh, hw, options)
        traced, graph = job.traced, job.graph
        written = expert_plans(job, plan, deadline=options.time_limit)
        repeats = depth.layer_period(graph)
        shallow = shallow_copies(config, work, repeats[1]) if repeats else None
        compile_one = depth.compiler(graph, traced, shallow, mesh, hw, traced.state_argnums)
        if wanted is None:
            wanted = list(written)
        for name in wanted:
            if name in measured:
                continue
            if name not in written:
                results[name] = f"not an expert plan of this step on mesh {plan.mesh}"
                continue
            with phases(f"compiling expert plan {name}"):
                # a failure is recorded, not raised; MaxText's runs the rematerialized step
                c = remat.compile_as_run(job, name, written[name], mesh, compile_one)
                results[name] = c.priced if c.priced is not None else f"failed: {c.error}"
    for name in wanted:
        if name in measured:
            c = measured[name]
            results[name] = c.priced if c.priced is not None else f"failed: {c.error}"
    return {name: results[name] for name in wanted}


def compile_and_price(config: Config, work: Workload, plan, phases: Phases, notes: list[str],
                      want_baselines: bool, verify: bool = False):
    """Compile the plan (and the baselines) where the target's compiler runs (compile-only TPU
    devices, or CPU devices standing in: analysis.targets), price each: (plan stats, priced
    plan, {baseline: priced or why not}, compile seconds)."""
    hw = config.profile()
    n = plan.mesh.num_devices
    have = len(jax.devices("cpu"))
    if have < n and targets.why_not_tpu(hw):
        notes.append(f"not compiled: JAX runs {have} CPU devices and the mesh needs {n} (it was "
                     "started before shardplan could ask for more)")
        return None, None, {}, 0.0
    start = time.perf_counter()
    mesh, compiler = targets.compile_mesh(hw, plan.mesh)
    notes.append(f"compiled by {compiler.describe()}")
    stats, priced = _compile_plan(work, plan, mesh, hw, phases, notes, need_stats=verify)
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
    compile_ok = n <= MAX_COMPILE_DEVICES or can_compile(config.profile(), n)
    stats = priced = None
    baselines: dict = {}
    compile_s = 0.0
    if (config.output.compare or verify) and not compile_ok:
        notes.append(f"not compiled: the mesh has {n} devices, more than the "
                     f"{MAX_COMPILE_DEVICES} CPU devices XLA is asked to stand in for; the "
                     "figures are the cost model's")
    elif config.output.compare or verify:
        stats, priced, baselines, compile_s = compile_and_price(
            config, work, plan, phases, notes, want_baselines=config.output.compare,
            verify=verify)
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
