"""Tied layers cost the planner once: strategy lists, prices, follower mappings and edge
matrices are made per distinct layer, not per layer (a dropout's fold-in of its layer's seed and
the gradients' fan-outs included), the ILP does not grow with the layers, and the shared prices
are the prices member by member."""

import functools

import numpy as np

from shardplan.cost.hardware import get_profile
from shardplan.cost.model import AlphaBetaCost
from shardplan.intra.memory.buffers import is_tensor
from shardplan.intra.problem import Problem
from shardplan.intra.settings import IntraOptions
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.strategies.spec import MeshShape

MESH = MeshShape(("data", "model"), (2, 4))


@functools.cache
def _problem(num_layers: int) -> Problem:
    step = get_model("gpt", "tiny", abstract=True, num_layers=num_layers)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    return Problem(graph, MESH, AlphaBetaCost(MESH, get_profile("cpu")), IntraOptions())


def _work(problem: Problem) -> dict:
    inp = problem.solver_input()
    return {**problem.work,
            "strategy lists": len({id(s) for s in problem.strategies}),
            "ILP nodes": inp.num_nodes,
            "ILP choices": sum(len(c) for c in inp.node_costs),
            "ILP edges": len(inp.edges),
            "ILP edge entries": sum(m.size for _, _, m in inp.edges)}


def test_planning_work_does_not_grow_with_tied_layers():
    two, four, six = (_work(_problem(n)) for n in (2, 4, 6))
    assert len(_problem(6).graph.nodes) > 2 * len(_problem(2).graph.nodes)
    assert four["unary costs"] > 0 and four["edge costs"] > 0 and four["node prices"] > 0
    assert four == six
    # two layers already hold both residues of the period-2 tying: only the ILP's edges
    # between an odd layer and the next even one are new with four
    assert {k: v for k, v in two.items() if not k.startswith("ILP edge")} == \
        {k: v for k, v in four.items() if not k.startswith("ILP edge")}


def test_shared_prices_are_each_members_own():
    """edges_and_unary (each distinct member and edge priced once) against the sums member by
    member and edge by edge."""
    p = _problem(4)
    unary, edges = p.edges_and_unary()
    g, root = p.graph, p.groups.root
    want_u = {r: np.zeros(len(p.strategies[r])) for r in p.roots}
    want_e: dict = {}
    for m in range(len(p.strategies)):
        want_u[root[m]] += [p.node_cost(m, k) for k in p.groups.pick[m]]

    def edge(value, src, out_idx, dst, spec_of):
        rp, rn = root[src], root[dst]
        srcs = [p.out_spec(src, out_idx, k) for k in range(len(p.strategies[rp]))]
        if value.ndim == 0 and not any(s.partial for s in srcs):
            return
        trips = p.edge_trips(src, dst)
        if rp == rn:
            want_u[rp] += [trips * p.reshards.edge_time(value, s, spec_of(k))
                           for k, s in enumerate(srcs)]
            return
        mat = np.array([[p.reshards.edge_time(value, s, spec_of(k)) for k in
                         range(len(p.strategies[rn]))] for s in srcs])
        if mat.any():
            want_e[(rp, rn)] = want_e.get((rp, rn), 0) + trips * mat

    for node in g.nodes:
        m = p.num_inputs + node.id
        for i, v in enumerate(node.inputs):
            if is_tensor(g.values[v]) and v in p.producer:
                edge(g.values[v], *p.source[v], m, lambda k, m=m, i=i: p.in_spec(m, i, k))
    for f, v in enumerate(p.fanout_of):
        m = p.num_real + f
        edge(g.values[v], *p.producer[v], m, lambda k, m=m: p.in_spec(m, 0, k))
    for j, v in enumerate(g.outputs):
        tie = g.output_ties[j]
        if tie is not None and is_tensor(g.values[v]) and v in p.producer:
            edge(g.values[v], *p.source[v], tie, lambda k, t=tie: p.out_spec(t, 0, k))
        elif tie is None and is_tensor(g.values[v]) and v in p.producer:
            # an output not tied to an input: its write (and its partial sum's reduction)
            src, out_idx = p.producer[v]
            specs = [p.out_spec(src, out_idx, k) for k in range(len(p.strategies[root[src]]))]
            want_u[root[src]] += [
                (p.reshards.edge_time(g.values[v], s, s.without_partial()) if s.partial else 0.0)
                + p.output_io_time(g.values[v], s.without_partial()) for s in specs]
    assert p.fanout_of and any(root[m] != m for m in range(len(p.strategies)))
    for r in p.roots:
        np.testing.assert_allclose(unary[r], want_u[r], rtol=1e-12, atol=0)
    assert sorted(edges) == sorted(want_e)
    for key, mat in edges.items():
        np.testing.assert_allclose(mat, want_e[key], rtol=1e-12, atol=0)
