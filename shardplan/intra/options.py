"""The intra-op planner's IntraOptions from the search's SearchOptions."""

from __future__ import annotations

from shardplan.intra.memory import MARGIN
from shardplan.intra.planner import IntraOptions
from shardplan.options import SearchOptions
from shardplan.units import Deadline


def intra_options(options: SearchOptions, memory_budget: float | None = None, *,
                  deadline: Deadline | None = None,
                  donated: frozenset[int] | None = None) -> IntraOptions:
    """IntraOptions with the solver settings of `options` and `memory_budget` (the ILP's
    budget, which the measured selection may tighten below the search's), the wall clock the
    whole search ends by, and the flat inputs the compiled step donates (None: its state)."""
    return IntraOptions(memory_budget=memory_budget, time_limit_s=options.time_limit,
                        seed=options.solver_seed, workers=options.workers, deadline=deadline,
                        donated=donated, memory_margin=MARGIN)
