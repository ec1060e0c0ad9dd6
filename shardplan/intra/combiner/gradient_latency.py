"""The latency of the gradients' combined all-reduces, in the ILP: one per group, paid by the
plans that reduce any gradient in it.

With IntraOptions.combine_gradients the ILP prices each reduction of a gradient without its own
latency (intra/problem.py Problem.combined): XLA runs them as one combined all-reduce per mesh
axes (intra/combiner/xla.py), which pays one latency whatever the number of gradients. That one
latency is not free: a plan that reduces no gradient over those axes runs no such collective.
Left out, a plan that reduces one gradient pays nothing for that all-reduce, and wins over a
plan that reduces none by less than the collective it runs
(tests/test_intra_combiner.py::
test_ilp_pays_the_combined_reduction_latency_once_where_a_gradient_is_reduced).

Each group is one more member of the ILP (a "switch") with two choices, off (free) and on (the
latency, once per step: a scanned model's gradients reduced inside its loop are priced as the
same model unrolled reduces them, as ReshardPrices.reshard_time prices its stacked values,
else the two would plan differently); a row (types.Implication) from every member whose
choice reduces a gradient over the group's axes forbids that choice with the switch off. As
rows, not edges of infinite entries, they leave presolve its eliminations
(intra/solve/presolve.py) and the MIP one row per member instead of an edge's pair variables
(tests/test_intra_implications.py: rows against the edges they stand for).
A member reduces a gradient where its strategy's own collectives do (a node making a
gradient), or where it leaves a gradient a partial sum (whoever reads it reduces it: no
gradient is read partial by the optimizer's update or left partial in an output).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from shardplan.cost.model import AlphaBetaCost
from shardplan.intra.reshard_prices import ReshardPrices
from shardplan.intra.settings import IntraOptions
from shardplan.intra.simplify import Groups
from shardplan.intra.solve.types import Implication
from shardplan.ir.graph import Graph
from shardplan.strategies.base import Collective, Strategy
from shardplan.strategies.spec import ShardSpec


class Members(Protocol):
    """What the combiner's latency terms read of the ILP's members: intra/problem.py's Problem,
    which adds these terms to the ILP it makes (so it is above this module, not below)."""

    options: IntraOptions
    graph: Graph
    cost: AlphaBetaCost
    num_inputs: int
    strategies: Sequence[Sequence[Strategy]]
    groups: Groups
    producer: Mapping[int, tuple[int, int]]
    index: Mapping[int, int]
    reshards: ReshardPrices

    def out_spec(self, m: int, out_idx: int, root_k: int) -> ShardSpec: ...

    def choice_key(self, m: int) -> int: ...

    def combined(self, values) -> bool: ...

    def loss_values(self) -> frozenset[int]: ...


def triggers(problem: Members) -> dict[tuple, list[tuple[int, np.ndarray]]]:
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


def terms(problem: Members, first: int) -> tuple[list[np.ndarray], list[Implication]]:
    """The switches' costs ([off, on] each, numbered from `first` among the ILP's members) and
    the rows that turn them on (a representative's reducing choices -> its switch on)."""
    costs: list[np.ndarray] = []
    rows: dict[tuple[int, int], np.ndarray] = {}
    for key, members in sorted(triggers(problem).items(), key=lambda kv: repr(kv[0])):
        latency = problem.cost.combined_latency([Collective("all-reduce", key, 1)])
        if latency <= 0:
            continue
        switch = first + len(costs)
        costs.append(np.array([0.0, latency]))
        for m, mask in members:
            i = problem.index[problem.groups.root[m]]
            old = rows.get((i, switch))
            rows[(i, switch)] = mask if old is None else old | mask
    on = np.array([False, True])
    return costs, [Implication(i, mask, switch, on) for (i, switch), mask in sorted(rows.items())]
