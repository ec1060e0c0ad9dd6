"""The intra-op planner's settings (intra/options.py builds them from SearchOptions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shardplan import progress as progress_mod
from shardplan.options import DEFAULTS, SearchOptions
from shardplan.strategies.spec import ShardSpec
from shardplan.units import Deadline

# Deterministic work per second of time_limit (SolverSettings.deterministic): HiGHS has no
# deterministic clock, so its solves are limited by simplex iterations (each LP relaxation)
# and branch-and-bound nodes (each MIP) at these rates; CP-SAT's own deterministic time is
# time_limit itself. The zoo's plans at test size are proven well within 30 s of it
# (tests/test_golden_plans.py).
SIMPLEX_ITERATIONS_PER_S = 10_000
MIP_NODES_PER_S = 20


@dataclasses.dataclass(frozen=True)
class SolverSettings:
    """How each solve of the intra-op ILP is limited and seeded: SearchOptions' solver fields,
    under their names, in the one value IntraOptions and SolverInput hold."""

    time_limit: float = DEFAULTS.time_limit
    solver_seed: int = DEFAULTS.solver_seed
    workers: int = DEFAULTS.workers
    deterministic: bool = DEFAULTS.deterministic
    # Told each solve's phases and incumbent / bound (shardplan.progress); it only listens,
    # so it is no part of the settings' equality.
    progress: progress_mod.Reporter = dataclasses.field(default=progress_mod.SILENT,
                                                         compare=False, repr=False)

    @classmethod
    def of(cls, options: SearchOptions,
           progress: progress_mod.Reporter = progress_mod.SILENT) -> SolverSettings:
        return cls(options.time_limit, options.solver_seed, options.workers,
                   options.deterministic, progress)

    def replace(self, **changes) -> SolverSettings:
        return dataclasses.replace(self, **changes)

    def wall_s(self, remaining: float) -> float:
        """Seconds of wall clock a solve may take: time_limit and what remains of the
        search's deadline; unlimited when the solve is limited by its work."""
        return float("inf") if self.deterministic else max(0.01, min(self.time_limit, remaining))

    def highs_mip(self, remaining: float) -> dict:
        """scipy.optimize.milp's options that stop a MIP: its branch-and-bound nodes when
        deterministic, else the wall clock."""
        if self.deterministic:
            return {"node_limit": max(1, round(MIP_NODES_PER_S * self.time_limit))}
        return {"time_limit": self.wall_s(remaining)}

    def simplex_iterations(self) -> int:
        """Simplex iterations an LP relaxation may take when deterministic."""
        return max(1, round(SIMPLEX_ITERATIONS_PER_S * self.time_limit))


@dataclasses.dataclass(frozen=True)
class IntraOptions:
    # time limit, solver seed, threads, deterministic limits: SearchOptions' (intra/options.py)
    solver: SolverSettings = SolverSettings()
    # The memory model counts the step's activations (1 + memory_margin) times: what it does
    # not see of XLA's buffers (intra/memory/model.py says what it does).
    memory_margin: float = 0.0
    # The compiler the plan is for (HardwareProfile.backend: "cpu", "gpu", "tpu"): the memory
    # model follows its rules (intra/memory/compilers.py).
    compiler: str = "cpu"
    # Flat input indices whose buffers the step donates (their tied outputs reuse them);
    # None: every state input (as measure and the zoo compile it).
    donated: frozenset[int] | None = None
    # The wall clock the whole search must end by (units.Deadline); None: the solver's
    # limits alone (always None when solver.deterministic).
    deadline: Deadline | None = None
    max_split_dims: int = 2
    # Fan-out members price a value's resharding once for all its consumers (as XLA runs it)
    # instead of once per consumer. "partial": only for values their producer may leave
    # partial sums (XLA reduces such a value once; priced per reader, the small reductions of
    # a softmax over a split vocabulary cost a collective each); "layers": only for those of
    # them made inside a named scope (a layer) and read outside every scope: the gradients the
    # optimizer's update reads several times (global norm, moments), which a scan reduces
    # once, into its stacked output (priced per reader, an unrolled model's ZeRO plans pay
    # each all-reduce several times and lose to the scanned model's plan); "reduce": the
    # fan-outs of "layers", and every other value read several times may be resharded once
    # where it is made (intra/simplify.py reduce_once: its producer's strategies that leave
    # it partial get twins that all-reduce or reduce-scatter it; a cast's, twins that gather
    # it); "reduced": the values of "partial", their fan-outs in whole layouts only; "all":
    # exact; "none". "auto" is "partial" on meshes with one useful axis and "reduce" on the
    # others: fan-outs grow the ILP, and on two axes they weaken its LP relaxation, where
    # twins are choices of members the ILP has already (tests/test_intra_problem.py::
    # test_a_value_read_several_times_gets_twins_that_reshard_it_once_where_it_is_made;
    # benchmarks/vs_experts.py compiles the searched plans against the experts').
    fanouts: str = "auto"
    # Repeated layers (numbered scopes such as layer_3) share one choice per operator.
    tie_layers: bool = True
    # Cheap ops run in the layout of their largest operand (Alpa's follower merging).
    merge_followers: bool = True
    # The model's own sharding constraints: "hint" (held, priced) or "ignore"
    # (SearchOptions.model_constraints; intra/hints.py model_pins).
    model_constraints: str = DEFAULTS.model_constraints
    # Where no plan fits: search for the least memory any plan needs (InfeasibleMemory exact),
    # or only bound it from below at once, for a caller with another step to plan (the
    # driver's step as a whole, before its rematerialized or accumulated step).
    least_memory: bool = True
    # Flat input index -> the spec it must have (user-pinned shardings, or a baseline to price).
    fixed_inputs: Mapping[int, ShardSpec] = dataclasses.field(default_factory=dict)
    # Also solve with each expert plan's input specs pinned and keep the cheapest.
    seed_baselines: bool = True
    # Flat input index -> its spec in an earlier candidate of the same search (the driver's
    # step as a whole, for its accumulated candidates): solved first with them pinned, a seed
    # whose plan, where it fits, is the free solve's starting point (intra/planner.py).
    warm_inputs: Mapping[int, ShardSpec] = dataclasses.field(default_factory=dict)
    # The reductions of the step's gradients priced as XLA's combiner runs them: each without
    # its own latency, and the latency of the combined all-reduce once per mesh axes, in the
    # plans that reduce a gradient over them (intra/combiner/gradient_latency.py,
    # intra/combiner/xla.py gradient_values; the loss's last reductions join them,
    # loss_values; its earlier ones, which the backward pass reads, keep their latency). Off
    # for the SPMD pipeline's stage programs, whose loss and head run inside the loop of
    # ticks, apart from the other gradients' reductions (inter/spmd_cost.py prices those
    # collectives). tests/test_intra_combiner.py::
    # test_ilp_prices_data_parallel_as_compiled_and_beats_it checks the pricing against the
    # compiled program; benchmarks/vs_experts.py compiles the searched plans against the
    # experts'; benchmarks/plan_speed.py times the solves with the switches' rows.
    combine_gradients: bool = True
