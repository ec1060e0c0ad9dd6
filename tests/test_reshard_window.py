"""The TPU compiler's windowed einsum: a dot whose partial sum is reduce-scattered (the weight
gradient of a layer whose weight is split as FSDP splits it) runs as a loop of
collective-permutes, each step a dot that reads the whole of the operand the scattered
dimension is not in. The pricer reads the compiled loop (analysis/hlo_bytes.py) and the
cost model prices it (intra/reshard_prices.py ReshardPrices.window_time); both are checked
against the TPU compiler's program here (libtpu, compile-only v5e devices)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardplan.analysis import hlo, hlo_bytes, hlo_collectives, price
from shardplan.cost.hardware import get_profile
from shardplan.intra import reshard_prices
from shardplan.ir.trace import trace
from shardplan.options import DEFAULTS
from shardplan.planning import compiled
from shardplan.planning.intra_op import plan_graph
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape, ShardSpec

BOTH = ("data", "model")
MIB = 2**20


def _weight_gradient(mesh, batch, d, f):
    """x^T @ dy over the batch, both split over the 8 chips, the result reduce-scattered
    along its rows (the lhs's free dimension): compiled by the TPU compiler, its text."""
    rows = NamedSharding(mesh, P(BOTH, None))
    args = [jax.ShapeDtypeStruct((batch, d), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((batch, f), jnp.bfloat16, sharding=rows)]
    fn = jax.jit(lambda x, dy: jnp.einsum("bd,bf->df", x, dy), out_shardings=rows)
    return fn.lower(*args).compile().as_text()


def test_a_windowed_einsum_reads_its_sliced_operand_once(tpu_v5e_2x4):
    """Over 8 chips the loop runs 4 steps (two chunks each, one per direction): each reads dy
    whole and two chunks of x (sliced out of x padded: read once in all), and writes its two
    chunks of the result. Below WINDOW_CONTRACTING rows per chip the dot is one dot and a
    reduce-scatter."""
    batch, d, f = 8192, 1024, 2048
    text = _weight_gradient(tpu_v5e_2x4, batch, d, f)
    assert "collective-permute-start" in text and "reduce-scatter" not in text
    x, dy, out = batch // 8 * d * 2, batch // 8 * f * 2, d * f * 2
    assert hlo_bytes.contraction_bytes(text) == pytest.approx(x + 4 * dy + out, rel=0.01)

    small = 8 * reshard_prices.WINDOW_CONTRACTING
    text = _weight_gradient(tpu_v5e_2x4, small, d, f)
    assert "collective-permute-start" not in text and "reduce-scatter" in text
    assert hlo_bytes.contraction_bytes(text) == pytest.approx(
        small // 8 * (d + f) * 2 + out, rel=0.01)


def _fsdp_step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.square(x @ w)))(w)


def test_the_estimate_prices_the_window_the_tpu_compiler_runs(tpu_v5e_2x4):
    """FSDP's weight gradient planned for tpu-v5e: the estimate's compute time within 2% of
    the TPU program's priced compute (the same flops-plus-bytes formula), the window's reads
    a sixth of it."""
    batch, d, f = 8192, 1024, 2048
    mesh = tpu_v5e_2x4
    shape = MeshShape.of(mesh)
    hw = get_profile("tpu-v5e")
    args = (jax.ShapeDtypeStruct((d, f), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, d), jnp.bfloat16))
    traced = trace(_fsdp_step, args, (0,), (1,))
    options = DEFAULTS.replace(state_argnums=(0,), batch_argnums=(1,))
    job = Job.make(traced, shape, hw, options, device_mesh=mesh, donate_argnums=(0,))
    rows = ShardSpec.split(2, 0, BOTH)
    plan, _ = plan_graph(job, fixed_inputs={0: rows, 1: rows})
    lowered = compiled.lower_plan(job.graph, traced, plan, mesh, (0,))
    stats = hlo.analyze(compiled.compile_for_analysis(lowered))
    priced = price.price(stats, shape, compiled.device_grid(mesh), hw, "bfloat16")
    assert plan.estimate.compute_s == pytest.approx(priced.compute_s, rel=0.02), (
        plan.estimate, stats.summary())
    window = 3 * batch // 8 * f * 2  # dy read in each of 4 steps, where one dot reads it once
    assert stats.contraction_bytes == pytest.approx(
        (batch // 8 * (d + f) * 2 + d * f * 2) * 2 + window, rel=0.02)
    assert window / hw.mem_bandwidth > 0.15 * priced.compute_s
    # the plan's table charges it to the op that reads the gradient reduce-scattered
    (update,) = [o for o in plan.ops if o.primitive == "sub"]
    assert update.compute_s == pytest.approx(window / hw.mem_bandwidth, rel=0.01)


@pytest.mark.parametrize("shape, axes, windowed", [
    ((2, 4), BOTH, True), ((4, 4), BOTH, True),  # the whole slice, at most 16 chips
    ((16, 16), BOTH, False), ((4, 8), BOTH, False),  # more chips: reduce-scattered
    ((2, 4), ("model",), False),  # one axis of the slice
])
def test_the_window_is_priced_where_the_tpu_compiler_runs_one(shape, axes, windowed):
    """ReshardPrices.window_time, without compiling: a window only where the reduce-scatter
    spans the whole slice of at most WINDOW_CHIPS chips (what libtpu did with x^T dy on each
    of these slices), and its contracting rows per chip exceed WINDOW_CONTRACTING."""
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.ir.lift import lift

    mesh = MeshShape(("data", "model"), shape)
    n = mesh.size(axes)
    rows, d, f = 1024 * n, 256, 512

    def wgrad(x, dy):
        return jnp.einsum("bd,bf->df", x, dy)

    graph = lift(jax.make_jaxpr(wgrad)(jnp.zeros((rows, d), jnp.bfloat16),
                                       jnp.zeros((rows, f), jnp.bfloat16)))
    (dot,) = graph.nodes
    n_in = len(graph.inputs)
    prices = reshard_prices.ReshardPrices(
        graph, mesh, AlphaBetaCost(mesh, get_profile("tpu-v5e")),
        {dot.outputs[0]: (n_in + dot.id, 0)}, n_in, lambda _: False)
    out = graph.values[dot.outputs[0]]
    src, dst = ShardSpec(((), ()), axes), ShardSpec((axes, ()))
    seconds = prices.window_time(out, src, dst)
    dy = rows // n * f * 2  # the operand read whole in each of n/2 steps
    expected = (n // 2 - 1) * dy / get_profile("tpu-v5e").mem_bandwidth if windowed else 0.0
    assert seconds == pytest.approx(expected)
    assert prices.window_time(out, src, ShardSpec(((), axes))) == pytest.approx(
        expected * d / f)  # split along dy's dimension: x read whole instead
    cpu = reshard_prices.ReshardPrices(graph, mesh, AlphaBetaCost(mesh, get_profile("cpu")),
                                       {dot.outputs[0]: (n_in + dot.id, 0)}, n_in,
                                       lambda _: False)
    assert cpu.window_time(out, src, dst) == 0.0


def test_a_plain_reduce_scatter_past_8_chips_is_priced_as_the_all_reduce_it_compiles_to(
        tpu_v5e_2x4):
    """A partial sum split over the summed axis and not windowed (one axis of the slice): on
    v5e 2x4 the TPU compiler forms one reduce-scatter (a fused all-reduce and slice), on 4x4
    it all-reduces the sum and moves the parts with collective-permutes. ReshardPrices prices
    the all-reduce there (all_reduced_first); a windowed one stays a reduce-scatter."""
    from shardplan.analysis import targets
    from shardplan.cost.model import AlphaBetaCost
    from shardplan.ir.lift import lift

    def wgrad(x, dy):
        return jnp.einsum("bd,bf->df", x, dy)

    for shape in ((2, 4), (4, 4)):
        mesh = (tpu_v5e_2x4 if shape == (2, 4) else
                targets.tpu_mesh(get_profile("tpu-v5e"), MeshShape(BOTH, shape)))
        split = NamedSharding(mesh, P("model", None))
        args = [jax.ShapeDtypeStruct((16384, 256), jnp.bfloat16, sharding=split),
                jax.ShapeDtypeStruct((16384, 512), jnp.bfloat16, sharding=split)]
        text = jax.jit(wgrad, out_shardings=split).lower(*args).compile().as_text()
        kinds = {c.kind for c in hlo_collectives.parse_collectives(text)}
        assert ("reduce-scatter" in kinds) == (shape == (2, 4)), (shape, kinds)
        assert ("all-reduce" in kinds) == (shape == (4, 4)), (shape, kinds)

        shape_ = MeshShape(BOTH, shape)
        graph = lift(jax.make_jaxpr(wgrad)(*(jnp.zeros(a.shape, a.dtype) for a in args)))
        (dot,) = graph.nodes
        n_in = len(graph.inputs)
        cost = AlphaBetaCost(shape_, get_profile("tpu-v5e"))
        prices = reshard_prices.ReshardPrices(
            graph, shape_, cost, {dot.outputs[0]: (n_in + dot.id, 0)}, n_in, lambda _: False)
        out = graph.values[dot.outputs[0]]
        src, dst = ShardSpec(((), ()), ("model",)), ShardSpec((("model",), ()))
        mid = prices.all_reduced_first(out, src, dst)
        assert (mid == src.without_partial()) == (shape == (4, 4))
        priced = [c.kind for c in prices.reshard_comms(out, src, dst)]
        assert priced == (["reduce-scatter"] if shape == (2, 4) else ["all-reduce"])
        # over the whole slice, 1024 rows a chip on 4x4, it is windowed: a reduce-scatter
        whole = ShardSpec(((), ()), BOTH)
        assert prices.all_reduced_first(out, whole, ShardSpec((BOTH, ()))) is None
