"""What a chosen plan costs under the model: compute, communication (with the collectives the
plan expects, for checking against the compiled program) and peak memory per device."""

from __future__ import annotations

from shardplan.cost import collectives
from shardplan.cost.estimate import Estimate
from shardplan.intra.combiner import xla
from shardplan.intra.memory.buffers import is_tensor
from shardplan.intra.problem import Problem
from shardplan.ir.graph import Role
from shardplan.strategies.base import Collective
from shardplan.strategies.spec import MeshShape, ShardSpec


def peak_bytes(problem: Problem, chosen) -> float:
    """The plan's peak bytes per device: the memory model's rows (the ILP's) at its choice."""
    model = problem.memory()
    root_choice = {}
    for r in problem.roots:
        s = chosen[r]
        root_choice[r] = next(k for k, t in enumerate(problem.strategies[r]) if t is s)
    return model.peak(root_choice)


def stale_partials(problem: Problem, chosen, value_specs, fanout) -> dict[int, frozenset]:
    """Value id -> the partial axes of its spec that XLA has already reduced: XLA reduces a
    partial sum once, where the first reader needs it whole, and every reader then reads the
    sum: a reader that reads it partial reads the reduced sum, and what it computes from it
    is never reduced over those axes again (tests/test_intra_reduce_scatter.py::
    test_a_sum_constrained_whole_another_reader_reads_partial_is_all_reduced). A node's
    output is stale over an axis when each input it reads partial over that axis is reduced
    or stale over it."""
    g, n_in = problem.graph, problem.num_inputs
    wanted: dict[int, list] = {}  # value id -> the specs its readers want
    for node in g.nodes:
        for v, dst in zip(node.inputs, chosen[n_in + node.id].in_specs):
            wanted.setdefault(v, []).extend((fanout.get(v, dst), dst))
    for j, v in enumerate(g.outputs):
        tie = g.output_ties[j]
        wanted.setdefault(v, []).append(value_specs[g.inputs[tie]] if tie is not None else
                                        value_specs.get(v, None))
    for src, carry, _ in g.carry_edges():
        wanted.setdefault(src, []).append(value_specs.get(carry))
    stale: dict[int, frozenset] = {}
    summed: dict[int, frozenset] = {}  # value id -> partial axes XLA has reduced or never had

    def whole(v) -> frozenset:
        if v not in summed:
            p = value_specs[v].partial if v in value_specs else ()
            reduced = {a for a in p for d in wanted.get(v, ()) if d is not None
                       and a not in d.partial}
            summed[v] = frozenset(reduced) | stale.get(v, frozenset())
        return summed[v]

    for node in g.nodes:
        reads = [(v, d) for v, d in zip(node.inputs, chosen[n_in + node.id].in_specs)
                 if d.partial and v in value_specs]
        if not reads:
            continue
        for v in node.outputs:
            p = value_specs[v].partial if v in value_specs else ()
            axes = [a for a in p if any(a in d.partial for _, d in reads)
                    and all(a in whole(u) for u, d in reads if a in d.partial)]
            if axes:
                stale[v] = frozenset(axes)
    return stale


def partial_origins(problem: Problem, chosen, value_specs) -> dict[int, tuple[frozenset, ...]]:
    """Value id -> its partial axes grouped by the node and operand dimension that made them
    partial, for values partial over two or more such groups. XLA reduces each group with
    its own all-reduce (a layer norm's scale gradient summed over the batch split on one axis
    and the sequence split on the other is all-reduced once over each axis, each joining the
    combined all-reduce of its axis: tests/test_intra_combiner.py::
    test_combined_all_reduces_as_compiled), where a sum over
    one dimension split on both axes is one all-reduce over all their devices."""
    g, n_in = problem.graph, problem.num_inputs
    groups: dict[int, tuple[frozenset, ...]] = {}
    for node in g.nodes:
        reads = [(v, d) for v, d in zip(node.inputs, chosen[n_in + node.id].in_specs)
                 if d.partial]
        for v in node.outputs:
            p = set(value_specs[v].partial) if v in value_specs else set()
            if not p:
                continue
            mine = []
            for u, d in reads:
                for grp in groups.get(u, (frozenset(d.partial),)):
                    if grp & p and grp & p not in mine:
                        mine.append(grp & p)
            made = p - set().union(*mine) if mine else p
            # what the node sums over: an axis per dimension of its operands
            for _, d in (*reads, *zip(node.inputs, chosen[n_in + node.id].in_specs)):
                for dim in d.dims:
                    if made & set(dim):
                        mine.append(frozenset(made & set(dim)))
                        made -= set(dim)
            if made:
                mine.append(frozenset(made))
            if len(mine) > 1:
                groups[v] = tuple(mine)
    return groups


def whole_first(src: ShardSpec, dst: ShardSpec, mesh: MeshShape) -> bool:
    """Whether the emitted program constrains a partial sum whole before `dst` splits it over
    the axes it was summed on (what the model prices as a reduce-scatter: an all-reduce and
    a slice): where a mesh axis neither layout uses has a multiple of their devices. Left to
    itself XLA's partitioner computes such a sum on a slice taken over that idle axis,
    all-reduces the slice and moves it to its devices with a collective-permute over both
    axes, which no plan priced; constrained whole first, it runs the all-reduce and slice
    the model priced, which GPU and TPU compilers form into a reduce-scatter. With no idle
    axis XLA runs that already, and a whole layout constrained on the way costs more
    (tests/test_intra_reduce_scatter.py::
    test_a_gradient_split_over_its_summed_axis_compiles_as_planned_on_an_idle_axis and
    test_reduced_first_only_where_an_idle_axis_could_hold_the_slice)."""
    if not src.partial or dst.partial:
        return False
    scattered = set(src.partial) & {a for d in dst.dims for a in d}
    if not scattered:
        return False
    used = set(src.used_axes()) | set(dst.used_axes())
    size = mesh.size(tuple(sorted(scattered)))
    return any(a not in used and mesh.size((a,)) % size == 0 for a in mesh.useful_axes())


def scattered_whole(src: ShardSpec, dst: ShardSpec, read_partial, mesh: MeshShape) -> bool:
    """Whether the all-reduce of a partial sum constrained whole (whole_first) is read whole,
    not sliced: when another reader reads the value partial over the scattered axes, XLA
    hands it the whole sum the constraint made (stale_partials), and runs no reduce-scatter
    (tests/test_intra_reduce_scatter.py::
    test_a_sum_constrained_whole_another_reader_reads_partial_is_all_reduced)."""
    if not whole_first(src, dst, mesh):
        return False
    return bool(set(src.partial) & {a for d in dst.dims for a in d} & set(read_partial))


def estimate(problem: Problem, chosen, value_specs) -> tuple[Estimate, tuple, tuple]:
    """The plan's Estimate, the collectives it expects ((where, Collective), as the strategies
    and reshards run them) and the combined all-reduces of those (xla.Combined)."""
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
        comms = cost.node_comms(s)
        comm_bytes += node.trips * collectives.comms_bytes(comms, cost.mesh)
        expected += [(f"{node.primitive} {node.name}", c) for c in comms]
        node_reds[node.id] = [(node.trips, c) for c in comms if c.kind in combinable]

    done = set()
    fanout = {v: chosen[problem.num_real + f].out_specs[0] for f, v in enumerate(problem.fanout_of)}
    stale = stale_partials(problem, chosen, value_specs, fanout)
    read_partial: dict[int, set] = {}  # value id -> the axes a reader reads it partial over
    for node in g.nodes:
        for v, d in zip(node.inputs, chosen[n_in + node.id].in_specs):
            read_partial.setdefault(v, set()).update(d.partial)
    origins = partial_origins(problem, chosen, value_specs)

    def reshard(value, src, dst, where, trips=1.0):
        nonlocal compute, comm, comm_bytes
        gone = stale.get(value.id)
        if gone:  # what XLA has summed already is read whole
            src, dst = (x.with_partial([a for a in x.partial if a not in gone])
                        for x in (src, dst))
        if src == dst or (value.ndim == 0 and not src.partial) or (value.id, src, dst) in done:
            return
        mid = (problem.reshards.whole_first(value, src, dst)  # reduced before it is sliced
               or problem.reshards.all_reduced_first(value, src, dst))
        if mid is None and scattered_whole(src, dst, read_partial.get(value.id, ()), cost.mesh):
            mid = src.without_partial()
        if mid is not None:
            reshard(value, src, mid, where, trips)
            reshard(value, mid, dst, where, trips)
            return
        # XLA reshards a value once for all the consumers that want the same layout.
        done.add((value.id, src, dst))
        compute += trips * problem.reshards.window_time(value, src, dst)
        comms = cost.reshard_comms(value, src, dst)
        split = [grp & set(src.partial) for grp in origins.get(value.id, ())]
        split = [tuple(a for a in src.partial if a in grp) for grp in split if grp]
        if (len(split) > 1 and not dst.partial and len(comms) == 1
                and comms[0].kind == "all-reduce" and set(comms[0].axes) == set(src.partial)):
            comms = tuple(Collective("all-reduce", axes, comms[0].nbytes) for axes in split)
            comm += trips * collectives.comms_time(comms, cost.mesh, cost.links)
        else:
            comm += trips * problem.reshards.reshard_time(value, src, dst)
        comm_bytes += trips * collectives.comms_bytes(comms, cost.mesh)
        expected.extend((f"{where}: {src} -> {dst}", c) for c in comms)
        edge_reds.setdefault(value.id, []).extend((trips, c) for c in comms
                                                  if c.kind in combinable)

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
    alone = xla.loss_alone(g, problem.loss_values(), node_reds, edge_reds)
    reductions = xla.levelled(g, node_reds, edge_reds, alone=alone)
    comm -= xla.latency_saving(reductions, cost)
    estimate = Estimate(compute, comm, peak_bytes(problem, chosen), state, comm_bytes)
    return estimate, tuple(expected), tuple(xla.combine(reductions))
