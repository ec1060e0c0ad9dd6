"""Python's cyclic garbage collector paused while a step is planned.

Planning builds millions of small objects that live until the plan is made (the jaxpr, the
graph, strategies, cost tables), and each full collection walks them all again, to free none
of them. Paused, the peak memory is the same (reference counting frees the rest); the cycles
planning leaves are collected when the collector runs again. tests/test_gcpause.py checks
that planning runs paused; benchmarks/plan_speed.py measures the planning time."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    """The collector off inside the block, as it was after it (nested blocks leave it off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
