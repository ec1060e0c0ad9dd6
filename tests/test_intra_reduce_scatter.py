"""A partial sum the plan splits over the axes it was summed on (a reduce-scatter in the
model), as XLA compiles it: reduced whole and sliced, on a mesh with an axis the value is
replicated on (intra/planner.py reduced_first), and all-reduced whole where another reader
reads the sum (intra/estimate.py scattered_whole)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardplan.analysis import hlo
from shardplan.cost.hardware import get_profile
from shardplan.intra import estimate, planner
from shardplan.ir.trace import trace
from shardplan.options import DEFAULTS
from shardplan.planning import compiled
from shardplan.planning.intra_op import plan_graph
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests.conftest import auto_mesh

S = ShardSpec


def _step(state, x):
    w, m = state

    def loss(w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    g = jax.grad(loss)(w)
    m = 0.9 * m + g
    return (w - 0.1 * m, m)


def test_a_gradient_split_over_its_summed_axis_compiles_as_planned_on_an_idle_axis(devices):
    """The batch on `model`, the kernel and its momentum split on `model`, `data` (4 devices,
    a multiple of 2) idle (no dimension divides by 4): the kernel's gradient is a partial sum over `model` the plan
    reduce-scatters. Left to itself XLA computed it on a slice taken over `data`,
    all-reduced the slice and moved it with a collective-permute over both axes (BERT base on
    8x8: 1.73 ms the a100 profile prices that no plan priced); constrained whole first, the
    compiled program runs the collectives the estimate expects, byte for byte."""
    mesh = auto_mesh((4, 2), ("data", "model"))
    shape = MeshShape.of(mesh)
    hw = dataclasses.replace(get_profile("a100-80gb"), devices_per_host=2)  # `data` across hosts
    args = ((jax.ShapeDtypeStruct((258, 514), jnp.float32),
             jax.ShapeDtypeStruct((258, 514), jnp.float32)),
            jax.ShapeDtypeStruct((4098, 258), jnp.float32))
    traced = trace(_step, args, (0,), (1,))
    options = DEFAULTS.replace(state_argnums=(0,), batch_argnums=(1,))
    col, row = S.split(2, 1, "model"), S.split(2, 0, "model")
    job = Job.make(traced, shape, hw, options, device_mesh=mesh, donate_argnums=(0,))
    assert job.donated == frozenset({0, 1})
    graph = job.graph
    plan, intra = plan_graph(job, fixed_inputs={0: col, 1: col, 2: row})
    assert any(c.kind == "reduce-scatter" for _, c in intra.comms)
    lowered = compiled.lower_plan(graph, traced, plan, mesh, (0,))
    stats = hlo.analyze(compiled.compile_for_analysis(lowered))
    assert not [op for op in stats.collectives if op.kind == "collective-permute"]
    _, priced = compiled.compile_and_price(lowered, mesh, shape, hw, "float32")
    assert plan.estimate.comm_bytes == pytest.approx(priced.bytes_sent, rel=1e-6)


def test_a_sum_constrained_whole_another_reader_reads_partial_is_all_reduced():
    """Constrained whole (an idle axis) and read partial by another reader (a layer norm's
    input gradient and its bias gradient): XLA all-reduces it whole; with no idle axis it
    reduce-scatters it."""
    idle, busy = MeshShape(("data", "model"), (4, 2)), MeshShape(("data", "model"), (2, 4))
    src = S(((), ()), ("model",))
    assert estimate.scattered_whole(src, S.split(2, 0, "model"), {"model"}, idle)
    assert not estimate.scattered_whole(src, S.split(2, 0, "model"), {"model"}, busy)
    assert not estimate.scattered_whole(src, S.split(2, 0, "model"), set(), idle)
    assert not estimate.scattered_whole(src, S.replicated(2), {"model"}, idle)


def test_reduced_first_only_where_an_idle_axis_could_hold_the_slice():
    """XLA takes the slice over an axis neither layout uses whose devices are a multiple of
    the scattered axes' (measured: data 4 / model 2 and 4 / 4 sliced, data 2 / model 4 not);
    with no such axis it runs the all-reduce and slice already, and a whole layout on the
    way costs more (GPT-2 124M on 8x8: 10.50 -> 11.42 ms compiled)."""
    src = S(((), ()), ("model",))
    dst = S.split(2, 1, "model")
    assert planner.reduced_first(src, dst, MeshShape(("data", "model"), (4, 2))) == [
        S(((), ()))]
    assert planner.reduced_first(src, dst, MeshShape(("data", "model"), (2, 4))) == []
    used = S((("data",), ()), ("model",))
    assert planner.reduced_first(used, S((("data",), ("model",))),
                                 MeshShape(("data", "model"), (4, 2))) == []
    assert planner.reduced_first(src, S.replicated(2), MeshShape(("data", "model"), (4, 2))) == []




def _planned(fn, args, mesh, hw, fixed):
    """fn(state, batch) planned on `mesh` with its inputs pinned: (graph, plan, intra plan,
    the plan's program lowered)."""
    traced = trace(fn, args, (0,), (1,))
    job = Job.make(traced, MeshShape.of(mesh), hw,
                   DEFAULTS.replace(state_argnums=(0,), batch_argnums=(1,)), device_mesh=mesh,
                   donate_argnums=())
    graph = job.graph
    plan, intra = plan_graph(job, fixed_inputs=fixed)
    return graph, plan, intra, compiled.lower_plan(graph, traced, plan, mesh)


def _same_numbers(lowered, fn, args, tol):
    real = [jax.random.normal(k, a.shape) for k, a in zip(jax.random.split(jax.random.key(0)),
                                                           args)]
    # float32 sums of thousands of terms in another order differ by a share of the terms'
    # size, not of the result's: a result near 0 among results near 100 is off by 1e-4 (seen
    # on 2 of 17,028 elements), so the absolute tolerance scales with the largest result
    want = np.asarray(jax.jit(fn)(*real))
    np.testing.assert_allclose(np.asarray(lowered.compile()(*real)), want, rtol=tol,
                               atol=tol * float(np.abs(want).max()))


def _read_twice(w, x):
    h = x @ w
    return jnp.tanh(h) * h


def test_a_partial_sum_read_twice_is_reduced_once_where_it_is_made(devices):
    """A dot's result, a partial sum over `model` (its contraction split there), read by two
    ops: on a mesh of two axes the plan reduce-scatters it once, where it is made (a twin of
    the dot's strategy, intra/simplify.py reduce_once), not once per reader. With `data` idle
    the emitted program constrains it whole first (in its readers' routes, as a fan-out's):
    no collective-permute, the bytes the estimate expects, the unsharded function's numbers."""
    mesh = auto_mesh((4, 2), ("data", "model"))
    hw = dataclasses.replace(get_profile("a100-80gb"), devices_per_host=2)
    args = (jax.ShapeDtypeStruct((4098, 258), jnp.float32),  # no dimension divides by 4
            jax.ShapeDtypeStruct((66, 4098), jnp.float32))
    graph, plan, intra, lowered = _planned(_read_twice, args, mesh, hw,
                                           {0: S.split(2, 0, "model"), 1: S.split(2, 1, "model")})
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    assert ", reduced[" in intra.node_strategies[dot.id].name
    assert [c.kind for _, c in intra.comms] == ["reduce-scatter"]
    stats = hlo.analyze(compiled.compile_for_analysis(lowered))
    assert not [op for op in stats.collectives if op.kind == "collective-permute"]
    _, priced = compiled.compile_and_price(lowered, mesh, MeshShape.of(mesh), hw, "float32")
    assert plan.estimate.comm_bytes == pytest.approx(priced.bytes_sent, rel=1e-6)
    _same_numbers(lowered, _read_twice, args, 1e-4)


def _cast_read_twice(w, x):
    wb = w.astype(jnp.bfloat16)
    h = jnp.tanh(x.astype(jnp.bfloat16) @ wb)
    return (h @ wb.T).astype(jnp.float32)


def test_a_split_value_read_twice_is_gathered_once_in_its_own_dtype(devices):
    """A kernel stored split over all 8 devices (FSDP), cast to bf16 and read by two dots that
    want it whole on the contraction: the cast's twin gathers it once for both (priced per
    reader, each dot paid the gather). Emitted in the readers' routes, the cast constrained
    where it is made as it was planned: constrained gathered there, XLA ran the cast itself
    gathered and gathered the f32 kernel (twice the bytes). Compiled: gathers of bf16, the bytes
    the estimate expects, the unsharded function's numbers."""
    mesh = auto_mesh((2, 4), ("data", "model"))
    hw = get_profile("a100-80gb")
    args = (jax.ShapeDtypeStruct((1024, 1024), jnp.float32),
            jax.ShapeDtypeStruct((64, 1024), jnp.float32))
    graph, plan, intra, lowered = _planned(_cast_read_twice, args, mesh, hw,
                                           {0: S.split(2, 0, ("data", "model")),
                                            1: S.split(2, 0, "data")})
    cast = next(n for n in graph.nodes if n.primitive == "convert_element_type"
                and graph.values[n.inputs[0]].shape == (1024, 1024))
    assert ", gathered[" in intra.node_strategies[cast.id].name
    stats = hlo.analyze(compiled.compile_for_analysis(lowered))
    gathers = [op for op in stats.collectives if op.kind == "all-gather"]
    # bf16 in the program (XLA:CPU widens it to f32 in the collective; the pricer halves it)
    assert gathers and all(op.dtypes == ("bfloat16",) or op.widened_nbytes == op.nbytes
                           for op in gathers)
    _, priced = compiled.compile_and_price(lowered, mesh, MeshShape.of(mesh), hw, "bfloat16")
    assert plan.estimate.comm_bytes == pytest.approx(priced.bytes_sent, rel=1e-6)
    _same_numbers(lowered, _cast_read_twice, args, 2e-2)
