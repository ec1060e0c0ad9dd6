"""A value's sharding over mesh axes: which axes split each dimension, which hold partial sums."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Axis names and sizes of a device mesh, without devices (planning needs no devices)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __post_init__(self):
        if len(self.names) != len(self.sizes):
            raise ValueError(f"mesh names {self.names} and sizes {self.sizes} differ in length")
        # Looked up hundreds of thousands of times while planning: a dict, not names.index.
        object.__setattr__(self, "_by_name", dict(zip(self.names, self.sizes)))

    @classmethod
    def of(cls, mesh) -> MeshShape:
        """From a jax.sharding.Mesh (or anything with axis_names and a shape mapping)."""
        names = tuple(mesh.axis_names)
        return cls(names, tuple(int(mesh.shape[n]) for n in names))

    def size(self, axes: str | Sequence[str] | None = None) -> int:
        by_name = self._by_name
        try:
            if axes is None:
                return math.prod(self.sizes)
            if isinstance(axes, str):
                return by_name[axes]
            n = 1
            for a in axes:
                n *= by_name[a]
            return n
        except KeyError as e:
            raise ValueError(f"mesh axis {e.args[0]!r} is not one of {list(self.names)}") from None

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def useful_axes(self) -> tuple[str, ...]:
        """Axes of size > 1; splitting over a size-1 axis changes nothing."""
        return tuple(n for n, s in zip(self.names, self.sizes) if s > 1)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """For each tensor dimension, the mesh axes it is split over (major to minor);
    `partial` lists mesh axes over which the value is an unreduced partial sum."""

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    @classmethod
    def replicated(cls, ndim: int) -> ShardSpec:
        return cls(((),) * ndim)

    @classmethod
    def split(cls, ndim: int, dim: int, axes: str | Sequence[str]) -> ShardSpec:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return cls(tuple(axes if d == dim else () for d in range(ndim)))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def used_axes(self) -> tuple[str, ...]:
        return tuple(a for d in self.dims for a in d) + self.partial

    def is_replicated(self) -> bool:
        return not self.used_axes()

    def num_shards(self, mesh: MeshShape) -> int:
        """How many distinct pieces the value is split into (partial axes do not split)."""
        return math.prod(mesh.size(d) for d in self.dims if d)

    def shard_shape(self, shape: Sequence[int], mesh: MeshShape) -> tuple[int, ...]:
        return tuple(s // mesh.size(d) if d else s for s, d in zip(shape, self.dims))

    def valid_for(self, shape: Sequence[int], mesh: MeshShape) -> bool:
        """Each axis used once, every split dimension divisible by its axes."""
        used = self.used_axes()
        if len(set(used)) != len(used) or len(shape) != len(self.dims):
            return False
        return all(not d or s % mesh.size(d) == 0 for s, d in zip(shape, self.dims))

    def without_partial(self) -> ShardSpec:
        return ShardSpec(self.dims)

    def with_partial(self, axes: Sequence[str]) -> ShardSpec:
        return ShardSpec(self.dims, tuple(axes))

    def to_partition_spec(self):
        """The jax.sharding.PartitionSpec of the split (partial sums cannot be expressed)."""
        from jax.sharding import PartitionSpec

        entries = [None if not d else (d[0] if len(d) == 1 else d) for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    @classmethod
    def from_partition_spec(cls, pspec, ndim: int) -> ShardSpec:
        dims = []
        for i in range(ndim):
            e = pspec[i] if i < len(pspec) else None
            dims.append(() if e is None else ((e,) if isinstance(e, str) else tuple(e)))
        return cls(tuple(dims))

    def __str__(self) -> str:
        body = ",".join("+".join(d) if d else "-" for d in self.dims)
        return f"[{body}]" + (f"~{'+'.join(self.partial)}" if self.partial else "")


def enumerate_specs(
    shape: Sequence[int], mesh: MeshShape, max_split_dims: int | None = None
) -> tuple[ShardSpec, ...]:
    """Every valid way to split a value over the useful mesh axes (each axis on at most one
    dimension, in mesh order within a dimension), replicated first."""
    return _enumerate_specs(tuple(int(s) for s in shape), mesh, max_split_dims)


@functools.lru_cache(maxsize=1 << 12)
def _enumerate_specs(shape: tuple[int, ...], mesh: MeshShape,
                     max_split_dims: int | None) -> tuple[ShardSpec, ...]:
    # asked for once per node and value: a model's few shapes, enumerated once each
    axes = mesh.useful_axes()
    ndim = len(shape)
    out = []
    # assign each axis to a dimension or to none (-1)
    for assign in itertools.product(range(-1, ndim), repeat=len(axes)):
        dims = tuple(tuple(a for a, d in zip(axes, assign) if d == i) for i in range(ndim))
        spec = ShardSpec(dims)
        if max_split_dims is not None and sum(1 for d in dims if d) > max_split_dims:
            continue
        if spec.valid_for(shape, mesh):
            out.append(spec)
    out.sort(key=lambda s: (len(s.used_axes()), str(s)))
    return tuple(out)
