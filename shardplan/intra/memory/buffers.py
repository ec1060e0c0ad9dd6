"""The memory model's buffers (intra/memory/model.py): one whose size is one member's choice, and a
reshard's copy that exists only when two members' layouts of one value differ."""

from __future__ import annotations

import dataclasses

import numpy as np

from shardplan.ir.graph import Value


def is_tensor(value: Value) -> bool:
    """Whether `value` is an array the step holds (a buffer, in a layout the plan chooses),
    not a literal or a constant folded into its readers."""
    return not value.is_literal and value.const is None


@dataclasses.dataclass(frozen=True, eq=False)
class Buffer:
    """A buffer whose size is `nbytes[k]` when root `root` makes its choice k."""

    root: int
    nbytes: np.ndarray
    start: int
    end: int
    what: str = ""  # what the buffer holds, for reports


@dataclasses.dataclass(frozen=True, eq=False)
class LiveCopy:
    """A buffer that exists only when two roots' layouts of one value differ, live from
    `start` to `end` in the schedule: the memory model's form of the solver's types.Copy, over
    root choices rather than the ILP's representatives."""

    a: int
    key_a: np.ndarray
    bytes_a: np.ndarray
    b: int
    key_b: np.ndarray
    bytes_b: np.ndarray
    start: int
    end: int
    what: str = ""
    # where the copy is a reshard its reader could take into its fusion if it only slices
    # (compilers.Rules.fused_slices; MemoryModel.live): (the source's layouts by choice, the
    # reader's, the node ids of the dots reading the value that may run windowed)
    sliced: tuple | None = None
