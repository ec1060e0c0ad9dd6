"""What the intra-operator ILP charges for resharding a value between two layouts: a scan's
stacked value resharded layer by layer, a partial sum XLA reduces whole before slicing it, the
latency of reductions priced elsewhere left out. intra/problem.py's Problem holds one
(Problem.reshards), through which the ILP's edges, the estimate and the emitted routes
price."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from shardplan.cost.model import AlphaBetaCost
from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Value
from shardplan.strategies.spec import MeshShape, ShardSpec


class ReshardPrices:
    """Reshard pricing over a step's graph, mesh and cost model. `producer`: value -> (member,
    output index), members numbered as Problem numbers them (the step's `num_inputs` inputs
    first, then its nodes); `latency_free(values)`: whether the reductions making `values`
    are priced without their own latency (Problem.latency_free)."""

    def __init__(self, graph: Graph, mesh: MeshShape, cost: AlphaBetaCost,
                 producer: Mapping[int, tuple[int, int]], num_inputs: int,
                 latency_free: Callable[[tuple[int, ...]], bool]):
        self.graph, self.mesh, self.cost = graph, mesh, cost
        self.producer, self.num_inputs, self.latency_free = producer, num_inputs, latency_free

    @functools.cached_property
    def _stacked_shapes(self) -> frozenset[tuple[int, ...]]:
        """The shapes of a scan's stacked values (what a loop_slice reads or a loop_stack
        writes)."""
        return frozenset(
            self.graph.values[v].shape for node in self.graph.nodes
            for v in ((node.inputs[0],) if node.primitive == "loop_slice" else
                      node.outputs if node.primitive == "loop_stack" else ()))

    def edge_time(self, value: Value, src: ShardSpec, dst: ShardSpec) -> float:
        """What the ILP charges for resharding `value`: reshard_time, less the latency of the
        reductions it prices elsewhere (latency_free: the gradients', the loss's)."""
        time = self.reshard_time(value, src, dst)
        if time > 0 and self.latency_free((value.id,)):
            time -= self.layers(value) * self.cost.combined_latency(
                self.reshard_comms(value, src, dst))
        return time

    def whole_first(self, value: Value, src: ShardSpec, dst: ShardSpec) -> ShardSpec | None:
        """The layout a partial sum is reduced into before it is resharded to `dst`, where XLA
        does not slice it first (the primitive table's reduced_whole: the slice cannot move
        into the op that made it): src's splits, and dst's over the summed axes (a
        reduce-scatter where the profile forms one, else an all-reduce of the whole); None
        where the reshard is priced as is."""
        if not src.partial or dst.partial or not self.reduced_whole(value):
            return None
        mid = ShardSpec(tuple(s + tuple(a for a in d if a in src.partial and a not in s)
                              for s, d in zip(src.dims, dst.dims)))
        if not mid.valid_for(value.shape, self.mesh):
            mid = src.without_partial()
        return None if mid == dst else mid

    def reduced_whole(self, value: Value) -> bool:
        """Whether an op the primitive table marks reduced_whole made `value`."""
        p = self.producer.get(value.id, (0, 0))[0] - self.num_inputs
        return p >= 0 and primitives.info(self.graph.nodes[p].primitive).reduced_whole

    def reshard_comms(self, value: Value, src: ShardSpec, dst: ShardSpec) -> tuple:
        """The collectives of resharding `value` from src to dst (through whole_first's
        layout where there is one)."""
        mid = self.whole_first(value, src, dst)
        if mid is not None:
            return self.cost.reshard_comms(value, src, mid) + self.cost.reshard_comms(
                value, mid, dst)
        return self.cost.reshard_comms(value, src, dst)

    def layers(self, value: Value) -> int:
        """Rows of `value` that are layers of a scan: its leading dimension when it has the
        shape of a scan's stacked value (what a loop_slice reads or a loop_stack writes: the
        stacked parameters, their gradients and optimizer states, saved activations), else 1."""
        return value.shape[0] if value.shape in self._stacked_shapes else 1

    def reshard_time(self, value: Value, src: ShardSpec, dst: ShardSpec) -> float:
        """Seconds to reshard `value` from src to dst. A scan's stacked value is priced as its
        layers resharded one by one, as the unrolled model's are: the same bytes, a latency per
        layer (XLA may send them in one collective outside the loop; priced so, a scanned
        model would win plans on latency that the same model unrolled cannot have)."""
        mid = self.whole_first(value, src, dst)
        if mid is not None:
            return self.reshard_time(value, src, mid) + self.reshard_time(value, mid, dst)
        time = self.cost.reshard_time(value, src, dst)
        layers = self.layers(value)
        if layers > 1 and time > 0:
            time += (layers - 1) * self.cost.reshard_latency(value, src, dst)
        return time
