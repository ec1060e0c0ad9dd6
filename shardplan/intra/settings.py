"""The intra-op planner's settings (intra/options.py builds them from SearchOptions)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from shardplan.options import DEFAULTS
from shardplan.strategies.spec import ShardSpec
from shardplan.units import Deadline


@dataclasses.dataclass(frozen=True)
class IntraOptions:
    memory_budget: float | None = None
    # time limit, solver seed and threads: SearchOptions' (shardplan.intra.options builds these)
    time_limit_s: float = DEFAULTS.time_limit
    seed: int = DEFAULTS.solver_seed
    workers: int = DEFAULTS.workers
    # The memory model counts the step's activations (1 + memory_margin) times: what it does
    # not see of XLA's buffers (intra/memory.py says what it does).
    memory_margin: float = 0.0
    # Flat input indices whose buffers the step donates (their tied outputs reuse them);
    # None: every state input (as measure and the zoo compile it).
    donated: frozenset[int] | None = None
    # The wall clock the whole search must end by (units.Deadline); None: time_limit_s alone.
    deadline: Deadline | None = None
    max_split_dims: int = 2
    # Fan-out members price a value's resharding once for all its consumers (as XLA runs it)
    # instead of once per consumer. "partial": only for values their producer may leave
    # partial sums (XLA reduces such a value once; the small reductions of a softmax over a
    # split vocabulary otherwise cost a collective per reader: 1.3x the compiled comm time of
    # Megatron's plan); "layers": only for those of them made inside a named scope (a
    # layer) and read outside every scope: the gradients the optimizer's update reads several
    # times (global norm, moments), which a scan reduces once, into its stacked output (priced
    # per reader, the unrolled model's ZeRO plans paid each all-reduce 2-3 times and lost to
    # the scanned model's plan); "reduced": the values of "partial", their fan-outs in whole
    # layouts only (XLA reduces once, where the value is first read whole); "all": exact;
    # "none". They grow the ILP: "partial" planned GPT-2 124M in 1.2x the time on 8 devices
    # but 6x on 2x4 (since the lazy LP: 1.07x there, and 1.35x for the unrolled GPT-2 1.5B on
    # 8x8), so "auto" is "partial" on meshes with one useful axis and "layers" on the
    # others. "reduced" on two axes plans that GPT-2 1.5B in 1.2x the CPU time of "layers"
    # and finds better plans by the estimate where "layers" prices a batch norm's statistics
    # or a layer norm's input once per reader (real size: WideResNet 250M 0.76x on 2x4 and
    # 0.84x on 8x8, ViT-B/16 0.92x, the MoE 380M 0.93x on 8x8; GPT-2 124M 1.015x on 8x8).
    # It is not "auto" yet: the zoo's GPT at test size on 2x4 gets 109 fan-outs (27 under
    # "layers": every dot's input gradient and dropout read twice in the backward pass) and
    # HiGHS's MIP no longer proves its plan in the 30 s tests/golden_plans.py gives it (38 s
    # and unproven, against 6.4 s proven); with it the 2-D completion of that GPT compiles to
    # 1.15x its memory estimate (XLA gathers its kernels whole; the memory model holds them
    # as laid out), and the extrapolation of FSDP's completion from 1 and 2 of its 8 layers
    # (depth.py) misses its compute by 2.5%.
    fanouts: str = "auto"
    # Repeated layers (numbered scopes such as layer_3) share one choice per operator.
    tie_layers: bool = True
    # Cheap ops run in the layout of their largest operand (Alpa's follower merging).
    merge_followers: bool = True
    # Flat input index -> the spec it must have (user-pinned shardings, or a baseline to price).
    fixed_inputs: Mapping[int, ShardSpec] = dataclasses.field(default_factory=dict)
    # Also solve with each expert plan's input specs pinned and keep the cheapest.
    seed_baselines: bool = True
    # The reductions of the step's gradients priced as XLA's combiner runs them: each without
    # its own latency, and the latency of the combined all-reduce once per mesh axes, in the
    # plans that reduce a gradient over them (intra/hubs.py, intra/combiner.py
    # gradient_values; the loss's last reductions join them, loss_values; its earlier ones,
    # which the backward pass reads, keep their latency). Off for the SPMD pipeline's stage programs, whose loss and head run inside the
    # loop of ticks, apart from the other gradients' reductions (inter/spmd_cost.py prices
    # those collectives). Measured on (searched / best expert, compiled and priced, 8 and
    # 2x4): gpt2-124m under a100-80gb 0.957 / 0.964 (off: 1.062 / 1.003); the zoo at test
    # size under cpu: bert 0.971 / 0.923 (off 1.043 / 0.988), gpt 1.035 / 0.906 (1.048 /
    # 1.082), llama 1.004 / 0.890 (1.178 / 1.024), moe 0.822 / 0.815 (0.993 / 1.025), vit
    # 0.976 / 0.953 (0.976 / 0.986); a tied 64k-vocab embedding takes Megatron's vocab split
    # (priced with every gradient's reduction free of latency, it took a plan 1.19x
    # Megatron's: its one gradient reduction ran alone). Costs planning time: as edges, the
    # hubs kept presolve from eliminating their members (benchmarks/plan_speed.py, quiet
    # machine, s: gpt2-1.5b 8x8 unrolled 12.0 against 9.9 off, scanned 2.1 / 1.8, llama-7b
    # 8x8 10.3 / 8.8, gpt2-124m 2x4 6.3 / 5.5); as rows (ilp.Implication) the core is the
    # size it is off, but HiGHS's LP still takes more iterations (the unrolled gpt2-1.5b's
    # 16k against 12k off). Off, the suite's plans are main's before
    # this option; on, tests/test_memory_fit.py's gpt case fails: the memory model puts the
    # new gpt 2x4 plan at 1.43 MB, compiled 1.13 MB (over-estimated, past its 10%).
    combine_gradients: bool = True
