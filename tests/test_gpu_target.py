"""XLA:GPU without a GPU (shardplan/analysis/gpu_target.py): compile-only H100s compile a
sharded step as a GPU would hold it (bf16 kept, reduce-scatters formed), and each way of not
getting there says what to do. The compiling tests are skipped without the CUDA plugin
(`pip install "jax[cuda12]==<jax version>"`, about 1.1 GB without the NVIDIA wheels; not in CI).
conftest.py sets JAX_PLATFORMS=cpu, which the plugin needs without a GPU."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.analysis import gpu_target, hlo
from shardplan.cost.hardware import PROFILES
from shardplan.strategies.spec import MeshShape

BF16 = 2  # bytes
MESH = MeshShape(("data", "model"), (2, 4))

needs_plugin = pytest.mark.skipif(
    gpu_target.plugin_version() is None,
    reason='the CUDA plugin is not installed: pip install "jax[cuda12]==<jax version>"')


@pytest.fixture(scope="module")
def h100_2x4():
    """A 2x4 (data, model) mesh of compile-only H100s on one host of 8."""
    return gpu_target.gpu_mesh("h100-80gb", MESH, 8)


def _compile(mesh, f, args, out=None):
    """Compile f for bf16 abstract args given as (shape, spec) on `mesh`."""
    structs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
               for shape, spec in args]
    out = None if out is None else NamedSharding(mesh, out)
    return jax.jit(f, out_shardings=out).lower(*structs).compile()


def _fsdp_step(w, x):
    """One SGD step of a tanh layer with weights and batch sharded over all 8 devices."""
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    return w - 1e-3 * jax.grad(loss)(w, x)


K, B = 256, 64  # weight K x K, batch B x K
FSDP = P(("data", "model"))


# -- without compiling (any install) -----------------------------------------------------------


def test_every_spec_is_a_gpu_profile_and_loads():
    for name, file in gpu_target.SPECS.items():
        assert PROFILES[name].backend == "gpu"
        text = gpu_target.spec_text(name)
        assert "gpu_device_info {" in text and "Apache License" in text, file


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(gpu_target.GpuTargetError, match="'tpu-v5e'.*a100-80gb, h100-80gb"):
        gpu_target.gpu_devices("tpu-v5e", 8, 8)
    assert "a100-80gb, h100-80gb" in gpu_target.why_not_gpu("b200")


def test_no_plugin_says_what_to_install(monkeypatch):
    monkeypatch.setattr(gpu_target, "plugin_version", lambda: None)
    with pytest.raises(gpu_target.GpuTargetError,
                       match=rf'pip install "jax\[cuda12\]=={jax.__version__}"'):
        gpu_target.gpu_devices("h100-80gb", 8, 8)
    assert "not installed" in gpu_target.why_not_gpu("a100-80gb")


@pytest.mark.parametrize("n, per_host, shape", [(8, 8, "1x1x8"), (4, 8, "1x1x4"),
                                                (16, 8, "1x2x8"), (64, 8, "1x8x8")])
def test_topology(n, per_host, shape):
    assert gpu_target.topology(n, per_host) == shape


def test_partial_hosts_make_no_topology():
    with pytest.raises(gpu_target.GpuTargetError, match="12 GPUs do not fill hosts of 8"):
        gpu_target.gpu_devices("h100-80gb", 12, 8)


# -- compiling on compile-only GPUs (the CUDA plugin) ------------------------------------------


@needs_plugin
@pytest.mark.parametrize("profile, kind", [("a100-80gb", "NVIDIA A100-SXM4-80GB"),
                                           ("h100-80gb", "NVIDIA H100 80GB HBM3")])
def test_devices_are_the_profiles_gpus_on_its_hosts(profile, kind):
    assert gpu_target.why_not_gpu(profile) == ""
    devices = gpu_target.gpu_devices(profile, 16, 8)
    assert [d.id for d in devices] == list(range(16))
    assert [d.process_index for d in devices] == [i // 8 for i in range(16)]
    assert {(d.platform, d.device_kind) for d in devices} == {("gpu", kind)}


@needs_plugin
def test_fsdp_step_gathers_and_reduce_scatters_in_bf16(h100_2x4):
    """XLA:GPU gathers the bf16 weight and reduce-scatters its bf16 gradient; XLA:CPU would
    all-reduce an f32 gradient (JAX-NOTES.md)."""
    c = _compile(h100_2x4, _fsdp_step, [((K, K), FSDP), ((B, K), FSDP)])
    assert "reduce-scatter-start" in c.as_text()
    stats = hlo.analyze(c)
    assert stats.platform == "gpu"
    assert sorted(op.kind for op in stats.collectives) == ["all-gather", "reduce-scatter"]
    for op in stats.collectives:
        assert (op.nbytes, op.dtypes, op.group_size) == (K * K * BF16, ("bfloat16",), 8)
        assert op.bytes_sent == 7 / 8 * K * K * BF16


@needs_plugin
def test_sharded_contraction_scattered_by_rows_is_a_reduce_scatter(h100_2x4):
    m = 512
    c = _compile(h100_2x4, lambda a, b: a @ b,
                 [((m, m), P(None, "model")), ((m, m), P("model", None))], P("model", None))
    (op,) = hlo.analyze(c).collectives
    assert (op.kind, op.nbytes, op.shapes) == ("reduce-scatter", m * m * BF16, ((m // 4, m),))
    assert op.groups == ((0, 1, 2, 3), (4, 5, 6, 7))


@needs_plugin
def test_memory_is_held_in_bf16(h100_2x4):
    """Arguments and outputs are their bf16 shards; the temporaries hold the gathered weight
    in bf16 (an f32 copy alone would be K * K * 4 bytes)."""
    mem = _compile(h100_2x4, _fsdp_step, [((K, K), FSDP), ((B, K), FSDP)]).memory_analysis()
    assert mem.argument_size_in_bytes == (K * K + B * K) // 8 * BF16
    assert mem.output_size_in_bytes == K * K // 8 * BF16
    assert K * K * BF16 <= mem.temp_size_in_bytes < K * K * 4


@needs_plugin
def test_plugin_refused_without_jax_platforms_cpu():
    """Without JAX_PLATFORMS=cpu the plugin's CUDA check fails (no GPU) and the error says
    what to set; on a machine with a working CUDA there is nothing to refuse."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")}
    code = ("from shardplan.analysis import gpu_target\n"
            "print('WHY:' + gpu_target.why_not_gpu('h100-80gb'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    why = out.split("WHY:", 1)[1].strip()
    if not why:
        pytest.skip("the CUDA plugin loads here without JAX_PLATFORMS=cpu (a working CUDA)")
    assert "JAX_PLATFORMS=cpu" in why and "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1" in why
