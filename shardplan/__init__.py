"""shardplan: auto-parallelization planner for JAX train steps."""

from shardplan.api import AutoStep, auto, coverage, search
from shardplan.distributed import PlanMismatchError, global_args
from shardplan.grad import grad, stage_boundary, value_and_grad
from shardplan.intra.ilp import InfeasibleMemory
from shardplan.plan import Estimate, Plan, load_plan

__all__ = ["AutoStep", "Estimate", "InfeasibleMemory", "Plan", "PlanMismatchError", "auto",
           "coverage", "global_args", "grad", "load_plan", "search", "stage_boundary",
           "value_and_grad"]
