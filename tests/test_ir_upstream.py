"""Graph.upstream, the walk back from values, against the fixed point it replaced (every node
in reverse program order, loop carries backwards, until nothing is added), on a scanned GPT
whose loops carry values back."""

import pytest

from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.models import get_model


def _fixed_point(g, seeds, heads=frozenset()):
    found = set(seeds)
    changed = True
    while changed:
        changed = False
        for node in reversed(g.nodes):
            if node.primitive in heads or any(v in found for v in node.outputs):
                for v in set(node.inputs) - found:
                    found.add(v)
                    changed = True
        for src, carry, _ in g.carry_edges():
            if carry in found and src not in found:
                found.add(src)
                changed = True
    return found


@pytest.mark.parametrize("scan", [False, True])
def test_upstream_is_the_fixed_point(scan):
    step = get_model("gpt", abstract=True, scan_layers=scan)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    g = lift(traced.closed_jaxpr, traced.arg_info)
    assert bool(g.carry_edges()) == scan
    tied = {v for v, tie in zip(g.outputs, g.output_ties) if tie is not None}
    untied = set(g.outputs) - tied
    heads = frozenset({"dot_general"})
    for seeds, hs in ((tied, frozenset()), (untied, frozenset()), ((), heads), (untied, heads)):
        assert g.upstream(seeds, hs) == _fixed_point(g, seeds, hs)
        assert g.upstream(seeds, hs) is g.upstream(seeds, hs)  # asked again: kept
