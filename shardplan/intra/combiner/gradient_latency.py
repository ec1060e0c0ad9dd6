"""The latency of the gradients' combined all-reduces, in the ILP: one per group, paid by the
plans that reduce any gradient in it.

With IntraOptions.combine_gradients the ILP prices each reduction of a gradient without its own
latency (intra/problem.py Problem.combined): XLA runs them as one combined all-reduce per mesh
axes (intra/combiner/xla.py), which pays one latency whatever the number of gradients. That one
latency is not free: a plan that reduces no gradient over those axes runs no such collective.
Left out, a plan that reduces one gradient paid nothing for it (measured: a tied 64k-vocab
embedding on 8 devices, the searched plan reduced the embedding's gradient, an all-reduce of
its own in the compiled program, priced by the ILP 0.4 us under Megatron's plan, which reduces
none; compiled, 41.6 us over it).

Each group is one more member of the ILP (a "hub") with two choices, off (free) and on (the
latency, once per step: a scanned model's gradients reduced inside its loop are priced as the
same model unrolled reduces them, as Problem.reshard_time prices its stacked values, else the
two would plan differently); a row (ilp.Implication) from every member whose choice reduces a
gradient over the group's axes forbids that choice with the hub off. As rows, not edges of
infinite entries, they leave presolve its eliminations (intra/solve/presolve.py) and the MIP one row
per member instead of an edge's pair variables (GPT-2 1.5B unrolled on 8x8: the core fell from
267 members and 654 edges to 237 and 421, as without hubs; the solve did not get faster with
it: the rows cost HiGHS's LP as many iterations as the edges did, 16k against 12k without).
A member reduces a gradient where its strategy's own collectives do (a node making a
gradient), or where it leaves a gradient a partial sum (whoever reads it reduces it: no
gradient is read partial by the optimizer's update or left partial in an output).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardplan.intra.solve.ilp import Implication
from shardplan.strategies.base import Collective

if TYPE_CHECKING:  # annotations only: problem imports this module
    from shardplan.intra.problem import Problem


def triggers(problem: Problem) -> dict[tuple, list[tuple[int, np.ndarray]]]:
    """Mesh axes -> (member, mask over its root's choices of those that
    reduce a gradient over the axes), for the members that can."""
    if not problem.options.combine_gradients:
        return {}
    g, n_in, groups = problem.graph, problem.num_inputs, problem.groups
    kinds = problem.cost.combined_kinds
    out: dict[tuple, list[tuple[int, np.ndarray]]] = {}
    # (member's choice_key, which) -> [(axes, mask)]: tied layers' members reduce alike
    memo: dict[tuple, list[tuple[tuple, np.ndarray]]] = {}

    def reductions(m: int, k: int, which) -> set:
        """The axes over which choice k of member m reduces a gradient: its own collectives
        (`which` "comms") or, leaving its output `which` partial, its reader's."""
        if which == "comms":
            return {tuple(sorted(c.axes)) for c in problem.strategies[m][groups.pick[m][k]].comms
                    if c.kind in kinds and c.nbytes > 0 and c.axes}
        spec = problem.out_spec(m, which, k)
        return {tuple(sorted(spec.partial))} if spec.partial else set()

    def add(m: int, which) -> None:
        key = (problem.choice_key(m), which)
        if key not in memo:
            sets = [reductions(m, k, which) for k in range(len(problem.strategies[groups.root[m]]))]
            memo[key] = [(axes, np.array([axes in ks for ks in sets]))
                         for axes in sorted(set().union(*sets), key=repr)]
        for axes, mask in memo[key]:
            out.setdefault(axes, []).append((m, mask))

    for node in g.nodes:
        m = n_in + node.id
        if problem.combined(node.outputs):  # the node's own reductions
            add(m, "comms")
        for out_idx, v in enumerate(node.outputs):  # gradients it leaves partial sums
            if problem.combined((v,)):
                add(m, out_idx)
    return out


def terms(problem: Problem, first: int) -> tuple[list[np.ndarray], list[Implication]]:
    """The hubs' costs ([off, on] each, numbered from `first` among the ILP's members) and
    the rows that turn them on (a representative's reducing choices -> its hub on)."""
    costs: list[np.ndarray] = []
    rows: dict[tuple[int, int], np.ndarray] = {}
    for key, members in sorted(triggers(problem).items(), key=lambda kv: repr(kv[0])):
        latency = problem.cost.combined_latency([Collective("all-reduce", key, 1)])
        if latency <= 0:
            continue
        hub = first + len(costs)
        costs.append(np.array([0.0, latency]))
        for m, mask in members:
            i = problem.index[problem.groups.root[m]]
            old = rows.get((i, hub))
            rows[(i, hub)] = mask if old is None else old | mask
    on = np.array([False, True])
    return costs, [Implication(i, mask, hub, on) for (i, hub), mask in sorted(rows.items())]
