"""shardplan: auto-parallelization planner for JAX train steps."""

from shardplan.api import AutoStep, auto, coverage
from shardplan.cluster import search
from shardplan.distributed import PlanMismatchError
from shardplan.global_inputs import global_args
from shardplan.grad import grad, stage_boundary, value_and_grad
from shardplan.intra.solve.types import InfeasibleMemory, SearchTimeout
from shardplan.options import Hints, SearchOptions
from shardplan.plan import Estimate, Plan
from shardplan.plan_file import PlanFileError, load_plan
from shardplan.strategies.coverage import Coverage
from shardplan.timeline import draw_plan as draw_timeline

__all__ = ["AutoStep", "Coverage", "Estimate", "Hints", "InfeasibleMemory", "Plan",
           "PlanFileError", "PlanMismatchError", "SearchOptions", "SearchTimeout", "auto", "coverage", "draw_timeline", "global_args",
           "grad", "load_plan", "search", "stage_boundary", "value_and_grad"]
