"""The intra-op problem prices a scanned model as it prices the same model unrolled: values
between loops resharded once, a scan's stacked values a layer at a time, and the gradients an
optimizer reads several times reduced once (fan-outs)."""

import jax
import jax.numpy as jnp
import pytest

from shardplan.cost.hardware import get_profile
from shardplan.cost.model import AlphaBetaCost
from shardplan.intra.problem import Problem
from shardplan.intra.settings import IntraOptions
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.strategies.spec import MeshShape, ShardSpec

MESH = MeshShape(("data", "model"), (2, 4))


def _problem(graph, **options) -> Problem:
    return Problem(graph, MESH, AlphaBetaCost(MESH, get_profile("cpu")), IntraOptions(**options))


def _two_scans():
    def f(xs):
        _, ys = jax.lax.scan(lambda c, x: (c, x * 2.0), 0.0, xs)
        _, zs = jax.lax.scan(lambda c, y: (c, jnp.sin(y)), 0.0, ys)
        return zs

    graph = lift(jax.make_jaxpr(f)(jnp.ones((4, 8, 16))))
    stack = next(n for n in graph.nodes if n.primitive == "loop_stack")
    read = next(n for n in graph.nodes if n.primitive == "loop_slice"
                and n.inputs[0] == stack.outputs[0])
    return graph, stack, read


def test_a_stacked_value_passed_between_loops_is_resharded_once():
    graph, stack, read = _two_scans()
    problem = _problem(graph)
    n_in = problem.num_inputs
    assert problem.trips(n_in + stack.id) == problem.trips(n_in + read.id) == 4
    assert problem.edge_trips(n_in + stack.id, n_in + read.id) == 1
    body = next(n for n in graph.nodes if n.primitive == "sin")
    assert problem.edge_trips(n_in + read.id, n_in + body.id) == 4


def test_a_stacked_value_is_priced_as_its_layers_one_by_one():
    graph, stack, _ = _two_scans()
    problem = _problem(graph)
    ys = graph.values[stack.outputs[0]]
    one = graph.values[stack.inputs[0]]
    assert problem.reshards.layers(ys) == 4 and problem.reshards.layers(one) == 1
    src, dst = ShardSpec(((), ("data",), ())), ShardSpec.replicated(3)
    one_src, one_dst = ShardSpec((("data",), ())), ShardSpec.replicated(2)
    per_layer = problem.cost.reshard_time(one, one_src, one_dst)
    assert per_layer > 0
    # the same bytes as the whole stack, a latency per layer
    assert problem.reshards.reshard_time(ys, src, dst) == pytest.approx(4 * per_layer)
    assert problem.reshards.reshard_time(ys, src, dst) > problem.cost.reshard_time(ys, src, dst)
    assert problem.reshards.reshard_time(one, one_src, one_dst) == per_layer


def _layered_step(layers=4, cast=False):
    """A train step whose layers are named scopes and whose update reads each gradient three
    times (a global norm, a moment, the update), as optax's do; `cast`: each kernel cast to
    bf16 before its dot (as a mixed-precision model's)."""

    def loss(params, x):
        for i in range(layers):
            with jax.named_scope(f"layer_{i}"):
                w = params[f"layer_{i}"]
                x = jnp.tanh(x @ (w.astype(jnp.bfloat16) if cast else w))
        return jnp.mean(x ** 2)

    def step(params, mom, x):
        grads = jax.grad(loss)(params, x)
        norm = sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))
        mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, grads)
        params = jax.tree.map(lambda p, g, m: p - 0.1 * (g + m) / norm, params, grads, mom)
        return params, mom

    params = {f"layer_{i}": jnp.ones((64, 64)) for i in range(layers)}
    traced = trace(step, (params, params, jnp.ones((16, 64))))
    return lift(traced.closed_jaxpr, traced.arg_info)


def test_gradients_the_update_reads_several_times_get_one_fan_out_each():
    graph = _layered_step()
    assert _problem(graph, fanouts="none").fanout_of == []
    problem = _problem(graph)  # auto: "reduce" (the fan-outs of "layers") on two axes
    assert problem.fanout_of
    producer = {v: graph.nodes[problem.producer[v][0] - problem.num_inputs]
                for v in problem.fanout_of}
    readers = {v: [n for n in graph.nodes if v in n.inputs] for v in problem.fanout_of}
    for v in problem.fanout_of:
        assert producer[v].name and len(readers[v]) >= 2
        assert any(not n.name for n in readers[v])  # the update, outside every scope
    # one per layer's weight gradient; the repeated layers' fan-outs tied with a period of 2
    names = problem._names()
    by_layer = {}
    for f, v in enumerate(problem.fanout_of):
        m = problem.num_real + f
        layer = next(i for i in range(4) if f"layer_{i}" in names[m])
        by_layer.setdefault(layer, []).append(problem.rep[m])
    assert sorted(by_layer) == [0, 1, 2, 3]
    assert by_layer[0] == by_layer[2] and by_layer[1] == by_layer[3]
    assert by_layer[0] != by_layer[1]
    assert len(_problem(graph, fanouts="partial").fanout_of) >= len(problem.fanout_of)


def test_reduced_fan_outs_price_a_partial_value_read_several_times_once():
    """A batch norm's statistics (a partial sum where the batch is split) are read by several
    ops, forward and backward; XLA reduces them once. fanouts="reduced" gives every value
    "partial" does a fan-out, in whole layouts only. With "layers" (the gradients the update
    reads, alone) each reader paid its all-reduce: a WideResNet's plan on 2x4 kept its
    convolutions replicated and cost 1.18x the "reduced" one by the estimate."""
    from shardplan import models
    from shardplan.intra.planner import plan_intra

    step = models.get_model("wresnet", "250m", abstract=True, stage_sizes=(1, 1),
                            image_size=64)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    cost = AlphaBetaCost(MESH, get_profile("a100-80gb"))
    reduced = Problem(graph, MESH, cost, IntraOptions(fanouts="reduced"))
    partial = Problem(graph, MESH, cost, IntraOptions(fanouts="partial"))
    assert reduced.fanout_of == partial.fanout_of
    assert len(reduced.fanout_of) > len(Problem(graph, MESH, cost,
                                                IntraOptions(fanouts="layers")).fanout_of)
    for f in range(len(reduced.fanout_of)):
        assert not any(s.out_specs[0].partial for s in reduced.strategies[reduced.num_real + f])
        assert any(s.out_specs[0].partial for s in partial.strategies[partial.num_real + f])

    def total(fanouts):
        options = IntraOptions(fanouts=fanouts, seed_baselines=False)
        return plan_intra(graph, MESH, cost, options).estimate.total_s

    assert total("reduced") < 0.95 * total("layers")
    # "auto" on two axes ("reduce"): the same statistics reduced once where they are made
    assert total("auto") <= 1.01 * total("reduced")


def test_a_value_read_several_times_gets_twins_that_reshard_it_once_where_it_is_made():
    """"reduce" (auto on two axes): each strategy leaving a value read by several nodes a
    partial sum has twins, the same strategy with the value all-reduced or reduce-scattered
    onto one dimension; a cast's strategies leaving it split, twins that all-gather it over
    some minor axes (an FSDP kernel's bf16 copy, gathered once for the forward and the
    backward dot); the collectives are those the edge would have charged each reader. Values
    read once, and those a fan-out reshards, have none; tied layers share the list with its
    twins."""
    graph = _layered_step(cast=True)
    problem = _problem(graph)
    layers = _problem(graph, fanouts="layers")
    assert problem.twins and not layers.twins and problem.fanout_of == layers.fanout_of
    reads: dict[int, int] = {}
    for v in [v for node in graph.nodes for v in set(node.inputs)] + list(graph.outputs):
        reads[v] = reads.get(v, 0) + 1  # an output is written where its input is stored
    kinds = set()
    found = [(node, twin) for node in graph.nodes
             for twin in problem.strategies[problem.num_inputs + node.id] if twin in problem.twins]
    assert {twin for _, twin in found} == set(problem.twins)
    for node, twin in found:
        k, made = problem.twins[twin]
        v = node.outputs[k]
        assert reads.get(v, 0) >= 2 and v not in problem.fanout_of
        base = next(s for s in layers.strategies[problem.num_inputs + node.id]
                    if s.in_specs == twin.in_specs and s.out_specs[k] == made)
        spec = twin.out_specs[k]
        assert not spec.partial and spec != made and twin.out_specs[:k] == base.out_specs[:k]
        extra = twin.comms[len(base.comms):]
        assert extra == problem.reshards.reshard_comms(graph.values[v], made, spec)
        if made.partial:
            assert {c.kind for c in extra} <= {"all-reduce", "reduce-scatter"}
        else:  # gathered: each dimension keeps a prefix of its axes
            assert node.primitive == "convert_element_type"
            assert all(d[:len(t)] == t for d, t in zip(made.dims, spec.dims))
            assert {c.kind for c in extra} == {"all-gather"}
        kinds |= {c.kind for c in extra}
    assert {"all-gather", "all-reduce"} <= kinds
    twinned = [m for m in range(problem.num_inputs, problem.num_real)
               if any(s in problem.twins for s in problem.strategies[m])]
    assert twinned and len({id(problem.strategies[m]) for m in twinned}) < len(twinned)


def test_a_scatter_adds_partial_sum_is_reduced_whole_before_it_is_sliced():
    """An embedding's gradient made by a scatter-add, a partial sum over `model`, read split
    over `data` and `model`: XLA all-reduces it whole and slices it after (BERT's tied
    embedding on 2x4: 7% more bytes sent than the model, which sliced it on `data` first and
    reduced half of it). A dot's partial sum is sliced first, as before."""
    def step(table, idx, x, w):
        grad = jnp.zeros_like(table).at[idx].add(x)
        return grad * 2.0, (x.T @ w) * 2.0

    graph = lift(jax.make_jaxpr(step)(jnp.ones((256, 64)), jnp.zeros((32,), jnp.int32),
                                      jnp.ones((32, 64)), jnp.ones((32, 64))))
    problem = _problem(graph)
    scatter = next(n for n in graph.nodes if n.primitive == "scatter-add")
    dot = next(n for n in graph.nodes if n.primitive == "dot_general")
    src = ShardSpec(((), ()), ("model",))
    whole, dst = src.without_partial(), ShardSpec((("data",), ("model",)))
    for node, reduced_whole in ((scatter, True), (dot, False)):
        value = graph.values[node.outputs[0]]
        sliced_first = problem.cost.reshard_time(value, src, dst)
        got = problem.reshards.reshard_time(value, src, dst)
        if reduced_whole:
            assert problem.reshards.whole_first(value, src, dst) == ShardSpec(((), ("model",)))
            assert got == pytest.approx(problem.cost.reshard_time(value, src, whole))
            assert got > sliced_first
            assert [c.nbytes for c in problem.reshards.reshard_comms(value, src, dst)] == [256 * 64 * 4]
            assert [c.nbytes for c in problem.cost.reshard_comms(value, src, dst)] == [
                256 * 64 * 4 // 2]
        else:
            assert problem.reshards.whole_first(value, src, dst) is None and got == sliced_first
    # where the profile forms reduce-scatters, the whole is reduce-scattered over `model`
    tpu = Problem(graph, MESH, AlphaBetaCost(MESH, get_profile("tpu-v4")), IntraOptions())
    value = graph.values[scatter.outputs[0]]
    assert [(c.kind, c.nbytes) for c in tpu.reshards.reshard_comms(value, src, dst)] == [
        ("reduce-scatter", 256 * 64 * 4)]


def test_the_estimate_prices_a_scatter_adds_reduction_as_the_ilp_does():
    """The estimate routes the scatter-add's partial sum through whole_first's layout too: a
    reduce-scatter of the whole on a profile that forms one (not an all-reduce)."""
    from shardplan.intra import estimate

    def step(table, idx, x):
        return jnp.zeros_like(table).at[idx].add(x) * 2.0

    graph = lift(jax.make_jaxpr(step)(jnp.ones((256, 64)), jnp.zeros((32,), jnp.int32),
                                      jnp.ones((32, 64))))
    problem = Problem(graph, MESH, AlphaBetaCost(MESH, get_profile("tpu-v4")), IntraOptions())
    scatter = next(n for n in graph.nodes if n.primitive == "scatter-add")
    mul = next(n for n in graph.nodes if scatter.outputs[0] in n.inputs)
    n_in = problem.num_inputs
    src = ShardSpec(((), ()), ("model",))
    dst = ShardSpec((("data",), ("model",)))
    chosen = {m: listed[0] for m, listed in enumerate(problem.strategies)}
    chosen[n_in + scatter.id] = next(s for s in problem.strategies[n_in + scatter.id]
                                     if s.out_specs[0] == src)
    chosen[n_in + mul.id] = next(s for s in problem.strategies[n_in + mul.id]
                                 if s.in_specs[0] == dst)
    specs = {v: s.out_specs[0] for m, s in chosen.items() if m < n_in
             for v in [graph.inputs[m]]}
    for node in graph.nodes:
        for v, spec in zip(node.outputs, chosen[n_in + node.id].out_specs):
            specs[v] = spec
    _, comms, _ = estimate.estimate(problem, chosen, specs)
    into_mul = [c for where, c in comms if "into mul" in where]
    assert [(c.kind, c.nbytes) for c in into_mul] == [("reduce-scatter", 256 * 64 * 4)]
