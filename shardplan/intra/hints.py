"""Hints -> pinned inputs: which flat inputs the user's patterns and logical axis names fix,
and to which ShardSpec (IntraOptions.fixed_inputs); and the model's own sharding constraints
-> pinned values (model_pins). Pure functions of the inputs' paths and shapes, the graph and
the mesh; the flax-specific reading of names is shardplan.hints'."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from shardplan import options
from shardplan.ir import constraints as constraints_mod
from shardplan.ir.graph import Graph
from shardplan.options import Hints
from shardplan.strategies.spec import MeshShape, ShardSpec

Axes = str | tuple[str, ...] | None


def matches(pattern: str, path: str) -> bool:
    """Whether the '/'-joined `path` matches the glob `pattern`: `**` is any number of
    components (none too), any other component is an fnmatch pattern of one component; in
    time linear in the pattern's and the path's components (options.path_matches)."""
    return options.path_matches(pattern, path)


def logical_to_mesh(names: Sequence[Axes], rules: Sequence[tuple[str, Axes]],
                    mesh: MeshShape) -> PartitionSpec:
    """The mesh axes of a value whose dimensions carry logical `names`, as flax's
    `logical_to_mesh_axes`: rules in order, each taken by the first dimension of its name that
    is unassigned when its mesh axes are all free. A name no rule assigns stays on no axis,
    unless it is a mesh axis itself (flax's `with_partitioning` names mesh axes directly)."""
    unset = object()
    out: list = [unset] * len(names)

    def taken() -> set[str]:
        return {a for e in out if e is not unset and e is not None for a in _tuple(e)}

    for name, axes in rules:
        if name in names:
            i = list(names).index(name)
            if out[i] is unset and not set(_tuple(axes)) & taken():
                out[i] = axes
    for i, n in enumerate(names):
        if out[i] is unset:
            out[i] = n if isinstance(n, str) and n in mesh.names and n not in taken() else None
    return PartitionSpec(*out)


def _tuple(axes: Axes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def check_spec(spec: PartitionSpec, shape: Sequence[int], mesh: MeshShape,
               name: str, source: str) -> ShardSpec:
    """`spec` as a ShardSpec of a value of `shape`, or the ValueError naming the input, the
    hint it came from and what does not fit."""
    where = f"hint {source} for input {name} (shape {tuple(shape)})"
    if len(spec) > len(shape):
        raise ValueError(f"{where}: {spec} has {len(spec)} entries, the value {len(shape)} "
                         "dimensions")
    seen: list[str] = []
    for d, entry in enumerate(spec):
        axes = _tuple(entry)
        for a in axes:
            if a not in mesh.names:
                raise ValueError(f"{where}: {a!r} is not a mesh axis; the mesh has "
                                 f"{', '.join(mesh.names)}")
            if a in seen:
                raise ValueError(f"{where}: {spec} uses mesh axis {a!r} twice")
            seen.append(a)
        if axes and shape[d] % mesh.size(axes):
            raise ValueError(f"{where}: dimension {d} of size {shape[d]} does not divide "
                             f"into {mesh.size(axes)} pieces over {'+'.join(axes)}")
    return ShardSpec.from_partition_spec(spec, len(shape))


def _translated(spec: PartitionSpec, rules: Sequence[tuple[str, Axes]],
                mesh: MeshShape) -> PartitionSpec:
    """A pinned spec that names logical axes (P("batch")) in mesh axes, by the rules; a spec
    of mesh axes (or of names no rule knows: check_spec names them) as it is."""
    known = {name for name, _ in rules}
    if any(isinstance(e, str) and e in known and e not in mesh.names for e in spec) \
            and all(e is None or isinstance(e, str) for e in spec):
        return logical_to_mesh(tuple(spec), rules, mesh)
    return spec


def _logical_entry(path: str, entries: Sequence[tuple[str, tuple]]) -> tuple[str, tuple] | None:
    """The logical names entry for the input at `path`: its own (argument index included),
    else one for its path within its argument, else the longest that ends its path (optax's
    mu / nu under their parameter's path)."""
    rel = path.split("/", 1)[1] if "/" in path else ""
    for key, names in entries:
        if key == path:
            return key, names
    for key, names in entries:
        if key == rel:
            return key, names
    ends = [(key, names) for key, names in entries if rel.endswith("/" + key)]
    return max(ends, key=lambda e: len(e[0])) if ends else None


def fixed_inputs(hints: Hints, paths: Sequence[str], shapes: Sequence[Sequence[int]],
                 mesh: MeshShape) -> Mapping[int, ShardSpec]:
    """{flat input index: pinned spec} for the inputs at `paths` (shardplan.options.path_str)
    with `shapes`. A pattern wins over logical names; every pattern and every logical names
    entry must match some input (a typo is an error, not a hint silently dropped)."""
    fixed: dict[int, ShardSpec] = {}
    if not hints:
        return fixed
    hit: set[str] = set()
    for i, (path, shape) in enumerate(zip(paths, shapes)):
        for pattern, spec in hints.pins:
            if matches(pattern, path):
                hit.add(pattern)
                if i not in fixed:
                    spec = _translated(spec, hints.logical_axis_rules, mesh)
                    fixed[i] = check_spec(spec, shape, mesh, path, repr(pattern))
        entry = _logical_entry(path, hints.logical_names)
        if entry is None:
            continue
        key, names = entry
        if len(names) != len(shape):
            if key in (path, path.split("/", 1)[-1]):
                raise ValueError(f"logical names {names} of {key} do not fit input {path} of "
                                 f"shape {tuple(shape)}")
            continue  # a longer state leaf whose path merely ends like a parameter's
        hit.add(key)
        if i in fixed:
            continue
        if not hints.logical_axis_rules and not all(n is None or n in mesh.names
                                                    for n in names):
            continue  # names with no rules to map them: the planner chooses
        spec = logical_to_mesh(names, hints.logical_axis_rules, mesh)
        fixed[i] = check_spec(spec, shape, mesh, path, f"logical names {names} -> {spec}")
    missed = [p for p, _ in hints.pins if p not in hit]
    missed += [k for k, _ in hints.logical_names if k not in hit]
    if missed:
        shown = ", ".join(paths[:6]) + (", ..." if len(paths) > 6 else "")
        raise ValueError(f"hints match no input: {', '.join(map(repr, missed))}; the inputs' "
                         f"paths look like {shown}")
    return fixed


Pin = tuple[tuple[str, ...] | None, ...]
"""A value's pinned layout: per dimension its mesh axes (() whole), or None (left free)."""


@dataclasses.dataclass(frozen=True)
class ModelPins:
    """What the planner does with the model's own sharding constraints: `pins`, {node id of
    a constraint: the layout its value is held to on the plan's mesh}; `notes`, what was done
    with each (the plan's notes)."""

    pins: Mapping[int, Pin] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def allows(self, node_id: int, spec: ShardSpec) -> bool:
        """Whether `spec` is a layout the pin of node `node_id` allows (any, unpinned)."""
        pin = self.pins.get(node_id)
        return pin is None or (not spec.partial and all(
            p is None or p == d for p, d in zip(pin, spec.dims)))


def replaced(c: constraints_mod.Constraint, shape: Sequence[int], mesh: MeshShape) -> Pin:
    """The layout constraint `c` asks of a value of `shape`, on the plan's `mesh`.

    On the mesh it was written for (the same axis names and sizes) it is taken as it is. On
    another mesh (a model built for one device, or for other axes) it is re-placed: each
    dimension keeps the axes the plan's mesh has by the same name, and a dimension left with
    none is free (whole on the model's mesh says nothing of the plan's axes). Axes of size 1,
    an axis used by an earlier dimension, and minor axes that do not divide the dimension are
    dropped (as MaxText's adjust_pspec_for_indivisible_shapes)."""
    same = (c.mesh_names, c.mesh_sizes) == (mesh.names, mesh.sizes)
    used: set[str] = set()
    out: list[tuple[str, ...] | None] = []
    for dim, axes in zip(shape, c.dims):
        if axes is None:
            out.append(None)
            continue
        kept: list[str] = []
        for a in axes:
            if a in mesh.names and mesh.size(a) > 1 and a not in used \
                    and dim % (mesh.size((*kept, a))) == 0:
                kept.append(a)
        used.update(kept)
        out.append(tuple(kept) if kept or same else None)
    return tuple(out)


def _pin_text(pin: Pin) -> str:
    return "[" + ",".join("*" if d is None else "+".join(d) or "-" for d in pin) + "]"


def _scope(name: str) -> str:
    """A node's scope without the wrappers JAX's transformations put around it (`jvp(...)`,
    `transpose(...)`): '' where nothing else is left."""
    bare = name
    for wrapper in ("transpose(", "jvp(", "checkpoint(", "remat(", ")"):
        bare = bare.replace(wrapper, "")
    return name if bare.strip("/") else ""


def model_pins(graph: Graph, mesh: MeshShape, mode: str = "hint") -> ModelPins:
    """The model's sharding constraints in `graph` on the plan's `mesh`: each read as a hint
    (mode "hint": its value is held to the layout it asks for, re-placed on the plan's mesh
    where it was written for another; `replaced`) or ignored (mode "ignore": the planner lays
    the value out). None is bound as written (shardplan.emit.jit binds them as identity and
    constrains the value to the plan's layout)."""
    found = constraints_mod.of_graph(graph)
    if not found:
        return ModelPins()
    pins: dict[int, Pin] = {}
    groups: dict[tuple, list[int]] = {}
    for nid, c in sorted(found.items()):
        value = graph.values[graph.nodes[nid].outputs[0]]
        of = f"{value.dtype}{list(value.shape)}"
        if c is None:
            groups.setdefault(("names no mesh axes (not a NamedSharding): left to the planner",
                               repr(graph.nodes[nid].params.get("sharding")), of, ""),
                              []).append(nid)
            continue
        same = (c.mesh_names, c.mesh_sizes) == (mesh.names, mesh.sizes)
        where = "" if same else f" on {c.mesh_text()}"
        if mode == "ignore":
            what = "ignored (option model_constraints='ignore'): laid out by the planner"
        else:
            pin = replaced(c, value.shape, mesh)
            if pin and all(d is None for d in pin):
                what = ("re-placed on the plan's mesh: it names no axis of it, so the planner "
                        "lays the value out")
            else:
                pins[nid] = pin
                what = (f"read as a hint, {_pin_text(pin)}" if same else
                        f"re-placed on the plan's mesh as {_pin_text(pin)}, read as a hint")
        groups.setdefault((what, c.text, of, where), []).append(nid)
    notes = [(f"model sharding constraints: {len(found)} in the step, none bound as written "
              "(the plan's layouts are emitted in their place; * a dimension left free)")]
    for (what, text, of, where), nids in sorted(groups.items(), key=lambda g: g[1][0]):
        scope = _scope(graph.nodes[nids[0]].name)
        at = f", first in {scope}" if scope else ""
        notes.append(f"  {len(nids)} x {text} of {of}{where}{at}: {what}")
    return ModelPins(pins, tuple(notes))
