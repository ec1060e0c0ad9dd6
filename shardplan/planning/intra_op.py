"""The intra-op candidate: one program of the job's step on its mesh, each value's layout
chosen by the ILP under the cost model (shardplan.intra), as a Plan with each node's compute
and communication. Nothing here compiles or runs a program."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardplan.cost import collectives
from shardplan.cost.hardware import HardwareProfile
from shardplan.cost.model import AlphaBetaCost
from shardplan.intra.options import intra_options
from shardplan.intra.planner import IntraPlan, plan_intra
from shardplan.intra.reshard_prices import ReshardPrices
from shardplan.ir.graph import Graph
from shardplan.ir.trace import TracedStep
from shardplan.options import DEFAULTS, SearchOptions
from shardplan.plan import OpRow, Plan
from shardplan.planning import zero
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import Deadline


def plan_graph(job: Job, *, ilp_budget: float | None = None, deadline: Deadline | None = None,
               fixed_inputs: dict[int, ShardSpec] | None = None,
               combine_gradients: bool | None = None) -> tuple[Plan, IntraPlan]:
    """The intra-op plan of the job's lifted step, the ILP held to `ilp_budget` (default the
    options' memory budget; the plan reports the options' budget) and ending by `deadline`
    (default the job's). `fixed_inputs` (flat input index -> spec) are pinned besides the
    hints' pins, which win; `combine_gradients`: IntraOptions' (None: its default; False for
    an SPMD pipeline's stage programs)."""
    graph, traced, options = job.graph, job.traced, job.options
    cost = AlphaBetaCost(job.mesh, job.hw, job.device_order)
    budget = options.memory_budget if ilp_budget is None else ilp_budget
    fixed = {**(fixed_inputs or {}), **job.pinned}
    intra = plan_intra(graph, job.mesh, cost, intra_options(
        options, fixed, deadline=deadline or job.deadline, donated=job.donated,
        combine_gradients=combine_gradients, compiler=job.hw.backend, progress=job.progress,
        least_memory=job.least_memory, warm_inputs=job.warm_inputs), budget)
    ops = tuple(op_rows(graph, cost, intra))
    plan = Plan(
        mesh=job.mesh, hardware=job.hw.name,
        input_names=traced.arg_info.input_names, input_specs=intra.input_specs,
        output_names=traced.arg_info.output_names, output_specs=intra.output_specs,
        constraints={v: intra.made_specs.get(v, intra.value_specs[v])
                     for v in sorted(intra.constrained)},
        estimate=intra.estimate, operand_specs=dict(intra.operand_specs),
        memory_budget=options.memory_budget, ops=ops,
        zero=zero.describe(graph, intra.input_specs, job.mesh),
        search_s=job.deadline.elapsed(), notes=intra.notes + _pinned_note(job.pinned, traced),
        solver=f"{intra.solver}{' (optimal)' if intra.optimal else ''}, "
               f"{intra.num_choices} choices",
        in_tree=traced.in_tree, out_tree=traced.out_tree, device_mesh=job.device_mesh)
    return plan, intra


def _pinned_note(fixed, traced: TracedStep) -> tuple[str, ...]:
    if not fixed:
        return ()
    n = len(traced.in_avals)
    return (f"hints pinned {len(fixed)} of {n} inputs; the ILP planned the rest",)


def op_rows(graph: Graph, cost: AlphaBetaCost, intra: IntraPlan) -> list[OpRow]:
    """Each node's compute and communication: its strategy's own collectives, and resharding
    its operands into the layouts it reads (counted at the first node that reads a value in a
    layout: XLA reshards once for all of them; the memory time of a windowed einsum's
    reduce-scatter on TPU in its compute, as the estimate counts it)."""
    specs, seen, rows = intra.value_specs, set(), []
    producer = {v: node.id for node in graph.nodes for v in node.outputs}
    n_in = len(graph.inputs)
    prices = ReshardPrices(graph, cost.mesh, cost, {
        v: (n_in + node.id, k) for node in graph.nodes for k, v in enumerate(node.outputs)},
        n_in, lambda _: False)

    def trips_at(node_id: int | None, side: str) -> float:
        # a loop's entry reads, and its exit writes, a value of the enclosing level: resharded
        # as often as the rarer side runs (intra.problem.Problem.edge_trips)
        if node_id is None:
            return 1.0
        node = graph.nodes[node_id]
        trips = node.trips
        if node.loop is not None and node_id in getattr(graph.loops[node.loop], side):
            trips /= graph.loops[node.loop].trips
        return trips

    for node in graph.nodes:
        s = intra.node_strategies[node.id]
        c, k = cost.node_time(graph, node, s)
        for v, dst in zip(node.inputs, s.in_specs):
            src = specs.get(v)
            if src is None or src == dst or (v, src, dst) in seen:
                continue
            seen.add((v, src, dst))
            comms = cost.reshard_comms(graph.values[v], src, dst)
            trips = min(trips_at(node.id, "enter"), trips_at(producer.get(v), "leave"))
            k += trips * collectives.comms_time(comms, cost.mesh, cost.links)
            c += trips * prices.window_time(graph.values[v], src, dst)
        rows.append(OpRow(node.primitive, node.name, s.name, c, k))
    # what a loop body hands its next iteration, resharded into the carry's layout (as the
    # ILP prices it: intra.problem), on the carry's loop_carry row
    for src, carry, trips in graph.carry_edges():
        a, b = specs.get(src), specs.get(carry)
        if a is None or b is None or a == b or carry not in producer:
            continue
        comms = cost.reshard_comms(graph.values[src], a, b)
        row = rows[producer[carry]]
        rows[producer[carry]] = dataclasses.replace(
            row, comm_s=row.comm_s + trips * collectives.comms_time(comms, cost.mesh, cost.links))
    return rows


def plan_step(traced: TracedStep, mesh_shape: MeshShape, hw: HardwareProfile,
              options: SearchOptions = DEFAULTS, *, device_mesh=None,
              donate_argnums: Sequence[int] | None = None,
              combine_gradients: bool | None = None) -> tuple[Plan, Graph, IntraPlan]:
    """One program of the traced step planned on `mesh_shape` priced as `hw`, a job of its
    own (Job.make): (the Plan, the lifted graph it is for, the intra-op plan)."""
    job = Job.make(traced, mesh_shape, hw, options, device_mesh=device_mesh,
                   donate_argnums=donate_argnums)
    plan, intra = plan_graph(job, combine_gradients=combine_gradients)
    return plan, job.graph, intra
