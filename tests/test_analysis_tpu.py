"""The analysis reads and prices programs the real TPU compiler compiled (compile-only TPU v5e
devices, nothing runs): collectives, flops, bytes and the compiler's optimal_seconds, each
against a number known by construction. Skipped without libtpu (the `tpu_v5e_2x4` fixture)."""

import math
import os
import re

# Compile-only devices run nothing on a chip, so several processes may hold libtpu at once
# (other test runs on this machine); without this libtpu refuses a second process.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.analysis import hlo, hlo_flops, hlo_parse, price
from shardplan.cost import collectives
from shardplan.cost.hardware import get_profile
from shardplan.strategies.spec import MeshShape

BF16 = 2  # bytes
MESH = MeshShape(("data", "model"), (2, 4))


def _compile(mesh, f, args, out=None):
    """Compile f for abstract args given as (shape, spec[, dtype]) on the TPU mesh."""
    structs = [jax.ShapeDtypeStruct(a[0], a[2] if len(a) > 2 else jnp.bfloat16,
                                    sharding=NamedSharding(mesh, a[1])) for a in args]
    out = None if out is None else NamedSharding(mesh, out)
    return jax.jit(f, out_shardings=out).lower(*structs).compile()


def _grid(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices)


def _only(stats, kind):
    ops = [c for c in stats.collectives if c.kind == kind]
    assert len(ops) == 1, stats.summary()
    assert len(stats.collectives) == 1, stats.summary()
    return ops[0]


def _check(op, mesh, nbytes, axes, n):
    assert op.nbytes == nbytes
    assert op.group_size == n
    assert op.count == 1 and op.count_known
    assert hlo.axes_of_group(op.groups, MESH, _grid(mesh)) == axes


# -- text forms (no compile) -------------------------------------------------------------------


def test_tiled_layouts_parse():
    assert hlo_parse.arrays("bf16[1024,1024]{1,0:T(8,128)(2,1)}") == [((1024, 1024), "bf16")]
    shape = "(bf16[64,512]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}, s32[2]{0:S(4)})"
    assert hlo_parse.nbytes(hlo_parse.arrays(shape)) == 64 * 512 * 2 + 4 + 8


def test_iota_groups_with_a_transpose():
    assert hlo_parse.parse_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]


# -- collectives -------------------------------------------------------------------------------


def test_all_reduce_of_a_sharded_contraction(tpu_v5e_2x4):
    m = 512
    c = _compile(tpu_v5e_2x4, lambda a, b: a @ b,
                 [((m, m), P(None, "model")), ((m, m), P("model", None))], P())
    op = _only(hlo.analyze(c), "all-reduce")
    _check(op, tpu_v5e_2x4, m * m * BF16, ("model",), 4)
    assert op.bytes_sent == 2 * 3 / 4 * m * m * BF16


def test_reduce_scatter_fusion_is_one_reduce_scatter(tpu_v5e_2x4):
    """A row-sharded result of a sharded contraction: the TPU compiler runs it as a custom
    fusion of an all-reduce and a device-indexed slice (an AllReduceScatter emitter)."""
    m = 512
    c = _compile(tpu_v5e_2x4, lambda a, b: a @ b,
                 [((m, m), P(None, "model")), ((m, m), P("model", None))], P("model", None))
    assert re.search(r"all-reduce\(", c.as_text()) and "kCustom" in c.as_text()
    stats = hlo.analyze(c)
    op = _only(stats, "reduce-scatter")
    _check(op, tpu_v5e_2x4, m * m * BF16, ("model",), 4)
    assert op.bytes_sent == 3 / 4 * m * m * BF16
    assert op.shapes == ((m // 4, m),)
    assert stats.formed() is stats  # already as the TPU runs it


def test_all_gather(tpu_v5e_2x4):
    c = _compile(tpu_v5e_2x4, lambda a: a * 2, [((512, 256), P("data", None))], P())
    op = _only(hlo.analyze(c), "all-gather")
    _check(op, tpu_v5e_2x4, 512 * 256 * BF16, ("data",), 2)
    assert op.bytes_sent == 1 / 2 * 512 * 256 * BF16


def _shard_map(mesh, f, in_spec, out_spec):
    return jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec)


def test_psum_scatter(tpu_v5e_2x4):
    f = _shard_map(tpu_v5e_2x4, lambda x: jax.lax.psum_scatter(x, "model", tiled=True),
                   P(), P("model"))
    op = _only(hlo.analyze(_compile(tpu_v5e_2x4, f, [((512, 256), P())])), "reduce-scatter")
    _check(op, tpu_v5e_2x4, 512 * 256 * BF16, ("model",), 4)


def test_ppermute_start_done_once(tpu_v5e_2x4):
    ring = [(i, (i + 1) % 4) for i in range(4)]
    f = _shard_map(tpu_v5e_2x4, lambda x: jax.lax.ppermute(x, "model", ring),
                   P("model"), P("model"))
    c = _compile(tpu_v5e_2x4, f, [((512, 256), P("model"))])
    assert "collective-permute-done" in c.as_text()
    op = _only(hlo.analyze(c), "collective-permute")
    _check(op, tpu_v5e_2x4, 128 * 256 * BF16, ("model",), 4)
    assert op.bytes_sent == 128 * 256 * BF16


def test_all_to_all(tpu_v5e_2x4):
    f = _shard_map(tpu_v5e_2x4, lambda x: jax.lax.all_to_all(x, "model", 0, 1, tiled=True),
                   P(None, "model"), P("model", None))
    op = _only(hlo.analyze(_compile(tpu_v5e_2x4, f, [((512, 512), P(None, "model"))])),
               "all-to-all")
    _check(op, tpu_v5e_2x4, 512 * 128 * BF16, ("model",), 4)
    assert op.bytes_sent == 3 / 4 * 512 * 128 * BF16


def test_async_collective_fusion_counted_once(tpu_v5e_2x4):
    """Three FSDP layers: the TPU compiler overlaps a weight's all-gather with the previous
    layer's matmul in a chain of fusions (start, continuation, done) that each hold a copy of
    the all-gather under one channel_id."""
    fsdp = P(("data", "model"))

    def f(x, w1, w2, w3):
        return jax.nn.relu(jax.nn.relu(jax.nn.relu(x @ w1) @ w2) @ w3)

    c = _compile(tpu_v5e_2x4, f, [((64, 512), fsdp)] + [((512, 512), fsdp)] * 3, fsdp)
    channels = re.findall(r"all-gather\(.*?channel_id=(\d+)", c.as_text())
    assert len(channels) > len(set(channels)), "no async collective fusion to count"
    stats = hlo.analyze(c)
    assert [op.kind for op in stats.collectives] == ["all-gather"] * 3, stats.summary()
    assert stats.bytes_sent == 3 * 7 / 8 * 512 * 512 * BF16


def _scan(w, x):
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]


def test_scan_collective_counted_per_trip(tpu_v5e_2x4):
    """The TPU compiler writes no known_trip_count: the count is read off the induction
    variable (analysis/hlo_loops.py). Flops, collectives and contraction bytes all x6."""
    trips, b, k = 6, 64, 512
    c = _compile(tpu_v5e_2x4, _scan,
                 [((trips, k, k), P(None, "model", None)), ((b, k), P(None, "model"))],
                 P(None, "model"))
    assert "known_trip_count" not in c.as_text()
    stats = hlo.analyze(c)
    op = _only(stats, "all-reduce")
    assert (op.count, op.count_known, op.in_loop) == (trips, True, True)
    assert op.nbytes == b * k * BF16
    per_trip = 2 * b * (k // 4) * k  # the dot on a quarter of the contraction, per device
    assert stats.flops == pytest.approx(trips * per_trip, rel=0.01)
    dot_bytes = (b * k // 4 + k * k // 4 + b * k) * BF16
    assert stats.contraction_bytes == pytest.approx(trips * dot_bytes, rel=0.01)


# -- flops, bytes and the compiler's roofline --------------------------------------------------


@pytest.mark.parametrize("case", ["batched", "transposed"])
def test_flops_match_the_analytic_count(tpu_v5e_2x4, case):
    """TPU dots are convolutions: a batched dot a base-dilated one (`0bf_0io->0bf`)."""
    if case == "batched":
        f, args = (lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
                   [((8, 256, 128), P("data")), ((8, 128, 256), P("data"))])
        flops = 2 * 8 * 256 * 128 * 256 / 2
    else:
        f, args = lambda a, b: a.T @ b, [((256, 512), P()), ((256, 512), P(None, "model"))]
        flops = 2 * 512 * 256 * 512 / 4
    text = _compile(tpu_v5e_2x4, f, args).as_text()
    assert " convolution(" in text and " dot(" not in text
    assert hlo_flops.program_flops(text) == flops
    stats = hlo.analyze(_compile(tpu_v5e_2x4, f, args))
    assert stats.flops == flops and stats.platform == "tpu"


def _roofline(text: str, peak: float, bandwidth: float) -> float:
    """Sum over the entry's instructions of max(flops / peak, bytes / bandwidth), bytes as
    HloCostAnalysis counts them: operands read plus results written."""
    module = hlo_parse.parse_module(text)
    shapes = {i.name: i.shape for c in module.computations.values() for i in c}
    counter = hlo_flops._Counter(module)
    total = 0.0
    for i in module.computations[module.entry]:
        if i.opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        flops = hlo_flops.instr_flops(i, shapes) + sum(
            counter.flops(c, False) for c in re.findall(r"%?([\w.\-]+)", i.attrs.get("calls", "")))
        moved = hlo_parse.nbytes(hlo_parse.arrays(i.shape)) + sum(
            hlo_parse.nbytes(hlo_parse.arrays(shapes[o.split()[-1].lstrip("%")]))
            for o in hlo_parse.split_top(i.operands) if i.opcode != "copy-done")
        total += max(flops / peak, moved / bandwidth)
    return total


def test_optimal_seconds_is_a_sum_of_rooflines(tpu_v5e_2x4):
    """optimal_seconds (ProgramStats docstring): memory-bound programs give the HBM bandwidth
    it assumes; a matmul program (a prefetch copy, its done, the dot fusion) is the sum of
    each instruction's roofline at 197 TFLOP/s; an all-gather is charged its HBM bytes alone;
    a scan's body once, whatever its trip count."""
    add = hlo.analyze(_compile(tpu_v5e_2x4, lambda a, b: a + b,
                               [((1024, 1024), P()), ((1024, 1024), P())]))
    bandwidth = add.bytes_accessed / add.optimal_seconds
    assert bandwidth == pytest.approx(738e9, rel=0.01)
    c = _compile(tpu_v5e_2x4, lambda a, b: a @ b, [((1024, 1024), P()), ((1024, 1024), P())])
    stats = hlo.analyze(c)
    assert stats.flops / 197e12 < stats.optimal_seconds  # not one roofline of the whole
    assert _roofline(c.as_text(), 197e12, bandwidth) == pytest.approx(
        stats.optimal_seconds, rel=0.02)
    gather = hlo.analyze(_compile(tpu_v5e_2x4, lambda a: a, [((1024, 1024), P("model"))], P()))
    assert gather.bytes_sent > 0
    assert gather.optimal_seconds == pytest.approx(gather.bytes_accessed / bandwidth, rel=0.01)
    short, long = (hlo.analyze(_compile(tpu_v5e_2x4, _scan, [((n, 256, 256), P()),
                                                            ((64, 256), P())])) for n in (2, 8))
    assert long.flops == pytest.approx(4 * short.flops, rel=0.01)
    assert long.optimal_seconds == pytest.approx(short.optimal_seconds, rel=0.01)


def test_price_of_a_sharded_matmul(tpu_v5e_2x4):
    """Priced compute = flops at the profile's peak + the dot's operands and result and the
    step's arguments and result at its HBM bandwidth; the all-reduce over the model axis's
    ICI ring."""
    hw = get_profile("tpu-v5e")
    m, k, n = 2048, 1024, 1024
    c = _compile(tpu_v5e_2x4, lambda x, w: x @ w,
                 [((m, k), P("data", "model")), ((k, n), P("model", None))], P("data", None))
    stats = hlo.analyze(c)
    flops = 2 * m * k * n / 8
    assert stats.flops == pytest.approx(flops, rel=0.01)  # and the all-reduce's additions
    local = (m // 2 * k // 4 + k // 4 * n + m // 2 * n) * BF16  # x, w and the partial sum
    assert stats.contraction_bytes == local
    priced = price.price(stats, MESH, _grid(tpu_v5e_2x4), hw, "bfloat16")
    memory = (stats.contraction_bytes + stats.io_bytes) / hw.mem_bandwidth
    assert priced.compute_s == pytest.approx(stats.flops / hw.peak_flops + memory)
    assert flops / hw.peak_flops < priced.compute_s < flops / hw.peak_flops + 3 * local / hw.mem_bandwidth
    (op,) = stats.collectives
    link = hw.axis_links(MESH, device_order=[int(d) for d in _grid(tpu_v5e_2x4).flat])["model"]
    expected = (collectives.latency_steps(op.kind, 4) * link.latency
                + op.bytes_sent / link.bandwidth)
    assert priced.comm_s == pytest.approx(expected)
    assert op.kind == "all-reduce" and op.nbytes == m // 2 * n * BF16


# -- the cost model against the TPU compiler ---------------------------------------------------


def test_planned_mlp_collectives_match_the_tpu_program(tpu_v5e_2x4):
    """A 2-layer bf16 MLP step with Adam (batch 64, width 512) planned for tpu-v5e: the
    plan's communication bytes against the collectives the TPU compiler emitted."""
    optax = pytest.importorskip("optax")
    import shardplan

    width, batch = 512, 64
    opt = optax.adam(1e-3)

    def loss(p, x, y):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return jnp.mean(((h @ p["w2"] + p["b2"]).astype(jnp.float32) - y) ** 2)

    def step(p, s, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    def init():
        p = {"w1": jnp.zeros((width, width), jnp.bfloat16), "b1": jnp.zeros((width,), jnp.bfloat16),
             "w2": jnp.zeros((width, width), jnp.bfloat16), "b2": jnp.zeros((width,), jnp.bfloat16)}
        return p, opt.init(p)

    p, s = jax.eval_shape(init)
    args = (p, s, jax.ShapeDtypeStruct((batch, width), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, width), jnp.float32))
    auto = shardplan.auto(step, mesh=tpu_v5e_2x4, hardware="tpu-v5e", measure=False,
                          cache=False)
    plan = auto.plan(*args)
    stats = hlo.analyze(auto.lower(*args).compile())
    assert stats.platform == "tpu"
    assert stats.bytes_sent > 0
    assert plan.estimate.comm_bytes / stats.bytes_sent == pytest.approx(1.0, rel=0.25), (
        plan.estimate, stats.summary())
    assert math.isfinite(stats.optimal_seconds) and stats.optimal_seconds > 0


class _WithConcatBitcasts:
    """A compiled program as the TPU compiler reports one with `n` ConcatBitcast custom calls:
    each charged -1 s in cost_analysis()'s optimal_seconds (a 1-layer GPT-2 on v5e 2x4 has 27,
    and -26.994 s)."""

    def __init__(self, compiled, n):
        self._compiled, self._n = compiled, n

    def __getattr__(self, name):
        return getattr(self._compiled, name)

    def as_text(self):
        head, rest = self._compiled.as_text().split("\n", 1)
        calls = "\n".join(f"// custom_call_target=\"ConcatBitcast\" {i}" for i in range(self._n))
        return f"{head}\n{calls}\n{rest}"

    def cost_analysis(self):
        cost = dict(self._compiled.cost_analysis())
        cost["optimal_seconds"] -= self._n
        return cost


def test_optimal_seconds_has_no_negative_charges(tpu_v5e_2x4):
    c = _compile(tpu_v5e_2x4, lambda a, b: a @ b, [((1024, 1024), P()), ((1024, 1024), P())])
    honest = hlo.analyze(c).optimal_seconds
    assert honest > 0
    assert hlo.analyze(_WithConcatBitcasts(c, 27)).optimal_seconds == pytest.approx(honest)


# -- memory ----------------------------------------------------------------------------------


def test_a_tpu_programs_peak_is_the_compilers_heap_peak(tpu_v5e_2x4):
    """On TPU, memory_analysis' temp_size leaves out temporaries the heap holds: `x @ x` of a
    replicated 2048 x 2048 f32 reports 16 MiB argument, 16 MiB output and no temp, where the
    compiler's heap peak holds 48 MiB. ProgramStats.peak_bytes is that heap peak."""
    stats = hlo.analyze(_compile(tpu_v5e_2x4, lambda x: x @ x, [((2048, 2048), P(), jnp.float32)]))
    mib = 2**20
    assert stats.platform == "tpu"
    assert stats.argument_bytes == 16 * mib and stats.temp_bytes == 0
    assert stats.xla_peak_bytes > stats.argument_bytes + stats.output_bytes
    assert stats.peak_bytes == stats.xla_peak_bytes
    assert "TPU compiler heap" in stats.summary()


def test_the_tpu_compiler_refuses_by_its_heap_peak_not_the_sum(tpu_v5e_2x4):
    """Which memory figure a v5e chip (15.75 GiB of HBM) runs out at: the gradient step of 121
    replicated bf16 8192 x 8192 layers sums (argument + output + temp - alias) to more than
    HBM and compiles, its heap peak under HBM; 124 layers are refused. MaxText's Llama2-7B
    configuration on v5e 4x4 is another such program (benchmarks/tpu_check.py: summed 19.40
    GiB, heap 15.65 GiB, compiled)."""
    hbm = 15.75 * 2**30  # what the compiler says a v5e chip makes available of its 16 GiB

    def compile_layers(layers):
        def loss(ws, x):
            for w in ws:
                x = jnp.tanh(x @ w)
            return jnp.sum(x.astype(jnp.float32))

        def step(ws, x):
            return [w - 0.1 * g for w, g in zip(ws, jax.grad(loss)(ws, x))]

        rep = NamedSharding(tpu_v5e_2x4, P())
        rows = NamedSharding(tpu_v5e_2x4, P(("data", "model")))
        ws = [jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16, sharding=rep)] * layers
        x = jax.ShapeDtypeStruct((1024, 8192), jnp.bfloat16, sharding=rows)
        return jax.jit(step, donate_argnums=0).lower(ws, x).compile()

    stats = hlo.analyze(compile_layers(121))
    summed = stats.argument_bytes + stats.output_bytes + stats.temp_bytes - stats.alias_bytes
    assert summed > hbm >= stats.peak_bytes, stats.summary()
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED"):
        compile_layers(124)
