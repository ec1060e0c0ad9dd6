"""Estimate: the per-device cost of a step (or a stage) under the cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Per-device cost of one step under the cost model."""

    compute_s: float
    comm_s: float
    peak_bytes: float
    state_bytes: float
    comm_bytes: float = 0.0
    bubble_fraction: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_s": self.total_s}

    @classmethod
    def from_dict(cls, d: Mapping) -> Estimate:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})
