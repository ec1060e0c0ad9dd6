"""The list schedule (intra/memory/liveness.py schedule) against its definition, evaluated afresh at
every step: of the nodes whose operands are ready, run the one that allocates the least net of
what it frees (ties: program order). The heap it runs on re-prices only the nodes a run
changes; this checks that it never runs a node at a stale price."""

import functools

import pytest

from shardplan.intra.memory import liveness
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.models import get_model


def reference_schedule(graph, unwritten=frozenset(), in_place=frozenset()) -> list[int]:
    nodes = graph.nodes
    producer = {v: node.id for node in nodes for v in node.outputs}
    pinned = set(graph.outputs)
    left: dict[int, int] = {}
    for node in nodes:
        for v in set(node.inputs):
            if v in producer:
                left[v] = left.get(v, 0) + 1
    done: set[int] = set()
    pos = [0] * len(nodes)

    def price(node):
        freed = sum(graph.values[v].nbytes for v in set(node.inputs)
                    if left.get(v) == 1 and v in producer and v not in pinned
                    and v not in unwritten)
        made = sum(graph.values[v].nbytes for v in node.outputs
                   if v not in unwritten and v not in in_place)
        return made - freed

    while len(done) < len(nodes):
        ready = [n for n in nodes if n.id not in done
                 and all(producer[v] in done for v in n.inputs if v in producer)]
        node = min(ready, key=lambda n: (price(n), n.id))
        pos[node.id] = len(done)
        done.add(node.id)
        for v in set(node.inputs):
            if v in left:
                left[v] -= 1
    return pos


@functools.cache
def _graph(model):
    step = get_model(model, "tiny", abstract=True, num_layers=1)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    return lift(traced.closed_jaxpr, traced.arg_info)


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_schedule_is_the_list_schedule_it_defines(model):
    g = _graph(model)
    readers: dict[int, list[int]] = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    outputs: dict[int, list[int]] = {}
    for j, v in enumerate(g.outputs):
        outputs.setdefault(v, []).append(j)
    unwritten = frozenset(liveness.unwritten(g, readers, outputs))
    tied = frozenset(v for j, v in enumerate(g.outputs) if g.output_ties[j] is not None)
    assert liveness.schedule(g) == reference_schedule(g)
    assert liveness.schedule(g, unwritten, tied) == reference_schedule(g, unwritten, tied)


def test_a_layer_norms_product_of_broadcasts_is_never_written():
    """A layer norm's 1/std [b, s, 1] times its scale [1, 1, h] (flax's LayerNorm): XLA:CPU
    fuses the product into each of its readers (the forward's normalization and the
    backward's) and writes neither it nor its broadcast operands (--xla_dump_to, GPT at test
    size on 8 devices and gpt-6.7b on 8x8, where holding it to the backward had the memory
    model count 0.5 GiB a layer that XLA does not hold)."""
    g = _graph("gpt")
    readers: dict[int, list[int]] = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    virtual = liveness.unwritten(g, readers, {v: [j] for j, v in enumerate(g.outputs)})
    products = [v for node in g.nodes if node.primitive == "mul" and "ln" in node.name
                for v in node.outputs
                if all(g.values[u].size < g.values[v].size for u in node.inputs)]
    assert products and all(v in virtual for v in products)


def test_a_value_a_loop_reads_from_outside_is_written():
    """XLA passes a loop's constants into its while loop as operands: the body's fusions cannot
    take in their producers, so a broadcast made outside a scan and read inside it is written
    whole and held through the loop (Llama2-7B's causal mask, broadcast to [b, heads, t, t]
    before the layers' scans, where JAX hoists what they read alike: 2 GiB the TPU compiler
    held through both scans of v5e 4x4, benchmarks/tpu_check.py). A broadcast of a literal is
    sunk into the body and fused there (the mask's -inf alongside it)."""
    import jax
    import jax.numpy as jnp

    def step(x, w):
        rows = jnp.arange(8)
        mask = jnp.broadcast_to(rows[:, None] >= rows[None, :], (4, 8, 8))
        low = jnp.full((4, 8, 8), -1e9, jnp.float32)

        def body(c, wi):
            return jnp.tanh(jnp.where(mask, c @ wi, low)), None

        return jax.lax.scan(body, x, w)[0].sum()

    g = lift(jax.make_jaxpr(step)(jnp.zeros((4, 8, 8)), jnp.zeros((3, 8, 8))))
    readers: dict[int, list[int]] = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    virtual = liveness.unwritten(g, readers, {v: [j] for j, v in enumerate(g.outputs)})
    outside = {node.primitive if not node.inputs or not g.values[node.inputs[0]].is_literal
               else "literal " + node.primitive: v for node in g.nodes if node.loop is None
               and node.primitive == "broadcast_in_dim" for v in node.outputs
               if g.values[v].shape == (4, 8, 8)}
    assert set(outside) == {"broadcast_in_dim", "literal broadcast_in_dim"}
    assert outside["broadcast_in_dim"] not in virtual  # the mask: a loop operand
    assert outside["literal broadcast_in_dim"] in virtual  # sunk into the body
