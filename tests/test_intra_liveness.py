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
    body_of = {i: {n for b in loop.bodies for n in b.nodes}
               for loop in graph.loops for i in loop.leave}  # a loop's results wait for it

    def price(node):
        freed = sum(graph.values[v].nbytes for v in set(node.inputs)
                    if left.get(v) == 1 and v in producer and v not in pinned
                    and v not in unwritten)
        made = sum(graph.values[v].nbytes for v in node.outputs
                   if v not in unwritten and v not in in_place)
        return made - freed

    while len(done) < len(nodes):
        ready = [n for n in nodes if n.id not in done
                 and all(producer[v] in done for v in n.inputs if v in producer)
                 and body_of.get(n.id, set()) <= done]
        node = min(ready, key=lambda n: (price(n), n.id))
        pos[node.id] = len(done)
        done.add(node.id)
        for v in set(node.inputs):
            if v in left:
                left[v] -= 1
    return pos


@functools.cache
def _graph(model):
    if model == "scanned gpt":
        return _scanned_gpt()
    step = get_model(model, "tiny", abstract=True, num_layers=1)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    return lift(traced.closed_jaxpr, traced.arg_info)


@pytest.mark.parametrize("model", ["gpt", "mlp", "scanned gpt"])
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


@functools.cache
def _scanned_gpt():
    step = get_model("gpt", "tiny", abstract=True, num_layers=2, scan_layers=True)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    return lift(traced.closed_jaxpr, traced.arg_info)


def _lifetimes(g, rules=None):
    from shardplan.intra.memory import compilers

    readers: dict[int, list[int]] = {}
    for node in g.nodes:
        for v in set(node.inputs):
            readers.setdefault(v, []).append(node.id)
    outputs = {v: [j] for j, v in enumerate(g.outputs)}
    virtual = liveness.unwritten(g, readers, outputs, rules or compilers.CPU)
    pos = liveness.schedule(g, frozenset(virtual))
    return readers, pos, *liveness.lifetimes(g, pos, readers, outputs, virtual)


def test_a_loops_results_wait_for_its_body():
    """A loop_result reads the carry as it enters the graph's one iteration, but the while
    loop hands its results on after its last: the schedule runs every node of a loop's body
    before its results (Llama2-70B's memory model ran the backward scan's body beside the
    forward's and peaked with both scans' attention live at once)."""
    g = _scanned_gpt()
    _, pos, _, _ = _lifetimes(g)
    assert len(g.loops) >= 2
    for loop in g.loops:
        body = [pos[n] for b in loop.bodies for n in b.nodes]
        assert body and all(pos[i] > max(body) for i in loop.leave)


def test_a_scans_inputs_are_held_through_its_loop_and_its_rows_written_in_place():
    """A value a loop reads from outside (a scan's stacked input: the forward scan's stacked
    layer inputs, which the backward scan slices) is read again each iteration: held to the
    loop's last node, not to where the graph's one iteration slices it (Llama2-70B's backward
    on v5p held its 5 GiB of stacked layer inputs through the whole backward scan). A row a
    scan writes into its stacked output is that stack's buffer: no buffer of its own past the
    op that makes it."""
    g = _scanned_gpt()
    _, pos, _, last = _lifetimes(g)
    ends = liveness.loop_ends(g, pos)
    stacks_sliced = [(n.inputs[0], n.loop) for n in g.nodes
                     if n.primitive == "loop_slice" and n.inputs[0] not in g.inputs]
    assert stacks_sliced  # the forward's stacked activations, sliced by the backward
    for v, lp in stacks_sliced:
        assert last[v] >= ends[lp]
    rows = [(v, n.id) for n in g.nodes if n.primitive == "loop_stack" for v in n.inputs]
    assert rows and all(last[v] < pos[stack] for v, stack in rows)


def test_tpu_writes_what_two_dots_read_when_it_is_costly():
    """Attention's probabilities (masked, exp over their broadcast sum, cast to bf16) that two
    dots of one pass read (a rematerialized layer's backward: the recomputed forward's dot
    with the values and the values' gradient dot): the TPU compiler writes them once
    (Llama2-70B's backward on v5p: divide_convert_fusion, 1 GiB a chip) rather than recompute
    them in each dot's operand fusion. Read by a forward dot and a backward one, it recomputes
    them in the backward from the exp it holds (Llama at test size on v5e 2x4); a layer
    norm's output read by two dots it fuses into each."""
    import jax
    import jax.numpy as jnp

    from shardplan.intra.memory import compilers

    def block(wq, wk, wv, w1, w2, x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True))
        q, k, v = h @ wq, h @ wk, h @ wv
        causal = jnp.tril(jnp.ones((128, 128), bool))  # made from iotas, not a dot
        p = jax.nn.softmax(jnp.where(causal, q @ k.T, -jnp.inf)).astype(jnp.bfloat16)
        a = x + (p @ v.astype(jnp.bfloat16)).astype(jnp.float32)  # the residual
        n = a * jax.lax.rsqrt(jnp.mean(a * a, -1, keepdims=True))
        return (n @ w1) * (n @ w2)

    def loss(*args):
        return jax.checkpoint(block)(*args).sum()

    w = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((128, 64), jnp.float32)
    traced = trace(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), (w, w, w, w, w, x), (0, 1, 2, 3, 4),
                   (5,))
    g = lift(traced.closed_jaxpr, traced.arg_info)
    dots_read = {}
    for node in g.nodes:
        if node.primitive == "dot_general":
            for u in node.inputs:
                dots_read[u] = dots_read.get(u, 0) + 1
    probs = {"transpose(" in n.name: v for n in g.nodes
             if n.primitive == "convert_element_type" for v in n.outputs
             if g.values[v].dtype == "bfloat16" and g.values[v].shape == (128, 128)}
    norm = [v for n in g.nodes if n.primitive == "mul" for v in n.outputs
            if dots_read.get(v, 0) >= 2 and g.values[v].shape == (128, 64)]
    assert set(probs) == {False, True} and dots_read[probs[True]] == 2 and norm
    _, _, tpu, _ = _lifetimes(g, compilers.TPU)
    assert probs[True] not in tpu  # two dots of the backward read the recomputed ones
    assert probs[False] in tpu  # the forward's dot alone reads the forward's
    assert all(v in tpu for v in norm)


def test_a_broadcast_literal_is_never_resharded():
    """A broadcast of a literal (attention's -inf fill) is made in whatever layout its reader
    wants: the memory model holds no reshard copy of it (Llama2-70B's backward was counted a
    2 GiB copy of one that the TPU compiler never made)."""
    import jax
    import jax.numpy as jnp

    def f(x):
        return jnp.where(x > 0, x, jnp.full(x.shape, -jnp.inf)).sum()

    g = lift(jax.make_jaxpr(f)(jnp.zeros((8, 8))))
    made = liveness.literal_broadcasts(g)
    assert len(made) == 1 and g.values[next(iter(made))].shape == (8, 8)
