"""What a chosen plan costs under the model: compute, communication (with the collectives the
plan expects, for checking against the compiled program) and peak memory per device."""

from __future__ import annotations

from shardplan.cost import collectives
from shardplan.cost.estimate import Estimate
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


def _combinable(cost) -> frozenset[str]:
    """Collective kinds XLA's combiner merges when independent: all-reduces, and the
    reduce-scatters an accelerator forms of them (analysis/price.py prices the combined
    all-reduce of XLA:CPU as one reduce-scatter there)."""
    return frozenset({"all-reduce", "reduce-scatter"} if cost.hardware.forms_reduce_scatter
                     else {"all-reduce"})


def combined_latency_saving(reductions, cost) -> float:
    """Seconds of latency XLA's all-reduce combiner saves: independent reductions of one kind
    over the same axes run as one collective, paying the ring's latency steps once.

    `reductions`: (level, trips, Collective) where level counts the reductions on the
    longest path of the graph up to this one, so two of one level never depend on each
    other (measured: XLA:CPU merges every gradient all-reduce of GPT-2 124M on 8 devices into
    one tuple all-reduce). A correction to the estimate; the ILP prices each collective
    alone."""
    groups: dict[tuple, list[float]] = {}
    for level, trips, c in reductions:
        n = cost.mesh.size(c.axes) if c.axes else 1
        link = collectives.slowest_link(c.axes, cost.mesh, cost.links) if c.axes else None
        if link is None or n <= 1 or c.nbytes <= 0:
            continue
        steps = collectives.latency_steps(c.kind, n) * link.latency
        groups.setdefault((level, trips, c.kind, tuple(sorted(c.axes))), []).append(steps)
    return sum(trips * (sum(v) - max(v)) for (_, trips, _, _), v in groups.items())


def _levelled(g, node_reds, edge_reds) -> list:
    """(level, trips, Collective) for every reduction: level counts the reductions on the
    longest path up to it (a value resharded with a reduction counts one on every path
    through it)."""
    level: dict[int, int] = {}
    out = []
    for node in g.nodes:
        lv = max((level.get(v, 0) + bool(edge_reds.get(v)) for v in node.inputs), default=0)
        if node_reds.get(node.id):
            lv += 1
            out += [(lv, t, c) for t, c in node_reds[node.id]]
        for v in node.outputs:
            level[v] = lv
    for v, reds in edge_reds.items():
        out += [(level.get(v, 0) + 1, t, c) for t, c in reds]
    return out


def estimate(problem: Problem, chosen, value_specs) -> tuple[Estimate, tuple]:
    g, cost = problem.graph, problem.cost
    compute = comm = comm_bytes = 0.0
    expected = []
    combinable = _combinable(cost)
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
    comm -= combined_latency_saving(_levelled(g, node_reds, edge_reds), cost)
    estimate = Estimate(compute, comm, peak_bytes(problem, chosen), state, comm_bytes)
    return estimate, tuple(expected)
