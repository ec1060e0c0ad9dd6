"""Plan: the PartitionSpec of every input, output and planned intermediate, the stages, the
estimate (shardplan.cost.estimate); its JSON values (`to_dict`, `save`) and a summary table.
Values only: how a plan is found is shardplan.planning, how it runs is shardplan.emit, how a
plan file is read back and checked is shardplan.plan_file."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardplan import files
from shardplan.cost.estimate import Estimate
from shardplan.fingerprint import Fingerprint
from shardplan.inter import schedule as schedule_mod
from shardplan.inter.stages import Stage, device_span
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import fmt_bytes, fmt_seconds

__all__ = ["FORMAT_VERSION", "Estimate", "Fingerprint", "OpRow", "Plan", "Stage", "path_arg"]

FORMAT_VERSION = 2
"""The version `to_dict` writes. A version 2 file holds the step's fingerprint and no search
time, so two processes planning the same step write the same bytes
(tests/test_plan.py::test_two_processes_write_the_same_bytes). shardplan.plan_file reads
version 1 files too, without a fingerprint to check."""


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One node of the plan, for the summary: what it is, how it runs, what it costs."""

    primitive: str
    name: str
    strategy: str
    compute_s: float
    comm_s: float


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A parallel plan for one train step signature."""

    mesh: MeshShape
    hardware: str
    input_names: tuple[str, ...]
    input_specs: tuple[ShardSpec, ...]
    output_names: tuple[str, ...]
    output_specs: tuple[ShardSpec, ...]
    constraints: Mapping[int, ShardSpec]
    """Planned intermediate values' specs by value id; for an SPMD pipeline, the specs of the
    scan's carries (the activation between layers) by position, held in the stage body."""
    estimate: Estimate
    operand_specs: Mapping[tuple[int, int], tuple[ShardSpec, ...]] = dataclasses.field(
        default_factory=dict)
    """(node, operand) -> the layouts the operand is moved through; for an SPMD pipeline,
    (equation of the layer body, operand), and under negative keys (stage_body.post_key) the
    head's and loss's equations after the scan (1F1B), under keys from stage_body.BACKWARD
    the layer's backward's equations (layer_backward; a negative operand: a result), and
    under keys from stage_body.STACKED the layout the backward keeps each stacked parameter
    in."""
    memory_budget: float | None = None
    ops: tuple[OpRow, ...] = ()
    stages: tuple[Stage, ...] = ()
    search_s: float = 0.0
    solver: str = ""
    notes: tuple[str, ...] = ()
    num_micro_batches: int = 1
    schedule: str = ""
    in_tree: Any = None
    out_tree: Any = None
    device_mesh: Any = None  # the jax Mesh when planned for real devices
    fingerprint: Fingerprint | None = None
    """What the plan was made for (checked when a plan is adopted); None for version 1 files."""
    pipeline_kind: str = ""
    """"spmd" (one program, stages along the mesh's `stage` axis), "mpmd" (one program per
    stage on its submesh) or "" (no pipeline)."""
    model_estimate: Estimate | None = None
    """The cost model's own estimate when `estimate` holds the compiled program's figures
    (measure=True, or the CLI once it compiled the plan); None when `estimate` is the model's."""
    stage_in_shardings: tuple | None = None
    """An emitted MPMD pipeline's input NamedShardings (flat), each on its stage's submesh."""
    stage_out_shardings: tuple | None = None  # likewise the outputs; both in memory only
    remat: bool = False
    """The step's scanned layers are rematerialized (shardplan.ir.remat): the plan is for the
    rewritten step (its value and node ids are that step's), and running or adopting the plan
    rewrites the step the same way."""
    grad_accumulation: int = 1
    """The step runs as this many micro-batches (shardplan.inter.accumulate: the loss and
    gradient a scan over micro-batches, the update once): the plan is for the accumulated step,
    and running or adopting the plan rewrites the step the same way; 1: as written."""
    zero: str = ""
    """The ZeRO stage the plan amounts to over the mesh axes that split the batch, and the
    shares of the parameters' and the optimizer state's bytes it splits over them
    (shardplan.planning.zero); "" for a pipeline or a step without state."""
    compiled_by: str = ""
    """Which compiler judged the plan (shardplan.analysis.targets.Compiler.describe(): the TPU
    compiler on compile-only devices, or XLA:CPU standing in); "" when no program was compiled
    and the cost model alone made the estimate."""
    candidates: tuple = ()
    """Every program the measured selection compiled and priced, or why it failed
    (shardplan.planning.compiled.MeasuredProgram: name, plan, priced, error); in memory only, not in
    plan files."""

    @property
    def estimate_source(self) -> str:
        """What `estimate` is: 'compiled by <the compiler>' or 'cost model'."""
        if self.model_estimate is None:
            return "cost model"
        return f"compiled by {self.compiled_by or 'XLA'}"

    def fits(self) -> bool | None:
        """Whether `estimate.peak_bytes` is within the memory budget (None: no budget)."""
        if self.memory_budget is None:
            return None
        return self.estimate.peak_bytes <= self.memory_budget

    # -- shardings -------------------------------------------------------------------------

    def _shardings(self, specs, tree, stage_shardings=None):
        if self.stages and self.pipeline_kind != "spmd":
            if stage_shardings is None:
                raise ValueError(
                    "this MPMD pipelined plan has no device shardings: each stage's inputs live "
                    "on its own submesh, known once the step is emitted on devices; take the "
                    "plan from the step (step.plan(*args)) or use plan.in_specs for the specs")
            leaves = list(stage_shardings)
        elif self.device_mesh is None:
            raise ValueError("this plan has no device mesh (it was planned with shardplan.search "
                             "or loaded from a file): use plan.in_specs / plan.out_specs, or "
                             "pass the plan to shardplan.auto(..., plan=plan) on a mesh")
        else:
            leaves = [NamedSharding(self.device_mesh, s.to_partition_spec()) for s in specs]
        return jax.tree_util.tree_unflatten(tree, leaves) if tree is not None else leaves

    @property
    def in_shardings(self):
        """Pytree of NamedSharding for the step's arguments (as a tuple of arguments). An MPMD
        pipeline's: each on the submesh of the stage that holds it (state where it is updated,
        the batch where first read), which the runtime takes without moving anything."""
        return tuple(self._shardings(self.input_specs, self.in_tree, self.stage_in_shardings))

    @property
    def out_shardings(self):
        return self._shardings(self.output_specs, self.out_tree, self.stage_out_shardings)

    @property
    def in_specs(self) -> dict[str, Any]:
        return {n: s.to_partition_spec() for n, s in zip(self.input_names, self.input_specs)}

    @property
    def out_specs(self) -> dict[str, Any]:
        return {n: s.to_partition_spec() for n, s in zip(self.output_names, self.output_specs)}

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The plan as JSON values (schema FORMAT_VERSION; Plan.save writes them, load_plan
        reads them back, checked). The search time is left out: two processes planning the
        same step write the same file."""
        fp = self.fingerprint
        return {
            "version": FORMAT_VERSION,
            "fingerprint": dataclasses.asdict(fp) if fp is not None else None,
            "mesh": {"names": list(self.mesh.names), "sizes": list(self.mesh.sizes)},
            "hardware": self.hardware,
            "memory_budget": self.memory_budget,
            "inputs": [{"name": n, "spec": _spec_to_json(s)}
                       for n, s in zip(self.input_names, self.input_specs)],
            "outputs": [{"name": n, "spec": _spec_to_json(s)}
                        for n, s in zip(self.output_names, self.output_specs)],
            "constraints": {str(k): _spec_to_json(v) for k, v in sorted(self.constraints.items())},
            "operand_specs": {f"{n}:{i}": [_spec_to_json(s) for s in route]
                              for (n, i), route in sorted(self.operand_specs.items())},
            "estimate": self.estimate.to_dict(),
            "model_estimate": (self.model_estimate.to_dict() if self.model_estimate is not None
                               else None),
            "ops": [dataclasses.asdict(o) for o in self.ops],
            "stages": [{"layers": list(s.layers), "submesh_shape": list(s.submesh_shape),
                        "devices": list(s.devices), "estimate": s.estimate.to_dict()}
                       for s in self.stages],
            "solver": self.solver,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule,
            "pipeline_kind": self.pipeline_kind,
            "notes": list(self.notes),
            # only when set: a plan that uses none of these writes no key for them, so its
            # file reads the same in a shardplan that does not know them
            **({"remat": True} if self.remat else {}),
            **({"grad_accumulation": self.grad_accumulation}
               if self.grad_accumulation > 1 else {}),
            **({"compiled_by": self.compiled_by} if self.compiled_by else {}),
            **({"zero": self.zero} if self.zero else {}),
        }

    def save(self, path) -> None:
        """Write the plan as JSON (sorted, so equal plans are equal bytes); read it back with
        shardplan.load_plan."""
        with open(path_arg(path, "Plan.save"), "w") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")

    # -- summary ---------------------------------------------------------------------------

    def param_table(self) -> list[tuple[str, str, int]]:
        """Inputs as (name or pattern, PartitionSpec, count): numbered layer scopes
        ('layer_3', 'Dense_3', 'blocks_3') are folded into '*' where every input of the pattern
        has the same spec; other names (fc1, fc2) are kept apart."""
        specs = [str(s.to_partition_spec()) for s in self.input_specs]
        patterns = [_LAYER_SCOPE.sub(r"\1_*", n) for n in self.input_names]
        by_pattern: dict[str, set[str]] = {}
        for pattern, spec in zip(patterns, specs):
            by_pattern.setdefault(pattern, set()).add(spec)
        groups: dict[tuple[str, str], int] = {}
        for name, pattern, spec in zip(self.input_names, patterns, specs):
            key = (pattern if len(by_pattern[pattern]) == 1 else name, spec)
            groups[key] = groups.get(key, 0) + 1
        return [(p, s, n) for (p, s), n in groups.items()]

    def summary(self, max_rows: int = 25) -> str:
        buf = io.StringIO()
        # force_jupyter=False: in a notebook rich would print to the cell and ignore `file`
        # (tests/test_plan.py::test_summary_is_returned_inside_jupyter)
        console = Console(file=buf, width=120, force_terminal=False, force_jupyter=False,
                          color_system=None)
        # Text a file gave (names, notes, hardware) is shown inert: control characters as their
        # escapes, rich markup escaped (tests/test_files.py::test_the_summary_shows_file_text_inert)
        mesh = _text(" x ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.sizes)))
        e = self.estimate
        fits = self.fits()
        budget = ("" if fits is None else f" ({'fits' if fits else 'OVER'} the budget of "
                                           f"{fmt_bytes(self.memory_budget)})")
        console.print(f"shardplan plan on mesh {mesh}, hardware {_text(self.hardware)}"
                      + (", scanned layers rematerialized" if self.remat else "")
                      + (f", gradients accumulated over {self.grad_accumulation} micro-batches"
                         if self.grad_accumulation > 1 else ""))
        if self.zero:
            console.print(_text(self.zero))
        console.print(f"estimate per step ({_text(self.estimate_source)}): {fmt_seconds(e.total_s)} = "
                      f"compute "
                      f"{fmt_seconds(e.compute_s)} + communication {fmt_seconds(e.comm_s)} "
                      f"({fmt_bytes(e.comm_bytes)} sent per device); peak memory "
                      f"{fmt_bytes(e.peak_bytes)} per device{budget}, state {fmt_bytes(e.state_bytes)}")
        if self.stages:
            t = Table(title=f"pipeline stages (bubble {e.bubble_fraction:.1%})")
            for c in ("stage", "layers", "submesh", "devices", "time", "memory"):
                t.add_column(c)
            for i, s in enumerate(self.stages):
                t.add_row(str(i), f"{s.layers[0]}-{s.layers[1]}", "x".join(map(str, s.submesh_shape)),
                          device_span(s.devices), fmt_seconds(s.estimate.total_s),
                          fmt_bytes(s.estimate.peak_bytes))
            console.print(t)
        t = Table(title="input shardings (grouped)")
        for c in ("inputs", "PartitionSpec", "count"):
            t.add_column(c)
        rows = self.param_table()
        for p, s, n in rows[:max_rows]:
            t.add_row(_text(p), _text(s), str(n))
        if len(rows) > max_rows:
            t.add_row(f"... {len(rows) - max_rows} more groups", "", "")
        console.print(t)
        if self.ops:
            t = Table(title="costliest operators")
            for c in ("op", "name", "strategy", "compute", "comm"):
                t.add_column(c)
            for o in sorted(self.ops, key=lambda o: -(o.compute_s + o.comm_s))[:max_rows]:
                t.add_row(_text(o.primitive), _text(o.name[-50:]), _text(o.strategy),
                          fmt_seconds(o.compute_s), fmt_seconds(o.comm_s))
            console.print(t)
        for note in self.notes:
            console.print(_text(note))
        if self.search_s:
            console.print(f"search took {self.search_s:.2f} s ({_text(self.solver)})")
        elif self.solver:
            console.print(f"solver: {_text(self.solver)}")
        return buf.getvalue()

    def timeline(self) -> str:
        """The pipeline's schedule as text: what each stage runs at each tick, and its bubble."""
        if not self.stages:
            raise ValueError("this plan has no pipeline stages (pipeline=False)")
        return schedule_mod.timeline_text(len(self.stages), self.num_micro_batches,
                                          self.schedule or "1f1b", self.pipeline_kind)

    def __repr__(self) -> str:
        return (f"Plan(mesh={dict(zip(self.mesh.names, self.mesh.sizes))}, "
                f"estimate={fmt_seconds(self.estimate.total_s)}, stages={len(self.stages)})")


# A numbered layer scope: 'layer_3', 'Dense_3', 'blocks_12' (not the digit of 'fc1').
_LAYER_SCOPE = re.compile(r"(?<![A-Za-z0-9])([A-Za-z][A-Za-z]*)_\d+(?![0-9])")


def _text(x) -> str:
    """`x` as text safe to print with rich: control characters shown as escapes, markup
    escaped (a note holding `[/]` prints as written)."""
    return escape(files.printable(x))


def _spec_to_json(s: ShardSpec) -> dict:
    return {"dims": [list(d) for d in s.dims], "partial": list(s.partial)}


def path_arg(path, where: str):
    """`path` if it is a str or os.PathLike, else a TypeError naming `where` (Plan.save,
    load_plan)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got "
                        f"{type(path).__name__} {path!r}")
    return path

