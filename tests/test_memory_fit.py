"""A plan said to fit its memory budget fits once XLA compiles it, and its estimate is within
TOLERANCE of the compiled peak (memory_analysis: argument + output + temp - alias), on cheap
cases at test size; benchmarks/memory_check.py runs the zoo at three budgets on 8 and 2x4
devices. A bf16 step compiled on CPU is counted as the target would hold it (XLA:CPU computes
bf16 through f32 buffers)."""

import warnings

import jax
import pytest

import shardplan
from shardplan import measure
from shardplan.analysis import hlo, target
from shardplan.cost.hardware import get_profile
from shardplan.intra import liveness
from shardplan.ir.lift import lift
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.options import DEFAULTS
from shardplan.search import plan_step
from shardplan.strategies.spec import MeshShape

# The estimate is to be within this of the compiled peak (issue 11).
TOLERANCE = 0.10

# name, config overrides, where the budget sits as a share of data parallel's compiled peak
# (cheap cases: the zoo at three budgets is benchmarks/memory_check.py's).
CASES = {
    "mlp": ({}, 0.5),
    "gpt": ({}, 0.6),
}


def _data_parallel_peak(m, mesh) -> int:
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    plan, graph, _ = plan_step(traced, MeshShape.of(mesh), get_profile("cpu"),
                               DEFAULTS.replace(time_limit=10.0), device_mesh=mesh)
    dp = measure.expert_plans(graph, plan)["data_parallel"]
    lowered = measure.lower_plan(graph, traced, dp, mesh, m.state_argnums)
    return hlo.analyze(measure.compile_for_analysis(lowered)).peak_bytes


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_plan_said_to_fit_fits_and_its_estimate_is_within_tolerance(name, mesh2x4):
    overrides, share = CASES[name]
    m = get_model(name, "tiny", abstract=True, **overrides)
    budget = int(share * _data_parallel_peak(m, mesh2x4))
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="cpu", memory_budget=budget,
                          donate_argnums=m.state_argnums, state_argnums=m.state_argnums,
                          batch_argnums=m.batch_argnums, time_limit=20)
    plan = step.plan(*m.args)
    assert plan.estimate.peak_bytes <= budget
    assert any("margin of 10%" in n for n in plan.notes), plan.notes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # donating abstract arguments warns
        peak = hlo.analyze(measure.compile_for_analysis(step.lower(*m.args))).peak_bytes
    assert peak <= budget, (peak, budget, plan.estimate.peak_bytes)
    assert abs(peak / plan.estimate.peak_bytes - 1) <= TOLERANCE, (peak, plan.estimate.peak_bytes)


def _graph(name, **overrides):
    m = get_model(name, "tiny", abstract=True, **overrides)
    traced = trace(m.fn, m.args, m.state_argnums, m.batch_argnums)
    return m, lift(traced.closed_jaxpr, traced.arg_info)


def test_xla_cpu_computes_bf16_in_f32_and_the_widening_says_how_much_the_target_keeps():
    """The fact the widening rests on, measured: the bf16 MLP's compiled peak on CPU is no
    less than the f32 MLP's (params f32 in both; a GPT's is equal to the byte); the model's share of the temporaries a bf16 device keeps
    is below 1 for the bf16 step and exactly 1 for the f32 one."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    peaks = {}
    for dtype in ("float32", "bfloat16"):
        m, graph = _graph("mlp", dtype=dtype, param_dtype="float32")
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lowered = jax.jit(m.fn, in_shardings=rep, out_shardings=rep).lower(*m.args)
        peaks[dtype] = hlo.analyze(measure.compile_for_analysis(lowered)).peak_bytes
        w = liveness.cpu_widening(graph)
        assert (w == 1.0) if dtype == "float32" else (0.5 <= w < 1.0), (dtype, w)
    assert peaks["bfloat16"] >= peaks["float32"], peaks


def test_compiled_peaks_on_cpu_count_the_temporaries_as_the_target_holds_them(mesh2x4):
    stats = hlo.ProgramStats((), 0.0, 0.0, 0.0, argument_bytes=100, output_bytes=60,
                             temp_bytes=1000, alias_bytes=50, peak_bytes=1110)
    gpu = get_profile("a100-80gb")
    assert target.widens(mesh2x4, gpu) and not target.widens(mesh2x4, get_profile("cpu"))
    assert target.on_target(stats, mesh2x4, gpu, 0.6).peak_bytes == 100 + 60 - 50 + 600
    assert target.on_target(stats, mesh2x4, get_profile("cpu"), 0.6) is stats
    assert target.on_target(stats, mesh2x4, gpu, 1.0) is stats
