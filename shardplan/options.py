"""SearchOptions: every option of a search, with its default, in one frozen value.

api.auto / api.search, the CLI and the YAML config build one and pass it down; the planners
read it (shardplan.search turns it into the intra-op planner's IntraOptions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from shardplan.units import parse_bytes

SCHEDULES = ("1f1b", "gpipe")
"""Pipeline schedules: 1F1B (PipeDream-flush) and GPipe."""
PIPELINE_MODES = ("auto", True, False)

BACKWARD_PER_FORWARD = 2.0
"""A micro-batch's backward takes about twice its forward: a stage's time per micro-batch is
split 1 : 2 between them (schedule simulation, pipeline plans, timelines)."""


def check_schedule(schedule: str) -> str:
    """`schedule` if it is one of SCHEDULES, else the error that lists them."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; use one of {SCHEDULES}")
    return schedule


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How to search a plan (everything but the step, the mesh and the hardware)."""

    memory_budget: int | None = None
    """Bytes per device (an int, or a string like "16GiB" given to `make`); None: no budget
    for the single-program planner, the profile's memory for the pipeline planner."""
    time_limit: float = 30.0
    """Seconds the ILP solver may take per solve (it returns its best plan so far)."""
    solver_seed: int = 0
    """The CP-SAT solver's random seed (plans are deterministic for a seed)."""
    workers: int = 1
    """Solver threads (1 keeps plans deterministic)."""
    state_argnums: tuple[int, ...] | None = None
    """Which arguments are state (params, optimizer state); default those an output gives back."""
    batch_argnums: tuple[int, ...] | None = None
    """Which arguments are the batch; default the arguments that are not state."""
    pipeline: bool | str = False
    """False (one program), True (pipeline stages on submeshes) or "auto" (where they pay)."""
    num_micro_batches: int | None = None
    """Micro-batches per step of a pipeline; default the planner's choice."""
    num_stages: int | None = None
    """Force this many pipeline stages on equal submeshes; default the stage DP's choice."""
    num_layers: int | None = None
    """Layers the loss function is clustered into for the stage DP; default min(8, ...)."""
    schedule: str = "1f1b"
    """Pipeline schedule, one of SCHEDULES."""
    measure: bool = False
    """Also compile the searched plan and the expert plans with XLA, price each with the
    hardware profile and keep the cheapest that fits (shardplan.measure)."""
    while_trips: float = 1.0
    """Iterations a while loop JAX knows no trip count of is priced at (scan and fori_loop
    with static bounds have theirs); the plan's notes say when this was used."""

    def __post_init__(self):
        if self.pipeline not in PIPELINE_MODES:
            raise ValueError(f"pipeline={self.pipeline!r}: use 'auto', True or False")
        check_schedule(self.schedule)
        if not self.time_limit > 0:
            raise ValueError(f"time_limit={self.time_limit!r}: give seconds > 0")
        if not self.while_trips >= 1:
            raise ValueError(f"while_trips={self.while_trips!r}: give iterations >= 1")
        if self.workers < 1:
            raise ValueError(f"workers={self.workers!r}: give at least 1 solver thread")

    @classmethod
    def make(cls, *, memory_budget=None, state_argnums: Sequence[int] | None = None,
             batch_argnums: Sequence[int] | None = None, **fields) -> SearchOptions:
        """SearchOptions from loose user values: a budget string, argnums as any sequence."""
        return cls(memory_budget=parse_bytes(memory_budget),
                   state_argnums=None if state_argnums is None else tuple(state_argnums),
                   batch_argnums=None if batch_argnums is None else tuple(batch_argnums),
                   **fields)

    def replace(self, **changes) -> SearchOptions:
        return dataclasses.replace(self, **changes)


DEFAULTS = SearchOptions()
