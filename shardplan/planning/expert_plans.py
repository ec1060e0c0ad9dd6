"""The expert plans written out as Plans of the job's step: data parallel, FSDP, Megatron and
2-D as an expert writes them by hand (intra/experts.py holds their input shardings, the same
the ILP is seeded with), and MaxText's configuration: FSDP over the whole slice with the
scanned layers rematerialized (its remat_policy full; planning.remat), for a step that has
scanned layers. The selection (shardplan.planning.select) compiles them beside the searched
plan; the CLI's comparison compiles them as its baselines."""

from __future__ import annotations

import dataclasses
import time
import warnings

from shardplan.intra import experts
from shardplan.intra.solve.types import InfeasibleMemory, SearchTimeout
from shardplan.ir.graph import Role
from shardplan.plan import Estimate, Plan
from shardplan.planning import remat
from shardplan.planning.intra_op import plan_graph
from shardplan.planning.job import Job
from shardplan.strategies.spec import ShardSpec
from shardplan.units import Deadline


def expert_plans(job: Job, plan: Plan, *, complete: bool = True,
                 deadline: Deadline | float | None = None) -> dict[str, Plan]:
    """The expert plans for the job's step as Plans: their input specs (but the inputs the
    hints pin keep their specs), state outputs tied to their inputs.

    As an expert writes them: data parallel is its input shardings (XLA's propagation does
    what the expert would: activations split on the batch, gradients all-reduced). A plan
    that splits the state is more than its inputs: with `complete` (the ILP with those inputs
    pinned, by shardplan.planning.intra_op) every intermediate is laid out as the planner would under them:
    FSDP gathers each weight where it is read and reduce-scatters its gradient instead of
    XLA carrying the weights' split into the activations, Megatron splits its activations
    with its weights (and the vocabulary with the embedding). Without `complete`, or when
    the completion fails (time limit, memory), the inputs only, the other outputs
    replicated, XLA propagating the rest. Each completion runs without a memory budget (the
    selection judges the compiled peak) and, where its plan needs more than the job's budget,
    again under it, as the expert lays the plan out to fit (MaxText's FSDP gathers each
    layer's weights inside the scan; completed without the budget, Llama2-70B's gathered them
    all before it: 153 GiB a chip, benchmarks/tpu_check.py), kept if one is found; each
    within `deadline` (default the job's) or, given seconds, that many each: a search that
    used up a shared deadline would leave the experts their inputs alone."""
    out = {name: _written(job, plan, name, fixed, complete, deadline)
           for name, fixed in experts.expert_inputs(job.graph, plan.mesh).items()}
    maxtext = _maxtext(job, plan, complete, deadline)
    if maxtext is not None:
        out[MAXTEXT] = maxtext
    return out


# A completion under the budget gets at most REFIT_FACTOR times the seconds of the one without,
# and REFIT_MIN_S at least: Llama2-70B's MaxText configuration is laid out to fit in 3 s
# (1.3 s without the budget), where the experts that cannot fit would take all they are given.
REFIT_FACTOR = 10.0
REFIT_MIN_S = 10.0

MAXTEXT = "maxtext"
"""MaxText's configuration (its configs' ici_fsdp_parallelism=-1 and remat_policy full): the
FSDP expert of the rematerialized step, the plan marked remat."""


def _maxtext(job: Job, plan: Plan, complete: bool,
             deadline: Deadline | float | None) -> Plan | None:
    """FSDP over the slice of the step with its scanned layers rematerialized, marked remat;
    None where the step has no scanned layers to rematerialize, or is rematerialized already
    (its FSDP expert is that plan)."""
    if job.traced.remat is not None:
        return None
    rewritten = job.traced.rematerialized
    if rewritten is None:
        return None
    own = job.replace(traced=rewritten)
    fixed = experts.expert_inputs(own.graph, plan.mesh).get("fsdp")
    if fixed is None:
        return None
    written = _written(own, plan, "fsdp", fixed, complete, deadline)
    return dataclasses.replace(remat.marked(written, rewritten, "MaxText's configuration"),
                               solver=written.solver.replace("fsdp", "maxtext: fsdp", 1))


def _written(job: Job, plan: Plan, name: str, fixed: dict[int, ShardSpec], complete: bool,
             deadline: Deadline | float | None) -> Plan:
    """One expert plan of the job's step from its input specs `fixed` (see expert_plans)."""
    graph, pinned = job.graph, job.pinned
    inputs = tuple(pinned.get(i, fixed[i]) for i in range(len(graph.inputs)))
    splits = experts.splits_state(inputs, graph.input_roles)
    written, budget = None, job.options.memory_budget
    if complete and splits:
        free = job.replace(options=job.options.replace(memory_budget=None))
        start = time.perf_counter()
        written = _complete(free, deadline, dict(enumerate(inputs)))
        if written is not None and budget is not None and written.estimate.peak_bytes > budget:
            held = _held_to(job, deadline,
                            max(REFIT_MIN_S, REFIT_FACTOR * (time.perf_counter() - start)))
            if held is not None:
                written = _complete(*held, dict(enumerate(inputs))) or written
    if written is not None:
        return dataclasses.replace(
            written, notes=(), solver=f"{name} (the expert's input shardings"
            f"{', hints pinned' if pinned else ''}; the ILP lays out the rest)")
    outputs = tuple(inputs[tie] if tie is not None else
                    ShardSpec.replicated(graph.values[v].ndim)
                    for v, tie in zip(graph.outputs, graph.output_ties))
    state = sum(graph.values[v].nbytes / s.num_shards(plan.mesh)
                for v, s, r in zip(graph.inputs, inputs, graph.input_roles) if r == Role.STATE)
    return dataclasses.replace(
        plan, input_specs=inputs, output_specs=outputs, constraints={}, operand_specs={},
        ops=(), notes=(), remat=False, estimate=Estimate(0.0, 0.0, 0.0, state),
        solver=f"{name} (the expert's input shardings{', hints pinned' if pinned else ''}; "
               "XLA propagates the rest)")


def _held_to(job: Job, deadline: Deadline | float | None, cap: float
             ) -> tuple[Job, Deadline] | None:
    """The job and its completion's deadline held to `cap` seconds (or what `deadline` leaves,
    if less; None when it leaves none), its deterministic work limits too."""
    d = job.deadline if deadline is None else deadline
    seconds = min(cap, d.limit_s - d.elapsed() if isinstance(d, Deadline) else d)
    if seconds <= 0:
        return None
    return job.replace(options=job.options.replace(time_limit=seconds)), Deadline(seconds)


def _complete(job: Job, deadline: Deadline | float | None, fixed: dict[int, ShardSpec]
              ) -> Plan | None:
    """The plan the ILP completes around the `fixed` inputs, or None when it cannot."""
    own = Deadline(deadline) if isinstance(deadline, (int, float)) else deadline
    try:
        with warnings.catch_warnings():  # the searched plan has warned about the same graph
            warnings.simplefilter("ignore")
            return plan_graph(job, deadline=own, fixed_inputs=fixed)[0]
    except (InfeasibleMemory, SearchTimeout):
        return None
