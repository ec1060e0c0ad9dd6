"""What the TPU compiler writes for the dots that read it (compilers.Rules.output_fusions): it
fuses an elementwise value into each dot's operand fusion that reads it, recomputed there, but
for the values `written` names. liveness.unwritten asks it."""

from __future__ import annotations

from shardplan.ir import primitives


def backward(node) -> bool:
    """A node of the backward pass (jax names what it transposes `transpose(...)`)."""
    return "transpose(" in node.name


def _dot_made(graph, node, producer, depth: int = 16) -> bool:
    """Whether `node` is an elementwise op on one dot's output alone: each of its operands of
    its size (not a broadcast) is that dot's output or, through elementwise ops, made from it
    alone (a bias add, a relu, gelu's x * cdf(x)), what the TPU compiler fuses into the dot's
    output fusion. A mask made from an iota, a second dot (SwiGLU's gate times up) or a
    reduction's result breaks it."""
    dots: set[int] = set()

    def walk(n, d) -> bool:
        if n.primitive == "dot_general":
            dots.add(n.id)
            return len(dots) == 1
        if d == 0 or primitives.info(n.primitive).family != "elementwise":
            return False
        out = max(graph.values[v].size for v in n.outputs)
        big = [u for u in n.inputs if not graph.values[u].is_literal
               and graph.values[u].size >= out]
        return bool(big) and all(
            u in producer and graph.nodes[producer[u]].primitive != "broadcast_in_dim"
            and walk(graph.nodes[producer[u]], d - 1) for u in big)
    return walk(node, depth)


# Ops the TPU compiler does not repeat in each dot's operand fusion that reads their result:
# a float division, a transcendental, or a concatenation (rotary embedding's halves).
COSTLY = frozenset({"div", "concatenate", "split", "logistic", "tanh", "erf", "exp", "log",
                    "rsqrt", "sqrt", "pow"})


def _literal(graph, v, producer) -> bool:
    """A literal, or a broadcast of one."""
    if graph.values[v].is_literal:
        return True
    node = graph.nodes[producer[v]] if v in producer else None
    return (node is not None and node.primitive == "broadcast_in_dim"
            and all(graph.values[u].is_literal for u in node.inputs))


def _costly(graph, node, producer, readers, depth: int = 16) -> bool:
    """Whether `node` or an elementwise op before it, through operands of its size that it
    alone reads (not a broadcast, not a value other ops read too), is COSTLY: attention's
    probabilities, exp over the broadcast sum, then cast; a query after its rotary embedding.
    A layer norm's output (x less its mean, times the broadcast 1/std and scale) is not, nor
    is one whose residual stream passed a dropout's division a layer before (GPT at test size
    on v5e 2x4: counted written, the model put its peak 19% over the heap)."""
    if node.primitive in COSTLY and not (node.primitive == "div" and _literal(
            graph, node.inputs[1], producer)):  # by a constant: a product, cheap
        return True
    if depth == 0 or primitives.info(node.primitive).family != "elementwise":
        return False
    out = max(graph.values[v].size for v in node.outputs)
    return any(graph.values[u].size >= out and u in producer and len(readers.get(u, ())) == 1
               and graph.nodes[producer[u]].primitive != "broadcast_in_dim"
               and _costly(graph, graph.nodes[producer[u]], producer, readers, depth - 1)
               for u in node.inputs if not graph.values[u].is_literal)


def window_operand(graph, node, rs, producer) -> bool:
    """An elementwise value of one dot's output (_dot_made: a bias add and relu or gelu) that
    two or more dots read (the next layer's, and its weight gradient's in the backward).
    Where one of them runs as a windowed einsum (a loop of collective-permutes: ReshardPrices.
    may_window), the value is the loop's operand, written whole: the dot's output fusion
    writes it beside the pre-activation (windows.operand_copies counts it); else the dots
    recompute it in their operand fusions. v5e 2x4, the MLP of tests/test_memory_tpu.py: its
    weight gradients reduce-scattered over the slice as windowed einsums, each relu written
    beside its pre-activation; its weights gathered for the dots and their gradients not
    scattered over the whole slice (the 2-D plan), one 64 MiB buffer a layer, the
    pre-activation (tests/test_memory_fit.py::
    test_an_activation_is_written_where_a_windowed_dot_reads_it)."""
    dots = [r for r in rs if graph.nodes[r].primitive == "dot_general"]
    return len(dots) >= 2 and _dot_made(graph, node, producer)


def written(graph, node, rs, producer, readers) -> bool:
    """A value two or more dots read (the next layer's dot and its weight gradient's dot in
    the backward) that the TPU compiler writes rather than recompute in each dot's operand
    fusion, whatever the plan (an activation of a dot's output is written where the plan
    windows a dot reading it: window_operand):
    - a cast to a narrower float of what a COSTLY op made (_costly): Llama2-70B's
      rematerialized backward on v5p 16x16 wrote attention's probabilities cast to bf16 (1
      GiB a chip), which the recomputed forward's dot and the value gradient's dot read, and
      the rotary-embedded queries and keys cast to bf16; the layer norm before the MLP's gate
      and up dots it fused into each. Read by dots of the forward and of the backward pass
      (Llama at test size on v5e 2x4, not rematerialized), it recomputes them in the backward
      from the exp it holds.
    tests/test_intra_liveness.py::test_tpu_writes_what_two_dots_read_when_it_is_costly."""
    dots = [r for r in rs if graph.nodes[r].primitive == "dot_general"]
    if len(dots) < 2:
        return False
    narrowed = (node.primitive == "convert_element_type" and graph.values[node.outputs[0]].itemsize
                < graph.values[node.inputs[0]].itemsize)
    same_pass = sum(backward(graph.nodes[r]) == backward(node) for r in dots) >= 2
    return narrowed and same_pass and _costly(graph, node, producer, readers)
