"""auto() and search(): trace -> plan -> emit, and the plan cache."""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from shardplan import _compat, distributed
from shardplan import cache as cache_mod
from shardplan import fingerprint as fingerprint_mod
from shardplan.cost.hardware import HardwareProfile, get_profile
from shardplan.cost.model import AlphaBetaCost
from shardplan.emit.jit import emit_jit
from shardplan.intra.planner import IntraOptions, IntraPlan, plan_intra
from shardplan.ir.lift import lift
from shardplan.ir.trace import TracedStep, abstractify, trace
from shardplan.plan import OpRow, Plan
from shardplan.strategies.coverage import Coverage
from shardplan.strategies.coverage import coverage as coverage_of
from shardplan.strategies.spec import MeshShape
from shardplan.units import parse_bytes

DEFAULT_PROFILE = {"tpu": "tpu-v4", "gpu": "a100-80gb", "cuda": "a100-80gb", "rocm": "a100-80gb",
                   "cpu": "cpu"}


@dataclasses.dataclass(frozen=True)
class Options:
    """What auto() and search() take besides the step."""

    memory_budget: int | None = None
    donate_argnums: tuple[int, ...] = ()
    state_argnums: tuple[int, ...] | None = None
    batch_argnums: tuple[int, ...] | None = None
    hardware: str | HardwareProfile | None = None
    time_limit: float = 30.0
    seed: int = 0
    workers: int = 1
    pipeline: bool | str = False
    num_micro_batches: int | None = None
    num_stages: int | None = None
    schedule: str = "1f1b"
    measure: bool = False


def _profile(hardware, backend: str) -> HardwareProfile:
    if isinstance(hardware, HardwareProfile):
        return hardware
    return get_profile(hardware or DEFAULT_PROFILE.get(backend, "cpu"))


def _signature(args) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _plan_traced(traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile, options: Options,
                 device_mesh=None, device_order=None) -> tuple[Plan, object, IntraPlan]:
    start = time.perf_counter()
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    cost = AlphaBetaCost(mesh_shape, hw, device_order)
    budget = options.memory_budget

    def plan_for(ilp_budget) -> tuple[Plan, IntraPlan]:
        intra = plan_intra(graph, mesh_shape, cost, IntraOptions(
            memory_budget=ilp_budget, time_limit_s=options.time_limit, seed=options.seed,
            workers=options.workers))
        ops = []
        for node in graph.nodes:
            s = intra.node_strategies[node.id]
            c, k = cost.node_time(graph, node, s)
            ops.append(OpRow(node.primitive, node.name, s.name, c, k))
        plan = Plan(
            mesh=mesh_shape, hardware=hw.name,
            input_names=traced.arg_info.input_names, input_specs=intra.input_specs,
            output_names=traced.arg_info.output_names, output_specs=intra.output_specs,
            constraints={v: intra.value_specs[v] for v in sorted(intra.constrained)},
            estimate=intra.estimate, operand_specs=dict(intra.operand_specs),
            memory_budget=budget, ops=tuple(ops),
            search_s=time.perf_counter() - start, notes=intra.notes,
            solver=f"{intra.solver}{' (optimal)' if intra.optimal else ''}, "
                   f"{intra.num_choices} choices",
            in_tree=traced.in_tree, out_tree=traced.out_tree, device_mesh=device_mesh)
        return plan, intra

    plan, intra = plan_for(budget)
    if options.measure:
        from shardplan import measure

        mesh = device_mesh if device_mesh is not None else _compile_mesh(mesh_shape)
        plan, _ = measure.select(graph, traced, plan, mesh, hw, memory_budget=budget,
                                 donate_argnums=traced.state_argnums,
                                 replan=lambda b: plan_for(b)[0])
        plan = dataclasses.replace(plan, search_s=time.perf_counter() - start,
                                   device_mesh=device_mesh)
    return plan, graph, intra


def _compile_mesh(mesh_shape: MeshShape):
    """A mesh of CPU devices standing in for the cluster, to compile candidates on."""
    devices = jax.devices("cpu")
    n = mesh_shape.num_devices
    if len(devices) < n:
        raise ValueError(
            f"measure=True compiles the candidate plans on {n} CPU devices standing in for the "
            f"cluster, and JAX runs {len(devices)}: call "
            f"jax.config.update('jax_num_cpu_devices', {n}) before JAX first touches a device, "
            "or pass measure=False")
    return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(mesh_shape.sizes), mesh_shape.names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_shape.sizes))


class AutoStep:
    """A train step planned on first call for each input signature, then run as one jit."""

    def __init__(self, fn, mesh=None, options: Options = Options(), plan: Plan | None = None,
                 cache=True):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._mesh = mesh
        self.options = options
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
            mesh = self.mesh
            traced = trace(self.fn, args, self.options.state_argnums, self.options.batch_argnums)
            backend = mesh.devices.flat[0].platform
            hw = _profile(self.options.hardware, backend)
            order = [d.id for d in mesh.devices.flat]
            if self.options.pipeline is True:
                distributed.refuse_mpmd_pipeline()
            # Multi-controller, pipeline="auto" plans one program: MPMD stages cannot run there.
            if (self._given_plan is not None or self.options.pipeline is False
                    or distributed.is_multi_controller()):
                # One plan for every process (planned once, cached, checked before the first step).
                fp = fingerprint_mod.step_fingerprint(traced, mesh, hw, self.options)

                def obtain():
                    if self._given_plan is not None:
                        return self._given_plan
                    return cache_mod.cached(self.plan_cache, fp, lambda: _plan_traced(
                        traced, MeshShape.of(mesh), hw, self.options, device_mesh=mesh,
                        device_order=order)[0])

                plan = distributed.plan_once(fp, obtain, broadcast=self._given_plan is None)
                plan, graph = _adopt(plan, traced, mesh)
            else:
                from shardplan.inter import planner as inter_planner

                o = self.options
                choice = inter_planner.choose(
                    self.fn, args, mesh, hw, o.pipeline, num_stages=o.num_stages,
                    num_micro_batches=o.num_micro_batches, schedule=o.schedule,
                    memory_budget=o.memory_budget, state_argnums=o.state_argnums,
                    batch_argnums=o.batch_argnums, time_limit=o.time_limit, seed=o.seed,
                    workers=o.workers, traced=traced)
                if choice.pipelined:
                    self._cache[key] = (choice.plan, choice.pipeline.run)
                    return self._cache[key]
                plan, graph = dataclasses.replace(choice.plan, device_mesh=mesh), choice.intra_graph
            jitted, _, _ = emit_jit(graph, mesh, traced.in_tree, traced.out_tree,
                                    plan.input_specs, plan.output_specs, plan.constraints,
                                    plan.operand_specs, self.options.donate_argnums)
            self._cache[key] = (plan, jitted)
        return self._cache[key]

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


def auto(fn=None, *, mesh=None, memory_budget=None, donate_argnums: Sequence[int] = (),
         state_argnums: Sequence[int] | None = None, batch_argnums: Sequence[int] | None = None,
         hardware: str | HardwareProfile | None = None, time_limit: float = 30.0,
         seed: int = 0, workers: int = 1, plan: Plan | str | None = None,
         pipeline: bool | str = False, num_micro_batches: int | None = None,
         num_stages: int | None = None, schedule: str = "1f1b", measure: bool = False,
         cache=True):
    """Plan and run a single-device train step over a device mesh.

    Use bare (`@shardplan.auto`: all devices on one axis) or with options. The step is traced
    on its first call for each input signature, planned (a PartitionSpec for every value,
    chosen by an ILP over the cost model of `hardware`), and run as one jax.jit.

    Args:
      mesh: a jax.sharding.Mesh (Auto or Explicit axes); default all devices on one axis
        (under jax.distributed: axes ("hosts", "devices"), the processes along the first).
      memory_budget: bytes per device (int) or a string like "16GiB"; default none.
      donate_argnums: arguments whose buffers the step may reuse (usually the state).
      state_argnums: which arguments are state; default those an output gives back.
      hardware: a profile name (see shardplan.cost.hardware.PROFILES) or HardwareProfile;
        default by the devices' platform.
      plan: a Plan (or a path to one saved with Plan.save) to run instead of planning.
      pipeline: False (one program, intra-operator parallelism only), True (pipeline stages on
        submeshes), or "auto" (stages only where the cost model says they pay). Pipelines need
        the step's gradient taken with shardplan.value_and_grad / shardplan.grad.
      num_micro_batches, num_stages, schedule ("1f1b" or "gpipe"): pipeline settings; by
        default the planner chooses.
      measure: also compile the searched plan and the expert plans (data parallel, FSDP,
        Megatron) with XLA on the mesh, price each program with `hardware`, and keep the
        cheapest that fits the budget (shardplan.measure); planning takes a few compiles
        longer.
      cache: reuse plans saved on disk by step fingerprint (shardplan.cache): True (the
        directory $SHARDPLAN_CACHE or ~/.cache/shardplan), False, or a directory.

    Under jax.distributed (several processes), process 0 plans (or loads the cached plan) and
    broadcasts it, and every process checks that all run the same plan before the first step
    (shardplan.distributed); build the inputs with shardplan.global_args.
    """
    if isinstance(plan, str):
        from shardplan.plan import load_plan

        plan = load_plan(plan)
    if pipeline not in ("auto", True, False):
        raise ValueError(f"pipeline={pipeline!r}: use 'auto', True or False")
    if schedule not in ("1f1b", "gpipe"):
        raise ValueError(f"schedule={schedule!r}: use '1f1b' or 'gpipe'")
    options = Options(parse_bytes(memory_budget), tuple(donate_argnums),
                      None if state_argnums is None else tuple(state_argnums),
                      None if batch_argnums is None else tuple(batch_argnums),
                      hardware, float(time_limit), int(seed), int(workers),
                      pipeline, num_micro_batches, num_stages, schedule, bool(measure))
    if fn is None:
        return lambda f: AutoStep(f, mesh, options, plan, cache)
    if not callable(fn):
        raise TypeError(f"shardplan.auto takes a function to plan, got {type(fn).__name__}; "
                        "pass options by keyword: shardplan.auto(step, mesh=mesh)")
    return AutoStep(fn, mesh, options, plan, cache)


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
           num_devices: int | None = None, memory_budget=None,
           state_argnums: Sequence[int] | None = None, batch_argnums: Sequence[int] | None = None,
           time_limit: float = 30.0, seed: int = 0, workers: int = 1,
           measure: bool = False) -> Plan:
    """Plan a step for a cluster without devices: args may be ShapeDtypeStructs.

    `cluster` is a hardware profile name, optionally with a device count ("tpu-v4-32"), or a
    HardwareProfile; the mesh is `mesh_shape` (with `axis_names`) or all devices on one axis.
    With `measure=True` the searched plan and the expert plans are compiled by XLA on CPU
    devices standing in for the cluster, priced with the profile, and the cheapest that fits
    is kept (JAX must run as many CPU devices as the mesh has).
    """
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
    budget = parse_bytes(memory_budget)
    options = Options(budget, (), None if state_argnums is None else tuple(state_argnums),
                      None if batch_argnums is None else tuple(batch_argnums), hw,
                      float(time_limit), int(seed), int(workers), measure=bool(measure))
    traced = trace(fn, abstract_args, options.state_argnums, options.batch_argnums)
    plan, _, _ = _plan_traced(traced, MeshShape(names, mesh_shape), hw, options)
    return plan
