"""What a device's HBM holds once the compiler has moved short-lived buffers on chip.

The TPU compiler's memory space assignment places buffers in a core's on-chip memory (VMEM;
v4's CMEM: its buffer assignment's "color 1" or "color 3" allocation), and its heap peak
(memory_analysis' peak_memory_in_bytes, what it refuses programs by) counts HBM alone: the
dumps of GPT-2 124M and the zoo's MoE planned for v5e 4x4 hold, at their heap peaks, what
their HBM buffers alone hold (benchmarks/xla_live.py --hbm: 1271.80 MB against a heap peak of
1271.84 MB, 745.82 against 745.85). Which buffers it moves: of the MoE's temporaries of 1 MiB
or more, 902 were placed on chip and 94 in HBM; the large ones on chip are the short-lived
ones (the logits, f32 62.5 MiB a chip, for 2 of the schedule's 9545 steps; attention's 32 MiB
scores for at most 355), while what the forward pass holds for the backward stays in HBM.

So the model holds in HBM, at each moment, what is live less the short-lived buffers it places
on chip (made and last read within SHORT of the step's schedule, whose positions are about half
the compiler's steps), each whole, largest first, as they fit in the on-chip capacity
(HardwareProfile.fast_memory_bytes) for the whole of their lives. Measured with the rules read
off the same dumps (liveness.recast, compilers.TPU.hoisted_gathers), the searched plans on v5e
4x4 (benchmarks/tpu_check.py): the MoE's estimate over the heap went from 1.25 to 1.09,
GPT-2's from 1.17 to 1.08; GPT-2's on 16x16 from 1.23 to 0.87, then 1.01 once temporaries
were counted in tiles (compilers.Rules.tiled: its attention's saved activations, the sequence
split 16 ways, have no dimension of 128 and are held padded). The ILP's
rows leave this out: they hold a plan to at most that capacity more than its estimate (v5e:
112 MiB a chip), the safe side.
"""

from __future__ import annotations

import numpy as np

# a buffer live for at most this share of the step's schedule may be held on chip
SHORT = 1 / 16


def hbm_peak(items, horizon: int, capacity: float, scale: float = 1.0) -> float:
    """The most bytes HBM holds at one moment: `items` are (start, end, bytes, what) over a
    schedule of `horizon` positions, the short-lived ones counted `scale` times their size
    (the memory model's margin on activations); on_chip says which are held on chip."""
    if not items:
        return 0.0
    starts, ends, sizes, _ = zip(*items)
    starts = np.asarray(starts, dtype=int)
    ends = np.asarray(ends, dtype=int)
    sizes = np.asarray(sizes, dtype=float)
    change = np.zeros(int(ends.max()) + 2)
    np.add.at(change, starts, sizes)
    np.add.at(change, ends + 1, -sizes)
    held = np.cumsum(change)
    if capacity > 0:
        held = held - on_chip(starts, ends, sizes, horizon, capacity, scale)
    return max(0.0, float(held.max()))


def on_chip(starts, ends, sizes, horizon: int, capacity: float, scale: float = 1.0
            ) -> np.ndarray:
    """The bytes (as counted) held on chip at each moment: the short-lived buffers, largest
    first (the order of XLA's heap simulator, GlobalDecreasingSizeBestFitHeap, which memory
    space assignment builds on), each whole where its size (counted / `scale`) fits beside
    those already placed for the whole of its life. The MoE's f32 logits on v5e 4x4, 62.5 MiB
    a chip, were placed on chip beside smaller buffers; GPT-2 124M's on 16x16, 98 MiB, stayed
    in HBM while its two bf16 copies of 49 MiB were on chip (the compiler orders by what a
    buffer's uses gain, which the model does not know: the same bytes here either way)."""
    used = np.zeros(int(ends.max()) + 2)
    moved = np.zeros_like(used)
    short = np.flatnonzero((ends - starts + 1 <= SHORT * horizon) & (ends >= starts)
                           & (sizes > 0))
    for j in short[np.argsort(-sizes[short], kind="stable")]:
        lo, hi = starts[j], ends[j] + 1
        if used[lo:hi].max() + sizes[j] / scale <= capacity:
            used[lo:hi] += sizes[j] / scale
            moved[lo:hi] += sizes[j]
    return moved
