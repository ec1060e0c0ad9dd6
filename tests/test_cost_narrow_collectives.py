"""bf16 and f16 values in collectives: XLA:CPU (jax 0.10.2 and 0.12) converts a narrow float to
f32 around every collective it partitions, so the cpu profile prices them at 4 bytes an
element (cost.model.AlphaBetaCost.wire_itemsize); an accelerator sends them at 2 (and
analysis/price.py halves XLA:CPU's widened bytes for it). Before, a bf16 step planned for the
cpu profile was estimated at half the communication it compiled to (the gemma library's
Gemma 3 cut down, benchmarks/third_party_check.py: 10.8 MB against 21.5 MB on 2x4)."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan.cost.hardware import get_profile
from shardplan.cost.model import AlphaBetaCost
from shardplan.ir.graph import Value
from shardplan.models import get_model
from shardplan.planning import compiled as compiled_mod
from shardplan.strategies.base import Collective, Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec


def test_xla_cpu_sends_bf16_through_its_collectives_as_f32(mesh8):
    """A bf16 all-gather (a reshard alone) and a bf16 dot's all-reduce compile to f32
    collectives on CPU devices."""
    x = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16, sharding=NamedSharding(mesh8, P(None, "x")))
    w = jax.ShapeDtypeStruct((128, 32), jnp.bfloat16, sharding=NamedSharding(mesh8, P("x", None)))
    whole = NamedSharding(mesh8, P())
    text = (jax.jit(lambda x: x, out_shardings=whole).lower(x).compile().as_text()
            + jax.jit(lambda x, w: x @ w, out_shardings=whole).lower(x, w).compile().as_text())
    found = re.findall(r"= (\w+)\[[\d,]*\]\S* (all-gather|all-reduce)\(", text)
    assert sorted(kind for _, kind in found) == ["all-gather", "all-reduce"], found
    assert all(dtype == "f32" for dtype, _ in found), found


def test_the_cpu_profile_prices_narrow_floats_at_f32_width():
    mesh = MeshShape(("x",), (8,))
    bf16 = Value(0, (64, 128), "bfloat16", 2)
    f32 = Value(1, (64, 128), "float32", 4)
    src, dst = ShardSpec((("x",), ())), ShardSpec(((), ()))
    cpu, gpu = (AlphaBetaCost(mesh, get_profile(p)) for p in ("cpu", "a100-80gb"))
    assert cpu.wire_itemsize(bf16) == cpu.wire_itemsize(f32) == gpu.wire_itemsize(f32) == 4
    assert gpu.wire_itemsize(bf16) == 2
    assert cpu.reshard_time(bf16, src, dst) == cpu.reshard_time(f32, src, dst)
    assert gpu.reshard_time(bf16, src, dst) < gpu.reshard_time(f32, src, dst)
    reduce = Strategy("r", (src,), (dst,), 0.0,
                      comms=(Collective("all-reduce", ("x",), 256, narrow=True),
                             Collective("all-reduce", ("x",), 512)))
    assert [c.nbytes for c in cpu.node_comms(reduce)] == [512, 512]
    assert [c.nbytes for c in gpu.node_comms(reduce)] == [256, 512]


def test_a_bf16_step_is_estimated_as_it_compiles_on_cpu(devices, mesh2x4):
    """The tiny GPT with bf16 parameters and activations on 2x4 for the cpu profile: the
    estimate's bytes are the compiled program's (they were half of them). An accelerator's
    estimate of bf16 collectives against XLA:CPU's program halved: tests/
    test_intra_reduce_scatter.py::test_a_split_value_read_twice_is_gathered_once_in_its_own_dtype."""
    profile = "cpu"
    m = get_model("gpt", "tiny", dtype="bfloat16", param_dtype="bfloat16")
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware=profile, state_argnums=m.state_argnums,
                          batch_argnums=m.batch_argnums, time_limit=20, deterministic=True,
                          cache=False)
    plan = step.plan(*m.args)
    _, priced = compiled_mod.compile_and_price(step.lower(*m.args), mesh2x4, plan.mesh,
                                               get_profile(profile), "bfloat16")
    assert priced.bytes_sent > 0
    assert plan.estimate.comm_bytes == pytest.approx(priced.bytes_sent, rel=0.05)
