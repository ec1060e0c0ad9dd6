"""The ILP's memory rows from the memory model's live intervals, in array operations.

A row is one moment where the live set can peak: what every buffer live then weighs under its
representative's choice, plus the copies live then. A deep unrolled model has millions of
(moment, live item) pairs, too many to sum one by one in Python: each representative's bytes
are summed once per span of moments where what it holds does not change, and each row's copies
are one slice of a sparse matrix (tests/test_intra_memory.py::
test_memory_rows_equal_the_live_sets_summed_at_each_point checks them against the sum).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import scipy.sparse

from shardplan.intra.solve import types


def live_ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, first, last) for items live over [starts[i], ends[i]]: the moments where the
    live set can peak (the last before some item ends, if one started since the previous such
    moment: any other moment's live set is contained in one of these), and the first and last
    of them each item is live at (last < first: none)."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if not len(starts):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    start_points = np.unique(starts)
    end_points = np.unique(ends)
    # starts up to each end; a moment is kept when one started since the previous end, which
    # has as many as the last kept moment (the ends between them added none)
    seen = np.searchsorted(start_points, end_points, side="right")
    before = np.concatenate([[np.searchsorted(start_points, -1, side="right")], seen[:-1]])
    times = end_points[seen > before]
    first = np.searchsorted(times, starts, side="left")
    last = np.searchsorted(times, ends, side="right") - 1
    return times, first, last


def _per_moment(first: np.ndarray, last: np.ndarray, ids: np.ndarray, moments: int):
    """A moments x items 0/1 CSR matrix: item ids[i] at moments first[i]..last[i] (ids
    ascending within each moment when ids ascend)."""
    lens = np.maximum(last - first + 1, 0)
    total = int(lens.sum())
    starts = np.repeat(first, lens)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    rows = (starts + offsets).astype(np.int32)
    cols = np.repeat(ids, lens).astype(np.int32)
    width = int(ids.max()) + 1 if len(ids) else 0
    return scipy.sparse.csr_matrix((np.ones(total, np.int8), (rows, cols)),
                                   shape=(moments, width))


def solver_terms(buffers: Sequence, copies: Sequence, index: Mapping[int, int]):
    """(base, rows, copies, row_copies) for types.SolverInput, over representatives (`index`:
    root -> representative): a buffer live at every moment goes to the base, a copy of one
    representative's layouts to the rows (its bytes when the two keys differ), a copy between
    two representatives to the copies, named per row by an array of their indices. Rows that
    repeat another are dropped."""
    nb = len(buffers)
    times, first, last = live_ranges(
        [b.start for b in buffers] + [c.start for c in copies],
        [b.end for b in buffers] + [c.end for c in copies])
    moments = len(times)
    if not moments:
        first = last = np.zeros(nb + len(copies), np.int64)
    always = (first[:nb] == 0) & (last[:nb] == moments - 1)
    base: dict[int, np.ndarray] = {}
    items = []
    for i, b in enumerate(buffers):
        rep = index[b.root]
        if always[i]:
            base[rep] = base.get(rep, 0) + b.nbytes
        elif first[i] <= last[i]:
            items.append((rep, b.nbytes, first[i], last[i]))
    out_copies, copy_id = [], np.full(len(copies), -1, np.int64)
    for j, c in enumerate(copies):
        ia, ib = index[c.a], index[c.b]
        if ia == ib:
            if first[nb + j] <= last[nb + j]:
                items.append((ia, np.where(c.key_a != c.key_b,
                                           np.maximum(c.bytes_a + c.bytes_b, 0.0), 0.0),
                              first[nb + j], last[nb + j]))
        else:
            copy_id[j] = len(out_copies)
            out_copies.append(types.Copy(ia, c.key_a, c.bytes_a, ib, c.key_b, c.bytes_b))
    if not moments:
        return (), (), tuple(out_copies), ()
    # each representative's bytes at every moment, summed over what is live then in the order
    # of the items (buffers, then copies), once per span of moments where that does not change
    per_rep: dict[int, list] = {}
    for rep, nbytes, f, la in sorted(items, key=lambda item: item[0]):
        per_rep.setdefault(rep, []).append((nbytes, f, la))
    rows: list[list] = [[] for _ in range(moments)]
    for rep in sorted(per_rep):
        entries = per_rep[rep]
        f = np.array([e[1] for e in entries])
        la = np.array([e[2] for e in entries])
        sizes = np.array([e[0] for e in entries], dtype=float)
        spans = np.unique(np.concatenate([f, la + 1, [moments]]))
        for start, stop in itertools.pairwise(spans):
            live = (f <= start) & (la >= start)
            if live.any():
                held = sizes[live].sum(axis=0)
                for p in range(start, stop):
                    rows[p].append((rep, held))
    shared = np.flatnonzero(copy_id >= 0)
    matrix = _per_moment(first[nb + shared], last[nb + shared], copy_id[shared], moments)
    row_copies = np.split(matrix.indices.astype(np.int64), matrix.indptr[1:-1])
    out_rows, out_row_copies, seen = [], [], set()
    for row, rc in zip(rows, row_copies):
        key = (tuple((r, a.tobytes()) for r, a in row), rc.tobytes())
        if key in seen:
            continue
        seen.add(key)
        out_rows.append(tuple(row))
        out_row_copies.append(rc)
    return (tuple(sorted(base.items())), tuple(out_rows), tuple(out_copies),
            tuple(out_row_copies))
