"""The memory model on the TPU compiler: bf16 models as users write them, planned for TPU v5e
on a 2x4 slice of compile-only chips and compiled by the TPU compiler (nothing runs); each
plan's estimate within 10% of the compiler's heap peak (memory_analysis' peak_memory_in_bytes,
what it refuses programs by: analysis/hlo.py ProgramStats.peak_bytes). The searched plan and an
expert plan (FSDP, completed by the ILP). The models are sized so that a step holds most of a
GiB a chip: the short-lived buffers the compiler holds in a core's VMEM instead (up to 112
MiB on v5e: intra/memory/fast_memory.py) rule a step of a few MiB. Skipped without libtpu (the `tpu_v5e_2x4` fixture).
benchmarks/memory_tpu.py runs the same check at larger sizes."""

import os

# Compile-only devices run nothing on a chip, so several processes may hold libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest

from shardplan.analysis import hlo
from shardplan.cost.hardware import get_profile
from shardplan.cost.model import AlphaBetaCost
from shardplan.intra.memory import compilers
from shardplan.intra.options import intra_options
from shardplan.intra.problem import Problem
from shardplan.ir.lift import LiftOptions, lift
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.options import DEFAULTS
from shardplan.planning import compiled as compiled_mod
from shardplan.planning.expert_plans import expert_plans
from shardplan.planning.intra_op import plan_step
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape

TOLERANCE = 0.10
MESH = MeshShape(("data", "model"), (2, 4))
BF16 = {"dtype": "bfloat16"}
# a transformer of width 1024, 2 layers, batch 32 x 1024 tokens, vocab 8192
WIDE = {**BF16, "hidden": 1024, "ffn_dim": 4096, "seq_len": 1024, "batch_size": 32,
        "num_layers": 2, "vocab_size": 8192}
# name -> (model, size, overrides): bf16 params and activations (the optimizer's state in
# the params' dtype)
CASES = {
    "gpt": ("gpt", "tiny", WIDE),
    "llama": ("gpt", "llama-tiny", {**WIDE, "num_heads": 8}),
    "moe": ("moe", "tiny", {**WIDE, "ffn_dim": 2048, "expert_group_size": 1024}),
    "mlp": ("mlp", "tiny", {**BF16, "width": 4096, "num_layers": 4, "batch_size": 65536}),
}
# Where the model is not yet within 10% (measured on libtpu 0.0.42.1, estimate / heap peak).
# The MoE: its live set at the peak, without the margin, is 0.99 of the sum of the buffers
# live at the compiler's peak (benchmarks/xla_live.py on its dump), but the compiler's heap
# holds 8% less than that sum and the margin adds 10%. Read with xla_live.py --hbm on the
# 4x4 dumps since, what the heap lacks of that sum is what the compiler holds in VMEM
# (fast_memory.py: 1.21 -> 1.18 here, 1.25 -> 1.13 on v5e 4x4).
# Llama: its searched plan is the 2-D expert plan's inputs completed by the ILP, kept for its
# estimate (intra.planner._window_s): its weights gathered for the dots, their gradients not
# scattered over the slice, no dot windowed. Before, its plan windowed the weight gradients'
# dots (1.05). Its rotary halves recomputed (compilers.TPU.also_fused): 1.31 -> 1.22; the
# short-lived buffers held in VMEM, the logits recast in the backward and its weights
# gathered at their dots (fast_memory.py, liveness.recast, compilers.TPU.hoisted_gathers):
# 1.10, the margin.
GAPS = {
    ("moe", None): "0.94 GiB estimated, 0.79 GiB compiled (1.18): the margin and the "
                   "compiler's in-place outputs",
    ("llama", None): "0.81 GiB estimated, 0.73 GiB compiled (1.10): the margin",
}
# make test compiles one case (the MLP, about 20 s); the others are slow (make test-all)
FAST = {("mlp", None)}


def _case(name, expert=None):
    gap = GAPS.get((name, expert))
    marks = [] if (name, expert) in FAST else [pytest.mark.slow]
    if gap:  # a known gap is expected to fail: `make test-all` runs it
        marks.append(pytest.mark.xfail(reason=gap, strict=False))
    return pytest.param(name, marks=marks)


def _peak(lowered) -> int:
    """The TPU compiler's heap peak per chip (what the fit check reads)."""
    return hlo.analyze(lowered.compile()).peak_bytes


def _plans(name, mesh, expert):
    model, size, overrides = CASES[name]
    m = get_model(model, size, abstract=True, **overrides)
    hw = get_profile("tpu-v5e")
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    plan, graph, _ = plan_step(traced, MESH, hw, DEFAULTS, device_mesh=mesh)
    if expert:
        job = Job.make(traced, MESH, hw, DEFAULTS, device_mesh=mesh)
        plan = expert_plans(job, plan, deadline=60.0)[expert]
    return plan, compiled_mod.lower_plan(graph, traced, plan, mesh, m.state_argnums)


@pytest.mark.parametrize("name", [_case(n) for n in sorted(CASES)])
def test_searched_plan_estimate_is_within_10pct_of_the_tpu_compiled_peak(tpu_v5e_2x4, name):
    plan, lowered = _plans(name, tpu_v5e_2x4, None)
    compiled = _peak(lowered)
    assert abs(plan.estimate.peak_bytes / compiled - 1) <= TOLERANCE, (
        name, plan.estimate.peak_bytes, compiled)


@pytest.mark.parametrize("name", [_case(n, "fsdp") for n in ("gpt", "mlp")])
def test_fsdp_estimate_is_within_10pct_of_the_tpu_compiled_peak(tpu_v5e_2x4, name):
    plan, lowered = _plans(name, tpu_v5e_2x4, "fsdp")
    compiled = _peak(lowered)
    assert abs(plan.estimate.peak_bytes / compiled - 1) <= TOLERANCE, (
        name, plan.estimate.peak_bytes, compiled)


def test_each_target_plans_with_its_compilers_rules():
    # a TPU plan under the TPU compiler's rules; a GPU's under XLA:CPU's, the ones measured
    assert intra_options(DEFAULTS, compiler="tpu").compiler == "tpu"
    assert compilers.rules("tpu") is compilers.TPU
    assert compilers.rules("cpu") is compilers.rules("gpu") is compilers.CPU
    assert compilers.CPU.reduction_broadcasts and not compilers.TPU.reduction_broadcasts


def test_xla_cpu_only_buffers_are_left_out_on_tpu():
    """A bf16 GPT's dropout bits, YNNPACK broadcasts and combined gradient holds are XLA:CPU's:
    planned for the TPU compiler the model holds none of them, and less in all."""
    m = get_model("gpt", "tiny", abstract=True, **BF16)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    g = lift(traced.closed_jaxpr, traced.arg_info, LiftOptions())
    models = {}
    for compiler in ("cpu", "tpu"):
        cost = AlphaBetaCost(MESH, get_profile("tpu-v5e"))
        p = Problem(g, MESH, cost, intra_options(DEFAULTS, compiler=compiler))
        models[compiler] = p.memory()
    whats = {c: " ".join(b.what for b in mm.buffers) for c, mm in models.items()}
    for cpu_only in ("counters", "broadcast for the reduction", "combined all-reduce"):
        assert cpu_only in whats["cpu"] and cpu_only not in whats["tpu"], cpu_only
    assert len(models["tpu"].virtual) > len(models["cpu"].virtual)


def test_temporaries_are_counted_in_tiles_on_tpu():
    """The TPU compiler holds a temporary in tiles as it holds an argument: an attention's
    exp, f32 [batch, heads, 16, 16] for the tiny GPT in bf16, its 16 keys padded to 128 (8x).
    XLA:CPU's rules count it dense. (GPT-2 124M on v5e 16x16 holds each layer's q/k/v, bf16
    [8, 64, 12, 3, 64] a chip, in tiles: 4.5 MiB for 2.25, compilers.Rules.tiled.)"""
    m = get_model("gpt", "tiny", abstract=True, **BF16)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    g = lift(traced.closed_jaxpr, traced.arg_info, LiftOptions())
    exp = next(n for n in g.nodes if n.primitive == "exp" and "attn" in n.name)
    value = g.values[exp.outputs[0]]
    whole = {}
    for compiler in ("cpu", "tpu"):
        p = Problem(g, MESH, AlphaBetaCost(MESH, get_profile("tpu-v5e")),
                    intra_options(DEFAULTS, compiler=compiler))
        model = p.memory()
        (buf,) = [b for b in model.buffers if b.what == f"exp {exp.name}"]
        whole[compiler] = max(buf.nbytes) / model.scale  # replicated: the whole array
    assert value.shape[-2:] == (16, 16)
    assert whole["cpu"] == value.nbytes
    assert whole["tpu"] == compilers.tiled_bytes(value.shape, value.itemsize) == 8 * value.nbytes


def _activations(act):
    """The activations of a 3-layer MLP's gradient step (`act` of each dot's output plus a
    bias: the value each next dot reads), the values the TPU compiler's rules leave unwritten
    whatever the plan, and those a windowed dot would read as its loop's operand."""
    import jax
    import jax.numpy as jnp

    from shardplan.intra.memory import dot_operands, liveness

    def loss(w, x):
        for k in w:
            x = act(x @ k + 1.0)
        return x.sum()

    w = [jax.ShapeDtypeStruct((256, 256), jnp.float32)] * 3
    x = jax.ShapeDtypeStruct((512, 256), jnp.float32)
    traced = trace(jax.grad(loss), (w, x), (0,), (1,))
    g = lift(traced.closed_jaxpr, traced.arg_info, LiftOptions())
    readers = {}
    for node in g.nodes:
        for v in node.inputs:
            readers.setdefault(v, set()).add(node.id)
    virtual = liveness.unwritten(g, readers, set(g.outputs), compilers.TPU)
    # what each layer's next dot (or the final sum) reads
    acts = [u for n in g.nodes if n.primitive in ("dot_general", "reduce_sum")
            and "transpose(" not in n.name for u in n.inputs[:1]][1:]
    producer = {v: n.id for n in g.nodes for v in n.outputs}
    operands = {v for v in acts if dot_operands.window_operand(
        g, g.nodes[producer[v]], readers.get(v, ()), producer)}
    return acts, virtual, operands


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_an_activation_of_a_dot_is_a_windowed_dots_operand_on_tpu(act):
    """An activation of a dot's output (relu and gelu both, as the TPU compiler's fusions of
    an MLP and a GPT make them) is recomputed in the fusions of the dots that read it, but
    where the weight gradient's dot runs windowed (its loop's operand: written beside the
    pre-activation; tests/test_memory_fit.py::
    test_an_activation_is_written_where_a_windowed_dot_reads_it); the last layer's, which the
    sum alone reads, is fused into it."""
    import jax

    acts, virtual, operands = _activations(getattr(jax.nn, act))
    assert len(acts) == 3
    assert all(v in virtual for v in acts)
    assert [v in operands for v in acts] == [True, True, False]


# (shape, dtype): the TPU compiler's layout of each as a step's argument pads these least
# (compilers.tiled_bytes): a dimension of 2 as T(2,128), of 3 moved out of the tile, a last
# dimension of 5 laid out second-minor, a bf16 [5, 7, 9] in 8-row tiles
LAYOUTS = [((4, 64, 2, 1024), "bfloat16"), ((4, 64, 3, 1024), "bfloat16"),
           ((64, 4, 1024), "float32"), ((3, 1000), "bfloat16"), ((1024, 5), "float32"),
           ((5, 7, 9), "bfloat16"), ((100, 3), "bfloat16"), ((32, 8, 256, 2, 448), "bfloat16"),
           ((4096,), "bfloat16"), ((24, 1000), "float32")]


def test_arguments_take_the_tiled_layout_that_pads_least(tpu_v5e_2x4):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    for shape, dtype in LAYOUTS:
        x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(tpu_v5e_2x4, P()))
        compiled = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
        itemsize = np.dtype(dtype).itemsize
        assert compilers.tiled_bytes(shape, itemsize) == (
            compiled.memory_analysis().argument_size_in_bytes), (shape, dtype)
