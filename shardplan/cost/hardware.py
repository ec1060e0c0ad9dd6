"""Hardware profiles: per-device compute and memory, and the links that mesh axes run over.

Every bandwidth here is the *one-direction* rate a single device can push into a ring
collective along one mesh axis (bytes/s), the beta of the alpha-beta model; every latency is
the cost of one ring step (seconds), the alpha. Vendor figures quoted as "bidirectional" or
"total" are halved; links a device drives at once for one axis (both neighbours of a torus
ring) are added. Figures are peaks from public datasheets; each is cited where it is set.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardplan import files
from shardplan.strategies.spec import MeshShape

GiB = 2**30
MiB = 2**20
BACKENDS = ("tpu", "gpu", "cpu")


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link: bandwidth in bytes/s per device, one direction, as a ring collective
    sees it; latency in seconds per ring step."""

    bandwidth: float
    latency: float

    def __post_init__(self):
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(
                f"Link bandwidth must be a positive number of bytes/s, got {self.bandwidth!r}"
            )
        if not (self.latency >= 0 and math.isfinite(self.latency)):
            raise ValueError(f"Link latency must be >= 0 seconds, got {self.latency!r}")


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What the cost model knows about one kind of device and the cluster it sits in."""

    name: str
    peak_flops: float
    """Dense peak per device for 16-bit and narrower types (bf16 / fp16 / int8), flop/s."""
    peak_flops_f32: float
    """Dense peak per device for float32 matmuls at JAX's default precision, flop/s."""
    memory_bytes: int
    """Accelerator memory (HBM) per device."""
    devices_per_host: int
    """Devices that share the fast intra-host link; a mesh is laid out row-major over hosts."""
    intra_host: Link
    inter_host: Link
    mem_bandwidth: float
    """HBM bandwidth per device, bytes/s."""
    backend: str
    """"tpu", "gpu" or "cpu": which XLA backend compiles for it."""
    forms_reduce_scatter: bool
    """Whether XLA fuses all-reduce + slice into a reduce-scatter (GPU/TPU yes, CPU no)."""
    fast_memory_bytes: int = 0
    """On-chip memory per device the compiler holds a step's short-lived buffers in instead of
    HBM (a TPU core's VMEM; v4: CMEM), as much as its buffer assignment was seen to fill
    (intra/memory/fast_memory.py); 0: none."""
    source: str = ""
    """Where the figures come from (datasheets, papers)."""

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(
                f"profile {self.name!r}: backend must be one of {BACKENDS}, got {self.backend!r}"
            )
        for field in ("peak_flops", "peak_flops_f32", "memory_bytes", "mem_bandwidth"):
            value = getattr(self, field)
            # .inf flops would price every step at 0 s (tests/test_hardening.py)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not (value > 0 and math.isfinite(value))):
                raise ValueError(
                    f"profile {self.name!r}: {field} must be a positive number, not infinite "
                    f"or NaN, got {value!r}"
                )
        if (isinstance(self.fast_memory_bytes, bool) or not isinstance(self.fast_memory_bytes, int)
                or self.fast_memory_bytes < 0):
            raise ValueError(f"profile {self.name!r}: fast_memory_bytes must be an int >= 0, "
                             f"got {self.fast_memory_bytes!r}")
        if not isinstance(self.devices_per_host, int) or self.devices_per_host < 1:
            raise ValueError(
                f"profile {self.name!r}: devices_per_host must be an int >= 1, "
                f"got {self.devices_per_host!r}"
            )
        for field in ("intra_host", "inter_host"):
            if not isinstance(getattr(self, field), Link):
                raise TypeError(
                    f"profile {self.name!r}: {field} must be a Link, got {getattr(self, field)!r}"
                )

    # -- links ---------------------------------------------------------------------------

    def axis_links(
        self, mesh: MeshShape, device_order: Sequence[int] | None = None
    ) -> dict[str, Link]:
        """Which link each mesh axis runs over: intra_host if every group of devices along the
        axis sits on one host, else inter_host (a ring is as slow as its slowest hop).

        device_order: the global device ids in the mesh's row-major order (for a
        jax.sharding.Mesh, `[d.id for d in mesh.devices.flat]`); device id // devices_per_host
        is its host. Default: 0..n-1, so minor mesh axes stay inside a host.
        """
        n = mesh.num_devices
        if device_order is None:
            return {name: self.intra_host if self._one_host(mesh, i, n) else self.inter_host
                    for i, name in enumerate(mesh.names)}
        order = [int(d) for d in device_order]
        if len(order) != n:
            raise ValueError(f"device_order has {len(order)} devices, the mesh {mesh} has {n}")
        hosts = [d // self.devices_per_host for d in order]
        out = {}
        for i, (name, size) in enumerate(zip(mesh.names, mesh.sizes)):
            stride = math.prod(mesh.sizes[i + 1 :])
            inside = all(
                len({hosts[base + k * stride] for k in range(size)}) == 1
                for base in range(n)
                if (base // stride) % size == 0
            )
            out[name] = self.intra_host if inside else self.inter_host
        return out

    def _one_host(self, mesh: MeshShape, i: int, n: int) -> bool:
        """Whether every group along axis `i` of `mesh`, devices 0..n-1 in row-major order,
        sits on one host, in O(1) at any n (so a fixed mesh of a million devices plans:
        tests/test_hardening.py::test_a_fixed_mesh_of_a_million_devices_plans_in_seconds):
        a block of stride x size consecutive devices holds whole groups and its first and
        last device share a group's row span, so the groups stay inside hosts iff every
        block does (the loop of axis_links agrees on random meshes:
        tests/test_hardening.py::test_axis_links_closed_form_agrees_with_the_devices)."""
        size = mesh.sizes[i]
        block = math.prod(mesh.sizes[i:])
        dph = self.devices_per_host
        return size == 1 or n <= dph or (block <= dph and dph % block == 0)

    def flops_for(self, dtype: Any) -> float:
        """Peak flop/s of one device for arithmetic in `dtype` (a numpy/JAX dtype or its name).

        16-bit and narrower types run at peak_flops, 32-bit ones at peak_flops_f32, 64-bit ones
        at an eighth of that on accelerators (A100: 19.5 TFLOPS FP64 tensor core vs 156 TF32;
        H100: 66.9 vs 494.7; TPUs emulate f64) and at half of it on a CPU (vector width)."""
        name = _dtype_name(dtype)
        bits = _DTYPE_BITS.get(name)
        if bits is None:
            raise ValueError(
                f"flops_for: unknown dtype {dtype!r}; use a numeric dtype such as "
                f"{', '.join(sorted(_DTYPE_BITS))}"
            )
        if bits <= 16:
            return float(self.peak_flops)
        if bits <= 32:
            return float(self.peak_flops_f32)
        return float(self.peak_flops_f32) / (2 if self.backend == "cpu" else 8)

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def uniform(
        cls,
        bandwidth: float = 1e11,
        latency: float = 1e-6,
        *,
        name: str = "uniform",
        peak_flops: float = 1e14,
        peak_flops_f32: float | None = None,
        memory_bytes: int = 16 * GiB,
        mem_bandwidth: float = 1e12,
        devices_per_host: int = 1 << 20,
        backend: str = "gpu",
        forms_reduce_scatter: bool = True,
    ) -> HardwareProfile:
        """A made-up profile with one link everywhere (for tests and what-if studies)."""
        link = Link(bandwidth, latency)
        return cls(
            name=name,
            peak_flops=peak_flops,
            peak_flops_f32=peak_flops if peak_flops_f32 is None else peak_flops_f32,
            memory_bytes=memory_bytes,
            devices_per_host=devices_per_host,
            intra_host=link,
            inter_host=link,
            mem_bandwidth=mem_bandwidth,
            backend=backend,
            forms_reduce_scatter=forms_reduce_scatter,
            source="synthetic (HardwareProfile.uniform)",
        )

    @classmethod
    def two_level(
        cls,
        devices_per_host: int,
        *,
        intra_bandwidth: float = 1e11,
        inter_bandwidth: float = 1e10,
        intra_latency: float = 1e-6,
        inter_latency: float = 1e-5,
        name: str | None = None,
        **kwargs,
    ) -> HardwareProfile:
        """A made-up cluster of hosts of `devices_per_host` devices with fast links inside a host
        and slow links between hosts; other fields as in `uniform`."""
        base = cls.uniform(name=name or f"two-level-{devices_per_host}", **kwargs)
        return dataclasses.replace(
            base,
            devices_per_host=devices_per_host,
            intra_host=Link(intra_bandwidth, intra_latency),
            inter_host=Link(inter_bandwidth, inter_latency),
            source="synthetic (HardwareProfile.two_level)",
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the YAML / JSON form that from_dict reads back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "profile",
                  bases: tuple[str, ...] = ()) -> HardwareProfile:
        """From plain data with the same field names (links as {bandwidth, latency} maps).
        `base: <known profile or .yaml path>` starts from that profile (a path relative to the
        file `where`) and overrides the fields given; `bases` are the files whose `base:` led
        here, and naming one of them again is a cycle (a ValueError naming the files)."""
        data = dict(data)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - {"base"})
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {unknown}; allowed: {sorted(fields | {'base'})}"
            )
        if "base" in data:
            base = _relative_to(str(data.pop("base")), where)
            chain = (*bases, where)
            if os.path.isfile(base) and os.path.realpath(base) in map(os.path.realpath, chain):
                raise ValueError(f"{where}: `base: {base}` makes a cycle of profiles "
                                 f"({' -> '.join((*chain, base))}); name a profile that does "
                                 "not lead back here")
            start = get_profile(base, bases=chain).to_dict()
            start["source"] = ""
            start.update(data)
            data = start
        missing = sorted(fields - set(data) - {"source", "fast_memory_bytes"})
        if missing:
            raise ValueError(
                f"{where}: missing field(s) {missing} (or give `base: <profile name>`)"
            )
        try:
            for key in ("intra_host", "inter_host"):
                link = data[key]
                if not isinstance(link, Link):
                    if not isinstance(link, Mapping):
                        raise TypeError(f"{key} must be a mapping {{bandwidth, latency}}, "
                                         f"got {link!r:.60}")
                    extra = sorted(set(link) - {"bandwidth", "latency"})
                    if extra:
                        raise ValueError(
                            f"unknown link field(s) {extra}; allowed: bandwidth, latency"
                        )
                    data[key] = Link(_number(link["bandwidth"], f"{key}.bandwidth"),
                                     _number(link["latency"], f"{key}.latency"))
            for key in ("peak_flops", "peak_flops_f32", "mem_bandwidth"):
                data[key] = _number(data[key], key)
            data["memory_bytes"] = int(_number(data["memory_bytes"], "memory_bytes"))
            data["devices_per_host"] = int(_number(data["devices_per_host"], "devices_per_host"))
            data["forms_reduce_scatter"] = _boolean(data["forms_reduce_scatter"])
            if "fast_memory_bytes" in data:
                data["fast_memory_bytes"] = int(_number(data["fast_memory_bytes"],
                                                        "fast_memory_bytes"))
            data["name"] = str(data["name"])
            data["backend"] = str(data["backend"])
            data["source"] = str(data.get("source", ""))
            return cls(**data)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ValueError(f"{where}: {e}") from e


def _number(x: Any, field: str) -> float:
    # PyYAML reads "1e11" (no dot) as a string, so accept numeric strings too
    if isinstance(x, bool):
        raise TypeError(f"{field} must be a number, got {x!r}")
    try:
        value = float(x)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{field} must be a number, got {x!r:.60}") from None
    if not math.isfinite(value):  # YAML's .inf / .nan (tests/test_hardening.py)
        raise ValueError(f"{field} must be a finite number, got {x!r:.60}")
    return value


def _relative_to(base: str, where: str) -> str:
    """A relative .yaml `base` as a path from the directory of the profile file `where`."""
    if (base.endswith((".yaml", ".yml")) and not os.path.isabs(base)
            and where.endswith((".yaml", ".yml"))):
        return os.path.join(os.path.dirname(where), base)
    return base


def _boolean(x: Any) -> bool:
    if isinstance(x, bool):
        return x
    raise TypeError(f"forms_reduce_scatter must be true or false, got {x!r}")


_DTYPE_GROUPS = {
    4: "int4 uint4 float4_e2m1fn",
    8: "bool int8 uint8 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "float8_e4m3b11fnuz float8_e4m3 float8_e3m4 float8_e8m0fnu",
    16: "int16 uint16 bfloat16 float16",
    32: "int32 uint32 float32 complex64",
    64: "int64 uint64 float64 complex128",
}
_DTYPE_BITS = {name: bits for bits, names in _DTYPE_GROUPS.items() for name in names.split()}


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(getattr(dtype, "name", dtype))


# -- the profiles ---------------------------------------------------------------------------

# TPU v4, one slice (all chips on ICI; a chip is one JAX device).
#   Cloud TPU docs, "TPU v4": 275 TFLOPS per chip (bf16 or int8); 32 GiB HBM2 at 1200 GBps;
#   a host (tray) holds 4 chips in a 2x2x1 ICI mesh.
#   TPU v4 paper (Jouppi et al., ISCA 2023): 6 ICI links per chip (3D torus), 400 Gb/s =
#   50 GB/s per link per direction; a ring along one torus axis sends to both neighbours,
#   so 2 x 50 GB/s = 100 GB/s one direction per device.
#   JAX docs, "Matmul precision": float32 dots default to one bf16 pass on TPU -> f32 = bf16 peak.
#   Latency: ~1 us per ICI hop (order of magnitude, no datasheet figure).
_TPU_V4_ICI = Link(bandwidth=2 * 50e9, latency=1e-6)
# TPU v5e: Cloud TPU docs, "TPU v5e": 197 TFLOPS bf16 per chip; 16 GB HBM2 at 819 GBps;
#   bidirectional ICI 400 GBps per chip over 4 ports (2D torus) = 50 GB/s per port per
#   direction; a ring along one axis uses 2 ports -> 100 GB/s; 8 chips per host.
_TPU_V5E_ICI = Link(bandwidth=2 * 50e9, latency=1e-6)
# TPU v5p: Cloud TPU docs, "TPU v5p": 459 TFLOPS bf16 per chip; 95 GiB HBM2e at 2765 GBps;
#   bidirectional ICI 1200 GBps per chip over 6 ports (3D torus) = 100 GB/s per port per
#   direction; a ring along one axis uses 2 ports -> 200 GB/s; 4 chips per host (2x2x1).
_TPU_V5P_ICI = Link(bandwidth=2 * 100e9, latency=1e-6)
# TPU v6e (Trillium): Cloud TPU docs, "TPU v6e": 918 TFLOPS bf16 per chip; 32 GB HBM at 1640
#   GBps; bidirectional ICI 800 GBps per chip over 4 ports (2D torus) = 100 GB/s per port per
#   direction; a ring along one axis uses 2 ports -> 200 GB/s; 8 chips per host.
_TPU_V6E_ICI = Link(bandwidth=2 * 100e9, latency=1e-6)
# A100 80GB SXM: NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 156 TFLOPS TF32 dense (JAX's
#   default f32 matmul precision uses TF32 on Ampere, JAX docs "Matmul precision"); 80 GB
#   HBM2e at 2039 GB/s; NVLink 3 + NVSwitch: 600 GB/s total per GPU = 300 GB/s per direction.
#   DGX A100 datasheet: 8 GPUs per node, 8x single-port ConnectX-6 HDR 200 Gb/s InfiniBand
#   (one per GPU) = 25 GB/s per GPU per direction.
#   Latencies: ~2 us per NVLink ring step, ~5 us per InfiniBand step (NCCL order of magnitude).
_A100_NVLINK = Link(bandwidth=300e9, latency=2e-6)
_A100_IB = Link(bandwidth=200e9 / 8, latency=5e-6)
# H100 80GB SXM5: NVIDIA H100 datasheet: 1979 TFLOPS bf16 *with sparsity* -> 989.4 dense;
#   TF32 494.7 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 4: 900 GB/s total per GPU = 450 GB/s per
#   direction. DGX H100 datasheet: 8 GPUs per node, 8x ConnectX-7 NDR 400 Gb/s (one per GPU)
#   = 50 GB/s per GPU per direction.
_H100_NVLINK = Link(bandwidth=450e9, latency=2e-6)
_H100_IB = Link(bandwidth=400e9 / 8, latency=5e-6)
# CPU: the test machine, where 8 virtual XLA devices share one process. Nominal figures (only
#   byte counts are compared on it, never times): 2 cores x 2.6 GHz x 64 f32 flop/cycle
#   (2 AVX-512 FMA units) = 333 GFLOP/s shared by 8 devices; XLA:CPU computes bf16 in f32.
#   "Links" are memcpy in shared memory, ~20 GB/s shared by 8 devices.
_CPU_MEMCPY = Link(bandwidth=20e9 / 8, latency=1e-5)

_SOURCES = {
    "tpu-v4": "Cloud TPU docs 'TPU v4'; Jouppi et al., 'TPU v4: An Optically Reconfigurable "
              "Supercomputer for Machine Learning', ISCA 2023; JAX docs 'Matmul precision'",
    "tpu-v5e": "Cloud TPU docs 'TPU v5e'; JAX docs 'Matmul precision'",
    "tpu-v5p": "Cloud TPU docs 'TPU v5p'; JAX docs 'Matmul precision'",
    "tpu-v6e": "Cloud TPU docs 'TPU v6e'; JAX docs 'Matmul precision'",
    "a100-80gb": "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); NVIDIA DGX A100 datasheet; "
                 "JAX docs 'Matmul precision'",
    "h100-80gb": "NVIDIA H100 Tensor Core GPU datasheet (SXM5); NVIDIA DGX H100 datasheet; "
                 "JAX docs 'Matmul precision'",
    "cpu": "nominal figures for the 2-core Xeon test VM shared by 8 XLA:CPU devices",
}

# One row per profile, in HardwareProfile's field order: name, peak_flops (bf16),
# peak_flops_f32, memory_bytes, devices_per_host, intra_host, inter_host, mem_bandwidth,
# backend, forms_reduce_scatter (XLA:CPU keeps all-reduce + slice: JAX-NOTES),
# fast_memory_bytes. On TPU v4 one slice's torus spans hosts (DCN only between slices), so both
# links are ICI. fast_memory_bytes: the most the TPU compiler (libtpu 0.0.42.1) placed in a
# core's on-chip memory space, read off its buffer assignment (--xla_dump_to) for the
# gradient of 96 chained 4 MiB f32 layers on one chip of each generation (the same with 16 MiB
# layers gave v5e and v4 the same, v5p 32 MiB and v6e 88): v5e 112 MiB and v6e 92 of their
# 128 MiB of VMEM, v5p 44, v4 64 (color 3: its CMEM).
_ROWS = (
    ("tpu-v4", 275e12, 275e12, 32 * GiB, 4, _TPU_V4_ICI, _TPU_V4_ICI, 1200e9, "tpu", True,
     64 * MiB),
    ("tpu-v5e", 197e12, 197e12, 16 * GiB, 8, _TPU_V5E_ICI, _TPU_V5E_ICI, 819e9, "tpu", True,
     112 * MiB),
    ("tpu-v5p", 459e12, 459e12, 95 * GiB, 4, _TPU_V5P_ICI, _TPU_V5P_ICI, 2765e9, "tpu", True,
     44 * MiB),
    ("tpu-v6e", 918e12, 918e12, 32 * GiB, 8, _TPU_V6E_ICI, _TPU_V6E_ICI, 1640e9, "tpu", True,
     92 * MiB),
    ("a100-80gb", 312e12, 156e12, 80 * GiB, 8, _A100_NVLINK, _A100_IB, 2039e9, "gpu", True, 0),
    ("h100-80gb", 989.4e12, 494.7e12, 80 * GiB, 8, _H100_NVLINK, _H100_IB, 3.35e12, "gpu", True,
     0),
    ("cpu", 333e9 / 8, 333e9 / 8, 2 * GiB, 8, _CPU_MEMCPY, _CPU_MEMCPY, 20e9 / 8, "cpu", False,
     0),
)

PROFILES: dict[str, HardwareProfile] = {
    row[0]: HardwareProfile(*row, source=_SOURCES[row[0]]) for row in _ROWS}


def get_profile(name_or_path: str | os.PathLike, *, bases: tuple[str, ...] = ()
                ) -> HardwareProfile:
    """A known profile by name, or one loaded from a YAML file with HardwareProfile's fields
    (`bases`: the profile files whose `base:` named this one, see HardwareProfile.from_dict)."""
    key = os.fspath(name_or_path)
    if key in PROFILES:
        return PROFILES[key]
    if key.endswith((".yaml", ".yml")) or os.path.isfile(key):
        if not os.path.isfile(key):
            raise FileNotFoundError(f"hardware profile file {key!r} does not exist")
        data = files.load_yaml(key, "hardware profile")  # FileError names the file
        if not isinstance(data, Mapping):
            raise ValueError(f"{key}: a hardware profile file must hold a mapping of fields")
        return HardwareProfile.from_dict(data, where=key, bases=bases)
    raise ValueError(
        f"unknown hardware profile {key!r}; known: {', '.join(sorted(PROFILES))} "
        "(or give the path of a .yaml file with the same fields)"
    )
