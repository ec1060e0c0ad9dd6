"""Alpa's stage DP (Zheng et al., OSDI 2022, section 5.1, Algorithm 1): layers -> stages.

The L layers are split into contiguous stages, each on a submesh, so that the pipeline
latency T = sum(t_i) + (B - 1) * max(t_i) of B micro-batches is least. For each candidate
t_max (a distinct stage cost), F(s, l, d) is the least sum of stage costs for layers
l..L-1 in s stages on exactly d devices with every stage cost <= t_max; the best T is the
least F(s, 0, N) + (B - 1) * t_max. Stages count from the end of the pipeline because the
memory a stage needs depends on its position: under 1F1B the stage p places before the
last holds min(p + 1, B) micro-batches of activations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from shardplan.cost.estimate import Estimate


class NoFeasibleStagePlan(ValueError):
    """No split of the layers into stages runs within the memory budget on all the devices.

    `min_memory` is the per-device memory the most frugal runnable plan needs (its most
    demanding stage), or None when no plan runs at all, whatever the budget.
    """

    def __init__(self, message: str, min_memory: float | None = None):
        super().__init__(message)
        self.min_memory = min_memory


@dataclasses.dataclass(frozen=True)
class Stage:
    """A pipeline stage as planned: its layers, the devices of its submesh, and its estimate."""

    layers: tuple[int, int]
    submesh_shape: tuple[int, ...]
    devices: tuple[int, ...]
    estimate: Estimate


def device_span(devices) -> str:
    """"0..3" for consecutive device ids, else "0,2,4"."""
    d = list(devices)
    return f"{d[0]}..{d[-1]}" if d == list(range(d[0], d[0] + len(d))) else ",".join(map(str, d))


@dataclasses.dataclass(frozen=True, eq=False)
class StageProblem:
    """The cost tables of one stage-construction problem (arrays are copied read-only)."""

    num_layers: int
    submeshes: tuple[tuple[int, int], ...]
    """Candidate submesh shapes (hosts, devices per host)."""
    num_devices: int
    """The stages' submeshes must hold exactly this many devices together."""
    num_micro_batches: int
    cost: np.ndarray
    """cost[i, j, s]: latency of one micro-batch (fwd + bwd) of layers i..j (inclusive) on
    submesh s; inf where it does not run. Entries with j < i are ignored."""
    state_mem: np.ndarray
    """state_mem[i, j, s]: params + grads + optimizer state per device."""
    act_mem: np.ndarray
    """act_mem[i, j, s]: activations of one micro-batch per device."""
    memory_budget: float
    """Bytes per device; inf for no limit."""
    max_stages: int | None = None

    def __post_init__(self):
        L, S = self.num_layers, len(self.submeshes)
        if L < 1 or S < 1 or self.num_devices < 1 or self.num_micro_batches < 1:
            raise ValueError(
                f"StageProblem needs num_layers ({L}), submeshes ({S}), num_devices "
                f"({self.num_devices}) and num_micro_batches ({self.num_micro_batches}) all >= 1"
            )
        if self.max_stages is not None and self.max_stages < 1:
            raise ValueError(f"max_stages={self.max_stages} must be >= 1 or None")
        shapes = tuple((int(a), int(b)) for a, b in self.submeshes)
        if any(a < 1 or b < 1 for a, b in shapes):
            raise ValueError(f"submesh shapes {shapes} must have positive sizes")
        object.__setattr__(self, "submeshes", shapes)
        for name in ("cost", "state_mem", "act_mem"):
            table = np.array(getattr(self, name), dtype=np.float64)
            if table.shape != (L, L, S):
                raise ValueError(
                    f"{name} has shape {table.shape}; expected (num_layers, num_layers, "
                    f"num_submeshes) = {(L, L, S)}"
                )
            if np.isnan(table).any():
                raise ValueError(f"{name} has NaN entries; use inf for what cannot run")
            table.setflags(write=False)
            object.__setattr__(self, name, table)
        if math.isnan(self.memory_budget):
            raise ValueError("memory_budget is NaN; give bytes per device or inf")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(a * b for a, b in self.submeshes)

    @property
    def stage_limit(self) -> int:
        """Most stages a plan can have: one layer and one device each, and max_stages."""
        limit = min(self.num_layers, self.num_devices)
        return limit if self.max_stages is None else min(limit, self.max_stages)

    def in_flight(self, position: int) -> int:
        """Micro-batches of activations a stage `position` places before the last holds (1F1B)."""
        return min(position + 1, self.num_micro_batches)

    def stage_memory(self, i: int, j: int, s: int, position: int) -> float:
        return float(self.state_mem[i, j, s] + self.in_flight(position) * self.act_mem[i, j, s])


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Stages as (first layer, last layer, submesh index) in pipeline order, the pipeline
    latency T = sum(t_i) + (B - 1) * max(t_i), and t_max = max(t_i)."""

    stages: tuple[tuple[int, int, int], ...]
    total_latency: float
    t_max: float

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def plan_of(problem: StageProblem, stages: tuple[tuple[int, int, int], ...]) -> StagePlan:
    """The StagePlan of given stages, with T computed exactly (fsum) so that equal plans found
    by different searches report the same latency."""
    costs = [float(problem.cost[i, j, s]) for i, j, s in stages]
    t_max = max(costs)
    total = math.fsum(costs) + (problem.num_micro_batches - 1) * t_max
    return StagePlan(tuple(stages), total, t_max)


def solve_stages(problem: StageProblem) -> StagePlan:
    """The plan of least pipeline latency, by Alpa's DP over t_max; raises NoFeasibleStagePlan."""
    L, N = problem.num_layers, problem.num_devices
    runnable = _runnable_costs(problem)
    fits = _fits_memory(problem)
    usable = np.where(fits.any(axis=0), runnable, np.inf)
    candidates = np.unique(usable)
    candidates = candidates[np.isfinite(candidates)]
    if candidates.size == 0:
        raise _no_plan(problem)
    # every layer lies in some stage, so t_max is at least the cheapest stage covering it
    covering = usable.min(axis=2)
    t_low = max(
        min(covering[i, j] for i in range(layer + 1) for j in range(layer, L)) for layer in range(L)
    )
    candidates = candidates[candidates >= t_low]
    if candidates.size == 0:
        raise _no_plan(problem)

    best_t = _best_t_max(problem, runnable, fits, candidates)
    sums, choices = _dp(problem, runnable, fits, best_t, keep_choices=True)
    num_stages = int(np.argmin(sums)) + 1
    stages = []
    layer, devices = 0, N
    S = len(problem.submeshes)
    for s in range(num_stages, 0, -1):
        k, m = divmod(int(choices[s][layer, devices]), S)
        stages.append((layer, k, m))
        devices -= problem.sizes[m]
        layer = k + 1
    assert layer == L and devices == 0
    return plan_of(problem, tuple(stages))


def _best_t_max(
    problem: StageProblem, runnable: np.ndarray, fits: np.ndarray, candidates: np.ndarray
) -> float:
    """The smallest t_max whose F(., 0, N) + (B - 1) * t_max is least over the candidates.

    F(t) = least sum of stage costs with every stage <= t is non-increasing in t. So between
    two candidates with equal F every candidate in between is worse (same sum, larger t_max)
    and is skipped. An interval is also skipped when no plan whose largest stage lies in it
    can beat the best so far: such a plan costs at least max(F(right end), t) + (B - 1) * t
    for the interval's smallest t (this includes Alpa's break on B * t_max >= best). Every
    plan is counted at the candidate equal to its largest stage, so the optimum stays exact.
    """
    B = problem.num_micro_batches
    sums: dict[int, float] = {}

    def evaluate(i: int) -> float:
        sums[i] = float(_dp(problem, runnable, fits, float(candidates[i]), False)[0].min())
        return sums[i]

    top = candidates.size - 1
    if not np.isfinite(evaluate(top)):
        raise _no_plan(problem)
    evaluate(0)
    stack = [(0, top)]
    while stack:
        lo, hi = stack.pop()
        if hi - lo < 2 or sums[lo] == sums[hi]:
            continue
        best = min(sums[i] + (B - 1) * candidates[i] for i in sums)
        t_next = float(candidates[lo + 1])
        if max(sums[hi], t_next) + (B - 1) * t_next >= best:
            continue
        mid = (lo + hi) // 2
        evaluate(mid)
        stack.extend([(mid, hi), (lo, mid)])  # left first: small t_max bounds the rest sooner
    estimates = {i: sums[i] + (B - 1) * float(candidates[i]) for i in sums}
    best_est = min(estimates.values())
    return float(candidates[min(i for i, e in estimates.items() if e == best_est)])


def brute_force_stages(problem: StageProblem) -> StagePlan:
    """Every split into contiguous stages times every submesh choice, for testing the DP."""
    L, N = problem.num_layers, problem.num_devices
    S = len(problem.submeshes)
    best: StagePlan | None = None
    least_memory = math.inf
    for stages in _all_splits(L, problem.stage_limit):
        for mesh in itertools.product(range(S), repeat=len(stages)):
            if sum(problem.sizes[m] for m in mesh) != N:
                continue
            plan = tuple((i, j, m) for (i, j), m in zip(stages, mesh))
            if any(not np.isfinite(problem.cost[i, j, m]) for i, j, m in plan):
                continue
            n = len(plan)
            need = max(problem.stage_memory(i, j, m, n - 1 - q) for q, (i, j, m) in enumerate(plan))
            least_memory = min(least_memory, need)
            if need > problem.memory_budget:
                continue
            candidate = plan_of(problem, plan)
            if best is None or candidate.total_latency < best.total_latency:
                best = candidate
    if best is None:
        raise _no_plan_message(problem, least_memory)
    return best


def _runnable_costs(problem: StageProblem) -> np.ndarray:
    """cost with the j < i entries set to inf."""
    L = problem.num_layers
    upper = np.triu(np.ones((L, L), dtype=bool))
    return np.where(upper[:, :, None], problem.cost, np.inf)


def _fits_memory(problem: StageProblem) -> np.ndarray:
    """fits[p, i, j, s]: layers i..j on submesh s fit the budget p stages before the last."""
    counts = np.array([problem.in_flight(p) for p in range(problem.stage_limit)], dtype=np.float64)
    need = problem.state_mem[None] + counts[:, None, None, None] * problem.act_mem[None]
    return need <= problem.memory_budget


def _device_index(problem: StageProblem) -> np.ndarray:
    """index[m, d] = d - size of submesh m, or N + 1 (a column of inf) when negative."""
    N = problem.num_devices
    d = np.arange(N + 1)[None, :] - np.array(problem.sizes)[:, None]
    return np.where(d >= 0, d, N + 1)


def _dp(
    problem: StageProblem,
    runnable: np.ndarray,
    fits: np.ndarray,
    t_max: float,
    keep_choices: bool,
) -> tuple[np.ndarray, list[np.ndarray | None]]:
    """F over stages counted from the end. Returns sums[s - 1] = F(s, 0, N) for s = 1..limit
    and, if asked, choices[s][l, d] = k * S + m of the first stage in the best F(s, l, d)."""
    L, N, S = problem.num_layers, problem.num_devices, len(problem.submeshes)
    index = _device_index(problem)
    allowed = runnable <= t_max
    # prev[l, d] = F(s - 1, l, d), with row L the empty suffix and column N + 1 always inf
    prev = np.full((L + 1, N + 2), np.inf)
    prev[L, 0] = 0.0
    sums = np.full(problem.stage_limit, np.inf)
    choices: list[np.ndarray | None] = [None]
    for s in range(1, problem.stage_limit + 1):
        # the first of s stages covers layers l..k with k <= L - s: the rest need a layer each
        top = L - s + 1
        stage = np.where(allowed & fits[s - 1], runnable, np.inf)[:top, :top]  # [l, k, m]
        rest = prev[1 : top + 1, :][:, index]  # [k, m, d] = F(s - 1, k + 1, d - size_m)
        total = (stage[:, :, :, None] + rest[None]).reshape(top, top * S, N + 1)
        best = total.argmin(axis=1)
        cur = np.full((L + 1, N + 2), np.inf)
        cur[:top, : N + 1] = np.take_along_axis(total, best[:, None, :], axis=1)[:, 0, :]
        sums[s - 1] = cur[0, N]
        choices.append(best if keep_choices else None)
        if not np.isfinite(cur).any():
            break  # no more stages can be added to nothing
        prev = cur
    return sums, choices


def _all_splits(num_layers: int, max_stages: int):
    """Every split of 0..num_layers-1 into at most max_stages contiguous (first, last) runs."""
    for count in range(1, max_stages + 1):
        for cuts in itertools.combinations(range(1, num_layers), count - 1):
            bounds = (0, *cuts, num_layers)
            yield tuple((bounds[q], bounds[q + 1] - 1) for q in range(count))


def _least_memory(problem: StageProblem) -> float:
    """Min over runnable plans (finite costs, all devices) of the largest stage memory: the
    same DP as _dp with max in place of sum, the memory of each stage as its cost."""
    L, N, S = problem.num_layers, problem.num_devices, len(problem.submeshes)
    runnable = np.isfinite(_runnable_costs(problem))
    index = _device_index(problem)
    prev = np.full((L + 1, N + 2), np.inf)
    prev[L, 0] = -np.inf
    least = np.inf
    for s in range(1, problem.stage_limit + 1):
        need = problem.state_mem + problem.in_flight(s - 1) * problem.act_mem
        stage = np.where(runnable, need, np.inf)
        rest = prev[1:, :][:, index]
        total = np.maximum(stage[:, :, :, None], rest[None]).reshape(L, L * S, N + 1)
        cur = np.full((L + 1, N + 2), np.inf)
        cur[:L, : N + 1] = total.min(axis=1)
        least = min(least, float(cur[0, N]))
        prev = cur
    return least


def _no_plan(problem: StageProblem) -> NoFeasibleStagePlan:
    return _no_plan_message(problem, _least_memory(problem))


def _no_plan_message(problem: StageProblem, least_memory: float) -> NoFeasibleStagePlan:
    where = (
        f"{problem.num_layers} layers on {problem.num_devices} devices with submeshes "
        f"{list(problem.submeshes)}"
        + (f" and at most {problem.max_stages} stages" if problem.max_stages is not None else "")
    )
    if not np.isfinite(least_memory):
        return NoFeasibleStagePlan(
            f"no stage plan runs for {where}: no split has finite cost on submeshes that add up "
            "to all devices; offer more submesh shapes, or check the cost table for inf entries",
            None,
        )
    return NoFeasibleStagePlan(
        f"no stage plan fits the memory budget of {problem.memory_budget:.4g} bytes per device "
        f"for {where}: the least any plan needs is {least_memory:.4g} bytes per device; raise "
        "memory_budget, add devices, or use fewer micro-batches in flight",
        float(least_memory),
    )
