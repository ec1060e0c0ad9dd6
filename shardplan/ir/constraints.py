"""A model's own sharding constraints: what a `sharding_constraint` node of the graph asks for
(`jax.lax.with_sharding_constraint`, flax's `nn.with_logical_constraint`, MaxText's
`maybe_shard_with_logical`), read off its equation as plain values.

The planner reads them as hints or ignores them (SearchOptions.model_constraints,
shardplan.intra.hints.model_pins); the emitter never binds them as written
(shardplan.emit.jit): their mesh may hold other devices than the plan's (a model built for one
device), and a layout the plan did not choose is a collective it did not price."""

from __future__ import annotations

import dataclasses

from shardplan.ir.graph import Graph, Node

PRIMITIVES = frozenset({"sharding_constraint"})
"""Primitives that hold a value in a layout the model's author wrote, and compute nothing."""

FREE = None
"""A dimension the constraint leaves to the partitioner (PartitionSpec.UNCONSTRAINED)."""


@dataclasses.dataclass(frozen=True)
class Constraint:
    """One model constraint. `dims`: per dimension of the value, the mesh axes it is split
    over (major to minor; () whole), or FREE; `mesh_names`, `mesh_sizes`: the mesh the model
    named them on; `device_ids`: its devices in mesh order (() where the mesh is abstract);
    `text`: the constraint as the model wrote it (for the plan's notes)."""

    dims: tuple[tuple[str, ...] | None, ...]
    mesh_names: tuple[str, ...]
    mesh_sizes: tuple[int, ...]
    device_ids: tuple[int, ...]
    text: str

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.mesh_sizes:
            n *= s
        return n

    def mesh_text(self) -> str:
        axes = " x ".join(f"{a}={s}" for a, s in zip(self.mesh_names, self.mesh_sizes))
        n = self.num_devices
        return f"{axes or 'no axes'} ({n} device{'s' if n != 1 else ''})"


def is_constraint(node: Node) -> bool:
    """Whether `node` is a model's sharding constraint (bound as identity when emitted)."""
    return node.primitive in PRIMITIVES


def _entry(entry, unconstrained) -> tuple[str, ...] | None:
    if entry is unconstrained:
        return FREE
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def read(node: Node, ndim: int) -> Constraint | None:
    """The constraint `node` holds its value to, or None where its sharding names no mesh
    axes (a sharding other than a NamedSharding: the planner lays the value out)."""
    sharding = node.params.get("sharding")
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None:
        return None
    unconstrained = type(spec).UNCONSTRAINED
    free = frozenset(node.params.get("unconstrained_dims") or ())
    dims = tuple(FREE if d in free else _entry(spec[d] if d < len(spec) else None, unconstrained)
                 for d in range(ndim))
    names = tuple(str(a) for a in mesh.axis_names)
    sizes = tuple(int(mesh.shape[a]) for a in mesh.axis_names)
    try:  # an AbstractMesh (a bare PartitionSpec under jax.set_mesh) raises: no devices
        ids = tuple(int(d.id) for d in mesh.devices.flat)
    except (AttributeError, ValueError):
        ids = ()
    return Constraint(dims, names, sizes, ids, repr(spec))


def of_graph(graph: Graph) -> dict[int, Constraint | None]:
    """{node id: its constraint} for every model constraint node of `graph` (loop bodies'
    included), None for those that name no layout."""
    out = {}
    for node in graph.nodes:
        if is_constraint(node) and node.outputs:
            out[node.id] = read(node, graph.values[node.outputs[0]].ndim)
    return out
