"""The intra-op planner's IntraOptions from the search's SearchOptions."""

from __future__ import annotations

from collections.abc import Mapping

from shardplan import progress as progress_mod
from shardplan.intra.memory.model import MARGIN
from shardplan.intra.settings import IntraOptions, SolverSettings
from shardplan.options import SearchOptions
from shardplan.strategies.spec import ShardSpec
from shardplan.units import Deadline


def intra_options(options: SearchOptions,
                  fixed_inputs: Mapping[int, ShardSpec] | None = None, *,
                  deadline: Deadline | None = None,
                  donated: frozenset[int] | None = None,
                  combine_gradients: bool | None = None,
                  compiler: str = IntraOptions.compiler,
                  progress: progress_mod.Reporter = progress_mod.SILENT,
                  least_memory: bool = True,
                  warm_inputs: Mapping[int, ShardSpec] | None = None) -> IntraOptions:
    """IntraOptions with the solver settings of `options` (its memory budget is not one of
    them: plan_intra takes the ILP's budget as an argument); `fixed_inputs` are
    the inputs the options' hints pin (shardplan.intra.hints.fixed_inputs); the wall clock the
    whole search ends by (dropped where the options limit solves by their work), and the flat
    inputs the compiled step donates (None: its state); `combine_gradients`: IntraOptions'
    (None: its default); `compiler`: the target's HardwareProfile.backend, whose buffer rules
    the memory model follows; `progress`: told the solves' phases and bounds; `least_memory`,
    `warm_inputs`: IntraOptions'."""
    solver = SolverSettings.of(options, progress)
    return IntraOptions(solver=solver,
                        fixed_inputs=dict(fixed_inputs or {}),
                        deadline=None if solver.deterministic else deadline,
                        donated=donated, memory_margin=MARGIN, compiler=compiler,
                        model_constraints=options.model_constraints, least_memory=least_memory,
                        warm_inputs=dict(warm_inputs or {}),
                        combine_gradients=(IntraOptions.combine_gradients
                                           if combine_gradients is None else combine_gradients))
