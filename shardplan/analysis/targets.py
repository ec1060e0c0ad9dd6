"""Where a plan's programs are compiled, and by which compiler.

A plan is judged by the compiler its user runs. For a TPU profile, with libtpu installed
(`pip install "shardplan[tpu]"`), programs are compiled by the real TPU compiler on compile-only
devices of the slice's topology (deviceless AOT, as MaxText's train_compile.py does: nothing
runs, `memory_analysis()` is the chip's own and a program past HBM fails to compile). Otherwise
XLA:CPU on CPU devices stands in, and `Compiler.stands_in` says so: it forms no
reduce-scatter, and where it widens bf16 to f32 (`xla_cpu_widens`: jax 0.10's does, jax 0.12's
does not) `on_target` scales its temporaries back.

A TPU slice of n chips is the topology the Cloud TPU docs give for n chips (`topology_name`):
v5e and v6e are 2-D (v5e:2x4 for 8), v5p 3-D (v5p:2x2x2 for 8). TPU v4's compile-only
devices are TensorCores, not megacore chips (libtpu 0.0.42.1: "Creating meshes for TPU >v3
requires one device per chip"), so v4 plans are compiled by XLA:CPU
(tests/test_targets.py::test_v4_is_compiled_on_cpu_and_says_why).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import math
import os
import re
import warnings

import jax
import numpy as np

from shardplan.analysis import gpu_target, hlo
from shardplan.cost.hardware import HardwareProfile
from shardplan.strategies.spec import MeshShape

# The TPU generations the TPU compiler is asked for, by profile: (topology prefix, dimensions
# of its torus). tpu-v4 is left out: see the module docstring.
TPU_GENERATIONS = {"tpu-v5e": ("v5e", 2), "tpu-v6e": ("v6e", 2), "tpu-v5p": ("v5p", 3)}

INSTALL_HINT = ('pip install "shardplan[tpu]" (or pip install "jax[tpu]==<your jax version>") '
                "brings libtpu, the TPU compiler")


class TargetError(ValueError):
    """A target the compiler cannot be asked for (a topology it does not know)."""


@dataclasses.dataclass(frozen=True)
class Compiler:
    """Which compiler judged a plan: `platform` is "tpu" (the TPU compiler, `version` libtpu's)
    or "cpu" (XLA:CPU, jaxlib's); `target` the profile the plan is for; `topology` the TPU
    slice compiled for ("" on CPU); `reason` why XLA:CPU stands in for a TPU or GPU target."""

    platform: str
    device_kind: str
    version: str
    target: str
    topology: str = ""
    reason: str = ""

    @property
    def stands_in(self) -> bool:
        """XLA:CPU compiling for an accelerator (its memory and collectives are not the
        target's: bf16 widened to f32, no reduce-scatter)."""
        return self.platform == "cpu" and self.target_backend != "cpu"

    @property
    def target_backend(self) -> str:
        return self.target.split(":", 1)[0]

    def describe(self) -> str:
        if self.platform == "gpu" and self.topology:
            return (f"XLA:GPU (jax CUDA plugin {self.version}, {self.device_kind}, "
                    f"topology {self.topology})")
        if self.platform == "tpu":
            return (f"the TPU compiler (libtpu {self.version}, {self.device_kind}, "
                    f"topology {self.topology})")
        text = f"XLA:CPU (jaxlib {self.version})"
        if self.stands_in:
            text += f" standing in for {self.target.split(':', 1)[1]}"
            if self.reason:
                text += f": {self.reason}"
        return text


def libtpu_version() -> str | None:
    """The installed libtpu's version, or None when the TPU compiler is not installed."""
    if importlib.util.find_spec("libtpu") is None:
        return None
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def topology_name(hw: HardwareProfile, num_devices: int) -> str:
    """The Cloud TPU topology of `num_devices` chips of `hw`'s generation ("v5e:2x4" for 8
    v5e chips): a torus as square as the count allows, the larger sides last."""
    if hw.name not in TPU_GENERATIONS:
        raise TargetError(f"no TPU topology for the profile {hw.name!r}; the TPU compiler is "
                          f"asked for {', '.join(sorted(TPU_GENERATIONS))}")
    prefix, dims = TPU_GENERATIONS[hw.name]
    if num_devices < 1 or num_devices & (num_devices - 1):
        raise TargetError(
            f"{num_devices} {hw.name} chips make no TPU slice: a slice has a power of two "
            f"chips ({', '.join(known_topologies(hw))}, ...)")
    sides = [1] * dims
    for _ in range(int(math.log2(num_devices))):
        sides[sides.index(min(sides))] *= 2  # grow the smallest side: 2x2x1 -> 2x2x2 -> 2x2x4
    sides.sort()
    if dims == 3 and num_devices < 8:
        sides = sides[1:] + sides[:1]  # v5p's small slices are 2x2x1, 2x1x1
    return f"{prefix}:{'x'.join(map(str, sides))}"


def known_topologies(hw: HardwareProfile) -> list[str]:
    """Topologies of `hw`'s generation, 4 to 256 chips (for error messages)."""
    return [topology_name(hw, 2**k) for k in range(2, 9)]


@functools.cache
def _topology(name: str):
    from jax.experimental import topologies

    # Compile-only devices run nothing: another process compiling for a TPU (a test worker, a
    # second planner) may hold libtpu too, which it refuses without this.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    sides = [int(s) for s in name.split(":")[1].split("x")]
    # A slice smaller than a host (v5e:1x1) names its host's bounds itself.
    kw = {"chips_per_host_bounds": (*sides, 1)[:3]} if math.prod(sides) < 4 else {}
    return topologies.get_topology_desc(topology_name=name, platform="tpu", **kw)


def tpu_devices(hw: HardwareProfile, num_devices: int) -> list:
    """Compile-only devices of the TPU slice of `num_devices` chips of `hw`."""
    if libtpu_version() is None:
        raise TargetError(f"compiling for {hw.name} takes the TPU compiler: {INSTALL_HINT}")
    name = topology_name(hw, num_devices)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return list(_topology(name).devices)
    except Exception as e:  # noqa: BLE001 - libtpu's own error, told in the user's terms
        raise TargetError(
            f"the TPU compiler does not know the topology {name!r} ({str(e).splitlines()[0]}); "
            f"known: {', '.join(known_topologies(hw))}") from None


def tpu_mesh(hw: HardwareProfile, mesh_shape: MeshShape) -> jax.sharding.Mesh:
    """An Auto-axes mesh of compile-only devices of `hw`'s TPU slice in `mesh_shape`, laid
    out over the torus as jax's mesh_utils lays a slice's devices (rings along each axis); a
    mesh axis that is no product of the torus' axes (8 x 8 on v5p's 4x4x4) splits a torus
    axis, as MaxText allows (tests/test_targets.py::test_a_mesh_axis_may_split_a_torus_axis)."""
    from jax.experimental import mesh_utils

    devices = tpu_devices(hw, mesh_shape.num_devices)
    try:
        grid = mesh_utils.create_device_mesh(mesh_shape.sizes, devices)
    except NotImplementedError:  # "Failed to find assignment for logical_axis_index ..."
        grid = mesh_utils.create_device_mesh(mesh_shape.sizes, devices,
                                             allow_split_physical_axes=True)
    return jax.sharding.Mesh(grid, mesh_shape.names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_shape.sizes))


def cpu_mesh(mesh_shape: MeshShape) -> jax.sharding.Mesh:
    """An Auto-axes mesh of CPU devices standing in for the cluster, to compile programs on."""
    devices = jax.devices("cpu")
    n = mesh_shape.num_devices
    if len(devices) < n:
        raise ValueError(
            f"compiling for the cluster takes {n} CPU devices standing in for it, and JAX runs "
            f"{len(devices)}: call jax.config.update('jax_num_cpu_devices', {n}) before JAX "
            "first touches a device, or pass measure=False")
    return jax.sharding.Mesh(np.asarray(devices[:n]).reshape(mesh_shape.sizes), mesh_shape.names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_shape.sizes))


def why_not_tpu(hw: HardwareProfile) -> str:
    """Why XLA:CPU compiles for `hw` ("" when the TPU or GPU compiler does)."""
    if hw.backend == "gpu":
        return gpu_target.why_not_gpu(hw.name)
    if hw.backend != "tpu":
        return ""
    if hw.name not in TPU_GENERATIONS:
        return (f"the TPU compiler's compile-only {hw.name} devices are TensorCores, not "
                "chips (docs/hardware.md)")
    if libtpu_version() is None:
        return f"libtpu is not installed: {INSTALL_HINT}"
    return ""


def compile_mesh(hw: HardwareProfile, mesh_shape: MeshShape, device_mesh=None
                 ) -> tuple[jax.sharding.Mesh, Compiler]:
    """Where to compile a plan for `hw` on `mesh_shape`, and by which compiler: compile-only
    devices of the TPU slice when `hw` is a TPU the TPU compiler is installed for, or of the
    GPU cluster when `hw` is a GPU and JAX's CUDA plugin is installed (analysis/gpu_target.py),
    whatever devices the user's mesh holds; else `device_mesh` (the user's devices), else CPU
    devices standing in. Falling back to XLA:CPU for a TPU warns once."""
    reason = why_not_tpu(hw)
    if hw.backend == "tpu" and not reason:
        mesh = tpu_mesh(hw, mesh_shape)
        device = mesh.devices.flat[0]
        return mesh, Compiler("tpu", device.device_kind, libtpu_version() or "",
                              f"tpu:{hw.name}", topology_name(hw, mesh_shape.num_devices))
    if hw.backend == "gpu" and not reason:
        mesh = gpu_target.gpu_mesh(hw.name, mesh_shape, hw.devices_per_host)
        device = mesh.devices.flat[0]
        return mesh, Compiler("gpu", device.device_kind, gpu_target.plugin_version() or "",
                              f"gpu:{hw.name}", gpu_target.topology(
                                  mesh_shape.num_devices, hw.devices_per_host))
    mesh = device_mesh if device_mesh is not None else cpu_mesh(mesh_shape)
    platform = np.asarray(mesh.devices).flat[0].platform
    if platform != "cpu":  # the user's own accelerators compile for themselves
        device = np.asarray(mesh.devices).flat[0]
        return mesh, Compiler(platform, device.device_kind, jax.__version__,
                              f"{hw.backend}:{hw.name}")
    if reason and hw.backend == "tpu":
        warnings.warn(f"shardplan: plans for {hw.name} are compiled by XLA:CPU, not the TPU "
                      f"compiler: {reason}", stacklevel=3)
    return mesh, Compiler("cpu", "cpu", jax.__version__, f"{hw.backend}:{hw.name}",
                          reason=reason)


# The TPU compiler refuses a program past HBM: "RESOURCE_EXHAUSTED: Ran out of memory on HBM,
# the total memory required for HLO temporaries (35.16G) exceeds available HBM (15.75G).", or,
# when its memory space assignment runs out (Llama2-70B on v5e 16x16), "RESOURCE_EXHAUSTED:
# E1000: CompileTimeHbmOom: ... Ran out of memory in memory space hbm. Used 16.21G of 15.75G
# hbm."
_HBM_REFUSALS = (
    re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\).*?available HBM \(([\d.]+)([KMGT])\)",
               re.DOTALL),
    re.compile(r"RESOURCE_EXHAUSTED.*?Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", re.DOTALL),
)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def hbm_refusal(message: str) -> tuple[float, float] | None:
    """(bytes the program needs, bytes the chip has) from the TPU compiler's refusal of a
    program past HBM, or None for any other error
    (tests/test_targets.py::test_a_program_past_hbm_is_refused_and_never_said_to_fit)."""
    for pattern in _HBM_REFUSALS:
        m = pattern.search(message)
        if m is not None:
            return float(m[1]) * _UNITS[m[2]], float(m[3]) * _UNITS[m[4]]
    return None


# -- what XLA:CPU holds that the target would not ---------------------------------------------


def widens(mesh, hw: HardwareProfile) -> bool:
    """Whether programs compiled on `mesh` hold narrow floats wider than `hw` would: CPU
    devices standing in for a GPU or TPU, where the XLA:CPU in use computes bf16 in f32
    (xla_cpu_widens: jax 0.10's does, jax 0.12's keeps bf16)."""
    devices = getattr(mesh, "devices", None)
    if hw.backend == "cpu" or devices is None:
        return False
    return all(d.platform == "cpu" for d in np.asarray(devices).flat) and xla_cpu_widens()


_PROBE_SIDE = 128


@functools.cache
def xla_cpu_widens() -> bool:
    """Whether the XLA:CPU in use holds a bf16 step's intermediates in f32, from one small
    compile (cached): a bf16 `tanh(x @ w) @ w` holds its temporary wider than bf16. jax
    0.10.2's XLA:CPU normalises bf16 ops to f32 (the temporary 196608 bytes for 32768 of bf16);
    jax 0.12's runs the dots and the fusion in bf16 (32768 bytes)
    (tests/test_memory_fit.py::test_the_widening_probe_says_what_xla_cpu_does)."""
    side = _PROBE_SIDE
    x = jax.ShapeDtypeStruct((side, side), jax.numpy.bfloat16)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    compiled = jax.jit(lambda x, w: jax.numpy.tanh(x @ w) @ w, in_shardings=sharding,
                       out_shardings=sharding).lower(x, x).compile()
    # tanh(x @ w) is the one temporary: side * side * 2 bytes held as bf16 (jax 0.12's
    # XLA:CPU), six times that with the dots and tanh run in f32 (jax 0.10's)
    return compiled.memory_analysis().temp_size_in_bytes > side * side * 2


def on_target(stats: hlo.ProgramStats, mesh, hw: HardwareProfile,
              widening: float) -> hlo.ProgramStats:
    """The compiled peak as `hw` would hold it: arguments and outputs as compiled (their
    dtypes are the step's), the temporaries scaled by `widening` where XLA:CPU widened them
    (shardplan.intra.memory.liveness.cpu_widening models the share the target keeps)."""
    if widening >= 1.0 or not widens(mesh, hw):
        return stats
    peak = (stats.argument_bytes + stats.output_bytes - stats.alias_bytes
            + int(np.ceil(stats.temp_bytes * widening)))
    return dataclasses.replace(stats, peak_bytes=peak)
