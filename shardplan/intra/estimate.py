"""What a chosen plan costs under the model: compute, communication (with the collectives the
plan expects, for checking against the compiled program) and peak memory per device."""

from __future__ import annotations

from shardplan.cost import collectives
from shardplan.cost.estimate import Estimate
from shardplan.intra import combiner
from shardplan.intra.problem import Problem, is_tensor
from shardplan.ir.graph import Role


def peak_bytes(problem: Problem, chosen) -> float:
    """The plan's peak bytes per device: the memory model's rows (the ILP's) at its choice."""
    model = problem.memory()
    root_choice = {}
    for r in problem.roots:
        s = chosen[r]
        root_choice[r] = next(k for k, t in enumerate(problem.strategies[r]) if t is s)
    return model.peak(root_choice)


def estimate(problem: Problem, chosen, value_specs) -> tuple[Estimate, tuple, tuple]:
    """The plan's Estimate, the collectives it expects ((where, Collective), as the strategies
    and reshards run them) and the combined all-reduces of those (combiner.Combined)."""
    g, cost = problem.graph, problem.cost
    compute = comm = comm_bytes = 0.0
    expected = []
    combinable = cost.combined_kinds
    node_reds: dict[int, list] = {}  # node id -> (trips, Collective) of the kinds XLA combines
    edge_reds: dict[int, list] = {}  # value id -> the same, of its resharding
    n_in = problem.num_inputs

    for node in g.nodes:
        m = n_in + node.id
        s = chosen.get(m)
        if s is None or m >= problem.num_real:
            continue
        c, k = cost.node_time(g, node, s)
        compute += c
        comm += k
        comm_bytes += node.trips * collectives.comms_bytes(s.comms, cost.mesh)
        expected += [(f"{node.primitive} {node.name}", c) for c in s.comms]
        node_reds[node.id] = [(node.trips, c) for c in s.comms if c.kind in combinable]

    done = set()

    def reshard(value, src, dst, where, trips=1.0):
        nonlocal comm, comm_bytes
        if src == dst or (value.ndim == 0 and not src.partial) or (value.id, src, dst) in done:
            return
        # XLA reshards a value once for all the consumers that want the same layout.
        done.add((value.id, src, dst))
        comms = cost.reshard_comms(value, src, dst)
        comm += trips * problem.reshard_time(value, src, dst)
        comm_bytes += trips * collectives.comms_bytes(comms, cost.mesh)
        expected.extend((f"{where}: {src} -> {dst}", c) for c in comms)
        edge_reds.setdefault(value.id, []).extend((trips, c) for c in comms
                                                  if c.kind in combinable)

    fanout = {v: chosen[problem.num_real + f].out_specs[0] for f, v in enumerate(problem.fanout_of)}

    def route(value, dst, where, trips=1.0):
        src = value_specs[value.id]
        mid = fanout.get(value.id, src)
        if mid != src and mid != dst:
            reshard(value, src, mid, where + " (shared)", trips)
            src = mid
        reshard(value, src, dst, where, trips)

    for node in g.nodes:
        s = chosen[n_in + node.id]
        for v, dst in zip(node.inputs, s.in_specs):
            if is_tensor(g.values[v]) and v in value_specs:
                trips = problem.edge_trips(problem.producer[v][0], n_in + node.id)
                route(g.values[v], dst, f"into {node.primitive} {node.name}", trips)
    for src, carry, trips in g.carry_edges():
        if is_tensor(g.values[src]) and src in value_specs:
            route(g.values[src], value_specs[carry], "loop carry", trips)
    for j, v in enumerate(g.outputs):
        if not is_tensor(g.values[v]) or v not in value_specs:
            continue
        tie = g.output_ties[j]
        dst = value_specs[g.inputs[tie]] if tie is not None else value_specs[v].without_partial()
        route(g.values[v], dst, f"output {j}")
    for i, v in enumerate(g.inputs):
        if v in value_specs:
            compute += problem.input_io_time(i, value_specs[v])
    for j, v in enumerate(g.outputs):
        if g.output_ties[j] is None and v in value_specs:
            compute += problem.output_io_time(g.values[v], value_specs[v].without_partial())
    state = sum(cost.value_bytes(g.values[v], value_specs[v])
                for v, r in zip(g.inputs, g.input_roles) if r == Role.STATE)
    reductions = combiner.levelled(g, node_reds, edge_reds)
    comm -= combiner.latency_saving(reductions, cost)
    estimate = Estimate(compute, comm, peak_bytes(problem, chosen), state, comm_bytes)
    return estimate, tuple(expected), tuple(combiner.combine(reductions))
