"""shardplan.search: plan a step for a cluster without devices (abstract inputs, a hardware
profile, a mesh shape or "auto"). The decorator, shardplan.auto, is shardplan.api."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Sequence

import numpy as np

from shardplan import fingerprint, gcpause, progress_display
from shardplan import hints as hints_mod
from shardplan import progress as progress_mod
from shardplan.api import _check_fn, _options
from shardplan.cost.hardware import HardwareProfile, get_profile
from shardplan.intra.solve.types import InfeasibleMemory, SearchTimeout
from shardplan.ir.trace import trace
from shardplan.options import SearchOptions
from shardplan.plan import Plan
from shardplan.planning import driver
from shardplan.planning.job import Job, default_axis_names, mesh_shapes
from shardplan.strategies.spec import MeshShape
from shardplan.units import fmt_bytes, fmt_seconds

_CLUSTER = re.compile(r"(?P<profile>.+?)(?:-(?P<n>\d+))?$")
MAX_AUTO_DEVICES = 2**20
"""Most devices `mesh_shape="auto"` (and a config's `mesh: {devices: N}`) factorises: the
factorisations are found by trial division, linear in the count, so a larger count is
refused at once (tests/test_hardening.py::test_auto_mesh_of_a_huge_device_count_is_refused_at_once);
a fixed mesh_shape has no such limit."""


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
           mesh_shape: Sequence[int] | str | None = None,
           axis_names: Sequence[str] | None = None, num_devices: int | None = None,
           options: SearchOptions | None = None,
           progress: progress_mod.Reporter | bool = False, **search_options) -> Plan:
    """Plan a step for a cluster without devices: args may be ShapeDtypeStructs.

    `cluster` is a hardware profile name, optionally with a device count ("tpu-v4-32"), or a
    HardwareProfile; the mesh is `mesh_shape` (with `axis_names`) or all devices on one axis.
    `mesh_shape="auto"` plans every 1-D and 2-D factorisation of the devices (axes named
    `axis_names`, default devices / data, model) and keeps the cheapest plan; its notes list
    every mesh tried. `options` (or its fields by keyword) as for shardplan.auto; one program
    is planned (pipeline=False). With `measure=True` the searched plan and the expert plans
    are compiled, priced with the profile, and the cheapest that fits is kept: for a TPU
    cluster by the TPU compiler on compile-only devices of the slice when libtpu is installed
    (`plan.candidates` then hold each program's peak per chip and collectives), else by XLA on
    CPU devices standing in for it (JAX must run as many CPU devices as the mesh has). On a
    TPU cluster the TPU compiler also checks a plan said to fit `memory_budget`
    (shardplan.planning.select), as `auto` does on devices. `progress`: a
    shardplan.progress.Reporter told each phase and the solver's bounds, True for a live
    display on stderr where it is a terminal, False (the default) for none.
    """
    _check_fn(fn, "shardplan.search")
    with gcpause.paused(), progress_display.on_stderr(progress) as reporter:
        return _search(fn, abstract_args, cluster, mesh_shape, axis_names, num_devices,
                       _options(options, search_options), reporter)


def _search(fn, abstract_args, cluster, mesh_shape, axis_names, num_devices,
            options: SearchOptions, reporter: progress_mod.Reporter) -> Plan:
    if options.pipeline is not False:
        raise ValueError(f"pipeline={options.pipeline!r}: shardplan.search plans one program; "
                         "pipeline stages are planned by shardplan.auto(..., pipeline=...) on a "
                         "mesh; pass pipeline=False")
    if isinstance(cluster, HardwareProfile):
        hw, n = cluster, None
    elif isinstance(cluster, str):
        hw, n = parse_cluster(cluster)
    else:
        raise TypeError(f"cluster must be a profile name, optionally with a device count "
                        f"('tpu-v4-32'), or a HardwareProfile; got {type(cluster).__name__} "
                        f"{cluster!r:.60}")
    if num_devices is not None and not (isinstance(num_devices, int) and num_devices >= 1):
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    if n is not None and num_devices is not None and num_devices != n:
        raise ValueError(f"num_devices={num_devices} but cluster {cluster!r} has {n} devices: "
                         f"give one of them")
    if mesh_shape is None or mesh_shape == "auto":
        count = num_devices or n
        if count is None:
            raise ValueError(f"cluster {cluster!r} names no device count: pass mesh_shape=(...) "
                             "or num_devices=N, or a cluster like 'tpu-v4-32'")
        if mesh_shape == "auto":
            check_auto_devices(count)
            return _search_meshes(fn, abstract_args, hw, count, axis_names, options, reporter)
        mesh_shape = (count,)
    if (not isinstance(mesh_shape, Sequence) or isinstance(mesh_shape, str) or not mesh_shape
            or not all(isinstance(k, (int, np.integer)) and k >= 1 for k in mesh_shape)):
        raise ValueError(f"mesh_shape must be a tuple of positive ints such as (2, 4), or "
                         f"'auto', got {mesh_shape!r:.60}")
    mesh_shape = tuple(int(s) for s in mesh_shape)
    if axis_names is not None and (isinstance(axis_names, str) or not all(
            isinstance(a, str) for a in axis_names) or len(set(axis_names)) != len(axis_names)):
        raise ValueError(f"axis_names must be a tuple of distinct strings such as ('data', "
                         f"'model'), got {axis_names!r:.60}")
    names = tuple(axis_names) if axis_names else default_axis_names(len(mesh_shape))
    if len(names) != len(mesh_shape):
        raise ValueError(f"axis_names {names} and mesh_shape {mesh_shape} differ in length")
    if num_devices is not None and num_devices != math.prod(mesh_shape):
        raise ValueError(f"num_devices={num_devices} but mesh_shape {mesh_shape} has "
                         f"{math.prod(mesh_shape)} devices")
    # a mesh larger (or smaller) than the named cluster plans devices that do not exist
    # (tests/test_hardening.py::test_a_mesh_of_another_size_than_the_cluster_is_an_error)
    if n is not None and n != math.prod(mesh_shape):
        raise ValueError(f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} devices, the "
                         f"cluster {cluster!r} {n}: give a mesh of {n} devices, or name the "
                         f"cluster with its size ('{hw.name}-{math.prod(mesh_shape)}')")
    hints_mod.check_mesh_axes(options.hints, names)
    options = options.replace(hints=hints_mod.with_boxes(options.hints, abstract_args,
                                                         options.model_constraints))
    with progress_mod.phase(reporter, "tracing"):
        traced = trace(fn, abstract_args, options.state_argnums, options.batch_argnums)
    shape = MeshShape(names, mesh_shape)
    plan = driver.plan_program(Job.make(traced, shape, hw, options, fn=fn, args=abstract_args,
                                        progress=reporter))
    return dataclasses.replace(plan, fingerprint=fingerprint.of_step(traced, shape))


def check_auto_devices(count: int) -> int:
    """`count` if mesh_shape="auto" can factorise it (at most MAX_AUTO_DEVICES), else the
    ValueError saying to give the mesh's shape (tests/test_hardening.py)."""
    if count > MAX_AUTO_DEVICES:
        raise ValueError(f"planning every factorisation of the device count (mesh_shape="
                         f"'auto', a config's mesh: {{devices: N}}) is for at most "
                         f"{MAX_AUTO_DEVICES:,} devices; {count:,} is more: give the mesh's "
                         "shape (mesh_shape=(hosts, devices_per_host), mesh: {shape: [...]})")
    return count


def _search_meshes(fn, abstract_args, hw: HardwareProfile, count: int,
                   axis_names: Sequence[str] | None, options: SearchOptions,
                   reporter: progress_mod.Reporter = progress_mod.SILENT) -> Plan:
    """mesh_shape="auto": the cheapest plan over every 1-D and 2-D mesh of `count` devices,
    the time limit shared among them (each gets what is left over the meshes still to plan)."""
    if axis_names is not None and (isinstance(axis_names, str) or len(axis_names) > 2):
        raise ValueError(f"with mesh_shape='auto', axis_names gives at most 2 names (for the "
                         f"1-D and 2-D meshes), got {axis_names!r:.60}")
    meshes = mesh_shapes(count, axis_names)
    end = time.monotonic() + options.time_limit
    best, tried, least = None, [], None
    for k, (names, sizes) in enumerate(meshes):
        label = " x ".join(f"{a}={s}" for a, s in zip(names, sizes))
        if best is not None and time.monotonic() >= end:
            # the time limit bounds the whole search: no mesh starts after it once a plan is
            # found (tests/test_hardening.py::test_auto_mesh_search_stops_at_the_time_limit)
            tried.append(f"{len(meshes) - k} more not planned (the time limit ran out)")
            break
        share = max((end - time.monotonic()) / (len(meshes) - k), 0.5)
        try:
            with progress_mod.phase(reporter, f"mesh {label}", k + 1, len(meshes)):
                plan = search(fn, *abstract_args, cluster=hw, mesh_shape=sizes,
                              axis_names=names, options=options.replace(time_limit=share),
                              progress=reporter)
        except InfeasibleMemory as e:
            least = e.min_bytes if least is None else min(least, e.min_bytes)
            tried.append(f"{label}: no plan fits (needs {fmt_bytes(e.min_bytes)})")
            continue
        except SearchTimeout:
            tried.append(f"{label}: the time limit ran out")
            continue
        tried.append(f"{label}: {fmt_seconds(plan.estimate.total_s)}")
        if best is None or plan.estimate.total_s < best.estimate.total_s:
            best = plan
    if best is None:
        if least is not None:
            raise InfeasibleMemory(options.memory_budget, least)
        raise SearchTimeout(options.time_limit, f"on every mesh of {count} devices "
                            f"({'; '.join(tried)})")
    kept = " x ".join(f"{a}={s}" for a, s in zip(best.mesh.names, best.mesh.sizes))
    note = f"mesh_shape='auto': planned {'; '.join(tried)}; kept {kept}"
    return dataclasses.replace(best, notes=(*best.notes, note))
