"""A scan's stacked weights cast before the loop: the TPU compiler casts the whole stack of a
scan's input whose slice the body casts to a narrower float (f32 weights to bf16), slices the
cast in each iteration, and holds it to the end of the last loop slicing it (one cast for the
forward and the backward scan). intra/memory/model.py adds these buffers (Rules.
hoisted_stack_converts)."""

from __future__ import annotations

from shardplan.intra.memory import liveness
from shardplan.intra.memory.buffers import Buffer


def hoisted_casts(model, sizes, readers) -> list[Buffer]:
    """One buffer per stacked input cast in its scan's body: the cast slice in its layout
    times the loop's iterations, from the first loop slicing it to the last one's end.
    Llama2-70B on v5p 16x16 (the rematerialized step, layers scanned) held bf16 casts of its
    three f32 MLP stacks, 140 MiB each a chip, through the backward scan
    (tests/test_memory_fit.py::test_a_stacked_weight_cast_in_its_scan_is_cast_whole_before_it_on_tpu)."""
    if not model.rules.hoisted_stack_converts:
        return []
    p, g, pos = model.problem, model.problem.graph, model.pos
    ends = liveness.loop_ends(g, pos)
    starts = {loop.id: min((pos[n] for b in loop.bodies for n in b.nodes + loop.enter),
                           default=0) for loop in g.loops}
    casts: dict[int, list] = {}
    for node in g.nodes:
        if node.primitive != "loop_slice" or node.loop is None:
            continue
        x, xs = node.outputs[0], node.inputs[0]
        for r in readers.get(x, ()):
            cast = g.nodes[r]
            out = g.values[cast.outputs[0]]
            if (cast.primitive == "convert_element_type" and "float" in out.dtype
                    and out.itemsize < g.values[x].itemsize):
                m = p.num_inputs + cast.id
                nbytes = model.scale * g.loops[node.loop].trips * sizes(cast.outputs[0], m, 0)
                held = casts.setdefault(xs, [p.groups.root[m], nbytes, starts[node.loop],
                                             ends[node.loop], cast.name])
                held[2] = min(held[2], starts[node.loop])
                held[3] = max(held[3], ends[node.loop])
                break
    return [Buffer(r, nbytes, a, b, f"v{xs} cast whole before its scan for {name}")
            for xs, (r, nbytes, a, b, name) in casts.items()]
