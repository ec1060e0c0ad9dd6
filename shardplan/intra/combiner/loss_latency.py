"""Whether the loss's last reduction joins the gradients' combined all-reduce, in the ILP.

The ILP prices a reduction of the loss's last values (intra/combiner/xla.py loss_values: its sum
over the batch) without its own latency (Problem.latency_free). XLA's combiner
(collective_combiner_utils.h) walks the program in post order, where the loss comes last, and
adds each all-reduce of one key to the group it is building until one depends on a member:
the loss's joins the gradients' when they are reduced over the same devices and no reduction
over those devices is upstream of it (tests/test_intra_combiner.py::
test_ilp_prices_data_parallel_as_compiled_and_beats_it: data parallel compiles to one
all-reduce, the loss's and the gradients'). Where the forward pass reduces over them (a split
vocabulary, a Megatron layer), one such reduction lands in the last group and the loss's runs
alone (tests/test_intra_combiner.py::
test_the_loss_reduction_runs_alone_where_the_forward_reduces_over_its_devices).

For each mesh axes over which the loss's last values can be partial, one more member of the
ILP with two free choices, alone (0) and joined (1): a member leaving a last value of the loss
partial over those axes pays that reduction's latency with it alone; joined needs the
gradients' combined all-reduce over the axes on (gradient_latency.py) and is forbidden by
every forward member whose choice reduces over them (its own collectives, or a partial output): both
rows (types.Implication), as the switches' are.
"""

from __future__ import annotations

import numpy as np

from shardplan.intra.combiner import gradient_latency, xla
from shardplan.intra.combiner.gradient_latency import Members
from shardplan.intra.solve.types import Implication
from shardplan.strategies.base import Collective


def gradient_switches(problem: Members, first: int) -> dict[tuple, int]:
    """Mesh axes -> the index of the gradients' switch over them, numbered from `first` as
    gradient_latency.terms numbers them (by their axes' repr, those of no latency left out)."""
    keys = [k for k in sorted(gradient_latency.triggers(problem), key=repr)
            if problem.cost.combined_latency([Collective("all-reduce", k, 1)]) > 0]
    return {k: first + j for j, k in enumerate(keys)}


def terms(problem: Members, switches_from: int, first: int
          ) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray], list[Implication]]:
    """The members' costs ([alone, joined] each, numbered from `first`), their edges
    ((representative index, member index) -> [the representative's choice, alone/joined]:
    the latency alone) and their rows (joined needs the gradients' switch on, numbered from
    `switches_from`; a forward member's reducing choice forbids joined)."""
    if not problem.options.combine_gradients:
        return [], {}, []
    g, groups, n_in = problem.graph, problem.groups, problem.num_inputs
    loss = problem.loss_values()
    if not loss:
        return [], {}, []
    kinds = problem.cost.combined_kinds

    def choices(m):
        return range(len(problem.strategies[groups.root[m]]))

    # members leaving a last value of the loss partial: axes -> (member, latency per choice)
    payers: dict[tuple, list[tuple[int, np.ndarray]]] = {}
    for v in sorted(loss):
        m, out_idx = problem.producer[v]
        if m < n_in:
            continue
        value = g.values[v]
        node = g.nodes[m - n_in]
        strategies = [problem.strategies[m][groups.pick[m][k]] for k in choices(m)]
        keys = {tuple(sorted(s.out_specs[out_idx].partial)) for s in strategies
                if s.out_specs[out_idx].partial}
        for key in sorted(keys):
            lat = np.array([problem.reshards.layers(value) * problem.cost.combined_latency(
                problem.cost.reshard_comms(value, s.out_specs[out_idx],
                                           s.out_specs[out_idx].without_partial()))
                if _starts(node, s, out_idx, key, loss) else 0.0 for s in strategies])
            if lat.any():
                payers.setdefault(key, []).append((m, lat))
    forward = xla.forward_values(g, loss)
    joins = gradient_switches(problem, switches_from)
    costs: list[np.ndarray] = []
    edges: dict[tuple[int, int], np.ndarray] = {}
    forbids: dict[tuple[int, int], np.ndarray] = {}  # (representative, switch) -> its choices
    rows: list[Implication] = []
    joined, alone = np.array([False, True]), np.array([True, False])

    def add(i: int, switch: int, mat: np.ndarray) -> None:
        old = edges.get((i, switch))
        edges[(i, switch)] = mat if old is None else old + mat

    masks: dict[tuple, np.ndarray] = {}  # (choice_key, axes): tied layers' members alike
    for key in sorted(payers, key=repr):
        switch = first + len(costs)
        grad_switch = joins.get(key)
        costs.append(np.array([0.0, 0.0 if grad_switch is not None else np.inf]))
        for m, lat in payers[key]:
            pay = np.zeros((len(lat), 2))
            pay[:, 0] = lat
            add(problem.index[groups.root[m]], switch, pay)
        if grad_switch is not None:  # joined needs the gradients' all-reduce on
            rows.append(Implication(switch, joined, grad_switch, joined))
        for node in g.nodes:
            if not any(v in forward for v in node.outputs):
                continue
            m = n_in + node.id
            mask = masks.get((problem.choice_key(m), key))
            if mask is None:
                mask = masks[(problem.choice_key(m), key)] = np.array([
                    _reduces(problem.strategies[m][groups.pick[m][k]], key, kinds)
                    for k in choices(m)])
            if mask.any():
                i = problem.index[groups.root[m]]
                forbids[(i, switch)] = forbids[(i, switch)] | mask if (i, switch) in forbids else mask
    rows += [Implication(i, mask, switch, alone) for (i, switch), mask in sorted(forbids.items())]
    return costs, edges, rows


def _starts(node, s, out_idx: int, key: tuple, loss: frozenset[int]) -> bool:
    """Whether strategy s of `node` leaves its output `out_idx` partial over the mesh axes
    `key` and reads no last value of the loss partial over them: the partial sum starts
    here (one passed on through linear ops is reduced once, where it ends)."""
    return (tuple(sorted(s.out_specs[out_idx].partial)) == key and not any(
        u in loss and tuple(sorted(d.partial)) == key for u, d in zip(node.inputs, s.in_specs)))


def _reduces(strategy, key: tuple, kinds) -> bool:
    """Whether a strategy reduces over the mesh axes `key`: a collective of its own or an
    output it leaves partial (its reader reduces it)."""
    return (any(c.kind in kinds and c.nbytes > 0 and tuple(sorted(c.axes)) == key
                for c in strategy.comms)
            or any(tuple(sorted(o.partial)) == key for o in strategy.out_specs if o.partial))
