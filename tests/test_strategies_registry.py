"""The registry: unknown primitives get the replicated strategy alone and are reported; every
node of a transformer train step gets valid strategies, deterministically, in modest numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from shardplan.ir import primitives
from shardplan.ir.lift import LiftOptions, lift
from shardplan.strategies import coverage, registry
from shardplan.strategies.spec import MeshShape
from tests import strategies_harness as H

MESHES = [MeshShape(("x",), (8,)), MeshShape(("data", "model"), (2, 4))]
A = jnp.ones((8, 16), jnp.float32)


def _callback(x):
    return jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _custom_primitive():
    """A primitive no rule knows: x * 2 under a new name, lowered through its own impl."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("shardplan_test_double")
    prim.def_impl(lambda x: x * 2)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
    return prim


@pytest.fixture(scope="module")
def double():
    return _custom_primitive()


def test_every_family_of_the_primitive_table_has_a_rule():
    """Families are the table's and the rules' shared vocabulary: no typo on either side."""
    families = {i.family for i in primitives.PRIMITIVES.values()}
    assert families - set(registry.RULES) == {"control", "call", "replicated"}
    assert set(registry.RULES) <= families


def test_pure_callback_runs_replicated_and_is_reported():
    graph, node = H.single_node(_callback, A, primitive="pure_callback")
    assert registry.rule_of("pure_callback") is None
    assert registry.unknown_primitives(graph) == {"pure_callback"}
    for mesh in MESHES:
        (s,) = registry.strategies_for(node, graph, mesh)
        assert s.name == "replicated" and s.flops == node.flops
        assert all(x.is_replicated() for x in (*s.in_specs, *s.out_specs))


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
def test_unknown_primitive_runs_replicated_and_is_reported(double, mesh_name, request):
    graph, node = H.single_node(double.bind, A, primitive="shardplan_test_double")
    assert registry.unknown_primitives(graph) == {"shardplan_test_double"}
    (s,) = H.check_all(node, graph, request.getfixturevalue(mesh_name))
    assert s.name == "replicated" and s.flops == node.flops


def test_coverage_tells_replicated_on_purpose_from_unknown(double):
    """A callback runs replicated by design (the table says why); a primitive the table does
    not know is what coverage calls unintended."""
    graph = lift(jax.make_jaxpr(lambda a: double.bind(_callback(a)))(A))
    cov = coverage.coverage(graph)
    assert {p for p, _, _ in cov.replicated} == {"pure_callback", "shardplan_test_double"}
    assert cov.unintended == ("shardplan_test_double",)
    assert primitives.info("pure_callback").why
    assert str(cov).endswith("not in the primitive table: shardplan_test_double")


def _control_flow(x):
    y = lax.while_loop(lambda c: c.sum() < 100.0, lambda c: c * 2.0, x)
    z, _ = lax.scan(lambda c, r: (c + r, None), x[0], x)
    return lax.cond(z.sum() > 0, lambda: y, lambda: -y)


def test_control_flow_is_inlined_and_its_entries_have_rules():
    graph = lift(jax.make_jaxpr(_control_flow)(A))
    assert not registry.unknown_primitives(graph)
    assert [loop.kind for loop in graph.loops] == ["while", "scan", "cond"]
    for node in graph.nodes:
        if node.eqn is None:  # a loop's entry or exit: one layout per split of the value
            for mesh in MESHES:
                names = [s.name for s in registry.strategies_for(node, graph, mesh)]
                assert names[0] == "replicated" and len(names) > 1, (node.primitive, names)


def test_opaque_control_flow_runs_replicated_and_is_reported():
    graph = lift(jax.make_jaxpr(_control_flow)(A), options=LiftOptions(loops=False))
    unknown = registry.unknown_primitives(graph)
    assert {"while", "scan", "cond"} <= unknown
    for node in graph.nodes:
        if node.primitive in unknown:
            for mesh in MESHES:
                assert [s.name for s in registry.strategies_for(node, graph, mesh)] == [
                    "replicated"]


@pytest.mark.parametrize("mesh_name", ["mesh8", "mesh2x4"])
@pytest.mark.parametrize("case", [
    ("top_k", lambda a: lax.top_k(a, 2), (A,)),
    ("optimization_barrier", lambda a, b: lax.optimization_barrier((a, b)),
     (A, jnp.ones((16,)))),
    ("random_bits", lambda k: jax.random.bits(k, (8, 16)), (jax.random.key(0),)),
], ids=lambda c: c[0])
def test_other_rules(case, mesh_name, request):
    name, f, args = case
    graph, node = H.single_node(f, *args, primitive=name)
    assert registry.rule_of(name) is not None and not registry.unknown_primitives(graph) & {name}
    if name == "random_bits":  # key inputs: checked by hand below
        _check_random_bits(node, graph, request.getfixturevalue(mesh_name), f, args)
        return
    strategies = H.check_all(node, graph, request.getfixturevalue(mesh_name))
    assert (len(strategies) == 1) == (name == "top_k")


def _check_random_bits(node, graph, mesh, f, args):
    """Partitionable threefry: every split of the bits equals the unsharded draw, with no
    collective."""
    from jax.sharding import NamedSharding

    from shardplan.analysis import hlo

    strategies = registry.strategies_for(node, graph, MeshShape.of(mesh))
    assert len(strategies) > 1
    want = np.asarray(f(*args))
    for s in strategies:
        out = NamedSharding(mesh, s.out_specs[0].to_partition_spec())
        compiled = jax.jit(f, out_shardings=out).lower(*args).compile()
        assert not hlo.analyze(compiled).collectives, s.name
        np.testing.assert_array_equal(np.asarray(compiled(*args)), want)


def _transformer_step():
    """A one-layer transformer LM train step with Adam: embedding, attention, layer norm,
    MLP, softmax cross-entropy, and the optimizer update."""
    V, D, H_, T, B = 64, 32, 4, 16, 8
    k = iter(jax.random.split(jax.random.key(0), 8))
    params = {n: jax.random.normal(next(k), s) * 0.02 for n, s in [
        ("emb", (V, D)), ("qkv", (D, 3 * D)), ("out", (D, D)), ("w1", (D, 4 * D)),
        ("w2", (4 * D, D)), ("ln", (D,))]}
    opt = optax.adam(1e-3)

    def loss_fn(p, tokens, labels):
        x = p["emb"][tokens]
        h = (x - x.mean(-1, keepdims=True)) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
        h = h * p["ln"]
        q, kk, v = jnp.split(h @ p["qkv"], 3, axis=-1)
        q, kk, v = (t.reshape(B, T, H_, D // H_) for t in (q, kk, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / jnp.sqrt(D // H_)
        mask = jnp.tril(jnp.ones((T, T), bool))
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, T, D) @ p["out"]
        x = x + o
        x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
        logits = x @ p["emb"].T
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    def step(p, s, tokens, labels):
        loss, g = jax.value_and_grad(loss_fn)(p, tokens, labels)
        updates, s = opt.update(g, s, p)
        return optax.apply_updates(p, updates), s, loss

    tokens = jnp.zeros((B, T), jnp.int32)
    return lift(jax.make_jaxpr(step)(params, opt.init(params), tokens, tokens))


def test_every_node_of_a_train_step_gets_valid_strategies():
    graph = _transformer_step()
    assert registry.unknown_primitives(graph) == set()
    for mesh in MESHES:
        counts = []
        for node in graph.nodes:
            strategies = registry.strategies_for(node, graph, mesh)
            H.check_structure(node, graph, mesh, strategies)
            assert strategies == registry.strategies_for(node, graph, mesh)  # deterministic
            counts.append(len(strategies))
        assert max(counts) <= 64, max(counts)
        if mesh.num_devices == 8 and len(mesh.names) == 2:
            assert sum(counts) / len(counts) > 5  # most nodes can be split
