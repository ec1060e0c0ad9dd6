"""Compiled programs as the target would hold them: XLA:CPU computes bf16 and f16 through f32
buffers that a GPU or TPU never makes, so a narrow-float step compiled on CPU devices standing
in for the target holds more temporaries than the target would (shardplan.intra.liveness
.cpu_widening models the share it keeps)."""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.analysis import hlo
from shardplan.cost.hardware import HardwareProfile


def widens(mesh, hw: HardwareProfile) -> bool:
    """Whether programs compiled on `mesh` hold narrow floats wider than `hw` would: CPU
    devices (XLA:CPU computes bf16 and f16 in f32) standing in for a GPU or TPU."""
    devices = getattr(mesh, "devices", None)
    if hw.backend == "cpu" or devices is None:
        return False
    return all(d.platform == "cpu" for d in np.asarray(devices).flat)


def on_target(stats: hlo.ProgramStats, mesh, hw: HardwareProfile,
              widening: float) -> hlo.ProgramStats:
    """The compiled peak as `hw` would hold it: arguments and outputs as compiled (their
    dtypes are the step's), the temporaries scaled by `widening` where XLA:CPU widened them."""
    if widening >= 1.0 or not widens(mesh, hw):
        return stats
    peak = (stats.argument_bytes + stats.output_bytes - stats.alias_bytes
            + int(np.ceil(stats.temp_bytes * widening)))
    return dataclasses.replace(stats, peak_bytes=peak)
