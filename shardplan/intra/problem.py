"""The intra-operator problem: members (the step's inputs and nodes), their strategies and
groups, and the ILP they make: node and edge costs (loops' trip counts included) and the memory
rows."""

from __future__ import annotations

import collections

import numpy as np

from shardplan.cost.model import CONTRACTIONS, AlphaBetaCost
from shardplan.intra import hints as hints_mod
from shardplan.intra.combiner import gradient_latency, loss_latency, xla
from shardplan.intra.memory.buffers import is_tensor
from shardplan.intra.memory.model import MemoryModel
from shardplan.intra.reshard_prices import ReshardPrices
from shardplan.intra.settings import IntraOptions
from shardplan.intra.simplify import (
    Groups,
    fanout_mode,
    fanouts_of,
    merge_followers,
    reduce_once,
    tie_layers,
)
from shardplan.intra.solve import types
from shardplan.ir.graph import Graph, Role, Value
from shardplan.strategies import registry
from shardplan.strategies.base import Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec, enumerate_specs


def _source_strategies(value: Value, role: Role, mesh: MeshShape, max_split_dims: int) -> list[Strategy]:
    if value.ndim == 0 or value.dtype.startswith("key") or role == Role.OTHER:
        specs = [ShardSpec.replicated(value.ndim)]
    else:
        specs = enumerate_specs(value.shape, mesh, max_split_dims=max_split_dims)
    return [Strategy(f"input{s}", (), (s,), 0.0) for s in specs]


def _held(strategies: list[list[Strategy]], pins: hints_mod.ModelPins) -> list[list[Strategy]]:
    """Node strategies with each model constraint read as a hint held to its layout: the
    strategies its pin allows, or the one that holds the value in it (its free dimensions
    whole) where none does. Nodes of repeated layers keep sharing one list."""
    memo: dict[tuple, list[Strategy]] = {}
    out = list(strategies)
    for nid, pin in pins.pins.items():
        key = (id(strategies[nid]), pin)
        if key not in memo:
            kept = [s for s in strategies[nid] if pins.allows(nid, s.out_specs[0])]
            if not kept:
                spec = ShardSpec(tuple(() if d is None else d for d in pin))
                kept = [Strategy(f"model constraint {spec}", (spec,), (spec,), 0.0)]
            memo[key] = kept
        out[nid] = memo[key]
    return out


class Problem:
    """The members (inputs and nodes), their strategies and groups, and the ILP they make."""

    def __init__(self, graph: Graph, mesh: MeshShape, cost: AlphaBetaCost, options: IntraOptions):
        self.graph, self.mesh, self.cost, self.options = graph, mesh, cost, options
        self.num_inputs = n_in = len(graph.inputs)
        # Work done once per distinct operator, layout list or edge (not per layer): counted
        # so that a test can hold planning cost to the distinct layers.
        self.work: collections.Counter = collections.Counter()
        sources: dict[tuple, list[Strategy]] = {}
        self.strategies: list[list[Strategy]] = []
        for i, (v, r) in enumerate(zip(graph.inputs, graph.input_roles)):
            if i in options.fixed_inputs:
                self.strategies.append([Strategy("fixed", (), (options.fixed_inputs[i],), 0.0)])
                continue
            # Inputs of one shape and role (each layer's kernels) share their list.
            key = (graph.values[v].shape, graph.values[v].dtype, r)
            if key not in sources:
                sources[key] = _source_strategies(graph.values[v], r, mesh,
                                                  options.max_split_dims)
            self.strategies.append(sources[key])
        self.model_pins = hints_mod.model_pins(graph, mesh, options.model_constraints)
        self.strategies += _held(registry.strategies_of_graph(graph, mesh), self.model_pins)
        self.producer: dict[int, tuple[int, int]] = {v: (i, 0) for i, v in enumerate(graph.inputs)}
        for node in graph.nodes:
            for k, v in enumerate(node.outputs):
                self.producer[v] = (n_in + node.id, k)
        self.reshards = ReshardPrices(graph, mesh, cost, self.producer, n_in, self.latency_free)
        self.num_real = len(self.strategies)
        self.source = dict(self.producer)
        self.fanout_of: list[int] = []
        mode = fanout_mode(options.fanouts, mesh)
        fanned, self.held_fanouts = fanouts_of(graph, self.strategies, self.producer, mode)
        # twin strategy -> (output index, the layout it reshards from): reduce_once's
        self.twins: dict[Strategy, tuple[int, ShardSpec]] = {}
        if mode == "reduce":
            self.strategies, self.twins = reduce_once(
                graph, self.strategies, mesh, {v for v, _ in fanned},
                lambda value, src, dst: self.reshards.reshard_comms(value, src, dst))
        for v, strategies in fanned:
            self.source[v] = (len(self.strategies), 0)
            self.strategies.append(strategies)
            self.fanout_of.append(v)
        self._node_times: dict[tuple, tuple] = {}
        self._time_keys: dict[int, tuple] = {}
        if options.merge_followers:
            self.groups = merge_followers(graph, self.strategies, self.source, self.node_cost,
                                          self.cost_key, self.work)
        else:
            self.groups = Groups(tuple(range(len(self.strategies))),
                                 tuple(tuple(range(len(s))) for s in self.strategies))
        self.roots = self.groups.roots()
        if options.tie_layers:
            self.rep = tie_layers(self._names(), self.strategies, self.roots, self._signature)
        else:
            self.rep = {r: r for r in self.roots}
        self.reps = sorted(set(self.rep.values()))
        self.index = {r: self.reps.index(self.rep[r]) for r in self.roots}

    def _names(self) -> list[str]:
        """A name per member: inputs by their pytree path, nodes by their scope, or, for nodes
        without one (optimizer updates), the name of their first named operand."""
        g = self.graph
        names = [g.input_names[i] if i < len(g.input_names) else "" for i in range(self.num_inputs)]
        of_value = dict(zip(g.inputs, names))
        for node in g.nodes:
            name = node.name or next((of_value[v] for v in node.inputs if of_value.get(v)), "")
            names.append(name)
            for v in node.outputs:
                of_value[v] = name
        # a fan-out is named as its value's producer: repeated layers' fan-outs are tied too
        return names + [names[self.producer[v][0]] for v in self.fanout_of]

    def _signature(self, m: int) -> tuple:
        g = self.graph
        if m < self.num_inputs:
            v = g.values[g.inputs[m]]
            return ("input", v.shape, v.dtype)
        if m >= self.num_real:
            v = self.fanout_of[m - self.num_real]
            p, out_idx = self.producer[v]
            return ("fanout", out_idx, g.values[v].shape, g.values[v].dtype, self._signature(p))
        node = g.nodes[m - self.num_inputs]
        return (node.primitive, tuple(g.values[v].shape for v in node.inputs),
                tuple(g.values[v].shape for v in node.outputs))

    def cost_key(self, m: int) -> tuple:
        """Members with equal keys and the same strategy list cost the same under each
        strategy (the same operator, or input, in every layer): priced once."""
        key = self._time_keys.get(m)
        if key is None:
            g = self.graph
            if m < self.num_inputs:
                v = g.values[g.inputs[m]]
                key = ("input", v.shape, v.dtype, v.itemsize, g.input_roles[m],
                       self.io_count(m))
            elif m >= self.num_real:
                key = ("fanout",)
            else:
                node = g.nodes[m - self.num_inputs]
                key = ("node", self.cost.node_time_key(g, node), self.latency_free(node.outputs))
            self._time_keys[m] = key
        return key

    def node_times(self, m: int, k: int) -> tuple[float, float]:
        if m >= self.num_real:
            return 0.0, 0.0
        strategy = self.strategies[m][k]
        shared = (self.cost_key(m), id(strategy))
        if shared not in self._node_times:
            self.work["node prices"] += 1
            # the strategy is kept beside its price: its id stays its own
            self._node_times[shared] = (self._node_times_once(m, strategy), strategy)
        return self._node_times[shared][0]

    def _node_times_once(self, m: int, strategy: Strategy) -> tuple[float, float]:
        if m < self.num_inputs:
            # The step reads its input and writes the outputs tied to it (input_io_time),
            # plus a tie-break, not a cost: a batch input split on a dimension other than
            # its leading (batch) one pays a thousandth of its read once more, so that where
            # the two tie, the batch split the user expects wins.
            value = self.graph.values[self.graph.inputs[m]]
            spec = strategy.out_specs[0]
            read = self.cost.value_bytes(value, spec) / self.cost.hardware.mem_bandwidth
            off_batch = (self.graph.input_roles[m] == Role.BATCH and value.shape
                         and any(spec.dims[1:]))
            return self.input_io_time(m, spec) + (1e-3 * read if off_batch else 0.0), 0.0
        node = self.graph.nodes[m - self.num_inputs]
        compute, comm = self.cost.node_time(self.graph, node, strategy)
        if self.latency_free(node.outputs):
            comm -= node.trips * self.cost.combined_latency(strategy.comms)
        return compute, comm

    def combined(self, values) -> bool:
        """Whether the reductions making `values` join XLA's combined all-reduce of the step's
        gradients (intra/combiner/xla.py gradient_values): the ILP prices them without their
        own latency, and the combined collective's one latency once, in the plans that reduce
        a gradient (intra/combiner/gradient_latency.py); the estimate prices the combined
        collectives as the combiner forms them."""
        if not self.options.combine_gradients:
            return False
        if "_gradients" not in self.__dict__:
            self.__dict__["_gradients"] = xla.gradient_values(self.graph, CONTRACTIONS)
        return bool(values) and all(v in self._gradients for v in values)

    def loss_values(self) -> frozenset[int]:
        """The loss's last values (intra/combiner/xla.py loss_values), or none without
        combine_gradients."""
        if not self.options.combine_gradients:
            return frozenset()
        if "_loss" not in self.__dict__:
            self.__dict__["_loss"] = xla.loss_values(self.graph, CONTRACTIONS)
        return self._loss

    def latency_free(self, values) -> bool:
        """Whether the ILP prices the reductions making `values` without their own latency:
        the gradients' (combined) and the loss's last ones, whose latency the loss's members
        of the ILP charge where they do not join the gradients' (intra/combiner/loss_latency.py)."""
        return self.combined(values) or (bool(values) and all(
            v in self.loss_values() for v in values))

    def choice_key(self, m: int) -> int:
        """What member m runs for each choice of its root, as a small int: members with equal
        keys take the same strategies of the same list (the same operator in tied layers)."""
        keys = self.__dict__.setdefault("_choice_keys", {})
        if m not in keys:
            ids = self.__dict__.setdefault("_choice_ids", {})
            keys[m] = ids.setdefault((id(self.strategies[m]), self.groups.pick[m]), len(ids))
        return keys[m]

    def io_count(self, m: int) -> float:
        """Times the step reads input m (once, if any op reads it) and writes it back (once
        per output tied to it)."""
        if "_io_counts" not in self.__dict__:
            g = self.graph
            used = {v for n in g.nodes for v in n.inputs} | set(g.outputs)
            counts = [float(v in used) for v in g.inputs]
            for tie in g.output_ties:
                if tie is not None:
                    counts[tie] += 1.0
            self.__dict__["_io_counts"] = counts
        return self.__dict__["_io_counts"][m]

    def input_io_time(self, m: int, spec: ShardSpec) -> float:
        """Seconds the step spends reading input m and writing the outputs tied to it (the
        state it updates) per device, at the memory bandwidth: what every backend pays
        whatever it fuses, and what the pricer charges the compiled program's arguments and
        results (analysis/hlo_bytes.py io_bytes). An input no op reads is not read (jit
        drops it)."""
        times = self.io_count(m)
        value = self.graph.values[self.graph.inputs[m]]
        return times * self.cost.value_bytes(value, spec) / self.cost.hardware.mem_bandwidth

    def output_io_time(self, value: Value, spec: ShardSpec) -> float:
        """Seconds to write an output not tied to an input (the loss, metrics) per device."""
        return self.cost.value_bytes(value, spec) / self.cost.hardware.mem_bandwidth

    def trips(self, m: int) -> float:
        """Times member m runs per step: inputs once, nodes per their loops, a fan-out as the
        value it reshards. An edge between members is paid as often as the rarer of the two
        runs (a loop constant is resharded once, outside the loop)."""
        if m < self.num_inputs:
            return 1.0
        if m >= self.num_real:
            return self.trips(self.producer[self.fanout_of[m - self.num_real]][0])
        return self.graph.nodes[m - self.num_inputs].trips

    def edge_trips(self, p: int, n: int) -> float:
        """Times the value member p produces is resharded into member n per step: as often as
        the rarer of the two runs, where a loop's entry reads and its exit writes a value of
        the enclosing level (a stacked value passed from one loop to the next is resharded
        once, between the loops, as the emitted program does)."""
        return min(self.trips_at(p, "leave"), self.trips_at(n, "enter"))

    def trips_at(self, m: int, side: str) -> float:
        """Times member m's values cross into (`side` "enter") or out of ("leave") its loop
        per step: a loop's entry and exit run once per run of the loop."""
        if m >= self.num_real:  # a fan-out lives where its value does
            return self.trips_at(self.producer[self.fanout_of[m - self.num_real]][0], "leave")
        trips = self.trips(m)
        if self.num_inputs <= m < self.num_real:
            node = self.graph.nodes[m - self.num_inputs]
            if node.loop is not None and node.id in getattr(self.graph.loops[node.loop], side):
                trips /= self.graph.loops[node.loop].trips
        return trips

    def node_cost(self, m: int, k: int) -> float:
        return sum(self.node_times(m, k))

    def out_spec(self, m: int, out_idx: int, root_k: int) -> ShardSpec:
        return self.strategies[m][self.groups.pick[m][root_k]].out_specs[out_idx]

    def in_spec(self, m: int, in_idx: int, root_k: int) -> ShardSpec:
        return self.strategies[m][self.groups.pick[m][root_k]].in_specs[in_idx]

    def _reshard_matrix(self, value: Value, srcs: list[ShardSpec], dsts: list[ShardSpec]) -> np.ndarray:
        # Repeated layers reshard values of the same shapes between the same layouts: the
        # matrix, and each layout pair's time, are computed once.
        memo = self.__dict__.setdefault("_reshard_memo", {})
        shape = (value.shape, value.dtype, value.itemsize, self.latency_free((value.id,)),
                 self.reshards.reduced_whole(value))
        key = (shape, tuple(srcs), tuple(dsts))
        if key in memo:
            return memo[key]
        us = {x: i for i, x in enumerate(dict.fromkeys(srcs))}  # each distinct layout once
        ud = {x: i for i, x in enumerate(dict.fromkeys(dsts))}
        si, di = np.array([us[x] for x in srcs]), np.array([ud[x] for x in dsts])

        def time(a, b):
            k = (shape, a, b)
            if k not in memo:
                memo[k] = self.reshards.edge_time(value, a, b)
            return memo[k]

        u = np.array([[time(a, b) for b in ud] for a in us])
        memo[key] = mat = u[si][:, di]
        mat.flags.writeable = False
        return mat

    def _edge_cost(self, value: Value, p: int, out_idx: int, n: int, dst: tuple,
                   same_root: bool) -> np.ndarray | None:
        """What resharding `value` from p's output `out_idx` into n (`dst`) costs once: per
        root choice when both follow one root, else a matrix [p's root choice, n's]; None when
        it is free whatever the choices."""
        kp = len(self.strategies[self.groups.root[p]])
        kn = len(self.strategies[self.groups.root[n]])
        srcs = [self.out_spec(p, out_idx, k) for k in range(kp)]
        if value.ndim == 0 and not any(s.partial for s in srcs):
            return None
        kind, idx = dst
        spec = self.in_spec if kind == "in" else self.out_spec
        if same_root:
            return np.array([self.reshards.edge_time(value, srcs[k], spec(n, idx, k))
                             for k in range(kp)])
        mat = self._reshard_matrix(value, srcs, [spec(n, idx, k) for k in range(kn)])
        return mat if mat.any() else None

    def edges_and_unary(self):
        """Node costs per root choice, and edge matrices between roots. Tied layers repeat the
        same members and edges: each distinct one (its strategies, picks and value shape) is
        priced once and added with its trip count."""
        g, n_in = self.graph, self.num_inputs
        root = self.groups.root
        unary = {r: np.zeros(len(self.strategies[r])) for r in self.roots}
        priced: dict[tuple, np.ndarray] = {}
        for m in range(len(self.strategies)):
            key = (self.cost_key(m), self.choice_key(m))
            if key not in priced:
                self.work["unary costs"] += 1
                priced[key] = np.array([self.node_cost(m, k) for k in self.groups.pick[m]])
            unary[root[m]] += priced[key]
        edges: dict[tuple[int, int], np.ndarray] = {}
        memo: dict[tuple, np.ndarray | None] = {}

        def add_edge(value: Value, p: int, out_idx: int, n: int, dst: tuple, trips=None) -> None:
            """`dst`: ("in", i) the strategies' i-th operand spec of n, ("out", 0) its output."""
            rp, rn = root[p], root[n]
            key = (value.shape, value.dtype, value.itemsize, self.choice_key(p), out_idx,
                   self.choice_key(n), dst, rp == rn, self.latency_free((value.id,)))
            if key not in memo:
                self.work["edge costs"] += 1
                memo[key] = self._edge_cost(value, p, out_idx, n, dst, rp == rn)
            cost = memo[key]
            if cost is None:
                return
            if trips is None:
                trips = self.edge_trips(p, n)
            if rp == rn:
                unary[rp] += trips * cost
            else:
                edges[(rp, rn)] = edges.get((rp, rn), 0) + trips * cost

        for node in g.nodes:
            m = n_in + node.id
            for i, v in enumerate(node.inputs):
                value = g.values[v]
                if not is_tensor(value) or v not in self.producer:
                    continue
                p, out_idx = self.source[v]
                add_edge(value, p, out_idx, m, ("in", i))
        for f, v in enumerate(self.fanout_of):
            m = self.num_real + f
            p, out_idx = self.producer[v]
            add_edge(g.values[v], p, out_idx, m, ("in", 0))
        for src, carry, trips in g.carry_edges():
            # What a loop body hands to its next iteration is resharded into the carry's layout.
            if not is_tensor(g.values[src]) or src not in self.producer:
                continue
            p, out_idx = self.source[src]
            c, _ = self.producer[carry]
            add_edge(g.values[src], p, out_idx, c, ("out", 0), trips)
        for j, v in enumerate(g.outputs):
            value = g.values[v]
            if not is_tensor(value) or v not in self.producer:
                continue
            tie = g.output_ties[j] if j < len(g.output_ties) else None
            p, out_idx = self.source[v] if tie is not None else self.producer[v]
            if tie is not None:
                add_edge(value, p, out_idx, tie, ("out", 0))
            else:
                rp = self.groups.root[p]
                unary[rp] += np.array([
                    (self.reshards.edge_time(value, s, s.without_partial()) if s.partial else 0.0)
                    + self.output_io_time(value, s.without_partial())
                    for s in (self.out_spec(p, out_idx, k) for k in range(len(self.strategies[rp])))])
        return unary, edges

    def memory(self):
        """The memory model (intra/memory/model.py), built once."""
        if "_memory" not in self.__dict__:
            self.__dict__["_memory"] = MemoryModel(self, self.options.donated,
                                                  self.options.memory_margin,
                                                  self.options.compiler)
        return self.__dict__["_memory"]

    def solver_input(self, budget: float | None = None) -> types.SolverInput:
        """The ILP over representatives: tied roots add their costs to their representative;
        with `budget` (bytes per device), the memory model's rows held to it."""
        unary, edges = self.edges_and_unary()
        costs = [np.zeros(len(self.strategies[r])) for r in self.reps]
        for r in self.roots:
            costs[self.index[r]] += unary[r]
        merged: dict[tuple[int, int], np.ndarray] = {}
        for (a, b), m in sorted(edges.items()):
            ia, ib = self.index[a], self.index[b]
            if ia == ib:
                costs[ia] += np.diagonal(m)
            else:
                merged[(ia, ib)] = merged.get((ia, ib), 0) + m
        switch_costs, switch_rows = gradient_latency.terms(self, len(costs))
        loss_costs, loss_edges, loss_rows = loss_latency.terms(self, len(costs),
                                                            len(costs) + len(switch_costs))
        node_costs = tuple(costs + switch_costs + loss_costs)
        edge_list = tuple((a, b, m) for (a, b), m in sorted({**merged, **loss_edges}.items()))
        base = rows = copies = row_copies = ()
        if budget is not None:
            memory = self.memory()
            base, rows, copies, row_copies = memory.solver_terms(self.index)
        return types.SolverInput(node_costs, edge_list, rows, budget, self.options.solver,
                               hint=(0,) * len(self.reps) + (1,) * len(switch_costs)
                               + (0,) * len(loss_costs),
                               memory_base=base,
                               copies=copies, row_copies=row_copies,
                               deadline=self.options.deadline,
                               implications=tuple(switch_rows + loss_rows),
                               least_memory=self.options.least_memory)


