"""The cost model the ILP minimises: compute (flops at peak plus the contractions' memory
traffic per device), communication (alpha-beta per mesh axis), resharding between specs, and
bytes per device."""

from __future__ import annotations

import dataclasses
import functools

from shardplan.cost import collectives, ring
from shardplan.cost.hardware import HardwareProfile
from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Node, Value
from shardplan.strategies import common
from shardplan.strategies.base import Strategy
from shardplan.strategies.spec import MeshShape, ShardSpec

# Ops XLA fuses into loop or input fusions with their neighbours (intra/memory/model.py: their
# intermediates are never live in memory on their own).
FUSED = frozenset(name for name, info in primitives.PRIMITIVES.items() if info.fusible)
# The ops whose memory traffic the compute time charges: what analysis/hlo_bytes.py counts
# in the compiled program (dots and convolutions, alone or in the fusions that hold them).
CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})
# Floats XLA:CPU sends through its collectives as f32 (AlphaBetaCost.wire_itemsize).
NARROW_FLOATS = common.NARROW_FLOATS
# The TPU compiler reduce-scatters a partial sum split where it is reduced on slices of at
# most this many chips: as one fused all-reduce and slice on v5e 2x4, as a windowed einsum on
# 2x4 and 4x4 (intra.reshard_prices.WINDOW_CHIPS; on 4x4 only those: a plain one is an
# all-reduce and collective-permutes there, priced as the all-reduce by
# intra.reshard_prices.ReshardPrices.all_reduced_first). On 16x16 it
# all-reduces the whole sum and slices it, over one axis or both (one dot compiled per case,
# read with analysis.hlo; Llama2-70B's weight gradients on 16x16: benchmarks/tpu_check.py).
TPU_SCATTER_CHIPS = 16


class AlphaBetaCost:
    """Compute as flops at the profile's peak plus the memory traffic of the contractions at
    its memory bandwidth, collectives by the ring model over each mesh axis's link.

    The compute time is the one analysis/price.py gives the compiled program: per device,
    flops / peak + (contraction bytes + the step's I/O bytes) / mem_bandwidth, where
    contraction bytes are what every dot and convolution reads and writes and I/O bytes what
    the step reads as arguments and writes as results (analysis/hlo_bytes.py; the I/O is
    charged on the input members and untied outputs, intra/problem.py input_io_time). The
    I/O term is what makes a replicated optimizer state, updated on every device, cost more
    than its flops: with it Alpa's wide MLP plans Megatron, as the compiled programs price it
    (tests/test_alpa_mlp.py::test_small_batch_wide_layers_is_megatron). A sum of the two
    terms rather than a roofline max: per op it is within 2x of the roofline, and close to it
    for the ops that dominate (a large dot is flop-bound, an elementwise op has no flops to
    speak of). Elementwise and reduction traffic is left out on both sides: how XLA fuses
    them differs between backends, and the planner's graph cannot see those boundaries; dots
    alone agree to the byte
    (tests/test_model_agrees.py::test_contraction_bytes_count_a_dot_as_cost_analysis_does).
    The model's flops are cost_analysis()'s per primitive
    (tests/test_ir_primitives.py::test_flops_match_xla); benchmarks/model_check.py sets the
    whole estimate against the compiled zoo."""

    def __init__(self, mesh: MeshShape, hardware: HardwareProfile, device_order=None):
        self.mesh = mesh
        self.hardware = hardware
        # whether a partial sum split where it is reduced runs as a reduce-scatter here
        self.forms_reduce_scatter = hardware.forms_reduce_scatter and not (
            hardware.backend == "tpu" and mesh.size() > TPU_SCATTER_CHIPS)
        self.links = hardware.axis_links(mesh, device_order)
        self._reshard = functools.lru_cache(maxsize=None)(self._reshard_uncached)
        # the collectives and the path of a reshard, asked again for each tied layer's values
        self._comms = functools.lru_cache(maxsize=None)(self._comms_uncached)
        self._path = functools.lru_cache(maxsize=None)(self._path_uncached)

    def wire_itemsize(self, value: Value) -> int:
        """Bytes per element a collective sends of `value`. XLA:CPU (jax 0.10.2 and 0.12)
        converts a bf16 or f16 operand to f32 around every collective it partitions (an
        all-reduce's reducer "clone_promoted"), so on the cpu backend narrow floats travel at
        4 bytes (tests/test_cost_narrow_collectives.py); a GPU or TPU sends them as they are
        (analysis/price.py prices XLA:CPU's widened bytes at 16 bits there: CollectiveOp.formed)."""
        if self.hardware.backend == "cpu" and value.dtype in NARROW_FLOATS:
            return max(value.itemsize, 4)
        return value.itemsize

    def node_comms(self, strategy: Strategy) -> tuple:
        """The collectives a strategy runs inside its node, at the width the backend sends
        them: a narrow float's (Collective.narrow) at wire_itemsize on the cpu backend."""
        if self.hardware.backend != "cpu" or not any(c.narrow for c in strategy.comms):
            return tuple(strategy.comms)
        return tuple(dataclasses.replace(c, nbytes=2 * c.nbytes, narrow=False) if c.narrow
                     else c for c in strategy.comms)

    def _peak(self, dtype: str) -> float:
        try:
            return self.hardware.flops_for(dtype)
        except ValueError:
            return self.hardware.peak_flops_f32

    def node_time(self, graph: Graph, node: Node, strategy: Strategy) -> tuple[float, float]:
        """(compute seconds, communication seconds) of one node under one strategy, for all
        the times it runs in the step (`node.trips`: the trip counts of the loops around it)."""
        if node.primitive in primitives.PSEUDO:
            return 0.0, 0.0  # a loop's entry or exit moves no data
        compute, comm = self._node_time_once(graph, node, strategy)
        return compute * node.trips, comm * node.trips

    def node_time_key(self, graph: Graph, node: Node) -> tuple:
        """What node_time reads of a node besides its strategy: two nodes with equal keys cost
        the same under the same strategy (the same operator in two layers)."""
        values = tuple((graph.values[v].shape, graph.values[v].dtype, graph.values[v].itemsize)
                       for v in (*node.inputs, *node.outputs))
        out_dtype = graph.values[node.outputs[0]].dtype if node.outputs else None
        return (node.primitive in primitives.PSEUDO, node.primitive in CONTRACTIONS, node.trips,
                out_dtype, values)

    def _node_time_once(self, graph: Graph, node: Node, strategy: Strategy) -> tuple[float, float]:
        out_dtype = graph.values[node.outputs[0]].dtype if node.outputs else "float32"
        compute = strategy.flops / self._peak(out_dtype)
        compute += self.node_traffic(graph, node, strategy) / self.hardware.mem_bandwidth
        comm = collectives.comms_time(self.node_comms(strategy), self.mesh,
                                      self.links)
        return compute, comm

    def node_traffic(self, graph: Graph, node: Node, strategy: Strategy) -> float:
        """Bytes per device one run of the node reads from and writes to memory in the
        compute time's memory-bound term: a contraction's (CONTRACTIONS) operands and
        results, nothing for other ops (see the class docstring)."""
        if node.primitive not in CONTRACTIONS:
            return 0.0
        return sum(self.value_bytes(graph.values[v], spec) for v, spec in
                   zip((*node.inputs, *node.outputs), (*strategy.in_specs, *strategy.out_specs)))

    def _reshard_uncached(self, shape, itemsize, src: ShardSpec, dst: ShardSpec) -> float:
        return collectives.reshard_time(
            shape, itemsize, src, dst, self.mesh, self.links,
            forms_reduce_scatter=self.forms_reduce_scatter)

    def reshard_time(self, value: Value, src: ShardSpec, dst: ShardSpec) -> float:
        """Seconds to reshard; infinite when dst holds partial sums that src does not (a value
        only becomes partial inside a node)."""
        if src == dst or value.ndim == 0 and not src.partial and not dst.partial:
            return 0.0
        if dst.partial:
            if src.partial != dst.partial:
                return float("inf")
            src, dst = src.without_partial(), dst.without_partial()
            if src == dst:
                return 0.0
        return self._reshard(value.shape, self.wire_itemsize(value), src, dst)

    def reshard_latency(self, value: Value, src: ShardSpec, dst: ShardSpec) -> float:
        """The latency part of reshard_time: what each further run of the same collectives
        would add if the bytes were sent in more, smaller pieces."""
        if src == dst:
            return 0.0
        total = 0.0
        for c in self.reshard_comms(value, src, dst):
            link = ring.slowest_link(c.axes, self.mesh, self.links)
            if link is not None and c.nbytes > 0:
                total += ring.latency_steps(c.kind, self.mesh.size(c.axes)) * link.latency
        return total

    @property
    def combined_kinds(self) -> frozenset[str]:
        """Collective kinds XLA's all-reduce combiner merges when independent (intra/combiner/xla.py):
        all-reduces, and the reduce-scatters an accelerator forms of them (analysis/price.py
        prices the sliced part of XLA:CPU's combined all-reduce as a reduce-scatter there)."""
        return frozenset({"all-reduce", "reduce-scatter"} if self.forms_reduce_scatter
                         else {"all-reduce"})

    def combined_latency(self, comms) -> float:
        """The latency part of the collectives among `comms` that XLA's combiner merges: what
        one of them adds to the time of the combined collective it joins."""
        total = 0.0
        for c in comms:
            if c.kind in self.combined_kinds and c.nbytes > 0:
                link = ring.slowest_link(c.axes, self.mesh, self.links)
                if link is not None:
                    total += ring.latency_steps(c.kind, self.mesh.size(c.axes)) * link.latency
        return total

    def reshard_comms(self, value: Value, src: ShardSpec, dst: ShardSpec):
        if src == dst:
            return ()
        if dst.partial:
            src, dst = src.without_partial(), dst.without_partial()
        return self._comms(value.shape, self.wire_itemsize(value), src, dst)

    def _comms_uncached(self, shape, itemsize, src: ShardSpec, dst: ShardSpec):
        return collectives.reshard(shape, itemsize, src, dst, self.mesh,
                                   forms_reduce_scatter=self.forms_reduce_scatter,
                                   links=self.links)

    def reshard_path(self, value: Value, src: ShardSpec, dst: ShardSpec) -> tuple[ShardSpec, ...]:
        """The layouts the cheapest resharding passes through, ending with dst (partial
        states, which no sharding can express, left out)."""
        if src == dst:
            return ()
        if dst.partial:
            src, dst = src.without_partial(), dst.without_partial()
        return self._path(value.shape, self.wire_itemsize(value), src, dst)

    def _path_uncached(self, shape, itemsize, src: ShardSpec, dst: ShardSpec):
        return collectives.reshard_path(shape, itemsize, src, dst, self.mesh,
                                        forms_reduce_scatter=self.forms_reduce_scatter,
                                        links=self.links)

    def value_bytes(self, value: Value, spec: ShardSpec) -> float:
        return value.nbytes / spec.num_shards(self.mesh)
