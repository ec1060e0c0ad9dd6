"""Measure the machine at hand and write a hardware profile the planner loads
(`shardplan profile`, `hardware="profile.yaml"`).

What is measured, with every device of the mesh busy at once (as in a train step):
- peak_flops / peak_flops_f32: a jitted batched matmul, one [n, n] @ [n, n] per device, in
  bfloat16 and float32; flop/s per device.
- mem_bandwidth: a jitted `x * a + b` over a large array per device: bytes read and written
  per second per device.
- the links: for each mesh axis, `psum` (all-reduce), `all_gather` and `ppermute` inside
  `shard_map` at a few message sizes; the ring model of shardplan.cost.ring (time = steps x
  latency + bytes sent / bandwidth) fitted by least squares over every size and kind, so the
  profile's Link is the alpha and beta the cost model will use. An axis whose devices all sit
  in one process is intra-host, one that spans processes inter-host.
- memory_bytes: the runtime's `bytes_limit` per device (GPU, TPU); on CPU the host's memory
  shared by its devices.

Each measurement is the best of `repeats` timed runs after a warm-up run that compiles.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.cost import ring
from shardplan.cost.hardware import HardwareProfile, Link

KINDS = {"all-reduce": "psum", "all-gather": "all_gather", "collective-permute": "ppermute"}
UNMEASURED_LINK = Link(bandwidth=1e11, latency=1e-6)
"""The links of a profile measured on one device, which has none to time (its notes say so)."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One timed collective: kind, axis, per-device buffer bytes (shardplan.cost.ring's
    convention), group size, seconds."""

    kind: str
    axis: str
    nbytes: int
    group_size: int
    seconds: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `measure_profile` found: the profile, and the raw samples behind its links."""

    profile: HardwareProfile
    samples: tuple[Sample, ...]
    links: dict[str, Link]
    """The fitted link of each mesh axis."""
    notes: tuple[str, ...] = ()
    """What the profile holds that was not measured (a mesh of one device has no links)."""


def check_repeats(repeats) -> int:
    """`repeats` if it is an int >= 1 (no timed run measures nothing), else a ValueError."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1 (timed runs per measurement), "
                         f"got {repeats!r}")
    return repeats


def best_time(fn: Callable, *args, repeats: int = 3) -> float:
    """Seconds of the fastest of `repeats` runs of `fn(*args)` (after one run that compiles)."""
    check_repeats(repeats)
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _per_device(mesh: jax.sharding.Mesh, shape: Sequence[int], dtype) -> jax.Array:
    """An array with one `shape` block per device of `mesh` (leading dimension split over all)."""
    n = mesh.devices.size
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    return jax.device_put(jnp.ones((n * shape[0], *shape[1:]), dtype), sharding)


def matmul_flops(mesh: jax.sharding.Mesh, dtype, size: int = 1024, repeats: int = 3) -> float:
    """Matmul flop/s per device in `dtype`, every device multiplying at once."""
    x = _per_device(mesh, (1, size, size), dtype)

    @jax.jit
    def f(a):
        return jnp.einsum("bij,bjk->bik", a, a, preferred_element_type=a.dtype)

    seconds = best_time(f, x, repeats=repeats)
    return 2 * size**3 / seconds


def memory_bandwidth(mesh: jax.sharding.Mesh, mbytes: int = 64, repeats: int = 3) -> float:
    """Bytes per second each device reads and writes in an elementwise pass."""
    elems = mbytes * 2**20 // 4
    x = _per_device(mesh, (1, elems), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001 + 0.5)
    return 2 * 4 * elems / best_time(f, x, repeats=repeats)


def _collective(mesh: jax.sharding.Mesh, axis: str, kind: str) -> Callable:
    size = mesh.shape[axis]
    if kind == "all-reduce":
        body = functools.partial(jax.lax.psum, axis_name=axis)
    elif kind == "all-gather":
        body = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    else:
        perm = [(i, (i + 1) % size) for i in range(size)]
        body = functools.partial(jax.lax.ppermute, axis_name=axis, perm=perm)
    spec = P(mesh.axis_names)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def time_collective(mesh: jax.sharding.Mesh, axis: str, kind: str, nbytes: int,
                    repeats: int = 3) -> Sample:
    """Time one collective over `axis` on a per-device buffer of about `nbytes` (for an
    all-gather, the gathered result)."""
    size = mesh.shape[axis]
    elems = max(1, nbytes // 4)
    if kind == "all-gather":
        elems = max(1, elems // size)
    x = _per_device(mesh, (elems,), jnp.float32)
    seconds = best_time(_collective(mesh, axis, kind), x, repeats=repeats)
    buffer = elems * 4 * (size if kind == "all-gather" else 1)
    return Sample(kind, axis, buffer, size, seconds)


def fit_link(samples: Sequence[Sample]) -> Link:
    """The Link (bandwidth, latency) of the ring model that fits the samples best in least
    squares: seconds = steps * latency + bytes_sent / bandwidth."""
    rows = [(ring.latency_steps(s.kind, s.group_size),
             ring.bytes_sent(s.kind, s.nbytes, s.group_size), s.seconds) for s in samples]
    a = np.array([[steps, sent] for steps, sent, _ in rows], dtype=float)
    b = np.array([t for *_, t in rows], dtype=float)
    # relative error: a large message's seconds must not drown a small one's
    w = 1.0 / np.maximum(b, 1e-9)
    (latency, inv_bw), *_ = np.linalg.lstsq(a * w[:, None], b * w, rcond=None)
    if not inv_bw > 0:  # too noisy to see the bytes: the slowest sample's rate
        inv_bw = max(t / sent for _, sent, t in rows if sent > 0)
    return Link(bandwidth=float(1.0 / inv_bw), latency=float(max(latency, 0.0)))


def host_memory_bytes() -> int:
    """Physical memory of this host (bytes), for CPU devices."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_memory_bytes(device) -> int:
    """What the runtime lets one device allocate; on CPU the host's memory shared by its
    devices."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - not every runtime implements memory_stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory_bytes() // max(1, jax.local_device_count())


def crosses_hosts(mesh: jax.sharding.Mesh, axis: str) -> bool:
    """Whether some group of devices along `axis` spans more than one process."""
    i = mesh.axis_names.index(axis)
    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    return bool((procs != procs.take([0], axis=i)).any())


def measure_profile(mesh: jax.sharding.Mesh, *, name: str | None = None,
                    sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22), matmul: int = 1024,
                    repeats: int = 3, progress: Callable[[str], None] | None = None
                    ) -> Calibration:
    """Measure the devices of `mesh` (every axis of size > 1 gets its collectives timed) and
    return the profile the planner would use for this machine."""
    check_repeats(repeats)
    say = progress or (lambda _msg: None)
    device = mesh.devices.flat[0]
    backend = device.platform
    say(f"matmul throughput on {mesh.devices.size} {device.device_kind} devices")
    flops16 = matmul_flops(mesh, jnp.bfloat16, matmul, repeats)
    flops32 = matmul_flops(mesh, jnp.float32, matmul, repeats)
    say("memory bandwidth")
    bandwidth = memory_bandwidth(mesh, repeats=repeats)
    samples, links = [], {}
    for axis in mesh.axis_names:
        if mesh.shape[axis] < 2:
            continue
        say(f"collectives over {axis!r} ({mesh.shape[axis]} devices)")
        axis_samples = [time_collective(mesh, axis, kind, nbytes, repeats)
                        for kind in KINDS for nbytes in sizes]
        samples += axis_samples
        links[axis] = fit_link(axis_samples)
    intra = [links[a] for a in links if not crosses_hosts(mesh, a)]
    inter = [links[a] for a in links if crosses_hosts(mesh, a)]
    slowest = functools.partial(min, key=lambda link: link.bandwidth)
    notes = []
    if links:
        intra_link = slowest(intra) if intra else slowest(inter)
    else:
        # A profile needs links; with none timed it says so, in its source and in the notes
        # `shardplan profile` prints (tests/test_hardening.py).
        intra_link = UNMEASURED_LINK
        notes.append(f"links NOT measured: the mesh has no axis of 2 or more devices, so "
                     f"intra_host and inter_host are placeholders ({UNMEASURED_LINK.bandwidth:g}"
                     f" bytes/s, {UNMEASURED_LINK.latency:g} s), not this machine's; profile a "
                     "mesh of several devices (--devices N or --mesh) to measure them")
    inter_link = slowest(inter) if inter else intra_link
    kind = str(device.device_kind)
    profile = HardwareProfile(
        name=name or f"{kind.lower().replace(' ', '-')}-measured",
        peak_flops=flops16, peak_flops_f32=flops32,
        memory_bytes=device_memory_bytes(device),
        devices_per_host=jax.local_device_count(),
        intra_host=intra_link, inter_host=inter_link, mem_bandwidth=bandwidth,
        backend=backend if backend in ("tpu", "gpu", "cpu") else "gpu",
        forms_reduce_scatter=backend != "cpu",
        source=(f"measured by `shardplan profile` on {datetime.date.today().isoformat()}: "
                f"{mesh.devices.size} x {kind}, {jax.process_count()} process(es), "
                f"jax {jax.__version__}; "
                + (f"links fitted per axis {sorted(links)}" if links else
                   "links NOT measured (one device: placeholders)")))
    return Calibration(profile, tuple(samples), links, tuple(notes))


def profile_mesh(spec: str | None, devices: int) -> jax.sharding.Mesh:
    """The mesh to measure: `spec` as "2x4" (axes named by MeshShape's defaults), else one
    axis per process boundary (hosts x devices) or one axis over every device."""
    procs = jax.process_count()
    if spec:
        try:
            shape = tuple(int(s) for s in spec.lower().split("x"))
        except ValueError:
            raise ValueError(f"--mesh {spec!r}: give sizes joined by x, e.g. 2x4") from None
        if len(shape) == 2 and shape[0] == procs > 1:
            names = ("hosts", "devices")
        else:
            names = {1: ("devices",), 2: ("data", "model")}.get(
                len(shape), tuple(f"axis{i}" for i in range(len(shape))))
    elif procs > 1:
        shape, names = (procs, devices // procs), ("hosts", "devices")
    else:
        shape, names = (devices,), ("devices",)
    if math.prod(shape) != devices or min(shape) < 1:
        raise ValueError(f"--mesh {spec!r} has {math.prod(shape)} devices; "
                         f"this machine runs {devices}")
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
