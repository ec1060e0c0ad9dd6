"""What the intra-operator ILP charges for resharding a value between two layouts: a scan's
stacked value resharded layer by layer, a partial sum XLA reduces whole before slicing it, the
latency of reductions priced elsewhere left out. intra/problem.py's Problem holds one
(Problem.reshards), through which the ILP's edges, the estimate and the emitted routes
price."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

from shardplan.cost.model import AlphaBetaCost
from shardplan.ir import primitives
from shardplan.ir.graph import Graph, Value
from shardplan.strategies.dot import DotDims
from shardplan.strategies.spec import MeshShape, ShardSpec

# The TPU compiler runs a dot whose partial result is reduce-scattered as a windowed einsum
# (a loop of collective-permutes, each step a dot making two chunks of the result) where its
# contracting dimensions hold more than this many elements per device (libtpu 0.0.42.1, v5e
# 2x4: 520 was not, 544 was; tests/test_reshard_window.py)
WINDOW_CONTRACTING = 512
# and the reduce-scatter spans the whole slice, of at most this many chips: seen on v5e 2x4
# and 4x4 (and Llama2-7B's gradients on 4x4), not over both axes of 4x8, 8x8 or 16x16, nor
# over one axis of 2x4, 4x8 or 16x16 (x^T dy with 1024 to 8192 rows a chip).
WINDOW_CHIPS = 16
# A plain reduce-scatter (no windowed einsum) is formed, one fused all-reduce and slice, on
# slices of at most this many chips: on v5e 4x4 the TPU compiler all-reduces the sum and
# moves the parts with collective-permutes (one dot compiled per case, read with
# analysis.hlo; tests/test_reshard_window.py). cost.model.TPU_SCATTER_CHIPS: past 16 chips
# every reduce-scatter is an all-reduce.
PLAIN_SCATTER_CHIPS = 8
# Ops that keep a partial sum partial when their other operands are scalars (dot_made).
_LINEAR = frozenset({"convert_element_type", "mul", "div", "neg", "copy", "copy_p"})


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

    def window_time(self, value: Value, src: ShardSpec, dst: ShardSpec) -> float:
        """The memory time the TPU compiler's windowed einsum adds where a dot's partial sum
        is reduce-scattered (WINDOW_CONTRACTING, WINDOW_CHIPS): over n devices it runs n/2
        steps (two chunks each, one per direction round the ring), and each step reads the
        whole of the operand that does not hold the scattered dimension, which one dot reads
        once.
        Compute time, not communication: the estimate adds it to compute
        (tests/test_reshard_window.py checks it against the compiled program's contraction
        bytes). The ILP's edges leave it out: priced there, the plans of
        tests/test_memory_tpu.py's MLP (searched, and FSDP completed by the ILP) turned from
        windowed reduce-scatters to all-reduces, whose heap peaks the TPU memory rules, read
        off windowed programs, over-count by 39% and 40%."""
        if self.cost.hardware.backend != "tpu" or not src.partial or dst.partial:
            return 0.0
        scattered = [(i, [a for a in d if a in src.partial]) for i, d in enumerate(dst.dims)]
        scattered = [(i, axes) for i, axes in scattered if axes]
        over = {a for _, axes in scattered for a in axes}
        if set(src.partial) - over or not self.mesh.size(tuple(over)) == self.mesh.size() <= (
                WINDOW_CHIPS):
            return 0.0
        found = self.dot_made(value) if scattered else None
        if found is None:
            return 0.0
        node, dims = found  # dims[i]: the dot result's dim that is value's dim i
        scattered = [(dims[i], axes) for i, axes in scattered]
        src = ShardSpec(tuple(src.dims[dims.index(j)] for j in range(len(dims))), src.partial)
        lhs, rhs = (self.graph.values[v] for v in node.inputs[:2])
        dd = DotDims.of(node.params, lhs.ndim, rhs.ndim)
        partial = self.mesh.size(src.partial)
        if math.prod(lhs.shape[d] for d in dd.lhs_contract) / partial <= WINDOW_CONTRACTING:
            return 0.0
        steps = self.mesh.size(tuple(over)) // 2
        nb, nm, nn = len(dd.lhs_batch), len(dd.lhs_free), len(dd.rhs_free)
        # the result's dims: the batch dims, the lhs's free dims, the rhs's (dot_general)
        held = {"both" if i < nb else "lhs" if i < nb + nm else "rhs" for i, _ in scattered}
        if steps <= 1 or len(held) != 1 or "both" in held:
            return 0.0
        whole, free = (rhs, range(nb + nm, nb + nm + nn)) if held == {"lhs"} else (
            lhs, range(nb, nb + nm))
        split = math.prod(self.mesh.size(src.dims[i]) for i in (*range(nb), *free))
        return (steps - 1) * whole.nbytes / (partial * split) / self.cost.hardware.mem_bandwidth

    def may_window(self, node, out: ShardSpec) -> bool:
        """Whether the TPU compiler may run dot `node`, its result laid out as `out`, as a
        windowed einsum: its partial sum over the whole slice, of at most WINDOW_CHIPS chips,
        its contracting dimensions holding more than WINDOW_CONTRACTING elements a device
        (window_time prices it where the sum is reduce-scattered, as it is there)."""
        if (self.cost.hardware.backend != "tpu" or node.primitive != "dot_general"
                or not out.partial
                or not self.mesh.size(out.partial) == self.mesh.size() <= WINDOW_CHIPS):
            return False
        lhs, rhs = (self.graph.values[v] for v in node.inputs[:2])
        dd = DotDims.of(node.params, lhs.ndim, rhs.ndim)
        return (math.prod(lhs.shape[d] for d in dd.lhs_contract) / self.mesh.size(out.partial)
                > WINDOW_CONTRACTING)

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

    def all_reduced_first(self, value: Value, src: ShardSpec, dst: ShardSpec
                          ) -> ShardSpec | None:
        """The whole sum, where the TPU compiler all-reduces a partial sum that dst splits
        over a summed axis rather than reduce-scatter it: a plain reduce-scatter (not
        windowed: window_time) on a slice of more than PLAIN_SCATTER_CHIPS chips that forms
        them (cost.model.TPU_SCATTER_CHIPS). Priced so (reshard_time, estimate), never
        emitted: the compiler chooses it. None elsewhere."""
        if (self.cost.hardware.backend != "tpu" or not self.cost.forms_reduce_scatter
                or self.mesh.size() <= PLAIN_SCATTER_CHIPS or not src.partial or dst.partial
                or not set(src.partial) & {a for d in dst.dims for a in d}
                or self.window_time(value, src, dst) > 0):
            return None
        return src.without_partial()

    def reduced_whole(self, value: Value) -> bool:
        """Whether an op the primitive table marks reduced_whole made `value`."""
        p = self.producer.get(value.id, (0, 0))[0] - self.num_inputs
        return p >= 0 and primitives.info(self.graph.nodes[p].primitive).reduced_whole

    def dot_made(self, value: Value, depth: int = 6):
        """(the dot_general whose result `value` is, through what keeps a partial sum
        partial: a transpose, a cast, a product or quotient by a scalar, a negation; for each
        of value's dims the dot result's dim it is), or None."""
        dims = list(range(value.ndim))
        for _ in range(depth):
            p = self.producer.get(value.id, (0, 0))[0] - self.num_inputs
            if p < 0:
                return None
            node = self.graph.nodes[p]
            if node.primitive == "dot_general":
                return node, dims
            same = [u for u in node.inputs if self.graph.values[u].shape == value.shape]
            if node.primitive == "transpose":
                perm = node.params["permutation"]
                dims = [perm[d] for d in dims]
            elif node.primitive not in _LINEAR or len(same) != 1 or any(
                    self.graph.values[u].size > 1 for u in node.inputs if u not in same) or (
                    node.primitive == "div" and same[0] != node.inputs[0]):
                return None
            value = self.graph.values[node.inputs[0] if node.primitive == "transpose"
                                      else same[0]]
        return None

    def reshard_comms(self, value: Value, src: ShardSpec, dst: ShardSpec) -> tuple:
        """The collectives of resharding `value` from src to dst (through whole_first's
        layout where there is one)."""
        mid = self.whole_first(value, src, dst) or self.all_reduced_first(value, src, dst)
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
        mid = self.whole_first(value, src, dst) or self.all_reduced_first(value, src, dst)
        if mid is not None:
            return self.reshard_time(value, src, mid) + self.reshard_time(value, mid, dst)
        time = self.cost.reshard_time(value, src, dst)
        layers = self.layers(value)
        if layers > 1 and time > 0:
            time += (layers - 1) * self.cost.reshard_latency(value, src, dst)
        return time
