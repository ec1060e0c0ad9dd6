"""Plan: the PartitionSpec of every input, output and planned intermediate, the stages, the
estimate (shardplan.cost.estimate); JSON round trip and a summary table. Values only: how a
plan is found is shardplan.planning, how it runs is shardplan.emit."""

from __future__ import annotations

import dataclasses
import io
import json
import math
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
from shardplan.options import SCHEDULES
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import fmt_bytes, fmt_seconds

__all__ = ["FORMAT_VERSION", "Estimate", "Fingerprint", "OpRow", "Plan", "PlanFileError",
           "Stage", "load_plan"]

FORMAT_VERSION = 2
"""Version 2 added the step's fingerprint and dropped the search time (two processes planning
the same step write the same bytes). Version 1 files load, without a fingerprint to check."""


class PlanFileError(ValueError):
    """A plan file that cannot be read: `path` and what is wrong with it."""

    def __init__(self, path, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


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
        """The plan as JSON values (schema FORMAT_VERSION). The search time is left out: two
        processes planning the same step write the same file."""
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
            # only when set: files of plans without it stay as they were
            **({"remat": True} if self.remat else {}),
            **({"grad_accumulation": self.grad_accumulation}
               if self.grad_accumulation > 1 else {}),
            **({"compiled_by": self.compiled_by} if self.compiled_by else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, path: str = "<plan>") -> Plan:
        """The plan of `to_dict`'s values, checked; PlanFileError (naming `path`) says what is
        wrong."""
        return _PlanReader(path).plan(d)  # no fingerprint required: cache entries, broadcasts

    def save(self, path) -> None:
        """Write the plan as JSON (sorted, so equal plans are equal bytes)."""
        with open(_path_arg(path, "Plan.save"), "w") as f:
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


def _path_arg(path, where: str):
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got "
                        f"{type(path).__name__} {path!r}")
    return path


_SPEC_KEYS = ("dims", "partial")
_NAMED_KEYS = ("name", "spec")
_OP_KEYS = ("primitive", "name", "strategy", "compute_s", "comm_s")
_STAGE_KEYS = ("layers", "submesh_shape", "devices", "estimate")
_ESTIMATE_KEYS = (*(f.name for f in dataclasses.fields(Estimate)), "total_s")
_PLAN_KEYS = ("version", "fingerprint", "mesh", "hardware", "memory_budget", "inputs", "outputs",
              "constraints", "operand_specs", "estimate", "model_estimate", "ops", "stages",
              "solver", "num_micro_batches", "schedule", "pipeline_kind", "notes", "remat",
              "compiled_by", "grad_accumulation")
_V1_KEYS = (*(k for k in _PLAN_KEYS if k != "version"), "format", "search_s")
"""Version 1 files named their version "format" and kept the search time."""
_MAX_INT = 2**62  # no count, size, id or byte figure in a plan is near it


class _PlanReader:
    """Reads a plan file's JSON values, raising PlanFileError at the first thing wrong: every
    object's fields known (to_dict's, no others), every value of its type, numbers finite,
    counts in range. Shown by tests/test_files.py and the corruptions of
    tests/test_cache_hardening.py."""

    def __init__(self, path):
        self.path = path

    def fail(self, what: str):
        raise PlanFileError(self.path, what)

    def fields(self, d: Mapping, allowed, where: str) -> None:
        unknown = sorted(set(d) - set(allowed), key=str)
        if unknown:
            self.fail(f"{where} has the unknown field {files.printable(unknown[0])!r:.80}; its "
                      f"fields are {', '.join(allowed)} (was the file edited, or written by "
                      "another program? save plans with Plan.save)")

    def get(self, d: Mapping, key: str, kind, where: str, default=...):
        if key not in d:
            if default is not ...:
                return default
            self.fail(f"{where} has no {key!r} (the file is incomplete or not a shardplan plan)")
        return self.check(d[key], kind, f"{where}.{key}")

    def check(self, x, kind, where: str):
        names = {dict: "an object", list: "a list", str: "a string", int: "an integer",
                 float: "a number", bool: "true or false"}
        ok = (isinstance(x, bool) if kind is bool else
              isinstance(x, int) and not isinstance(x, bool) and abs(x) < _MAX_INT
              if kind is int else
              isinstance(x, (int, float)) and not isinstance(x, bool) and _finite(x)
              if kind is float else isinstance(x, kind))
        if not ok and kind in (int, float) and isinstance(x, (int, float)) and \
                not isinstance(x, bool):
            self.fail(f"{where} should be a finite number{' below 2**62' if kind is int else ''}"
                      f", got {_shown(x)}")
        if not ok:
            self.fail(f"{where} should be {names.get(kind, 'a number or null')}, got "
                      f"{_shown(x)}")
        return x

    def count(self, d: Mapping, key: str, where: str, low: int, default=...) -> int:
        x = self.get(d, key, int, where, default)
        if x < low:
            self.fail(f"{where}.{key} should be at least {low}, got {x}")
        return x

    def items(self, d: Mapping, key: str, kind, where: str, default=...) -> list:
        xs = self.get(d, key, list, where, default)
        return [self.check(x, kind, f"{where}.{key}[{i}]") for i, x in enumerate(xs)]

    def spec(self, d, where: str) -> ShardSpec:
        self.check(d, dict, where)
        self.fields(d, _SPEC_KEYS, where)
        dims = self.get(d, "dims", list, where)
        for i, axes in enumerate(dims):
            self.items({"dims": axes}, "dims", str, f"{where}.dims[{i}]")
        partial = self.items(d, "partial", str, where, ())
        spec = ShardSpec(tuple(tuple(x) for x in dims), tuple(partial))
        used = spec.used_axes()
        if len(set(used)) != len(used):
            twice = sorted({a for a in used if used.count(a) > 1})
            self.fail(f"{where} uses the mesh axis {files.printable(twice[0])!r:.60} more than "
                      "once; a value is split over an axis at most once")
        return spec

    def estimate(self, d, where: str) -> Estimate:
        self.check(d, dict, where)
        self.fields(d, _ESTIMATE_KEYS, where)
        fields = {f.name: self.get(d, f.name, float, where) for f in dataclasses.fields(Estimate)
                  if f.name in d or f.default is dataclasses.MISSING}
        self.get(d, "total_s", float, where, 0.0)
        negative = [k for k, v in fields.items() if v < 0]
        if negative:
            self.fail(f"{where}.{negative[0]} should be >= 0, got {fields[negative[0]]}")
        return Estimate(**fields)

    def version(self, d: Mapping) -> int:
        version = d.get("version", d.get("format"))
        if type(version) is not int or version not in (1, FORMAT_VERSION):
            self.fail(f"plan file version {_shown(version)} is not one this shardplan reads (1 "
                      f"or {FORMAT_VERSION}, an integer); plan the step again with this version "
                      "of shardplan")
        return version

    def plan(self, d, require_fingerprint: bool = False) -> Plan:
        if not isinstance(d, dict):
            self.fail(f"the file holds {type(d).__name__ if d is not None else 'null'}, not a "
                      "plan object (write plans with Plan.save)")
        version = self.version(d)
        self.fields(d, _PLAN_KEYS if version == FORMAT_VERSION else _V1_KEYS, "plan")
        m = self.get(d, "mesh", dict, "plan")
        self.fields(m, ("names", "sizes"), "mesh")
        names = tuple(self.items(m, "names", str, "mesh"))
        sizes = tuple(self.items(m, "sizes", int, "mesh"))
        if len(names) != len(sizes) or any(k < 1 for k in sizes) or len(set(names)) != len(names):
            self.fail(f"mesh names {_shown(list(names))} and sizes {_shown(list(sizes))} do not "
                      "match (one positive size per axis, each name once)")
        mesh = MeshShape(names, sizes)

        def named(key):
            rows = self.items(d, key, dict, "plan")
            for i, r in enumerate(rows):
                self.fields(r, _NAMED_KEYS, f"{key}[{i}]")
            return ([self.get(r, "name", str, f"{key}[{i}]") for i, r in enumerate(rows)],
                    [self.spec(self.get(r, "spec", dict, f"{key}[{i}]"), f"{key}[{i}].spec")
                     for i, r in enumerate(rows)])

        in_names, in_specs = named("inputs")
        out_names, out_specs = named("outputs")
        constraints = {self.int_key(k, "constraints"): self.spec(v, f"constraints[{k}]")
                       for k, v in self.get(d, "constraints", dict, "plan").items()}
        operand_specs = {}
        for k, route in self.get(d, "operand_specs", dict, "plan", {}).items():
            node, sep, index = k.partition(":")
            if not sep:
                self.fail(f"operand_specs has the key {_shown(k)}; its keys are "
                          "'<node id>:<operand index>'")
            key = (self.int_key(node, "operand_specs"), self.int_key(index, "operand_specs"))
            self.check(route, list, f"operand_specs[{k}]")
            operand_specs[key] = tuple(self.spec(s, f"operand_specs[{k}]") for s in route)
        # a pipeline's specs are on its stages' submeshes, whose axes are their own
        kind = self.get(d, "pipeline_kind", str, "plan", "mpmd" if d.get("stages") else "")
        if kind not in ("", "spmd", "mpmd"):
            self.fail(f"plan.pipeline_kind should be \"\", \"spmd\" or \"mpmd\", got "
                      f"{_shown(kind)}")
        checked = [] if kind == "mpmd" else [
            *zip(in_specs, in_names), *zip(out_specs, out_names),
            *((s, f"constraint {k}") for k, s in constraints.items())]
        for spec, where in checked:
            unknown = sorted(set(spec.used_axes()) - set(names))
            if unknown:
                self.fail(f"the spec of {files.printable(where)[:80]} uses mesh axes "
                          f"{files.printable(unknown)[:80]}, not in the plan's mesh "
                          f"{files.printable(list(names))[:80]}")
        ops = []
        for i, o in enumerate(self.items(d, "ops", dict, "plan", ())):
            w = f"ops[{i}]"
            self.fields(o, _OP_KEYS, w)
            ops.append(OpRow(*(self.get(o, f, str, w) for f in ("primitive", "name", "strategy")),
                             *(self.get(o, f, float, w) for f in ("compute_s", "comm_s"))))
        stages = [self.stage(st, f"stages[{i}]")
                  for i, st in enumerate(self.items(d, "stages", dict, "plan", ()))]
        fp = self.fingerprint(d, version, require_fingerprint)
        model = d.get("model_estimate")
        model = None if model is None else self.estimate(model, "model_estimate")
        budget = self.get(d, "memory_budget", (int, float, type(None)), "plan", None)
        if isinstance(budget, bool) or (budget is not None and not (_finite(budget) and budget > 0)):
            self.fail(f"memory_budget should be a positive, finite number of bytes or null, got "
                      f"{_shown(budget)}")
        schedule = self.get(d, "schedule", str, "plan", "")
        if schedule not in ("", *SCHEDULES):
            self.fail(f"plan.schedule should be one of {list(SCHEDULES)} or \"\", got "
                      f"{_shown(schedule)}")
        return Plan(
            mesh=mesh, hardware=self.get(d, "hardware", str, "plan"),
            input_names=tuple(in_names), input_specs=tuple(in_specs),
            output_names=tuple(out_names), output_specs=tuple(out_specs),
            constraints=constraints, operand_specs=operand_specs,
            estimate=self.estimate(self.get(d, "estimate", dict, "plan"), "estimate"),
            memory_budget=budget, ops=tuple(ops), stages=tuple(stages),
            solver=self.get(d, "solver", str, "plan", ""),
            num_micro_batches=self.count(d, "num_micro_batches", "plan", 1, 1),
            schedule=schedule, pipeline_kind=kind,
            notes=tuple(self.items(d, "notes", str, "plan", ())), fingerprint=fp,
            model_estimate=model, remat=self.get(d, "remat", bool, "plan", False),
            grad_accumulation=self.count(d, "grad_accumulation", "plan", 1, 1),
            compiled_by=self.get(d, "compiled_by", str, "plan", ""))

    def stage(self, st: Mapping, w: str) -> Stage:
        self.fields(st, _STAGE_KEYS, w)
        layers = tuple(self.items(st, "layers", int, w))
        if len(layers) != 2 or not 0 <= layers[0] <= layers[1]:
            self.fail(f"{w}.layers should be [first layer, last layer] with 0 <= first <= last, "
                      f"got {_shown(list(layers))}")
        shape = tuple(self.items(st, "submesh_shape", int, w))
        devices = tuple(self.items(st, "devices", int, w))
        if not shape or any(k < 1 for k in shape):
            self.fail(f"{w}.submesh_shape should be positive sizes, got {_shown(list(shape))}")
        if (len(devices) != math.prod(shape) or any(i < 0 for i in devices)
                or len(set(devices)) != len(devices)):
            self.fail(f"{w}.devices should be {math.prod(shape)} distinct device ids (the "
                      f"submesh {_shown(list(shape))}), got {_shown(list(devices))}")
        return Stage(layers, shape, devices,
                     self.estimate(self.get(st, "estimate", dict, w), f"{w}.estimate"))

    def fingerprint(self, d: Mapping, version: int, required: bool) -> Fingerprint | None:
        fp = d.get("fingerprint")
        if fp is None:
            if required and version == FORMAT_VERSION:
                self.fail("the plan has no fingerprint (\"fingerprint\": null or missing): a "
                          f"version {FORMAT_VERSION} plan file records the step it was made for, "
                          "which is checked before it runs; save plans with Plan.save, or plan "
                          "the step again")
            return None
        self.check(fp, dict, "fingerprint")
        self.fields(fp, ("inputs", "function", "mesh"), "fingerprint")
        return Fingerprint(*(self.get(fp, f, str, "fingerprint")
                             for f in ("inputs", "function", "mesh")))

    def int_key(self, k: str, where: str) -> int:
        value = files.ascii_int(k)
        if value is None:
            self.fail(f"{where} has the key {_shown(k)}; its keys are value ids (integers in "
                      "ASCII digits)")
        return value


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _shown(x) -> str:
    """A value from a file, short and printable, for an error message."""
    try:
        text = json.dumps(x)
    except (ValueError, TypeError, RecursionError):
        text = type(x).__name__
    return files.printable(text[:60] + ("..." if len(text) > 60 else ""))


def load_plan(path, *, max_bytes: int = files.MAX_BYTES) -> Plan:
    """A plan saved with Plan.save, checked: PlanFileError says what is wrong with the file.
    Only a regular file (or a symlink to one) of at most `max_bytes` is read."""
    _path_arg(path, "load_plan")
    try:
        d = files.load_json(path, what="plan file", max_bytes=max_bytes)
    except FileNotFoundError:
        raise PlanFileError(path, "no such file") from None
    except files.FileError as e:
        raise PlanFileError(path, e.what) from None
    return _PlanReader(path).plan(d, require_fingerprint=True)
