"""How long an activation's own buffer lives once a plan is fixed.

The memory model (intra/memory/model.py) keeps a value until its last reader, whichever layout that
reader reads. XLA frees it once the last read of it as laid out has run and the last reshard
made from it is made: a reader that reads another layout reads a copy, and a later reader of
that layout reads the same copy (the MoE on 2x4: an expert dot's result resharded for the
combine held only as its copy to the backward, where the model held both, 32 KiB of 80 KiB at
its peak). Whether a read is of the value as laid out, of a copy made then, or of a copy made
before depends on the producer's layout and two readers': a plan's evaluation
(MemoryModel.peak) counts it, the ILP's rows keep the value to its last reader, never less.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Need:
    """The value is needed until `end` when root a's and root b's layouts are equal (`equal`:
    a read of the value as laid out) or differ (a reshard made from it)."""

    end: int
    a: int
    key_a: np.ndarray
    b: int
    key_b: np.ndarray
    equal: bool


@dataclasses.dataclass(frozen=True, eq=False)
class Original:
    """A value's buffer (model.buffers[buffer]): needed until `floor` whatever the plan, and
    until each Need's end when it holds."""

    buffer: int
    floor: int
    needs: tuple[Need, ...]


def evaluate(original: Original, end: int, root_choice: Mapping[int, int]) -> int:
    """The buffer's last moment at a choice, never past the rows' `end`."""
    last = original.floor
    for n in original.needs:
        if n.end > last and (n.key_a[root_choice[n.a]] == n.key_b[root_choice[n.b]]) == n.equal:
            last = n.end
    return min(last, end)
