"""Fingerprints: stable hashes of what a plan depends on (the traced step, the mesh, the
hardware profile, the search options) and of what a plan decides (its specs).

Both are equal across processes, runs and machines for equal inputs: they hash canonical
text (sorted JSON, the jaxpr printed without source information, memory addresses removed),
never Python's `hash()` or object ids. The plan cache is keyed by the first; processes of a
multi-controller job compare both before the first step (shardplan.distributed).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jaxlib

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")

PLAN_KEYS = ("mesh", "inputs", "outputs", "constraints", "operand_specs", "stages",
             "num_micro_batches", "schedule", "pipeline_kind", "remat", "grad_accumulation")
"""The fields of Plan.to_dict() that decide what runs (not the estimate, timings or notes)."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What a plan was made for, as hashes (checked when a plan is adopted): the inputs
    (pytree, shapes, dtypes), the function (its jaxpr without source information) and the mesh
    (axis names and sizes)."""

    inputs: str
    function: str
    mesh: str

    @property
    def key(self) -> str:
        """One hash of all three."""
        return digest(f"{self.inputs}/{self.function}/{self.mesh}")[:32]


def of_step(traced, mesh) -> Fingerprint:
    """The Fingerprint of a traced step (shardplan.ir.trace.TracedStep) on `mesh` (a MeshShape);
    the same in every process (no object addresses)."""
    avals = [(tuple(a.shape), str(a.dtype)) for a in traced.closed_jaxpr.in_avals]
    inputs = strip_addresses(f"{traced.in_tree}|{avals}")
    return Fingerprint(digest(inputs)[:32], traced.jaxpr_digest[:32],
                       digest(f"{list(mesh.names)}|{list(mesh.sizes)}")[:32])


def digest(text: str) -> str:
    """sha256 hex digest of `text`."""
    return hashlib.sha256(text.encode()).hexdigest()


def canonical_json(value: Any) -> str:
    """Sorted, compact JSON of plain values, dataclasses, enums and tuples; anything else by
    its repr with memory addresses removed."""
    return json.dumps(_plain(value), sort_keys=True, separators=(",", ":"))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return strip_addresses(repr(value))


def strip_addresses(text: str) -> str:
    """`text` without memory addresses (`<function f at 0x7f...>`), which differ per process."""
    return _ADDRESS.sub("", text)


def jaxpr_text(closed_jaxpr) -> str:
    """The jaxpr as text without source information, name stacks or memory addresses."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    return strip_addresses(jaxpr.pretty_print(source_info=False, name_stack=False))


def mesh_key(mesh) -> dict:
    """Axis names and sizes of a jax Mesh or a MeshShape, and for a jax Mesh the device ids
    in mesh order (the cost model places links by them), the platform and the device kinds."""
    if hasattr(mesh, "axis_names"):
        names = tuple(str(n) for n in mesh.axis_names)
        key = {"names": list(names), "sizes": [int(mesh.shape[n]) for n in names]}
        devices = getattr(mesh, "devices", None)
        if devices is not None:
            key["devices"] = [int(d.id) for d in devices.flat]
            key["platform"] = str(devices.flat[0].platform)
            key["kinds"] = sorted({str(getattr(d, "device_kind", "")) for d in devices.flat})
        return key
    return {"names": list(mesh.names), "sizes": [int(s) for s in mesh.sizes]}


def step_key(traced) -> dict:
    """What identifies a traced step (shardplan.ir.trace.TracedStep): its input and output
    pytree structures, shapes and dtypes, which inputs are state or batch, and its jaxpr."""
    info = traced.arg_info
    return {
        "in_tree": strip_addresses(str(traced.in_tree)),
        "out_tree": strip_addresses(str(traced.out_tree)),
        "in_avals": [[list(a.shape), str(a.dtype)] for a in traced.in_avals],
        "out_avals": [[list(a.shape), str(a.dtype)] for a in traced.out_avals],
        "input_names": list(info.input_names),
        "roles": [str(r) for r in info.roles],
        "ties": list(info.ties),
        "state_argnums": list(traced.state_argnums),
        "jaxpr": traced.jaxpr_digest,
    }


def step_fingerprint(traced, mesh, hardware, options, *, donate_argnums: Sequence[int],
                     extra: Sequence = ()) -> str:
    """THE key of a plan: the plan cache's file name and what every process of a job compares
    before planning. It covers every input that changes the plan: the traced step (pytrees,
    shapes, dtypes, roles, jaxpr), the mesh (names, sizes, device ids and kinds), every field
    of `hardware` (a HardwareProfile, or a name) and of `options` (SearchOptions, hints
    included), the donated arguments (donation frees their buffers, so a donating step's plan
    may be over the budget without it), and the versions of jax, jaxlib and shardplan (its
    source digest). tests/test_cache_hardening.py::test_every_input_of_auto_is_in_the_key
    fails when an option or an argument of shardplan.auto is neither here nor in its list of
    arguments that do not change the plan. Equal inputs give equal hex strings in any
    process."""
    return digest(canonical_json({
        "step": step_key(traced), "mesh": mesh_key(mesh), "hardware": hardware,
        "options": options, "donate_argnums": sorted({int(i) for i in donate_argnums}),
        "versions": versions(), "extra": list(extra)}))


def versions() -> dict:
    """The versions a plan depends on: jax's, jaxlib's and shardplan's (shardplan_version)."""
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "shardplan": shardplan_version()}


@functools.lru_cache(maxsize=1)
def shardplan_version() -> str:
    """The shardplan version and a digest of its source: plans of a changed planner are not
    reused, even in a development install whose version number did not move."""
    try:
        release = importlib.metadata.version("shardplan")
    except importlib.metadata.PackageNotFoundError:
        release = "unknown"
    root = pathlib.Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return f"{release}+{h.hexdigest()[:12]}"


def plan_key(plan_dict: Mapping) -> dict:
    """The parts of a Plan.to_dict() that decide what runs."""
    return {k: plan_dict[k] for k in PLAN_KEYS if k in plan_dict}


def plan_fingerprint(plan) -> str:
    """Hash of a Plan's decisions: mesh, input/output specs, constraints, operand routes,
    stages, micro-batches, schedule and the kind of pipeline (one program, SPMD, MPMD).
    Plans with equal fingerprints run the same program."""
    d = plan if isinstance(plan, Mapping) else plan.to_dict()
    return digest(canonical_json(plan_key(d)))


def first_difference(a: Mapping, b: Mapping) -> str | None:
    """The first decision two Plan.to_dict()s differ in, named for a person ("input
    '[0][1]': {...} vs {...}"), or None if they decide the same."""
    for field in ("pipeline_kind", "remat", "grad_accumulation", "mesh", "num_micro_batches",
                  "schedule"):
        if a.get(field) != b.get(field):
            return f"{field}: {a.get(field)!r} vs {b.get(field)!r}"
    for field, label in (("inputs", "input"), ("outputs", "output")):
        xs, ys = a.get(field, []), b.get(field, [])
        if len(xs) != len(ys):
            return f"number of {field}: {len(xs)} vs {len(ys)}"
        for x, y in zip(xs, ys):
            if x != y:
                name = x.get("name") if x.get("name") == y.get("name") else \
                    f"{x.get('name')}/{y.get('name')}"
                return f"{label} {name!r}: spec {_spec_text(x.get('spec'))} vs " \
                       f"{_spec_text(y.get('spec'))}"
    for field, label in (("constraints", "constraint on value"),
                         ("operand_specs", "operand route")):
        xs, ys = a.get(field, {}), b.get(field, {})
        for k in sorted(set(xs) | set(ys), key=_natural):
            if xs.get(k) != ys.get(k):
                return f"{label} {k}: {_spec_text(xs.get(k))} vs {_spec_text(ys.get(k))}"
    xs, ys = a.get("stages") or [], b.get("stages") or []
    if len(xs) != len(ys):
        return f"number of pipeline stages: {len(xs)} vs {len(ys)}"
    for i, (x, y) in enumerate(zip(xs, ys)):
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                return f"pipeline stage {i} {key}: {x.get(key)!r} vs {y.get(key)!r}"
    return None


def _natural(key: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(key))]


def _spec_text(spec) -> str:
    """A JSON spec ({"dims": [[axes], ...], "partial": [...]}) as PartitionSpec-like text."""
    if spec is None:
        return "(none)"
    if isinstance(spec, list):
        return "[" + ", ".join(_spec_text(s) for s in spec) + "]"
    dims = []
    for axes in spec.get("dims", []):
        dims.append("None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(tuple(axes)))
    partial = f" partial{tuple(spec['partial'])}" if spec.get("partial") else ""
    return f"P({', '.join(dims)}){partial}"
