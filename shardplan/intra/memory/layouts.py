"""The memory model's layouts of a value, made once: a member's specs for each of its choices,
their bytes, and the keys that say which choices of two members give equal layouts. Tied
layers read and write the same layouts, so each is made once per choice key, not per layer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def keys(a: Sequence, b: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Equal specs -> equal ints, across both sides."""
    index: dict = {}  # specs are frozen dataclasses: equal specs hash equal
    ka = np.array([index.setdefault(s, len(index)) for s in a])
    kb = np.array([index.setdefault(s, len(index)) for s in b])
    return ka, kb


class Layouts:
    """A Problem's layouts as the memory model reads them; `nbytes(value, spec)` sizes a value
    in a layout (MemoryModel.nbytes), `scale` multiplies every size (the activations' margin).
    A layout is (specs by choice, an interned id)."""

    def __init__(self, problem, scale: float, nbytes):
        self.problem, self.scale, self._nbytes = problem, scale, nbytes
        self._bytes: dict = {}  # (shape, dtype, itemsize) -> spec -> bytes
        self._layouts: dict[tuple, tuple] = {}  # (choice key, side, index) -> layout
        self._interned: dict[tuple, int] = {}
        self._pairs: dict[tuple[int, int], tuple] = {}  # ids of two layouts -> keys, same
        self._sized: dict[tuple, np.ndarray] = {}

    def nbytes(self, value, specs) -> np.ndarray:
        """Bytes per device of `value` in each of `specs`, scaled."""
        of = self._bytes.setdefault((value.shape, value.dtype, value.itemsize), {})
        out = []
        for d in specs:  # one lookup per spec (hashing the specs is what this costs)
            b = of.get(d)
            if b is None:
                b = of[d] = self._nbytes(value, d)
            out.append(b)
        return self.scale * np.ceil(out)

    def of(self, m: int, side: str, idx: int) -> tuple:
        """Member m's layout of its input (side "in") or output ("out") `idx`."""
        key = (self.problem.choice_key(m), side, idx)
        if key not in self._layouts:
            p = self.problem
            spec = p.out_spec if side == "out" else p.in_spec
            specs = tuple(spec(m, idx, k) for k in range(len(p.strategies[p.groups.root[m]])))
            self._layouts[key] = (specs, self._interned.setdefault(specs, len(self._interned)))
        return self._layouts[key]

    def keys(self, a: tuple, b: tuple) -> tuple[np.ndarray, np.ndarray, bool]:
        """keys() of two layouts (read-only), and whether every choice of both is one spec."""
        if (a[1], b[1]) not in self._pairs:
            ka, kb = keys(a[0], b[0])
            ka.flags.writeable = kb.flags.writeable = False
            self._pairs[(a[1], b[1])] = (ka, kb, len(set(a[0]).union(b[0])) == 1)
        return self._pairs[(a[1], b[1])]

    def sized(self, value, layout: tuple) -> np.ndarray:
        """nbytes() of `value` in a layout (read-only)."""
        key = (value.shape, value.dtype, value.itemsize, layout[1])
        if key not in self._sized:
            self._sized[key] = self.nbytes(value, layout[0])
            self._sized[key].flags.writeable = False
        return self._sized[key]
