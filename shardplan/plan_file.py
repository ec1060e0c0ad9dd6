"""Plan files read back: JSON from outside the process (a file given by a user, a cache
entry, a plan broadcast by process 0) checked field by field into a Plan. PlanFileError names
the file and the first thing wrong with it. Plans are written by Plan.to_dict and Plan.save
(shardplan.plan), whose FORMAT_VERSION this reads."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from shardplan import files
from shardplan.cost.estimate import Estimate
from shardplan.fingerprint import Fingerprint
from shardplan.inter.stages import Stage
from shardplan.options import SCHEDULES
from shardplan.plan import FORMAT_VERSION, OpRow, Plan, path_arg
from shardplan.strategies.spec import MeshShape, ShardSpec

__all__ = ["PlanFileError", "load_plan", "plan_from_dict"]


class PlanFileError(ValueError):
    """A plan file that cannot be read: `path` and what is wrong with it."""

    def __init__(self, path, what: str):
        super().__init__(f"{path}: {what}")
        self.path, self.what = path, what


def load_plan(path, *, max_bytes: int = files.MAX_BYTES) -> Plan:
    """A plan saved with Plan.save, checked: PlanFileError says what is wrong with the file.
    Only a regular file (or a symlink to one) of at most `max_bytes` is read."""
    path_arg(path, "load_plan")
    try:
        d = files.load_json(path, what="plan file", max_bytes=max_bytes)
    except FileNotFoundError:
        raise PlanFileError(path, "no such file") from None
    except files.FileError as e:
        raise PlanFileError(path, e.what) from None
    return _PlanReader(path).plan(d, require_fingerprint=True)


def plan_from_dict(d: Any, path: str = "<plan>") -> Plan:
    """The plan of Plan.to_dict's values, checked; PlanFileError (naming `path`) says what is
    wrong. Unlike load_plan, it takes a version 2 plan without a fingerprint: the step a cache
    entry is for is its key, and the processes that receive a broadcast plan have compared
    their step fingerprints first (shardplan.distributed.plan_once)."""
    return _PlanReader(path).plan(d)


# The fields Plan.to_dict writes, and no others: a field to_dict gains must be added here, or
# the files it writes fail to load (the round trips of tests/test_plan.py, and of
# test_remat.py, test_planning_driver.py and test_targets.py for those written only when set).
_SPEC_KEYS = ("dims", "partial")
_NAMED_KEYS = ("name", "spec")
_OP_KEYS = ("primitive", "name", "strategy", "compute_s", "comm_s")
_STAGE_KEYS = ("layers", "submesh_shape", "devices", "estimate")
_ESTIMATE_KEYS = (*(f.name for f in dataclasses.fields(Estimate)), "total_s")
_PLAN_KEYS = ("version", "fingerprint", "mesh", "hardware", "memory_budget", "inputs", "outputs",
              "constraints", "operand_specs", "estimate", "model_estimate", "ops", "stages",
              "solver", "num_micro_batches", "schedule", "pipeline_kind", "notes", "remat",
              "compiled_by", "grad_accumulation", "zero")
_V1_KEYS = (*(k for k in _PLAN_KEYS if k != "version"), "format", "search_s")
"""Version 1 files name their version "format" and keep the search time
(tests/test_plan.py::test_a_version_1_file_loads_without_a_fingerprint)."""
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
            compiled_by=self.get(d, "compiled_by", str, "plan", ""),
            zero=self.get(d, "zero", str, "plan", ""))

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
