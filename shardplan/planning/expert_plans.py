"""The expert plans written out as Plans of the job's step: data parallel, FSDP, Megatron and
2-D as an expert writes them by hand (intra/experts.py holds their input shardings, the same
the ILP is seeded with). The selection (shardplan.planning.select) compiles them beside the
searched plan; the CLI's comparison compiles them as its baselines."""

from __future__ import annotations

import dataclasses
import warnings

from shardplan.intra import experts
from shardplan.intra.solve.types import InfeasibleMemory, SearchTimeout
from shardplan.ir.graph import Role
from shardplan.plan import Estimate, Plan
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
    replicated, XLA propagating the rest. Each completion runs without a memory budget (an
    expert plan is what it is: the selection judges its compiled peak) within `deadline`
    (default the job's) or, given seconds, that many each: a search that used up a shared
    deadline would leave the experts their inputs alone."""
    out = {}
    graph, pinned = job.graph, job.pinned
    free = job.replace(options=job.options.replace(memory_budget=None))
    for name, fixed in experts.expert_inputs(graph, plan.mesh).items():
        inputs = tuple(pinned.get(i, fixed[i]) for i in range(len(graph.inputs)))
        splits = experts.splits_state(inputs, graph.input_roles)
        written = (_complete(free, dict(enumerate(inputs)), deadline)
                   if complete and splits else None)
        if written is not None:
            out[name] = dataclasses.replace(
                written, notes=(), solver=f"{name} (the expert's input shardings"
                f"{', hints pinned' if pinned else ''}; the ILP lays out the rest)")
            continue
        outputs = tuple(inputs[tie] if tie is not None else
                        ShardSpec.replicated(graph.values[v].ndim)
                        for v, tie in zip(graph.outputs, graph.output_ties))
        state = sum(graph.values[v].nbytes / s.num_shards(plan.mesh)
                    for v, s, r in zip(graph.inputs, inputs, graph.input_roles) if r == Role.STATE)
        out[name] = dataclasses.replace(
            plan, input_specs=inputs, output_specs=outputs, constraints={}, operand_specs={},
            ops=(), notes=(), estimate=Estimate(0.0, 0.0, 0.0, state),
            solver=f"{name} (the expert's input shardings{', hints pinned' if pinned else ''}; "
                   "XLA propagates the rest)")
    return out


def _complete(job: Job, fixed: dict[int, ShardSpec], deadline: Deadline | float | None
              ) -> Plan | None:
    """The plan the ILP completes around the `fixed` inputs, or None when it cannot."""
    own = Deadline(deadline) if isinstance(deadline, (int, float)) else deadline
    try:
        with warnings.catch_warnings():  # the searched plan has warned about the same graph
            warnings.simplefilter("ignore")
            return plan_graph(job, deadline=own, fixed_inputs=fixed)[0]
    except (InfeasibleMemory, SearchTimeout):
        return None
