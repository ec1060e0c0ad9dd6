"""A planning job's progress shown live on a terminal (rich): each running phase with its
candidate number and elapsed time, nested as the phases are, and the solver's incumbent,
bound and gap as they come. Nothing is shown where the stream is not a terminal, or the
console is quiet: those get progress.SILENT (tests/test_progress.py)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.spinner import Spinner
from rich.text import Text

from shardplan import progress
from shardplan.units import fmt_bytes, fmt_seconds


def describe(update: progress.SolverUpdate) -> str:
    """One line of a solver's state: 'HiGHS MIP: incumbent 1.23 ms, bound 1.22 ms, gap 0.8%'."""
    fmt = fmt_bytes if update.unit == "B" else fmt_seconds
    parts = []
    if update.incumbent is not None:
        parts.append(f"incumbent {fmt(update.incumbent)}")
    if update.bound is not None:
        parts.append(f"bound {fmt(update.bound)}")
    if update.gap is not None:
        parts.append(f"gap {update.gap:.2%}")
    return f"{update.solver} {update.what}: {', '.join(parts) or 'no solution yet'}"


def phase_text(name: str, done: int | None, total: int | None) -> str:
    """A phase as shown: its name, and which candidate of how many it is."""
    if done is None:
        return name
    return f"{name} ({done} of {total})" if total else f"{name} ({done})"


class LiveProgress:
    """A progress.Reporter drawing on `console` while any phase runs (a rich Live region,
    gone when the last phase ends: the console keeps only what else was printed)."""

    def __init__(self, console: Console, refresh_per_second: float = 8.0):
        self.console = console
        self._lock = threading.Lock()
        self._open: list[tuple[str, str, float]] = []  # (name, as shown, start)
        # the last solver update and how many phases were open when it came: it is shown
        # until the phase it came in ends
        self._solver: tuple[progress.SolverUpdate, int] | None = None
        self._spinner = Spinner("dots")
        self._live = Live(self, console=console, transient=True, auto_refresh=True,
                          refresh_per_second=refresh_per_second, redirect_stdout=False,
                          redirect_stderr=False)

    def started(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        with self._lock:
            self._open.append((phase, phase_text(phase, done, total), time.perf_counter()))
            first = len(self._open) == 1
        if first:
            self._live.start()

    def ended(self, phase: str, failed: bool = False) -> None:
        with self._lock:
            for i in range(len(self._open) - 1, -1, -1):
                if self._open[i][0] == phase:
                    del self._open[i:]
                    break
            last = not self._open
            if self._solver is not None and self._solver[1] > len(self._open):
                self._solver = None
        if last:
            self._live.stop()

    def solver(self, update: progress.SolverUpdate) -> None:
        with self._lock:
            self._solver = (update, len(self._open))

    def close(self) -> None:
        """Stop drawing, whatever phases a failure left open."""
        with self._lock:
            self._open.clear()
            self._solver = None
        self._live.stop()

    def __rich__(self):
        now = time.perf_counter()
        with self._lock:
            rows = [(shown, now - start) for _, shown, start in self._open]
            update = self._solver[0] if self._solver is not None else None
        lines = []
        for depth, (shown, elapsed) in enumerate(rows):
            line = Text("  " * depth)
            line.append(Text.from_markup(f"{escape(shown)} [dim]{elapsed:.0f} s[/dim]"))
            lines.append(line)
        if update is not None:
            lines.append(Text("  " * len(rows)) + Text(describe(update), style="cyan"))
        if not lines:
            return Text("")
        head = Text.assemble(self._spinner.render(time.monotonic()), " ")
        return Group(head + lines[0], *(Text("  ") + line for line in lines[1:]))


def for_console(console: Console) -> progress.Reporter:
    """A live display on `console` where it is a terminal and not quiet, else SILENT."""
    if console.quiet or not console.is_terminal:
        return progress.SILENT
    return LiveProgress(console)


@contextlib.contextmanager
def on_stderr(reporter: progress.Reporter | None | bool = None) -> Iterator[progress.Reporter]:
    """The reporter shardplan.auto and shardplan.search plan with: `reporter` itself if one
    is given; False: SILENT; True: a live display on stderr where it is a terminal; None:
    the same outside pytest (whose runs would otherwise draw between test names). A display
    made here is gone when the block leaves; a given reporter is left as it is."""
    made = reporter
    if reporter is None:
        made = (progress.SILENT if "PYTEST_CURRENT_TEST" in os.environ
                else for_console(Console(stderr=True)))
    elif reporter is False:
        made = progress.SILENT
    elif reporter is True:
        made = for_console(Console(stderr=True))
    try:
        yield made
    finally:
        if made is not reporter and isinstance(made, LiveProgress):
            made.close()
