"""Price a compiled program with a hardware profile: the step time of what XLA really emitted.

The planner's estimate is its own cost model; a hand-written baseline has none. To compare
them on the same footing, both are compiled by XLA (on CPU devices standing in for the
cluster) and the compiled programs are priced here by one profile: compute is the per-device
flops of `compiled.cost_analysis()` at the profile's peak for the dtype plus the bytes its
dots and convolutions read and write and the bytes of its arguments and results
(analysis/hlo_bytes.py) at the profile's memory bandwidth, as the cost model prices a plan
(cost/model.py AlphaBetaCost), communication is the alpha-beta time of every collective in
the partitioned HLO over the link of the mesh axes its replica groups span
(`HardwareProfile.axis_links`), memory is `compiled.memory_analysis()`.

Two things XLA:CPU does differently from a GPU or TPU compiler would make CPU-compiled
programs look dearer than they run on the accelerator, and not alike for every plan:

- it never forms reduce-scatters (JAX-NOTES): "all-reduce, keep a device's slice" stays an
  all-reduce (2x the bytes of the reduce-scatter);
- it runs bf16 arithmetic in f32 and sends the widened values (2x the bytes of bf16).

`analysis/hlo.py` recognises both in the partitioned HLO, and for an accelerator profile
(`HardwareProfile.forms_reduce_scatter`) the program is priced as the accelerator would run
it (`ProgramStats.formed`), for the plan and the baselines alike. The `cpu` profile prices
the CPU program as compiled, and a program the TPU compiler compiled is priced as compiled
(it already sends bf16 and runs its reduce-scatters: tests/test_analysis_tpu.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardplan.analysis import hlo
from shardplan.cost import collectives
from shardplan.cost.hardware import HardwareProfile, Link
from shardplan.strategies.spec import MeshShape


@dataclasses.dataclass(frozen=True)
class KindCost:
    """What one kind of collective costs per step: executions, bytes sent per device, seconds."""

    count: int
    bytes_sent: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class PricedStep:
    """Per-device cost of one step of a compiled program under a hardware profile."""

    compute_s: float
    """flops per device / the profile's peak for the dtype + (contraction bytes + argument
    and result bytes) per device / the profile's memory bandwidth."""
    comm_s: float
    """Alpha-beta time of every collective, run one after another (no overlap)."""
    total_s: float
    """compute_s + comm_s."""
    peak_bytes: float
    """argument + output + temp - alias bytes per device (ProgramStats.peak_bytes)."""
    bytes_sent: float
    """Bytes each device sends per step (ring model), summed over collectives."""
    per_kind: Mapping[str, KindCost]
    """Collective kind -> its count, bytes and time, kinds sorted by name."""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["per_kind"] = {k: dataclasses.asdict(v) for k, v in self.per_kind.items()}
        return d


def collective_link(op: hlo.CollectiveOp, mesh_shape: MeshShape, device_ids_grid: Any,
                    links: Mapping[str, Link]) -> Link | None:
    """The link a compiled collective runs over: the slowest link of the mesh axes its groups
    span (for a collective-permute, the components of its source-target pairs); None if it
    spans none (groups of one device, a permute that moves nothing)."""
    axes = hlo.axes_of_group(op.groups, mesh_shape, device_ids_grid)
    return collectives.slowest_link(axes, mesh_shape, links) if axes else None


def collective_seconds(op: hlo.CollectiveOp, link: Link | None) -> float:
    """Seconds for one execution: ring steps x latency + bytes sent / bandwidth."""
    if link is None or op.bytes_sent <= 0:
        return 0.0
    steps = collectives.latency_steps(op.kind, op.group_size)
    return steps * link.latency + op.bytes_sent / link.bandwidth


def price(stats: hlo.ProgramStats, mesh_shape: MeshShape, device_ids_grid: Any,
          hw: HardwareProfile, dtype: Any = "float32") -> PricedStep:
    """Price a compiled program (hlo.analyze) on `hw`.

    Args:
      stats: the program's ProgramStats (flops, memory and collectives per device).
      mesh_shape: the mesh the program was compiled for (names and sizes).
      device_ids_grid: the mesh's device ids laid out like the mesh, e.g.
        `np.vectorize(lambda d: d.id)(mesh.devices)`; id // hw.devices_per_host is the host
        a device stands for, which decides whether an axis runs over the intra- or
        inter-host link.
      hw: the profile whose peak flops and links price the program.
      dtype: the arithmetic dtype of the step (bfloat16 runs at peak_flops, float32 at
        peak_flops_f32; see HardwareProfile.flops_for).
    """
    if hw.forms_reduce_scatter:
        stats = stats.formed()
    grid = np.asarray(device_ids_grid)
    links = hw.axis_links(mesh_shape, device_order=[int(d) for d in grid.flat])
    per_kind: dict[str, list] = {}
    for op in stats.collectives:
        seconds = collective_seconds(op, collective_link(op, mesh_shape, grid, links))
        acc = per_kind.setdefault(op.kind, [0, [], []])
        acc[0] += op.count
        acc[1].append(op.bytes_sent * op.count)
        acc[2].append(seconds * op.count)
    kinds = {k: KindCost(n, math.fsum(b), math.fsum(s)) for k, (n, b, s) in sorted(per_kind.items())}
    compute = (float(stats.flops) / hw.flops_for(dtype)
               + float(stats.contraction_bytes + stats.io_bytes) / hw.mem_bandwidth)
    comm = math.fsum(k.seconds for k in kinds.values())
    return PricedStep(
        compute_s=compute, comm_s=comm, total_s=compute + comm,
        peak_bytes=float(stats.peak_bytes),
        bytes_sent=math.fsum(k.bytes_sent for k in kinds.values()), per_kind=kinds,
    )
