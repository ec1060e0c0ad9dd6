"""Compile-only GPU devices: the real XLA:GPU compiler, without a GPU.

JAX's CUDA plugin (jax-cuda12-plugin or jax-cuda13-plugin, with its jax-cudaNN-pjrt; `pip
install "jax[cuda12]==<jax version>"`) makes compile-only devices of a GPU cluster from a
GpuTargetConfig textproto that describes the GPU. XLA keeps such specs in its source tree
(xla/backends/gpu/target_config/specs/), no wheel ships them: the ones shardplan's GPU profiles
need are copied in gpu_specs/ (Apache-2.0, origin in each file's header). `jax.jit(f).lower(...)
.compile()` on a mesh of these devices runs the XLA:GPU pipeline, nothing runs on a GPU:
`memory_analysis()` and `as_text()` are the GPU program's (bf16 kept, reduce-scatters formed,
async collectives), `cost_analysis()` is empty. The NVIDIA wheels `jax[cuda12]` pulls (cuDNN,
cuBLAS, NCCL...) are not needed to compile (tests/test_gpu_target.py runs without them).

Without a GPU the plugin's CUDA check (cuInit) fails when JAX loads its plugins, and JAX then
knows no "cuda" topology, unless JAX_PLATFORMS leaves cuda out (JAX_PLATFORMS=cpu) or
JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1; either must be set before JAX loads its plugins (its first
device use or topology; safest: before importing jax).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import os
import warnings

import jax
import numpy as np

from shardplan.strategies.spec import MeshShape

# The GpuTargetConfig spec of each GPU profile (shardplan.cost.hardware), in gpu_specs/.
SPECS = {"a100-80gb": "a100_sxm_80.txtpb", "h100-80gb": "h100_sxm.txtpb"}

# (plugin, its PJRT library) distributions, in the order jax's CUDA plugin looks for them.
PLUGINS = (("jax-cuda13-plugin", "jax-cuda13-pjrt"), ("jax-cuda12-plugin", "jax-cuda12-pjrt"))

ENVIRONMENT_HINT = ("set JAX_PLATFORMS=cpu (or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1) before "
                    "importing jax: without a GPU the CUDA plugin's CUDA check fails and JAX "
                    "does not load it")


class GpuTargetError(ValueError):
    """A GPU target the compiler cannot be asked for: an unknown profile, a cluster shape
    that makes no topology, or the CUDA plugin missing or not loaded."""


def install_hint() -> str:
    """How to install the CUDA plugin that matches the installed jax."""
    return (f'pip install "jax[cuda12]=={jax.__version__}" brings the CUDA plugin, XLA:GPU '
            "(the NVIDIA wheels it pulls, about 4 GB, are not needed to compile: "
            f'"jax[cuda12-local]=={jax.__version__}" leaves them out)')


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def plugin_version() -> str | None:
    """The installed CUDA plugin's version (jax-cuda12-plugin or jax-cuda13-plugin, with its
    PJRT library), or None when no CUDA plugin is installed."""
    for plugin, pjrt in PLUGINS:
        version = _version(plugin)
        if version is not None and _version(pjrt) is not None:
            return version
    return None


def spec_text(profile_name: str) -> str:
    """The GpuTargetConfig textproto of the GPU of `profile_name`."""
    if profile_name not in SPECS:
        raise GpuTargetError(
            f"no GPU compiler target for the profile {profile_name!r}: XLA:GPU is asked for "
            f"{', '.join(sorted(SPECS))} (their specs are in shardplan/analysis/gpu_specs/)")
    spec = importlib.resources.files("shardplan.analysis").joinpath("gpu_specs",
                                                                     SPECS[profile_name])
    return spec.read_text(encoding="utf-8")


def topology(num_devices: int, devices_per_host: int) -> str:
    """The CUDA plugin's topology of `num_devices` GPUs on hosts of `devices_per_host`:
    "<partitions>x<hosts>x<devices per host>", one partition ("1x2x8" for 16 GPUs, 8 a host;
    "1x1x4" for 4 GPUs of one host). Device i is on host i // devices_per_host, as
    HardwareProfile places them."""
    if num_devices < 1 or devices_per_host < 1:
        raise GpuTargetError(f"{num_devices} GPUs on hosts of {devices_per_host} make no "
                             "cluster: both must be at least 1")
    if num_devices <= devices_per_host:
        return f"1x1x{num_devices}"
    if num_devices % devices_per_host:
        raise GpuTargetError(
            f"{num_devices} GPUs do not fill hosts of {devices_per_host}: a cluster past one "
            f"host is whole hosts ({devices_per_host}, {2 * devices_per_host}, "
            f"{4 * devices_per_host}, ... GPUs)")
    return f"1x{num_devices // devices_per_host}x{devices_per_host}"


@functools.cache
def _topology(profile_name: str, shape: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="cuda", topology=shape,
                                        target_config=spec_text(profile_name))


def gpu_devices(profile_name: str, num_devices: int, devices_per_host: int) -> list:
    """Compile-only devices of `num_devices` GPUs of `profile_name` ("a100-80gb",
    "h100-80gb") on hosts of `devices_per_host`, in id order (device i on host
    i // devices_per_host). Raises GpuTargetError saying what to install or set."""
    spec_text(profile_name)  # an unknown profile is told first, whatever is installed
    shape = topology(num_devices, devices_per_host)
    version = plugin_version()
    if version is None:
        raise GpuTargetError(f"compiling for {profile_name} takes XLA:GPU, the CUDA plugin, "
                             f"which is not installed: {install_hint()}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return list(_topology(profile_name, shape).devices)
    except NotImplementedError:  # jax: "topology not implemented for cuda"
        raise GpuTargetError(
            f"the CUDA plugin {version} is installed but JAX did not load it "
            f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}): "
            f"{ENVIRONMENT_HINT}") from None
    except Exception as e:  # noqa: BLE001 - the plugin's own error, told in the user's terms
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GpuTargetError(
            f"the CUDA plugin {version} gives no {profile_name} devices for topology {shape!r} "
            f"({first}); a spec it fails to parse names the unknown field in its log (a spec "
            f"newer than the plugin: drop the field from gpu_specs/{SPECS[profile_name]})"
        ) from None


def gpu_mesh(profile_name: str, mesh_shape: MeshShape,
             devices_per_host: int) -> jax.sharding.Mesh:
    """An Auto-axes mesh of compile-only GPUs of `profile_name` in `mesh_shape`, devices in id
    order (the last axis varies fastest: inside a host first, as HardwareProfile assumes)."""
    devices = gpu_devices(profile_name, mesh_shape.num_devices, devices_per_host)
    return jax.sharding.Mesh(np.asarray(devices).reshape(mesh_shape.sizes), mesh_shape.names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh_shape.sizes))


def why_not_gpu(profile_name: str) -> str:
    """Why XLA:GPU cannot compile for `profile_name` here ("" when it can): the first error
    gpu_devices gives for one GPU."""
    try:
        gpu_devices(profile_name, 1, 1)
    except GpuTargetError as e:
        return str(e)
    return ""
