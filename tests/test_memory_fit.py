"""A plan said to fit its memory budget fits once XLA compiles it, and its estimate bounds the
compiled peak (memory_analysis: argument + output + temp - alias) from above, closely for an MLP
and within the memory model's stated margin for a transformer. benchmarks/memory_check.py runs
the zoo at three budgets on 8 and 2x4 devices."""

import warnings

import pytest

import shardplan
from shardplan import measure
from shardplan.analysis import hlo
from shardplan.cost.hardware import get_profile
from shardplan.intra import memory
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.options import DEFAULTS
from shardplan.search import plan_step
from shardplan.strategies.spec import MeshShape

# name, config overrides, where the budget sits as a share of data parallel's compiled peak,
# and how far above the compiled peak the estimate may be: the MLP's activations are a small
# share of its memory, so the margin on them costs little; a transformer's are most of it.
CASES = {
    "mlp": ({}, 0.5, 1.15),
    "gpt": ({"num_layers": 1}, 0.6, 1.0 + memory.MARGIN),
}


def _data_parallel_peak(m, mesh) -> int:
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    plan, graph, _ = plan_step(traced, MeshShape.of(mesh), get_profile("cpu"),
                               DEFAULTS.replace(time_limit=10.0), device_mesh=mesh)
    dp = measure.expert_plans(graph, plan)["data_parallel"]
    lowered = measure.lower_plan(graph, traced, dp, mesh, m.state_argnums)
    return hlo.analyze(measure.compile_for_analysis(lowered)).peak_bytes


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_said_to_fit_fits_and_its_estimate_bounds_the_compiled_peak(name, mesh2x4):
    overrides, share, above = CASES[name]
    m = get_model(name, "tiny", abstract=True, **overrides)
    budget = int(share * _data_parallel_peak(m, mesh2x4))
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="cpu", memory_budget=budget,
                          donate_argnums=m.state_argnums, state_argnums=m.state_argnums,
                          batch_argnums=m.batch_argnums, time_limit=20)
    plan = step.plan(*m.args)
    assert plan.estimate.peak_bytes <= budget
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donating abstract arguments warns
        peak = hlo.analyze(measure.compile_for_analysis(step.lower(*m.args))).peak_bytes
    assert peak <= budget, (peak, budget, plan.estimate.peak_bytes)
    assert peak <= plan.estimate.peak_bytes <= above * peak, (peak, plan.estimate.peak_bytes)
