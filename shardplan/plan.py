"""Plan: the PartitionSpec of every input, output and planned intermediate, the stages, the
estimate (shardplan.cost.estimate); JSON round trip and a summary table. Values only: how a
plan is found is shardplan.search, how it runs is shardplan.emit."""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from shardplan.cost.estimate import Estimate
from shardplan.inter.stages import Stage, device_span
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import fmt_bytes, fmt_seconds

__all__ = ["FORMAT_VERSION", "Estimate", "OpRow", "Plan", "Stage", "load_plan"]

FORMAT_VERSION = 1


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
    estimate: Estimate
    operand_specs: Mapping[tuple[int, int], tuple[ShardSpec, ...]] = dataclasses.field(
        default_factory=dict)
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

    # -- shardings -------------------------------------------------------------------------

    def _shardings(self, specs, tree):
        if self.stages:
            raise ValueError("a pipelined plan has no single mesh: each stage's inputs live on "
                             "its own submesh (see plan.stages); use plan.in_specs for the specs")
        if self.device_mesh is None:
            raise ValueError("this plan has no device mesh (it was planned with shardplan.search "
                             "or loaded from a file): use plan.in_specs / plan.out_specs, or "
                             "pass the plan to shardplan.auto(..., plan=plan) on a mesh")
        leaves = [NamedSharding(self.device_mesh, s.to_partition_spec()) for s in specs]
        return jax.tree_util.tree_unflatten(tree, leaves) if tree is not None else leaves

    @property
    def in_shardings(self):
        """Pytree of NamedSharding for the step's arguments (as a tuple of arguments)."""
        return tuple(self._shardings(self.input_specs, self.in_tree))

    @property
    def out_shardings(self):
        return self._shardings(self.output_specs, self.out_tree)

    @property
    def in_specs(self) -> dict[str, Any]:
        return {n: s.to_partition_spec() for n, s in zip(self.input_names, self.input_specs)}

    @property
    def out_specs(self) -> dict[str, Any]:
        return {n: s.to_partition_spec() for n, s in zip(self.output_names, self.output_specs)}

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION,
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
            "ops": [dataclasses.asdict(o) for o in self.ops],
            "stages": [{"layers": list(s.layers), "submesh_shape": list(s.submesh_shape),
                        "devices": list(s.devices), "estimate": s.estimate.to_dict()}
                       for s in self.stages],
            "search_s": self.search_s,
            "solver": self.solver,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> Plan:
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"plan format {d.get('format')!r} is not {FORMAT_VERSION}; "
                             "plan the step again with this version of shardplan")
        mesh = MeshShape(tuple(d["mesh"]["names"]), tuple(d["mesh"]["sizes"]))
        return cls(
            mesh=mesh, hardware=d["hardware"],
            input_names=tuple(x["name"] for x in d["inputs"]),
            input_specs=tuple(_spec_from_json(x["spec"]) for x in d["inputs"]),
            output_names=tuple(x["name"] for x in d["outputs"]),
            output_specs=tuple(_spec_from_json(x["spec"]) for x in d["outputs"]),
            constraints={int(k): _spec_from_json(v) for k, v in d["constraints"].items()},
            operand_specs={tuple(int(x) for x in k.split(":")): tuple(_spec_from_json(s) for s in v)
                           for k, v in d.get("operand_specs", {}).items()},
            estimate=Estimate.from_dict(d["estimate"]),
            memory_budget=d.get("memory_budget"),
            ops=tuple(OpRow(**o) for o in d.get("ops", ())),
            stages=tuple(Stage(tuple(s["layers"]), tuple(s["submesh_shape"]), tuple(s["devices"]),
                               Estimate.from_dict(s["estimate"])) for s in d.get("stages", ())),
            search_s=d.get("search_s", 0.0), solver=d.get("solver", ""),
            num_micro_batches=d.get("num_micro_batches", 1), schedule=d.get("schedule", ""),
            notes=tuple(d.get("notes", ())),
        )

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    # -- summary ---------------------------------------------------------------------------

    def param_table(self) -> list[tuple[str, str, int]]:
        """Inputs grouped by name pattern (layer numbers folded into '*'): (pattern, spec,
        count)."""
        groups: dict[tuple[str, str], int] = {}
        for name, spec in zip(self.input_names, self.input_specs):
            pattern = re.sub(r"\d+", "*", name)
            key = (pattern, str(spec.to_partition_spec()))
            groups[key] = groups.get(key, 0) + 1
        return [(p, s, n) for (p, s), n in groups.items()]

    def summary(self, max_rows: int = 25) -> str:
        buf = io.StringIO()
        console = Console(file=buf, width=120, force_terminal=False, color_system=None)
        mesh = " x ".join(f"{n}={s}" for n, s in zip(self.mesh.names, self.mesh.sizes))
        e = self.estimate
        budget = f" (budget {fmt_bytes(self.memory_budget)})" if self.memory_budget else ""
        console.print(f"shardplan plan on mesh {mesh}, hardware {self.hardware}")
        console.print(f"estimate per step: {fmt_seconds(e.total_s)} = compute "
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
            t.add_row(escape(p), s, str(n))
        if len(rows) > max_rows:
            t.add_row(f"... {len(rows) - max_rows} more groups", "", "")
        console.print(t)
        if self.ops:
            t = Table(title="costliest operators")
            for c in ("op", "name", "strategy", "compute", "comm"):
                t.add_column(c)
            for o in sorted(self.ops, key=lambda o: -(o.compute_s + o.comm_s))[:max_rows]:
                t.add_row(o.primitive, escape(o.name[-50:]), escape(o.strategy), fmt_seconds(o.compute_s),
                          fmt_seconds(o.comm_s))
            console.print(t)
        for note in self.notes:
            console.print(note)
        console.print(f"search took {self.search_s:.2f} s ({self.solver})")
        return buf.getvalue()

    def __repr__(self) -> str:
        return (f"Plan(mesh={dict(zip(self.mesh.names, self.mesh.sizes))}, "
                f"estimate={fmt_seconds(self.estimate.total_s)}, stages={len(self.stages)})")


def _spec_to_json(s: ShardSpec) -> dict:
    return {"dims": [list(d) for d in s.dims], "partial": list(s.partial)}


def _spec_from_json(d: Mapping) -> ShardSpec:
    return ShardSpec(tuple(tuple(x) for x in d["dims"]), tuple(d.get("partial", ())))


def load_plan(path) -> Plan:
    """A plan saved with Plan.save."""
    with open(path) as f:
        return Plan.from_dict(json.load(f))
