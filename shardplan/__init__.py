"""shardplan: auto-parallelization planner for JAX train steps."""

from shardplan.api import AutoStep, auto, coverage, search
from shardplan.grad import grad, stage_boundary, value_and_grad
from shardplan.intra.ilp import InfeasibleMemory
from shardplan.options import SearchOptions
from shardplan.plan import Estimate, Plan, PlanFileError, load_plan

__all__ = ["AutoStep", "Estimate", "InfeasibleMemory", "Plan", "PlanFileError", "SearchOptions",
           "auto",
           "coverage", "grad",
           "load_plan", "search", "stage_boundary", "value_and_grad"]
