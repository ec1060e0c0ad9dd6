"""Intra-operator planning: strategies for every node and input, costs, the ILP, and the
chosen spec of every value."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np

from shardplan import _compat, progress
from shardplan.cost.estimate import Estimate
from shardplan.cost.model import AlphaBetaCost
from shardplan.intra import estimate as estimate_mod
from shardplan.intra import experts
from shardplan.intra.memory.buffers import is_tensor
from shardplan.intra.problem import Problem
from shardplan.intra.settings import IntraOptions, SolverSettings
from shardplan.intra.solve import greedy, ilp, types
from shardplan.ir.graph import Graph
from shardplan.strategies import coverage as coverage_mod
from shardplan.strategies.base import Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec
from shardplan.units import Deadline


@dataclasses.dataclass(frozen=True, eq=False)
class IntraPlan:
    mesh: MeshShape
    input_specs: tuple[ShardSpec, ...]
    output_specs: tuple[ShardSpec, ...]
    value_specs: Mapping[int, ShardSpec]
    node_strategies: Mapping[int, Strategy]
    constrained: frozenset[int]
    estimate: Estimate
    solver: str
    optimal: bool
    num_choices: int
    search_s: float
    comms: tuple = ()  # (where, Collective) of every collective the plan expects
    # the all-reduces (and reduce-scatters) among them as XLA combines them (intra/combiner/xla.py)
    combined: tuple = ()
    notes: tuple[str, ...] = ()
    # (node id, input index) -> the layouts an operand is resharded through before the node
    operand_specs: Mapping[tuple[int, int], tuple[ShardSpec, ...]] = dataclasses.field(
        default_factory=dict)
    # value -> the layout it is constrained to where it is made, where that is not its
    # value_specs' (a gather twin's: its readers' routes gather it)
    made_specs: Mapping[int, ShardSpec] = dataclasses.field(default_factory=dict)


def _pinned(problem: Problem, inp: types.SolverInput, fixed: Mapping[int, ShardSpec]):
    """The same ILP with the inputs in `fixed` pinned (other choices of theirs forbidden), or
    None when tied inputs are pinned to different specs."""
    costs = [c.copy() for c in inp.node_costs]
    for i, spec in fixed.items():
        j = problem.index[problem.groups.root[i]]
        allowed = np.array([s.out_specs[0] == spec for s in problem.strategies[i]])
        if len(allowed) != len(costs[j]) or not allowed.any():
            return None
        costs[j] = np.where(allowed, costs[j], np.inf)
        if np.isinf(costs[j]).all():
            return None
    hint = tuple(int(np.argmin(c)) for c in costs)
    # A seed is a guard, not the search: it gets a short time limit (_solve_with_seeds gives
    # it its share of what the free solve left).
    return inp.replace(node_costs=tuple(costs), hint=hint,
                       solver=inp.solver.replace(time_limit=min(inp.solver.time_limit,
                                                                SEED_SECONDS)))


# Under a budget and a deadline, the share of the time kept from the free solve for the
# expert seeds after it, should it not prove its plan optimal: a budgeted free solve that ran
# to the end would leave them none, and they would be evaluated, each other node at its
# cheapest, not completed by the ILP (tests/test_intra_planner.py::
# test_under_a_budget_the_free_solve_leaves_the_seeds_a_share_of_the_time).
SEED_SHARE = 0.25
# The least seconds a seed's budgeted completion gets; past it, its even share of what the free
# solve left them. At 3 s each, Llama2-70B's FSDP seed, accumulated over 2 micro-batches on
# 16x16 under 15.75 GiB, was completed at 37.4 s a step where the free solve found 33.7 s and
# a 300 s one 20.8 s.
SEED_SECONDS = 3.0


def _leaving_seeds_time(inp: types.SolverInput, seeds) -> types.SolverInput:
    """`inp` for the free solve: under a budget with seeds to follow, its deadline ends early
    enough to leave them SEED_SHARE of the time (no grace past it)."""
    if not seeds or inp.deadline is None or inp.memory_budget is None:
        return inp
    left = max(0.0, inp.deadline.limit_s - inp.deadline.elapsed())
    return inp.replace(deadline=Deadline(left * (1 - SEED_SHARE), grace=0.0))


def _seeded(pinned: types.SolverInput, solver: SolverSettings) -> types.Solution:
    """The best plan with an expert's inputs. Under a budget, first as measure writes the
    expert's plan (shardplan.planning.expert_plans: the ILP around its inputs without the budget;
    fast, as no memory row keeps presolve or the LP from the problem): if that fits, nothing
    that fits is cheaper. Else the budgeted ILP, that completion as its hint."""
    if pinned.memory_budget is None:
        return ilp.solve(pinned)
    free = ilp.solve(dataclasses.replace(ilp.without_memory(pinned), solver=solver))
    obj, peak = types.evaluate(pinned, free.choice)
    if np.isfinite(obj) and peak <= pinned.memory_budget:
        return types.Solution(free.choice, obj, peak, free.optimal, free.solver)
    return ilp.solve(pinned.replace(hint=free.choice))


def _solve_with_seeds(problem: Problem, inp: types.SolverInput, options: IntraOptions):
    """Solve the ILP free and, unless that solve is proven optimal, with each expert plan's
    inputs pinned; keep the cheapest. A pinned problem is the free one with fewer choices, so
    it can only win when the free solve stopped at its time limit: the seeds are the guard
    that the plan is never worse than the experts' under the cost model. Where the proven
    optimum runs windowed einsums (_window_s), which the estimate prices and the ILP does
    not, the seeds are solved too and the candidate of the least estimate is kept.

    Every solve gets only what remains of the deadline. When it has run out, a seed is not
    solved but its pinned choice (each other node at its cheapest) is evaluated, and kept if it
    fits; when nothing that fits was found, SearchTimeout (never InfeasibleMemory, which
    needs a proof)."""
    deadline = options.deadline
    seeds = (experts.expert_inputs(problem.graph, problem.mesh)
             if options.seed_baselines and not options.fixed_inputs else {})
    candidates, notes, timeout = [], [], None
    reporter = options.solver.progress
    # the earlier candidate's specs this problem's inputs can take (the same shape and split)
    warm = {i: spec for i, spec in options.warm_inputs.items() if i < problem.num_inputs
            and any(s.out_specs[0] == spec for s in problem.strategies[i])}
    warm = _pinned(problem, inp, warm) if warm and not options.fixed_inputs else None
    if warm is not None:
        # An earlier candidate's inputs (the step as a whole's, for its accumulated step; as
        # written, for its rematerialized one): a seed solved first, whose plan, where it
        # fits, the free solve starts from (Llama2-70B in 2 micro-batches on 16x16 under
        # 15.75 GiB: the free solve held to 120 s alone ended at 37 s a step, the whole
        # step's inputs give 21 s;
        # tests/test_intra_planner.py::test_an_earlier_candidates_inputs_start_the_search)
        try:
            with progress.phase(reporter, "the ILP seeded with the earlier candidate's inputs"):
                found = _seeded(warm, inp.solver)
            candidates.append(("earlier-candidate-seeded", found))
            inp = inp.replace(hint=found.choice)
        except (types.InfeasibleMemory, types.SearchTimeout):
            pass
    try:
        with progress.phase(reporter, "the ILP"):
            candidates.append(("searched", ilp.solve(_leaving_seeds_time(inp, seeds))))
    except types.SearchTimeout as e:
        timeout = e
    free = dict(candidates).get("searched")
    proven = free is not None and free.optimal
    # the ILP's optimum is not the estimate's where it runs windowed einsums: the seeds too
    windowed = proven and _window_s(problem, free.choice) > 0
    skipped = []
    if not proven or windowed:
        for k, (name, fixed) in enumerate(seeds.items()):
            pinned = _pinned(problem, inp, fixed)
            if pinned is None:
                continue
            if deadline is not None and deadline.expired():
                if proven:  # solved for the window alone: nothing was cut short
                    break
                skipped.append(name)
                # The expert's inputs, every other node at its cheapest or as a greedy pass
                # propagates them (as XLA would): kept if it fits.
                fits = []
                for choice in (pinned.hint, *greedy.choices(pinned)):
                    obj, peak = types.evaluate(pinned, choice)
                    if np.isfinite(obj) and (inp.memory_budget is None
                                             or peak <= inp.memory_budget):
                        fits.append((obj, choice, peak))
                if fits:
                    obj, choice, peak = min(fits)
                    candidates.append((f"{name} (pinned, not searched)",
                                       types.Solution(choice, obj, peak, False, "pinned")))
                continue
            if deadline is not None:
                share = max(SEED_SECONDS, deadline.remaining() / (len(seeds) - k))
                pinned = pinned.replace(solver=pinned.solver.replace(
                    time_limit=min(inp.solver.time_limit, share)))
            try:
                with progress.phase(reporter, f"the ILP seeded with {name}'s inputs", k + 1,
                                    len(seeds)):
                    candidates.append((f"{name}-seeded", _seeded(pinned, inp.solver)))
            except (types.InfeasibleMemory, types.SearchTimeout):
                continue
    cut_short = timeout is not None or bool(skipped) or (
        not proven and deadline is not None and deadline.expired())
    candidates = [(n, s) for n, s in candidates if np.isfinite(s.objective)]
    if not candidates:
        # the time limit the caller gave (the free solve's own deadline is a share of it)
        raise types.SearchTimeout(
            deadline.limit_s if deadline else inp.solver.time_limit,
            "neither the ILP nor an expert plan's inputs gave a plan that fits in it") from timeout
    if windowed and len(candidates) > 1:
        totals = {n: estimate_mod.estimate(problem, c, _value_specs(problem, c))[0].total_s
                  for n, c in ((n, _chosen(problem, s.choice)) for n, s in candidates)}
        best_name, best = min(candidates, key=lambda c: (totals[c[0]], c[1].objective))
        notes.append("candidates (estimated step, with the windowed einsums the ILP leaves "
                     "out): " + ", ".join(f"{n} {totals[n] * 1e3:.3f} ms" for n, _ in candidates)
                     + f"; kept {best_name}")
    else:
        best_name, best = min(candidates, key=lambda c: c[1].objective)
        if len(candidates) > 1:
            notes.append("candidates (cost model objective): " + ", ".join(
                f"{n} {s.objective * 1e3:.3f} ms" for n, s in candidates)
                + f"; kept {best_name}")
    if cut_short:
        notes.append(
            f"the search was cut short by the time limit ({deadline.limit_s:g} s): this is the "
            "best plan found that fits, not a proven optimum"
            + (f"; expert plans not searched, only evaluated: {', '.join(skipped)}"
               if skipped else "") + "; raise time_limit for a better one")
    return dataclasses.replace(best, solver=f"{best.solver}, {best_name}"), notes


def _window_s(problem: Problem, choice) -> float:
    """The seconds of the TPU compiler's windowed einsums (ReshardPrices.window_time) in the
    reshards of a solution's choice: what the estimate prices and the ILP's edges leave out
    (ReshardPrices.window_time says why). Llama2-7B on v5e 4x4: the ILP's optimum runs more
    of them than FSDP's inputs completed by the ILP, whose objective is hardly higher and whose
    estimate and compiled program are lower (benchmarks/tpu_check.py's docstring)."""
    chosen = _chosen(problem, choice)
    specs = _value_specs(problem, chosen)
    graph, total = problem.graph, 0.0
    for node in graph.nodes:
        for v, dst in zip(node.inputs, chosen[problem.num_inputs + node.id].in_specs):
            if v in specs and specs[v] != dst:
                total += node.trips * problem.reshards.window_time(graph.values[v], specs[v],
                                                                   dst)
    return total


def _chosen(problem: Problem, choice) -> dict[int, Strategy]:
    """Member -> its strategy, of a solution's choice (one per root of the ILP)."""
    root_choice = {r: choice[problem.index[r]] for r in problem.roots}
    return {m: problem.strategies[m][problem.groups.pick[m][root_choice[problem.groups.root[m]]]]
            for m in range(len(problem.strategies))}


def _value_specs(problem: Problem, chosen) -> dict[int, ShardSpec]:
    """Value -> its layout where it is made (an input's chosen spec, a node's output spec)."""
    graph, n_in = problem.graph, problem.num_inputs
    specs = {v: chosen[i].out_specs[0] for i, v in enumerate(graph.inputs)}
    for node in graph.nodes:
        for v, spec in zip(node.outputs, chosen[n_in + node.id].out_specs):
            specs.setdefault(v, spec)
    return specs


def plan_intra(graph: Graph, mesh: MeshShape, cost: AlphaBetaCost,
               options: IntraOptions | None = None,
               memory_budget: float | None = None) -> IntraPlan:
    """Choose a strategy for every node and a spec for every input of `graph` on `mesh`, the
    estimated peak per device within `memory_budget` (bytes; None: unbounded)."""
    start = time.perf_counter()
    options = options or IntraOptions()
    covered = coverage_mod.coverage(graph)
    if covered.replicated:
        names = ", ".join(sorted(p for p, _, _ in covered.replicated))
        _compat.warn_at_caller(f"shardplan: no sharding rule for {names}; these ops run "
                               "replicated")
    with progress.phase(options.solver.progress, "strategies and costs"):
        problem = Problem(graph, mesh, cost, options)
        inp = problem.solver_input(memory_budget)
    try:
        solution, notes = _solve_with_seeds(problem, inp, options)
    except types.InfeasibleMemory as e:
        if not options.memory_margin:
            raise
        raise types.InfeasibleMemory(memory_budget, e.min_bytes, e.exact,
                                   margin=options.memory_margin,
                                   found_bytes=e.found_bytes) from None
    if memory_budget is not None and options.memory_margin:
        notes.append(f"the memory estimate counts the step's activations with a margin of "
                     f"{options.memory_margin:.0%} for what the memory model does not see of "
                     "XLA's buffers (its inputs and outputs exactly)")
    if covered.replicated:
        notes.append(str(covered))
    notes.extend(problem.model_pins.notes)
    whiles = sorted({loop.trips for loop in graph.loops if loop.kind == "while"})
    if whiles:
        notes.append("while loops have no trip count JAX knows: priced as running "
                     f"{', '.join(f'{t:g}' for t in whiles)} time(s) (option while_trips)")
    chosen = _chosen(problem, solution.choice)
    n_in = problem.num_inputs
    value_specs = _value_specs(problem, chosen)
    node_strategies = {}
    constrained = set()
    # value -> the layout a twin (Problem.twins) reshards it from, where the emitted program
    # reshards it in its readers' routes: a partial sum constrained whole first
    # (estimate.whole_first), a cast gathered (made: constrained as the cast made it)
    resharded_from: dict[int, ShardSpec] = {}
    made: dict[int, ShardSpec] = {}
    for node in graph.nodes:
        s = chosen[n_in + node.id]
        node_strategies[node.id] = s
        twin = problem.twins.get(s)
        for k, (v, spec) in enumerate(zip(node.outputs, s.out_specs)):
            if twin is not None and twin[0] == k and not twin[1].partial:
                # constrained gathered where it is made, XLA would run the cast itself
                # gathered, on its wider input
                resharded_from[v] = made[v] = twin[1]
                constrained.add(v)
                continue
            if twin is not None and twin[0] == k and (
                    estimate_mod.whole_first(twin[1], spec, mesh)
                    or problem.reshards.whole_first(graph.values[v], twin[1], spec) is not None):
                resharded_from[v] = twin[1]
                continue
            # Every value is pinned to its planned spec (partial sums cannot be written as a
            # sharding): left free, XLA's propagation picks other layouts for followers and
            # pays collectives the plan did not price.
            if not spec.partial and graph.values[v].ndim > 0:
                constrained.add(v)
    input_specs = tuple(value_specs[v] for v in graph.inputs)
    output_specs = []
    for j, v in enumerate(graph.outputs):
        tie = graph.output_ties[j]
        if tie is not None:
            output_specs.append(input_specs[tie])
        else:
            spec = value_specs.get(v, ShardSpec.replicated(graph.values[v].ndim))
            output_specs.append(spec.without_partial())
    estimate, comms, combined = estimate_mod.estimate(problem, chosen, value_specs)
    fanout = {v: chosen[problem.num_real + f].out_specs[0] for f, v in enumerate(problem.fanout_of)}
    operand_specs = {}
    for node in graph.nodes:
        for i, (v, dst) in enumerate(zip(node.inputs, node_strategies[node.id].in_specs)):
            if not is_tensor(graph.values[v]) or v not in value_specs or graph.values[v].ndim == 0:
                continue
            src, route = resharded_from.get(v, value_specs[v]), []
            for target in (fanout.get(v) or (value_specs[v] if v in resharded_from else None), dst):
                if target is not None and target != src:
                    mid = problem.reshards.whole_first(graph.values[v], src, target)
                    route += [mid] if mid is not None else reduced_first(src, target, mesh)
                    route += problem.cost.reshard_path(graph.values[v], mid or src, target)
                    src = target
            route = [x for k, x in enumerate(route) if not x.partial
                     and (x != value_specs[v] or v in resharded_from)
                     and (k == 0 or x != route[k - 1])]
            if route:
                operand_specs[(node.id, i)] = tuple(route)
    return IntraPlan(mesh, input_specs, tuple(output_specs), value_specs, node_strategies,
                     frozenset(constrained), estimate, solution.solver, solution.optimal,
                     len(problem.reps), time.perf_counter() - start, comms=comms,
                     combined=combined,
                     operand_specs=operand_specs, notes=tuple(notes), made_specs=made)



def reduced_first(src: ShardSpec, dst: ShardSpec, mesh: MeshShape) -> list[ShardSpec]:
    """The whole layout a partial sum is constrained to before it is split over the axes it
    was summed on, where XLA would otherwise take the slice over an idle axis
    (estimate.whole_first), or nothing."""
    return [src.without_partial()] if estimate_mod.whole_first(src, dst, mesh) else []


__all__ = ["IntraOptions", "IntraPlan", "plan_intra"]
