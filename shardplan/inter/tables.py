"""Cost tables for Alpa's stage DP, from the intra-op planner.

A layer's cost on a submesh shape is the estimate of shardplan.intra.planner.plan_intra on the
layer's forward + backward graph of one micro-batch (cached by the layer's signature, so
repeated blocks are planned once). A range of layers costs the sum of its layers (resharding
between layers of a stage is not priced) plus receiving its input activations and sending
their gradients back over the link between hosts when the cluster has several (where its
neighbour sits is not known to the DP; the chosen stages' moves are priced again where they
sit, shardplan.inter.transfer_cost). Memory: parameters, their gradient accumulators and
optimizer state as the layer plans lay them out, plus the residuals of one micro-batch
spread over the submesh, times the micro-batches 1F1B keeps in flight.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np

from shardplan.cost.hardware import HardwareProfile
from shardplan.cost.model import AlphaBetaCost
from shardplan.inter import split as split_mod
from shardplan.inter import stage_io
from shardplan.inter import stages as stages_mod
from shardplan.inter import submesh as submesh_mod
from shardplan.inter.submesh import STAGE_AXES
from shardplan.intra.planner import plan_intra
from shardplan.intra.settings import IntraOptions
from shardplan.ir.graph import Role
from shardplan.ir.layers import cut_bytes
from shardplan.ir.lift import ArgInfo, lift
from shardplan.strategies.spec import MeshShape, ShardSpec


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The mesh's devices as hosts x devices per host, in the mesh's device order."""

    num_hosts: int
    per_host: int
    device_ids: tuple[int, ...]

    @classmethod
    def of(cls, mesh, hw: HardwareProfile) -> Cluster:
        if isinstance(mesh, MeshShape):
            ids = tuple(range(mesh.num_devices))
        elif isinstance(mesh, int):
            ids = tuple(range(mesh))
        else:
            ids = tuple(int(d.id) for d in np.asarray(mesh.devices).flat)
        n = len(ids)
        per = min(hw.devices_per_host, n)
        if n % per:
            raise ValueError(f"{n} devices do not fill hosts of {hw.devices_per_host} devices "
                             f"(profile {hw.name}); use a mesh of whole hosts")
        return cls(n // per, per, ids)

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)

    def shapes(self) -> list[tuple[int, int]]:
        return submesh_mod.submesh_shapes(self.num_hosts, self.per_host)


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's forward + backward of a micro-batch on one submesh shape, by its plan."""

    compute_s: float
    comm_s: float
    state_bytes: float
    """Differentiated parameters per device, as planned."""
    act_bytes: float
    """Residuals kept from forward to backward, per device (spread over the submesh)."""
    input_specs: tuple[ShardSpec, ...]
    """Planned spec of each of the layer's inputs (diff_in then const_in)."""

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s


class CostTables:
    """Per-layer costs by layer signature and submesh shape, computed on demand, kept for the
    planner's session (several micro-batch counts, the final stages)."""

    def __init__(self, hw: HardwareProfile, cluster: Cluster, options: IntraOptions):
        self.hw, self.cluster, self.options = hw, cluster, options
        self._models: dict[tuple[int, int], AlphaBetaCost] = {}
        self._costs: dict[tuple, LayerCost] = {}
        self._residuals: dict[tuple, float] = {}
        self.num_ilps = 0

    def model(self, shape: tuple[int, int]) -> AlphaBetaCost:
        if shape not in self._models:
            n = shape[0] * shape[1]
            self._models[shape] = AlphaBetaCost(MeshShape(STAGE_AXES, shape), self.hw,
                                                self.cluster.device_ids[:n])
        return self._models[shape]

    def layer(self, split: split_mod.SplitStep, io: stage_io.StageIO,
              shape: tuple[int, int]) -> LayerCost:
        sig = stage_io.layer_signature(split.forward, io)
        key = (sig, shape)
        if key not in self._costs:
            graph = _layer_graph(split, io)
            cost = self.model(shape)
            intra = plan_intra(graph, cost.mesh, cost, self.options)
            self.num_ilps += 1
            if sig not in self._residuals:
                self._residuals[sig] = _residual_bytes(split, io)
            n = len(io.diff_in) + len(io.const_in)
            e = intra.estimate
            self._costs[key] = LayerCost(e.compute_s, e.comm_s, e.state_bytes,
                                         self._residuals[sig] / (shape[0] * shape[1]),
                                         tuple(intra.input_specs[:n]))
        return self._costs[key]


def _layer_graph(split: split_mod.SplitStep, io: stage_io.StageIO):
    """The forward + backward graph of one micro-batch of a layer (or stage). Parameters are
    state whose gradients are tied to them (the accumulator has the parameter's layout);
    activations, the batch and cotangents are batch; the rest is replicated."""
    g = split.forward
    fouts = stage_io.float_outs(split, io)
    fb = stage_io.forward_backward(split, io)
    closed = jax.make_jaxpr(fb)(stage_io.avals(g, io.diff_in), stage_io.avals(g, io.const_in),
                                stage_io.avals(g, fouts))
    index = {v: i for i, v in enumerate(g.inputs)}
    micro = set(split.micro_leaves)
    diff = set(split.diff_values)
    computed = set(g.producers()) - {v for n in split.pre_nodes for v in g.nodes[n].outputs}
    roles = [Role.STATE if v in diff else Role.BATCH for v in io.diff_in]
    for v in io.const_in:
        i = index.get(v)
        if i is None:
            roles.append(Role.BATCH if v in computed else Role.OTHER)
        elif i in micro:
            roles.append(Role.BATCH)
        else:
            roles.append(Role.STATE if g.input_roles[i] == Role.STATE else Role.OTHER)
    roles += [Role.BATCH] * len(fouts)
    n_out = len(closed.jaxpr.outvars)
    ties = [None] * (n_out - len(io.diff_in)) + [k if v in diff else None
                                                 for k, v in enumerate(io.diff_in)]
    return lift(closed, ArgInfo(tuple(roles), tuple(ties)))


def _residual_bytes(split: split_mod.SplitStep, io: stage_io.StageIO) -> float:
    """Bytes of the residuals jax.vjp keeps for the layer, less the parameters among them."""
    g = split.forward
    fn = stage_io.stage_function(split, io)

    def residuals(diff, const):
        return jax.vjp(lambda *d: fn(list(d), const), *diff, has_aux=True)[1]

    shapes = jax.eval_shape(residuals, stage_io.avals(g, io.diff_in),
                            stage_io.avals(g, io.const_in))
    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
                for x in jax.tree_util.tree_leaves(shapes))
    params = sum(g.values[v].nbytes for v in io.diff_in if v in split.diff_values)
    return float(max(total - params, 0))


# -- the stage problem --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
    """The DP's inputs for one split into layers at one micro-batch count."""

    split: split_mod.SplitStep
    layers: tuple[tuple[int, ...], ...]
    ios: tuple[stage_io.StageIO, ...]
    shapes: tuple[tuple[int, int], ...]
    costs: tuple[tuple[LayerCost, ...], ...]  # [layer][shape]
    transfer_s: tuple[tuple[float, ...], ...]  # [layer][shape]: receiving layer's inputs
    state_factor: float
    act_factor: float
    memory_budget: float
    num_devices: int
    in_bytes: tuple[float, ...] = ()
    """[layer]: bytes of the activations crossing into the layer from the layers before it."""

    def problem(self, shapes: Sequence[int] | None = None, max_stages: int | None = None
                ) -> stages_mod.StageProblem:
        """The StageProblem over the given submesh shape indices (default all)."""
        idx = list(range(len(self.shapes))) if shapes is None else list(shapes)
        L, S = len(self.layers), len(idx)
        cost = np.full((L, L, S), np.inf)
        state = np.zeros((L, L, S))
        act = np.zeros((L, L, S))
        for c, m in enumerate(idx):
            t = np.array([self.costs[layer][m].time_s for layer in range(L)])
            st = np.array([self.costs[layer][m].state_bytes for layer in range(L)])
            ac = np.array([self.costs[layer][m].act_bytes for layer in range(L)])
            bad = np.concatenate([[0], np.cumsum(~np.isfinite(t))])  # layers not costed here
            pt, ps, pa = (np.concatenate([[0.0], np.cumsum(x)])
                          for x in (np.where(np.isfinite(t), t, 0.0), st, ac))
            for i in range(L):
                for j in range(i, L):
                    cost[i, j, c] = (np.inf if bad[j + 1] > bad[i] else
                                     pt[j + 1] - pt[i] + self.transfer_s[i][m])
                    state[i, j, c] = (ps[j + 1] - ps[i]) * self.state_factor
                    act[i, j, c] = (pa[j + 1] - pa[i]) * self.act_factor
        return stages_mod.StageProblem(
            num_layers=L, submeshes=tuple(self.shapes[m] for m in idx),
            num_devices=self.num_devices,
            num_micro_batches=self.split.num_micro_batches, cost=cost, state_mem=state,
            act_mem=act, memory_budget=self.memory_budget, max_stages=max_stages)

    def update_s(self, hw: HardwareProfile, stage_layers: tuple[int, int], m: int) -> float:
        """The update of a stage: reading and writing its state once (memory bound)."""
        i, j = stage_layers
        state = sum(self.costs[k][m].state_bytes for k in range(i, j + 1)) * self.state_factor
        return 2.0 * state / hw.mem_bandwidth


def build_tables(split: split_mod.SplitStep, layers, tables: CostTables, hw: HardwareProfile,
                 memory_budget: float | None, shapes: Sequence[tuple[int, int]] | None = None,
                 gpipe: bool = False) -> Tables:
    """Cost every layer on every candidate submesh shape (or only on `shapes`). The DP counts
    1F1B's activations in flight; for GPipe (all B micro-batches in flight) the activations
    are scaled by B, which over-counts stages that 1F1B would charge several already."""
    cluster = tables.cluster
    all_shapes = tuple(cluster.shapes())
    wanted = set(all_shapes if shapes is None else shapes)
    ios = stage_io.stage_ios(split, layers)
    costs = []
    for io in ios:
        row = []
        for shape in all_shapes:
            row.append(tables.layer(split, io, shape) if shape in wanted else
                       LayerCost(math.inf, 0.0, 0.0, 0.0, ()))
        costs.append(tuple(row))
    cuts = cut_bytes(split.forward, split.body)
    starts = np.cumsum([0] + [len(layer) for layer in layers])[:-1]
    link = hw.inter_host if cluster.num_hosts > 1 else hw.intra_host
    transfer, in_bytes = [], []
    for i, start in enumerate(starts):
        nbytes = float(cuts[start - 1]) if i > 0 else 0.0
        in_bytes.append(nbytes)
        transfer.append(tuple(
            0.0 if i == 0 else 2.0 * (link.latency + nbytes / (a * b) / link.bandwidth)
            for a, b in all_shapes))
    return Tables(split, tuple(tuple(x) for x in layers), ios, all_shapes, tuple(costs),
                  tuple(transfer), 2.0 + _optimizer_ratio(split),
                  float(split.num_micro_batches) if gpipe else 1.0,
                  math.inf if memory_budget is None else float(memory_budget),
                  cluster.num_devices, tuple(in_bytes))


def _optimizer_ratio(split: split_mod.SplitStep) -> float:
    """Optimizer state per parameter byte: the state inputs that are not differentiated."""
    avals = split.traced.in_avals
    nbytes = [math.prod(a.shape) * np.dtype(a.dtype).itemsize if not
              str(a.dtype).startswith("key") else 0 for a in avals]
    sources = {s for s in split.diff_sources if s is not None}
    params = sum(nbytes[i] for i in sources) or 1
    other = sum(nb for i, (nb, r) in enumerate(zip(nbytes, split.traced.arg_info.roles))
                if r == Role.STATE and i not in sources)
    return other / params
