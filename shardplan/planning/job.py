"""The planning job: one frozen value holding what every stage of planning reads (the traced
step, the mesh, the devices, the hardware, the options, the deadline, the donation), made once
by a front end (shardplan.api, shardplan.cluster, the CLI) and handed down."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardplan import progress as progress_mod
from shardplan.cost.hardware import HardwareProfile
from shardplan.intra import hints as hints_mod
from shardplan.ir.graph import Graph
from shardplan.ir.lift import LiftOptions, lift
from shardplan.ir.trace import TracedStep
from shardplan.options import SearchOptions
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import Deadline


@dataclasses.dataclass(frozen=True, eq=False)
class Job:
    """A step to plan on a mesh.

    `device_mesh` is the jax Mesh the plan will run on (None: a cluster without devices);
    `device_order` the device ids in mesh order (where each collective's links are);
    `donate_argnums` the arguments the compiled step donates (None: its state, as a plan for a
    cluster assumes; the memory model counts an undonated state output twice); `fn` and `args`
    the step as written, which the pipeline planners trace again (None when only one program
    is planned). `deadline` bounds the whole job: every stage gets what remains of it.
    `progress` is told each phase and the solver's bounds as they go (shardplan.progress:
    silent by default; it never changes the plan)."""

    traced: TracedStep
    mesh: MeshShape
    hw: HardwareProfile
    options: SearchOptions
    deadline: Deadline
    device_mesh: Any = None
    device_order: tuple[int, ...] | None = None
    donate_argnums: tuple[int, ...] | None = None
    fn: Callable | None = None
    args: tuple | None = None
    progress: progress_mod.Reporter = progress_mod.SILENT
    least_memory: bool = True
    """Where no plan fits: search for the least memory any plan needs (the error's exact
    figure), or only bound it at once (the driver, with another step still to plan)."""
    warm_inputs: Mapping[int, ShardSpec] | None = None
    """Flat input index -> its spec in an earlier candidate's plan (the driver's step as a
    whole, for its accumulated candidates): the ILP's first seed and starting point."""

    @classmethod
    def make(cls, traced: TracedStep, mesh: MeshShape, hw: HardwareProfile,
             options: SearchOptions, *, device_mesh=None,
             donate_argnums: Sequence[int] | None = None, fn: Callable | None = None,
             args: Sequence | None = None,
             progress: progress_mod.Reporter = progress_mod.SILENT) -> Job:
        """A job whose deadline starts now (options.time_limit); the device order is the
        device mesh's, if any."""
        order = (tuple(int(d.id) for d in device_mesh.devices.flat)
                 if device_mesh is not None else None)
        return cls(traced, mesh, hw, options, Deadline(options.time_limit), device_mesh, order,
                   None if donate_argnums is None else tuple(donate_argnums), fn,
                   None if args is None else tuple(args), progress)

    def replace(self, **changes) -> Job:
        """The job with `changes`; its lifted step is kept unless the step or how loops are
        lifted changed."""
        new = dataclasses.replace(self, **changes)
        if ("graph" in self.__dict__ and "traced" not in changes
                and new.options.while_trips == self.options.while_trips):
            new.__dict__["graph"] = self.__dict__["graph"]
        return new

    @functools.cached_property
    def graph(self) -> Graph:
        """The traced step lifted (loops inlined once with their trip count)."""
        with progress_mod.phase(self.progress, "lifting"):
            return lift(self.traced.closed_jaxpr, self.traced.arg_info,
                        LiftOptions(while_trips=self.options.while_trips))

    @property
    def donated(self) -> frozenset[int] | None:
        """The flat inputs of the donated arguments (None: the state)."""
        return donated_inputs(self.traced, self.donate_argnums)

    @property
    def donated_args(self) -> tuple[int, ...]:
        """The arguments a compiled check donates: the given ones, else the state."""
        return self.traced.state_argnums if self.donate_argnums is None else self.donate_argnums

    @functools.cached_property
    def pinned(self) -> dict[int, ShardSpec]:
        """{flat input index: spec} of the inputs the options' hints pin on the mesh."""
        return pinned_inputs(self.traced, self.mesh, self.options)


def donated_inputs(traced: TracedStep, donate_argnums: Sequence[int] | None):
    """The flat inputs of the arguments `donate_argnums` (None stays None: the state)."""
    if donate_argnums is None:
        return None
    counts = traced.arg_leaf_counts
    return frozenset(j for a in donate_argnums for j in range(sum(counts[:a]), sum(counts[:a + 1])))


def pinned_inputs(traced: TracedStep, mesh_shape: MeshShape,
                  options: SearchOptions) -> dict[int, ShardSpec]:
    """{flat input index: spec} of the inputs the options' hints pin on `mesh_shape`."""
    return dict(hints_mod.fixed_inputs(options.hints, traced.input_paths,
                                       [a.shape for a in traced.in_avals], mesh_shape))


def default_axis_names(ndim: int) -> tuple[str, ...]:
    """The axis names of a mesh given by its shape alone (shardplan.search, the CLI's
    configs, mesh_shape="auto"): devices; data, model; then axis0, axis1, ..."""
    if ndim == 1:
        return ("devices",)
    if ndim == 2:
        return ("data", "model")
    return tuple(f"axis{i}" for i in range(ndim))


def mesh_shapes(n: int, names: Sequence[str] | None = None
                ) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """(axis names, sizes) of every 1-D and 2-D factorisation of n devices (axes of size 1
    left out), 1-D first: what `mesh_shape="auto"` plans. `names`: at most two axis names
    (a 1-D mesh takes the last); default devices / (data, model)."""
    shapes = [(n,)] + [(a, n // a) for a in range(2, n) if n % a == 0]
    out = []
    for sizes in shapes:
        given = tuple(names[-len(sizes):]) if names and len(names) >= len(sizes) else None
        out.append((given or default_axis_names(len(sizes)), sizes))
    return out
