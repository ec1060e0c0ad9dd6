"""Re-planning a plan that compiled over its memory budget: the ILP asked again under a budget
scaled by the plan's estimate over its compiled peak (shardplan.measure's selection and
shardplan.fit's check both do it)."""

from __future__ import annotations

from collections.abc import Callable

from shardplan.intra.ilp import InfeasibleMemory, SearchTimeout
from shardplan.plan import Plan
from shardplan.units import fmt_bytes

# Times the planner re-plans under a tighter budget when its plan compiles over the budget.
RECALIBRATIONS = 2


def recalibrate(candidates: list, run, memory_budget: float | None,
                replan: Callable[[float], Plan] | None) -> str:
    """Re-plan under a tighter ILP budget while the last searched plan compiles over the
    budget (appending each re-plan to `candidates`); why it stopped early, or ""."""
    ilp_budget = memory_budget
    for k in range(RECALIBRATIONS if replan is not None and memory_budget else 0):
        last = candidates[-1]
        # a program the compiler refused for want of memory (its need known) re-plans too
        if (last.peak_bytes is None or last.fits(memory_budget)
                or last.plan.estimate.peak_bytes <= 0):
            break
        scaled = 0.98 * memory_budget * last.plan.estimate.peak_bytes / last.peak_bytes
        ilp_budget = min(0.98 * ilp_budget, scaled)
        try:
            again = replan(ilp_budget)
        except InfeasibleMemory as e:
            # The scaled budget is below the least the model allows: one more try between
            # the two (1% above the least when it is proven, else halfway from its bound to
            # the last plan's estimate), the plan that needs about the least by the model.
            high = 0.98 * last.plan.estimate.peak_bytes
            floor = 1.01 * e.min_bytes if e.exact else 0.5 * (e.min_bytes + high)
            if not floor < high:
                return (f"; re-planning under {fmt_bytes(ilp_budget)} to fit once compiled: no "
                        f"plan fits it (the least any needs is {fmt_bytes(e.min_bytes)})")
            ilp_budget = floor
            try:
                again = replan(ilp_budget)
            except (InfeasibleMemory, SearchTimeout):
                return (f"; re-planning under {fmt_bytes(ilp_budget)} (near the least any plan "
                        "needs) to fit once compiled: none found")
        except SearchTimeout:
            return (f"; re-planning under {fmt_bytes(ilp_budget)} to fit once compiled: the "
                    "time limit ran out")
        candidates.append(run(f"searched-{k + 1} (ILP budget {fmt_bytes(ilp_budget)})", again))
    return ""
