"""emit/jit.py: the planned step as one jax.jit, its operands moved through the plan's layouts."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from shardplan.analysis.hlo import analyze
from shardplan.emit import jit
from shardplan.ir.lift import lift
from shardplan.strategies.spec import ShardSpec
from tests.conftest import auto_mesh


def _spec(*dims):
    return ShardSpec(tuple(() if d is None else tuple(d) for d in dims))


def test_readers_moving_a_value_through_the_same_layouts_share_one_reshard(devices):
    """Adam's two moments read a gradient through [(m, d)] -> [(d, m)] (WResNet 250M on 2x4):
    emitted as one chain of constraints per reader, XLA ran the all-to-all once but the final
    collective-permute once per reader; the plan prices one reshard per value and layout."""
    mesh = auto_mesh((2, 4), ("d", "m"))
    x = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.float32)

    def moments(g, mu, nu):
        return mu * 0.9 + 0.1 * g, nu * 0.99 + 0.01 * jnp.square(g)

    graph = lift(jax.make_jaxpr(moments)(x, x, x))
    g = graph.inputs[0]
    src = _spec(None, None, "d", "m")
    route = (_spec(None, None, None, ("m", "d")), _spec(None, None, None, ("d", "m")))
    readers = {(n.id, i): route for n in graph.nodes for i, v in enumerate(n.inputs) if v == g}
    assert len(readers) == 2
    run = jit.graph_fn(graph, mesh, {}, readers)
    shard = lambda s: NamedSharding(mesh, s.to_partition_spec())
    compiled = jax.jit(lambda *a: tuple(run(*a)), in_shardings=(shard(src), shard(route[-1]),
                                                         shard(route[-1])),
                       out_shardings=(shard(route[-1]),) * 2).lower(x, x, x).compile()
    kinds = sorted(op.kind for op in analyze(compiled).collectives)
    assert kinds == ["all-to-all", "collective-permute"]
