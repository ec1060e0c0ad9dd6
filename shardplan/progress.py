"""Progress of a planning job, told to a Reporter: the phases as they start and end (tracing,
lifting, strategies, presolve, the MIP, the least memory, each candidate compiled, ...) and
the solver's incumbent and bound as it goes. The planning layers call the reporter the job
carries (planning.job.Job.progress); SILENT, the default, does nothing, so a library user who
asks for nothing sees nothing. progress_display.py shows it live on a terminal."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple, Protocol


class SolverUpdate(NamedTuple):
    """Where a solve stands: the cost of its best solution so far (`incumbent`, None before
    it has one) and the bound no solution can beat (`bound`, None where the solver gives
    none), in `unit` ("s" for a plan's cost, "B" for bytes per device)."""

    solver: str
    what: str
    incumbent: float | None = None
    bound: float | None = None
    unit: str = "s"

    @property
    def gap(self) -> float | None:
        """|incumbent - bound| / |incumbent| (0 when both are 0), None without both."""
        if self.incumbent is None or self.bound is None:
            return None
        if not (math.isfinite(self.incumbent) and math.isfinite(self.bound)):
            return None
        scale = abs(self.incumbent)
        if scale == 0.0:
            return 0.0 if self.bound == 0.0 else None
        return max(0.0, abs(self.incumbent - self.bound) / scale)


class Reporter(Protocol):
    """What the planning layers tell about a job as it runs. `done` of `total`: the
    candidate (mesh, compiled plan, micro-batch count) a phase is, where it is one of several.
    A reporter only listens: nothing it does changes the plan (tests/test_progress.py)."""

    def started(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        ...

    def ended(self, phase: str, failed: bool = False) -> None:
        ...

    def solver(self, update: SolverUpdate) -> None:
        ...


class Silent:
    """The reporter that does nothing (the default)."""

    def started(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        pass

    def ended(self, phase: str, failed: bool = False) -> None:
        pass

    def solver(self, update: SolverUpdate) -> None:
        pass


SILENT: Reporter = Silent()


@contextlib.contextmanager
def phase(reporter: Reporter, name: str, done: int | None = None,
          total: int | None = None) -> Iterator[None]:
    """`name` started on `reporter` and ended when the block leaves, failed if it raised."""
    reporter.started(name, done, total)
    try:
        yield
    except BaseException:
        reporter.ended(name, failed=True)
        raise
    reporter.ended(name)
