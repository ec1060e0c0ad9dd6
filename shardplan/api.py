"""auto() and search(), the public entry points: trace -> plan (the driver, shardplan.planning)
-> emit, and the plan cache."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from shardplan import _compat, distributed, gcpause, progress_display
from shardplan import adopt as adopt_mod
from shardplan import cache as cache_mod
from shardplan import fingerprint as fingerprint_mod
from shardplan import hints as hints_mod
from shardplan import progress as progress_mod
from shardplan.cost.hardware import HardwareProfile, get_profile
from shardplan.emit import spmd as spmd_mod
from shardplan.emit.jit import emit_jit
from shardplan.emit.pipeline import emit_pipeline
from shardplan.ir.lift import lift
from shardplan.ir.trace import abstractify, trace
from shardplan.options import DEFAULTS, SearchOptions, path_str
from shardplan.plan import Plan
from shardplan.plan_file import load_plan
from shardplan.planning import driver
from shardplan.planning.job import Job
from shardplan.strategies.coverage import Coverage
from shardplan.strategies.coverage import coverage as coverage_of
from shardplan.strategies.spec import MeshShape

DEFAULT_PROFILE = {"tpu": "tpu-v4", "gpu": "a100-80gb", "cuda": "a100-80gb", "rocm": "a100-80gb",
                   "cpu": "cpu"}


def _profile(hardware, backend: str) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    return get_profile(hardware or DEFAULT_PROFILE.get(backend, "cpu"))


# -- arguments --------------------------------------------------------------------------------


def _check_fn(fn, where: str):
    if isinstance(fn, jax.sharding.Mesh):
        raise TypeError(f"{where} takes the function to plan first, got a Mesh: pass the mesh "
                        f"by keyword, {where}(step, mesh=mesh) or @{where}(mesh=mesh)")
    if not callable(fn):
        raise TypeError(f"{where} takes a function to plan, got {type(fn).__name__} {fn!r:.60}; "
                        f"pass options by keyword: {where}(step, mesh=mesh)")


def _check_mesh(mesh):
    if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, e.g. jax.make_mesh((2, 4), "
                        f"('data', 'model')), or None for all devices on one axis; got "
                        f"{type(mesh).__name__} {mesh!r:.60}")
    return mesh


def _check_hardware(hardware):
    """`hardware` checked now (a typo fails at the decorator, not at the first call)."""
    if hardware is None or isinstance(hardware, HardwareProfile):
        return hardware
    if not isinstance(hardware, str):
        raise TypeError(f"hardware must be a profile name such as 'tpu-v4' or 'a100-80gb', the "
                        "path of a profile .yaml, or a shardplan.cost.hardware.HardwareProfile; "
                        f"got {type(hardware).__name__} {hardware!r:.60}")
    get_profile(hardware)  # raises, listing the known profiles
    return hardware


def _argnums(x, name: str) -> tuple[int, ...]:
    """An int or a sequence of ints (as jax.jit takes them), as a tuple."""
    if isinstance(x, int) and not isinstance(x, bool):
        return (x,)
    if (isinstance(x, Sequence) and not isinstance(x, str)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in x)):
        return tuple(x)
    raise TypeError(f"{name} must be an int or a tuple of ints (argument positions), got "
                    f"{type(x).__name__} {x!r:.60}")


def _check_plan(plan):
    if isinstance(plan, (str, os.PathLike)):
        return load_plan(plan)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a shardplan.Plan or the path of a plan file saved with "
                        f"Plan.save, got {type(plan).__name__}")
    return plan


def _signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _options(options: SearchOptions | None, search_options: dict) -> SearchOptions:
    if options is not None and search_options:
        raise TypeError(f"pass options=SearchOptions(...) or the options by keyword "
                        f"({', '.join(sorted(search_options))}), not both")
    if options is not None and not isinstance(options, SearchOptions):
        raise TypeError(f"options must be a shardplan.SearchOptions, got {type(options).__name__}")
    known = {f.name for f in dataclasses.fields(SearchOptions)}
    unknown = sorted(set(search_options) - known)
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are "
                        f"{', '.join(sorted(known))}")
    return options if options is not None else SearchOptions.make(**search_options)


class AutoStep:
    """A train step planned on first call for each input signature, then run as one jit (an
    SPMD pipeline too), or as an MPMD pipeline of programs, one per stage."""

    def __init__(self, fn, mesh=None, options: SearchOptions = DEFAULTS,
                 plan: Plan | None = None, hardware: str | HardwareProfile | None = None,
                 donate_argnums: tuple[int, ...] = (), cache=True, progress=None):
        functools.update_wrapper(self, fn)
        self.progress = progress  # progress_display.on_stderr's argument
        self.fn = fn
        self._mesh = mesh
        self.options = options
        self.hardware = hardware
        self.donate_argnums = tuple(donate_argnums)
        self.plan_cache = cache
        self._given_plan = plan
        # signature -> (plan, the callable that runs it, its input shardings or None)
        self._cache: dict[tuple, tuple[Plan, Any, Any]] = {}

    @property
    def mesh(self):
        if self._mesh is None:
            self._mesh = distributed.default_mesh()
        if self._mesh is None:
            self._mesh = jax.make_mesh((len(jax.devices()),), ("devices",),
                                       axis_types=(jax.sharding.AxisType.Auto,))
        return _compat.auto_mesh(self._mesh)

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The call's arguments by position (keyword arguments bound as jax.jit binds them)."""
        if not kwargs:
            return args
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{getattr(self.fn, '__name__', 'the step')}: {e}") from None
        if bound.kwargs:
            raise TypeError(f"{getattr(self.fn, '__name__', 'the step')}: cannot pass "
                            f"{', '.join(sorted(bound.kwargs))} by keyword (keyword-only, "
                            "**kwargs, or an earlier argument left to its default): pass every "
                            "argument up to the last by position")
        return bound.args

    def _entry(self, args) -> tuple[Plan, Any, Any]:
        for i in self.donate_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(f"donate_argnums has {i}, but the step is called with "
                                 f"{len(args)} arguments")
        key = _signature(args)
        if key not in self._cache:
            with gcpause.paused(), progress_display.on_stderr(self.progress) as reporter:
                self._cache[key] = self._plan_and_emit(args, reporter)
        return self._cache[key]

    def _plan_and_emit(self, args, reporter=progress_mod.SILENT
                       ) -> tuple[Plan, Any, Any]:
        """Trace, plan (or adopt the given plan) and emit: (plan, the callable that runs it,
        the input shardings of its one jit, or None for a pipeline)."""
        mesh = self.mesh
        o = self.options.replace(hints=hints_mod.with_boxes(self.options.hints, args,
                                                            self.options.model_constraints))
        hints_mod.check_mesh_axes(o.hints, mesh.axis_names)
        with progress_mod.phase(reporter, "tracing"):
            traced = trace(self.fn, args, o.state_argnums, o.batch_argnums)
        fp = fingerprint_mod.of_step(traced, MeshShape.of(mesh))
        hw = _profile(self.hardware, mesh.devices.flat[0].platform)
        multi = distributed.is_multi_controller()

        def job(options: SearchOptions) -> Job:
            return Job.make(traced, MeshShape.of(mesh), hw, options, device_mesh=mesh,
                            donate_argnums=self.donate_argnums, fn=self.fn, args=args,
                            progress=reporter)

        if o.remat is True and o.pipeline is not False and self._given_plan is None:
            raise ValueError(f"remat=True rematerializes the layers of one program; pipeline="
                             f"{o.pipeline!r} plans as written: pass pipeline=False")
        if self._given_plan is None and multi and o.pipeline is not False:
            if o.pipeline == "auto":
                # Process 0 chooses (one program, SPMD or MPMD pipeline) and broadcasts the
                # plan; every process checks it (its fingerprint covers the pipeline kind).
                plan, pp = distributed.plan_auto_once(
                    traced, mesh, hw, o, lambda: driver.choose_program(job(o)),
                    cache_mod.PlanCache.of(self.plan_cache), donate_argnums=self.donate_argnums)
            else:
                # The SPMD pipeline (process 0 plans it) where it applies, else the MPMD one
                # (every process plans it); all check the plan before the first step.
                plan, pp = distributed.plan_pipeline_once(
                    self.fn, args, mesh, hw, o, traced, cache_mod.PlanCache.of(self.plan_cache),
                    donate_argnums=self.donate_argnums)
            if pp is not None:
                return self._emit_mpmd(plan, pp, fp)
            if plan.pipeline_kind == "spmd":
                return self._emit_spmd(plan, fp)
            # one program, as process 0 chose
            plan, graph = adopt_mod.adopt(plan, traced, mesh, self.fn, args, o)
        elif self._given_plan is None and o.pipeline is not False:
            # An SPMD pipeline plan is one program's plan: cached like one (an MPMD plan is
            # rebuilt by the pipeline planner, which its JSON cannot stand in for).
            cache = cache_mod.PlanCache.of(self.plan_cache)
            pipe_fp = fingerprint_mod.step_fingerprint(traced, mesh, hw, o,
                                                       donate_argnums=self.donate_argnums)
            hit = cache.load(pipe_fp) if cache is not None else None
            if hit is not None and hit.pipeline_kind == "spmd":
                try:
                    return self._emit_spmd(dataclasses.replace(
                        hit, in_tree=traced.in_tree, out_tree=traced.out_tree), fp)
                except Exception as e:  # noqa: BLE001  a bad entry is ignored; a planned one raises below
                    cache.discard(pipe_fp, f"its plan does not apply to this step "
                                           f"({type(e).__name__}: {str(e)[:200]})")
            choice = driver.choose_program(job(o))
            if choice.pipelined and choice.plan.pipeline_kind == "spmd":
                if cache is not None:
                    cache.store(pipe_fp, dataclasses.replace(choice.plan, device_mesh=None))
                return self._emit_spmd(choice.plan, fp)
            if choice.pipelined:
                return self._emit_mpmd(choice.plan, choice.pipeline, fp)
            plan, graph = dataclasses.replace(choice.plan, device_mesh=mesh), choice.intra_graph
        else:
            # One plan for every process: planned once (or loaded from the cache), checked
            # before the first step.
            o1 = o.replace(pipeline=False) if o.pipeline is not False else o
            step_fp = fingerprint_mod.step_fingerprint(traced, mesh, hw, o1,
                                                       donate_argnums=self.donate_argnums)

            def obtain() -> Plan:
                if self._given_plan is not None:
                    return self._given_plan
                cache = cache_mod.PlanCache.of(self.plan_cache)
                plan = None if cache is None else cache.lookup(
                    step_fp, check=lambda p: adopt_mod.check_cached(p, traced, mesh, self.fn,
                                                                    args, o1))
                if plan is None:
                    plan = driver.plan_program(job(o1))
                    if cache is not None:
                        cache.store(step_fp, plan)
                return plan

            # several processes: planned by process 0 (or each, given a plan) and compared
            plan = (distributed.plan_once(step_fp, obtain, broadcast=self._given_plan is None)
                    if multi else obtain())
            plan, graph = adopt_mod.adopt(plan, traced, mesh, self.fn, args, o)
        if self._given_plan is None:
            plan = dataclasses.replace(plan, fingerprint=fp)
        jitted, in_shardings, _ = emit_jit(graph, mesh, traced.in_tree, traced.out_tree,
                                           plan.input_specs, plan.output_specs, plan.constraints,
                                           plan.operand_specs, self.donate_argnums)
        return plan, jitted, tuple(in_shardings)

    def _emit_spmd(self, plan: Plan, fp) -> tuple[Plan, Any, Any]:
        """An SPMD pipeline plan emitted as one jit on the pipeline's mesh (shardplan.emit.spmd)."""
        pmesh = spmd_mod.pipeline_mesh(self.mesh, len(plan.stages))
        jitted, plan = spmd_mod.emit_plan(self.fn, dataclasses.replace(plan, fingerprint=fp),
                                          pmesh, self.donate_argnums)
        return plan, jitted, plan.in_shardings

    def _emit_mpmd(self, plan: Plan, pp, fp) -> tuple[Plan, Any, Any]:
        """An MPMD pipeline: one program per stage on its submesh (shardplan.emit.pipeline);
        the plan carries the runtime's input and output shardings (each on its stage's
        submesh), so global_args can build the inputs."""
        runtime = emit_pipeline(pp.split, pp.ios, pp.specs, pp.stages, pp.device_mesh,
                                pp.schedule)
        plan = dataclasses.replace(plan, fingerprint=fp, stage_in_shardings=runtime.in_shardings,
                                   stage_out_shardings=runtime.out_shardings)
        return plan, runtime, None

    def __call__(self, *args, **kwargs):
        args = self._positional(args, kwargs)
        _check_live(args, getattr(self.fn, "__name__", "the step"))
        _, run, in_shardings = self._entry(args)
        if in_shardings is not None:
            # Place the arguments on the plan's shardings first: an array's type carries its
            # mesh, so fresh single-device arrays and the step's own (sharded) outputs fed back
            # would be two signatures to jit and compile the step twice.
            args = jax.device_put(args, in_shardings)
        return run(*args)

    def lower(self, *args, **kwargs):
        """jax.stages.Lowered of the planned step; args may be arrays or ShapeDtypeStructs."""
        args = self._positional(args, kwargs)
        plan, jitted, _ = self._entry(args)
        if plan.stages and plan.pipeline_kind != "spmd":
            raise ValueError("this step runs as a pipeline of several programs (one per stage), "
                             "not one: call it, or use .plan(); pass pipeline=False to get one "
                             "program to lower")
        return jitted.lower(*jax.tree_util.tree_map(abstractify, args))

    def plan(self, *args, **kwargs) -> Plan:
        """The plan for these arguments (arrays or ShapeDtypeStructs), planned if need be."""
        return self._entry(self._positional(args, kwargs))[0]


def _check_live(args, name: str) -> None:
    """A ValueError naming the first argument whose buffer was deleted (donated to an earlier
    call), before it reaches JAX, which fails on it obscurely or crashes
    (tests/test_hardening.py::test_a_donated_array_passed_again_is_named)."""
    for path, x in jax.tree_util.tree_flatten_with_path(args)[0]:
        if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                and x.is_deleted()):
            raise ValueError(f"{name}: argument {path_str(path)} (shape {tuple(x.shape)}) is a "
                             "deleted jax.Array: its buffer was donated to an earlier call "
                             "(donate_argnums) or deleted. Pass what the step returned in its "
                             "place, e.g. params, opt_state, loss = step(params, opt_state, "
                             "batch)")


def auto(fn=None, *, mesh=None, hardware: str | HardwareProfile | None = None,
         donate_argnums: Sequence[int] = (), plan: Plan | str | None = None,
         options: SearchOptions | None = None, cache=True, progress=None, **search_options):
    """Plan and run a single-device train step over a device mesh.

    Use bare (`@shardplan.auto`: all devices on one axis) or with options. The step is traced
    on its first call for each input signature, planned (a PartitionSpec for every value,
    chosen by an ILP over the cost model of `hardware`), and run as one jax.jit.

    Args:
      mesh: a jax.sharding.Mesh (Auto or Explicit axes); default all devices on one axis
        (under jax.distributed: axes ("hosts", "devices"), the processes along the first).
      hardware: a profile name (see shardplan.cost.hardware.PROFILES) or HardwareProfile;
        default by the devices' platform.
      donate_argnums: arguments whose buffers the step may reuse (usually the state).
      plan: a Plan (or a path to one saved with Plan.save) to run instead of planning.
      options: a shardplan.SearchOptions; or give its fields by keyword (`search_options`):
        memory_budget (bytes per device, an int or a string like "16GiB"), state_argnums,
        batch_argnums, time_limit, solver_seed, workers, measure (also compile the searched
        plan and the expert plans with XLA on the mesh, price each with `hardware` and keep
        the cheapest that fits), pipeline (False: one program; True: pipeline stages, as
        an SPMD pipeline (one program, stages along a `stage` mesh axis) where the loss
        runs its layers as one scan over stacked parameters, else MPMD stages on
        submeshes; "spmd" / "mpmd": that kind only; "auto": an SPMD or MPMD pipeline only
        where it beats one program (the cost model, or compiled with measure); pipelines need the step's gradient taken with
        shardplan.value_and_grad / shardplan.grad; see docs/concepts.md#pipelines),
        num_micro_batches, num_stages, num_layers, schedule ("1f1b" or "gpipe"), hints
        (shardings to pin, the planner choosing the rest: a dict {path pattern:
        PartitionSpec} such as {"2/**": P("data")}, or a shardplan.Hints with
        logical_axis_rules for parameters that carry logical axis names; see
        docs/concepts.md#hints), remat ("auto": rematerialize the layers of a scan, the
        backward pass recomputing each from its input, only where no plan of the step as
        written fits memory_budget; True: always; False: never), grad_accumulation ("auto":
        run the step as M micro-batches, their gradients summed before one update, the
        fewest that fit, only where no plan of the whole batch fits memory_budget and the
        loss is a mean over the batch; an int M: always), model_constraints ("hint": the
        model's own sharding constraints held, priced; "ignore": laid out by the planner),
        deterministic (solver limits by work, not time: the same plan at any load).
      cache: reuse plans saved on disk by step fingerprint (shardplan.cache): True (the
        directory $SHARDPLAN_CACHE or ~/.cache/shardplan), False, or a directory.
      progress: None (default): planning shows its phases and the solver's bound and gap
        live on stderr where it is a terminal (not under pytest); False: nothing; True: live
        on a terminal; a shardplan.progress.Reporter: told them instead.

    Under jax.distributed (several processes), process 0 plans (or loads the cached plan) and
    broadcasts it, and every process checks that all run the same plan before the first step
    (shardplan.distributed); build the inputs with shardplan.global_args. An MPMD pipeline is
    planned by every process and compared; each process runs its own stages' programs, and
    values cross processes in collective programs (docs/multihost.md#mpmd-pipelines). With
    pipeline="auto" process 0 chooses the kind (one program, SPMD or MPMD pipeline) and the
    plans' fingerprints, which cover the kind and the stages, are compared as above.
    """
    if fn is not None:
        _check_fn(fn, "shardplan.auto")
    mesh, hardware = _check_mesh(mesh), _check_hardware(hardware)
    donate_argnums = _argnums(donate_argnums, "donate_argnums")
    plan = _check_plan(plan)
    options = _options(options, search_options)
    if fn is None:
        def decorate(f):
            _check_fn(f, "shardplan.auto")
            return AutoStep(f, mesh, options, plan, hardware, donate_argnums, cache, progress)
        return decorate
    return AutoStep(fn, mesh, options, plan, hardware, donate_argnums, cache, progress)


def coverage(fn, *args, state_argnums: Sequence[int] | None = None,
             batch_argnums: Sequence[int] | None = None) -> Coverage:
    """Which operators of `fn(*args)` (arrays or ShapeDtypeStructs) would run replicated for
    lack of a sharding rule, how many, and their share of the step's flops."""
    traced = trace(fn, args, state_argnums, batch_argnums)
    return coverage_of(lift(traced.closed_jaxpr, traced.arg_info))
