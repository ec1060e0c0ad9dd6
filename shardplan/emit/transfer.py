"""Moving a value between devices the MPMD pipeline's stages own, also across the processes of
a multi-controller job (jax.distributed).

`jax.device_put` cannot move an array to devices another process owns ("Cannot reshard an
input that is not fully addressable"), so a move that involves several processes is one
collective program over the union of the source's and the destination's devices (shard_map):
a `ppermute` from each source device to the destination device that needs the same block
where both sides are laid out alike on meshes of one shape, else the value made whole on the
source (gathered among the source devices) and each destination device's block sent to it by
`ppermute` from one source device, in as many rounds as destinations per source. Either way
the value crosses between the two sides once (shardplan.inter.transfer_cost prices it). Every process that owns one
of those devices runs it; the others skip it. Callers issue moves in the same order in every
process (a pipeline's schedule is static), so the collectives of two processes always pair up.

A process that owns no destination device gets a global array without local shards: its
shape, dtype and sharding, which is all it needs to pass it on.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

SIDE = "_transfer_side"
UNION = "_transfer_devices"


def process_of(devices) -> frozenset[int]:
    """The processes owning `devices`."""
    return frozenset(d.process_index for d in devices)


def empty(shape: Sequence[int], dtype, sharding) -> jax.Array:
    """A global array of this process that holds none of its shards."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)


def from_host(x, sharding) -> jax.Array:
    """A global array from a full host copy `x`, equal in every process: each device of this
    process takes its block (no communication)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx], dtype=x.dtype)


def _mesh_of(src) -> Mesh:
    if isinstance(src, Mesh):
        return src
    if isinstance(src, NamedSharding):
        return src.mesh
    devices = sorted(src.device_set, key=lambda d: (d.process_index, d.id))
    return Mesh(np.asarray(devices), ("_source",))


def _device_set(src) -> frozenset:
    return frozenset(np.asarray(src.devices).flat) if isinstance(src, Mesh) else frozenset(
        src.device_set)


class Mover:
    """Moves values between device sets (see the module's docstring); programs cached."""

    def __init__(self):
        self.me = jax.process_index()
        self._programs: dict = {}

    def move(self, x, src, dst: NamedSharding, shape: Sequence[int], dtype) -> jax.Array | None:
        """`x` (laid out on the devices of `src`: a Mesh or a Sharding; None or an array
        without local shards in a process that owns none of them) laid out as `dst`.

        Every process must call it with the same `src`, `dst`, shape and dtype, in the same
        order; only the owners of the devices do any work."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        src_devices, dst_devices = _device_set(src), frozenset(dst.device_set)
        owners = process_of(src_devices | dst_devices)
        if self.me not in owners:
            return empty(shape, dtype, dst)
        if owners == {self.me}:
            return jax.device_put(x, dst)
        if src_devices == dst_devices:  # one device set over several processes: a reshard
            return self._program(("reshard", dst, shape, dtype), lambda: jax.jit(
                lambda a: a, out_shardings=dst))(x)
        src_mesh = _mesh_of(src)
        if (not src_devices & dst_devices and src_mesh.axis_names == dst.mesh.axis_names
                and src_mesh.devices.shape == dst.mesh.devices.shape):
            return self._permute(x, src_mesh, dst, shape, dtype)
        return self._scatter(x, src_mesh, dst, shape, dtype)

    def _program(self, key, build):
        if key not in self._programs:
            self._programs[key] = build()
        return self._programs[key]

    def _staged(self, x, sharding: NamedSharding, shape, dtype):
        """`x` laid out as `sharding` on its own devices (in the processes that own them)."""
        if self.me not in process_of(sharding.device_set):
            return None
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, len(shape)):
            return x
        return self._program(("stage", sharding, shape, dtype), lambda: jax.jit(
            lambda a: a, out_shardings=sharding))(x)

    def _union_array(self, x, sharding: NamedSharding, gshape, src_devices, dtype):
        """The (slots, *shape) array of the transfer program: a source device's slot holds its
        block of `x`, a destination device's slot zeros."""
        held = {s.device: s.data for s in x.addressable_shards} if x is not None else {}
        block = sharding.shard_shape(gshape)
        arrays = []
        for d in sharding.addressable_devices:
            if d in src_devices:
                arrays.append(held[d].reshape(block))
            else:
                arrays.append(jax.device_put(np.zeros(block, dtype), d))
        return jax.make_array_from_single_device_arrays(gshape, sharding, arrays, dtype=dtype)

    def _take(self, out, dst: NamedSharding, shape, dtype):
        dst_devices = dst.device_set
        block = dst.shard_shape(shape)
        arrays = [s.data.reshape(block) for s in out.addressable_shards if s.device in dst_devices]
        return jax.make_array_from_single_device_arrays(shape, dst, arrays, dtype=dtype)

    def _permute(self, x, src_mesh: Mesh, dst: NamedSharding, shape, dtype):
        """Source and destination meshes of one shape and axes: source device k sends its block
        (the destination's layout on the source mesh) to destination device k."""
        spec = dst.spec
        x = self._staged(x, NamedSharding(src_mesh, spec), shape, dtype)
        union = Mesh(np.stack([src_mesh.devices, dst.mesh.devices]), (SIDE, *dst.mesh.axis_names),
                     axis_types=(jax.sharding.AxisType.Auto,) * (1 + src_mesh.devices.ndim))
        uspec = P(SIDE, *spec)
        gshape = (2, *shape)
        key = ("permute", tuple(d.id for d in union.devices.flat), union.axis_names, uspec,
               gshape, dtype)
        prog = self._program(key, lambda: jax.jit(jax.shard_map(
            lambda b: jax.lax.ppermute(b, SIDE, [(0, 1)]), mesh=union, in_specs=uspec,
            out_specs=uspec)))
        usharding = NamedSharding(union, uspec)
        out = prog(self._union_array(x, usharding, gshape, frozenset(src_mesh.devices.flat),
                                     dtype))
        return self._take(out, dst, shape, dtype)

    def _scatter(self, x, src_mesh: Mesh, dst: NamedSharding, shape, dtype):
        """Any layouts: the value made whole on the source devices (gathered among them), then
        each destination device receives only its block, from one source device, by ppermute
        in ceil(receivers / sources) rounds (a destination device that is also a source cuts
        its block locally). On the wire between the sides: the value once, in blocks."""
        key_of = _device_key
        sources = sorted(src_mesh.devices.flat, key=key_of)
        src_devices = frozenset(sources)
        x = self._staged(x, NamedSharding(src_mesh, P()), shape, dtype)
        devices = sorted(src_devices | frozenset(dst.device_set), key=key_of)
        pos = {d: k for k, d in enumerate(devices)}
        block = dst.shard_shape(shape)
        starts = np.zeros((len(devices), len(shape)), np.int32)
        for d, index in dst.devices_indices_map(shape).items():
            starts[pos[d]] = [sl.indices(n)[0] for sl, n in zip(index, shape)]
        receivers = sorted((d for d in dst.device_set if d not in src_devices), key=key_of)
        n = len(sources)
        rounds = [[(pos[sources[k]], pos[d]) for k, d in enumerate(receivers[r:r + n])]
                  for r in range(0, len(receivers), n)]
        send = np.zeros((max(len(rounds), 1), len(devices), len(shape)), np.int32)
        for r, pairs in enumerate(rounds):
            for a, b in pairs:
                send[r, a] = starts[b]
        local = np.asarray([d in src_devices and d in dst.device_set for d in devices])
        wide = jnp.int32 if dtype == np.bool_ else None

        def body(b):
            whole = b[0] if wide is None else b[0].astype(wide)
            i = jax.lax.axis_index(UNION)
            mine = jax.lax.dynamic_slice(whole, jnp.asarray(starts)[i], block)
            out = jnp.where(jnp.asarray(local)[i], mine, jnp.zeros_like(mine))
            for r, pairs in enumerate(rounds):
                part = jax.lax.dynamic_slice(whole, jnp.asarray(send[r])[i], block)
                out = out + jax.lax.ppermute(part, UNION, pairs)
            return (out if wide is None else out.astype(dtype))[None]

        union = Mesh(np.asarray(devices), (UNION,), axis_types=(jax.sharding.AxisType.Auto,))
        key = ("scatter", tuple(d.id for d in devices), tuple(d.id for d in sources),
               dst.spec, tuple(d.id for d in dst.mesh.devices.flat), tuple(shape), dtype)
        prog = self._program(key, lambda: jax.jit(jax.shard_map(
            body, mesh=union, in_specs=P(UNION), out_specs=P(UNION))))
        out = prog(self._union_array(x, NamedSharding(union, P(UNION)),
                                     (len(devices), *shape), src_devices, dtype))
        return self._take(out, dst, shape, dtype)


def _device_key(d):
    return (d.process_index, d.id)
