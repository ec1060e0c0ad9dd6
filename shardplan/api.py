"""auto() and search(), the public entry points: trace -> plan (shardplan.search, measured by
shardplan.measure) -> emit, and the plan cache."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from shardplan import _compat, distributed, measure
from shardplan import cache as cache_mod
from shardplan import fingerprint as fingerprint_mod
from shardplan import hints as hints_mod
from shardplan.cost.hardware import HardwareProfile, get_profile
from shardplan.emit.jit import emit_jit
from shardplan.emit.pipeline import emit_pipeline
from shardplan.ir.lift import lift
from shardplan.ir.trace import TracedStep, abstractify, trace
from shardplan.options import DEFAULTS, SearchOptions
from shardplan.plan import Plan, load_plan
from shardplan.search import choose
from shardplan.strategies.coverage import Coverage
from shardplan.strategies.coverage import coverage as coverage_of
from shardplan.strategies.spec import MeshShape

DEFAULT_PROFILE = {"tpu": "tpu-v4", "gpu": "a100-80gb", "cuda": "a100-80gb", "rocm": "a100-80gb",
                   "cpu": "cpu"}


def _profile(hardware, backend: str) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    return get_profile(hardware or DEFAULT_PROFILE.get(backend, "cpu"))


def _signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _options(options: SearchOptions | None, search_options: dict) -> SearchOptions:
    if options is not None and search_options:
        raise TypeError(f"pass options=SearchOptions(...) or the options by keyword "
                        f"({', '.join(sorted(search_options))}), not both")
    return options if options is not None else SearchOptions.make(**search_options)


class AutoStep:
    """A train step planned on first call for each input signature, then run as one jit (or as
    a pipeline of programs, one per stage)."""

    def __init__(self, fn, mesh=None, options: SearchOptions = DEFAULTS,
                 plan: Plan | None = None, hardware: str | HardwareProfile | None = None,
                 donate_argnums: tuple[int, ...] = (), cache=True):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._mesh = mesh
        self.options = options
        self.hardware = hardware
        self.donate_argnums = tuple(donate_argnums)
        self.plan_cache = cache
        self._given_plan = plan
        self.plan_cache = cache
        self._cache: dict[tuple, tuple[Plan, Any]] = {}

    @property
    def mesh(self):
        if self._mesh is None:
            self._mesh = distributed.default_mesh()
        if self._mesh is None:
            self._mesh = jax.make_mesh((len(jax.devices()),), ("devices",),
                                       axis_types=(jax.sharding.AxisType.Auto,))
        return _compat.auto_mesh(self._mesh)

    def _entry(self, args) -> tuple[Plan, Any]:
        key = _signature(args)
        if key not in self._cache:
            self._cache[key] = self._plan_and_emit(args)
        return self._cache[key]

    def _plan_and_emit(self, args) -> tuple[Plan, Any]:
        """Trace, plan (or adopt the given plan) and emit: (plan, the callable that runs it)."""
        mesh = self.mesh
        o = self.options.replace(hints=hints_mod.with_boxes(self.options.hints, args))
        traced = trace(self.fn, args, o.state_argnums, o.batch_argnums)
        hw = _profile(self.hardware, mesh.devices.flat[0].platform)
        if o.pipeline is True and distributed.is_multi_controller():
            distributed.refuse_mpmd_pipeline()
        # Multi-controller, pipeline="auto" plans one program: MPMD stages cannot run there.
        if (self._given_plan is None and o.pipeline is not False
                and not distributed.is_multi_controller()):
            choice = choose(self.fn, args, mesh, hw, o, traced=traced)
            if choice.pipelined:
                pp = choice.pipeline
                return choice.plan, emit_pipeline(pp.split, pp.ios, pp.specs, pp.stages,
                                                  pp.device_mesh, pp.schedule)
            plan, graph = dataclasses.replace(choice.plan, device_mesh=mesh), choice.intra_graph
        else:
            # One plan for every process: planned once (or loaded from the cache), checked
            # before the first step.
            o1 = o.replace(pipeline=False) if o.pipeline is not False else o
            fp = fingerprint_mod.step_fingerprint(traced, mesh, hw, o1)

            def obtain():
                if self._given_plan is not None:
                    return self._given_plan
                return cache_mod.cached(self.plan_cache, fp, lambda: measure.plan_measured(
                    traced, MeshShape.of(mesh), hw, o1, device_mesh=mesh,
                    device_order=[d.id for d in mesh.devices.flat],
                    donate_argnums=self.donate_argnums)[0])

            plan = distributed.plan_once(fp, obtain, broadcast=self._given_plan is None)
            plan, graph = _adopt(plan, traced, mesh)
        jitted, _, _ = emit_jit(graph, mesh, traced.in_tree, traced.out_tree,
                                plan.input_specs, plan.output_specs, plan.constraints,
                                plan.operand_specs, self.donate_argnums)
        return plan, jitted

    def __call__(self, *args):
        _, jitted = self._entry(args)
        return jitted(*args)

    def lower(self, *args):
        """jax.stages.Lowered of the planned step; args may be arrays or ShapeDtypeStructs."""
        plan, jitted = self._entry(args)
        if plan.stages:
            raise ValueError("this step runs as a pipeline of several programs (one per stage), "
                             "not one: call it, or use .plan(); pass pipeline=False to get one "
                             "program to lower")
        return jitted.lower(*jax.tree_util.tree_map(abstractify, args))

    def plan(self, *args) -> Plan:
        return self._entry(args)[0]


def _adopt(plan: Plan, traced: TracedStep, mesh):
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    if len(plan.input_specs) != len(graph.inputs) or len(plan.output_specs) != len(graph.outputs):
        raise ValueError("the given plan was made for a step with "
                         f"{len(plan.input_specs)} inputs and {len(plan.output_specs)} outputs, "
                         f"this one has {len(graph.inputs)} and {len(graph.outputs)}: plan it again")
    if tuple(plan.mesh.sizes) != tuple(int(mesh.shape[n]) for n in mesh.axis_names):
        raise ValueError(f"the given plan is for mesh {plan.mesh}, not {MeshShape.of(mesh)}")
    return dataclasses.replace(plan, in_tree=traced.in_tree, out_tree=traced.out_tree,
                               device_mesh=mesh), graph


def auto(fn=None, *, mesh=None, hardware: str | HardwareProfile | None = None,
         donate_argnums: Sequence[int] = (), plan: Plan | str | None = None,
         options: SearchOptions | None = None, cache=True, **search_options):
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
        the cheapest that fits), pipeline (False: one program; True: pipeline stages on
        submeshes; "auto": stages only where the cost model says they pay; pipelines need
        the step's gradient taken with shardplan.value_and_grad / shardplan.grad),
        num_micro_batches, num_stages, num_layers, schedule ("1f1b" or "gpipe"), hints
        (shardings to pin, the planner choosing the rest: a dict {path pattern:
        PartitionSpec} such as {"2/**": P("data")}, or a shardplan.Hints with
        logical_axis_rules for parameters that carry logical axis names; see
        docs/concepts.md#hints).
      cache: reuse plans saved on disk by step fingerprint (shardplan.cache): True (the
        directory $SHARDPLAN_CACHE or ~/.cache/shardplan), False, or a directory.

    Under jax.distributed (several processes), process 0 plans (or loads the cached plan) and
    broadcasts it, and every process checks that all run the same plan before the first step
    (shardplan.distributed); build the inputs with shardplan.global_args.
    """
    if isinstance(plan, str):
        plan = load_plan(plan)
    options = _options(options, search_options)
    if fn is None:
        return lambda f: AutoStep(f, mesh, options, plan, hardware, tuple(donate_argnums), cache)
    if not callable(fn):
        raise TypeError(f"shardplan.auto takes a function to plan, got {type(fn).__name__}; "
                        "pass options by keyword: shardplan.auto(step, mesh=mesh)")
    return AutoStep(fn, mesh, options, plan, hardware, tuple(donate_argnums), cache)


def coverage(fn, *args, state_argnums: Sequence[int] | None = None,
             batch_argnums: Sequence[int] | None = None) -> Coverage:
    """Which operators of `fn(*args)` (arrays or ShapeDtypeStructs) would run replicated for
    lack of a sharding rule, how many, and their share of the step's flops."""
    traced = trace(fn, args, state_argnums, batch_argnums)
    return coverage_of(lift(traced.closed_jaxpr, traced.arg_info))


_CLUSTER = re.compile(r"(?P<profile>.+?)(?:-(?P<n>\d+))?$")


def parse_cluster(cluster: str) -> tuple[HardwareProfile, int | None]:
    """"tpu-v4-32" -> (the tpu-v4 profile, 32 devices); a bare profile name gives no count."""
    try:
        return get_profile(cluster), None
    except (KeyError, ValueError, FileNotFoundError):
        m = _CLUSTER.match(cluster)
        if not m or m.group("n") is None:
            raise
        return get_profile(m.group("profile")), int(m.group("n"))


def search(fn, *abstract_args, cluster: str | HardwareProfile = "cpu",
           mesh_shape: Sequence[int] | None = None, axis_names: Sequence[str] | None = None,
           num_devices: int | None = None, options: SearchOptions | None = None,
           **search_options) -> Plan:
    """Plan a step for a cluster without devices: args may be ShapeDtypeStructs.

    `cluster` is a hardware profile name, optionally with a device count ("tpu-v4-32"), or a
    HardwareProfile; the mesh is `mesh_shape` (with `axis_names`) or all devices on one axis.
    `options` (or its fields by keyword) as for shardplan.auto; one program is planned
    (pipeline=False). With `measure=True` the searched plan and the expert plans are compiled
    by XLA on CPU devices standing in for the cluster, priced with the profile, and the
    cheapest that fits is kept (JAX must run as many CPU devices as the mesh has).
    """
    options = _options(options, search_options)
    if options.pipeline is not False:
        raise ValueError("shardplan.search plans one program: pipeline stages are planned by "
                         "shardplan.auto(..., pipeline=...) on a mesh; pass pipeline=False")
    if isinstance(cluster, HardwareProfile):
        hw, n = cluster, None
    else:
        hw, n = parse_cluster(cluster)
    if mesh_shape is None:
        count = num_devices or n
        if count is None:
            raise ValueError(f"cluster {cluster!r} names no device count: pass mesh_shape=(...) "
                             "or num_devices=N, or a cluster like 'tpu-v4-32'")
        mesh_shape = (count,)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    names = tuple(axis_names) if axis_names else (("devices",) if len(mesh_shape) == 1 else
                                                  tuple(f"axis{i}" for i in range(len(mesh_shape))))
    if len(names) != len(mesh_shape):
        raise ValueError(f"axis_names {names} and mesh_shape {mesh_shape} differ in length")
    options = options.replace(hints=hints_mod.with_boxes(options.hints, abstract_args))
    traced = trace(fn, abstract_args, options.state_argnums, options.batch_argnums)
    plan, _, _ = measure.plan_measured(traced, MeshShape(names, mesh_shape), hw, options)
    return plan
