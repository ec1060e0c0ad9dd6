"""shardplan.planning.depth: candidates of a deep step priced from two shallow copies agree with the
full compile; what it does not apply to is compiled in full."""

import warnings

import jax
import pytest

from shardplan import models
from shardplan.analysis import targets
from shardplan.analysis.price import KindCost, PricedStep
from shardplan.cost.hardware import get_profile
from shardplan.intra.memory import liveness
from shardplan.ir.lift import lift
from shardplan.ir.trace import abstractify, trace
from shardplan.options import DEFAULTS
from shardplan.planning import compiled, depth
from shardplan.planning.expert_plans import expert_plans
from shardplan.planning.intra_op import plan_step
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape
from shardplan.units import Deadline

HW = get_profile("a100-80gb")
SHAPE = MeshShape(("data", "model"), (2, 4))


def _lifted(name, **kw):
    step = models.get_model(name, "tiny", abstract=True, **kw)
    traced = trace(step.fn, jax.tree.map(abstractify, step.args), step.state_argnums,
                   step.batch_argnums)
    return traced, lift(traced.closed_jaxpr, traced.arg_info)


def _shallow(layers, **kw):
    k = depth.cut_depths(1)[0]  # as the CLI cuts
    cuts = [_lifted("gpt", num_layers=n, **kw) for n in (k, k + 1)]
    return depth.Shallow(layers, k, (cuts[0][0], cuts[1][0]), (cuts[0][1], cuts[1][1]))


@pytest.mark.slow  # a full compile of the deep step: make test-all
def test_extrapolated_candidates_agree_with_the_full_compile(devices):
    """GPT at test size, 8 layers, 2x4: the searched plan and the expert plans (FSDP gathers
    per layer, 2-D splits the activations) priced from the 1- and 2-layer copies are within
    2% of the 8-layer program compiled in full: step time, communication, peak memory."""
    layers = 8
    traced, _ = _lifted("gpt", num_layers=layers)
    options = DEFAULTS.replace(measure=False, time_limit=60, deterministic=True)
    plan, graph, _ = plan_step(traced, SHAPE, HW, options)
    assert depth.layer_period(graph) == (layers, 1)
    mesh = targets.cpu_mesh(SHAPE)
    compile_one = depth.compiler(graph, traced, _shallow(layers), mesh, HW, traced.state_argnums)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experts = expert_plans(Job.make(traced, SHAPE, HW, options), plan,
                               deadline=Deadline(60))
    dtype = compiled.compute_dtype(graph)
    widening = liveness.cpu_widening(graph) if targets.widens(mesh, HW) else 1.0
    for name, p in {"searched": plan, "fsdp": experts["fsdp"],
                    "two_d": experts["two_d"]}.items():
        got = compile_one(name, p)
        assert "extrapolated from the step compiled at 1 and 2 of its 8 layers" in got.extrapolated
        assert got.stats is None and got.plan is p
        full = compiled.measure(graph, traced, p, mesh, HW, name, traced.state_argnums, dtype,
                               widening)
        for f in ("total_s", "comm_s", "compute_s", "peak_bytes", "bytes_sent"):
            want = getattr(full.priced, f)
            assert getattr(got.priced, f) == pytest.approx(want, rel=0.02, abs=1e-12), (name, f)
        for kind, cost in full.priced.per_kind.items():
            # XLA's combiners group a deeper step's all-reduces a little differently (FSDP's
            # completion: 19 extrapolated, 22 compiled, bytes within 0.3%)
            got_count = got.priced.per_kind[kind].count
            assert abs(got_count - cost.count) <= max(1, 0.15 * cost.count), (name, kind)


def test_a_plan_of_another_step_is_compiled_in_full(devices):
    """Shallow copies of another model (a wider GPT) do not map onto the step: the candidate
    is compiled in full, not extrapolated."""
    traced, graph = _lifted("gpt", num_layers=6)
    plan, graph, _ = plan_step(traced, SHAPE, HW, DEFAULTS.replace(
        measure=False, time_limit=30, deterministic=True))
    wrong = _shallow(6, hidden=128)
    got = depth.compiler(graph, traced, wrong, targets.cpu_mesh(SHAPE), HW,
                         traced.state_argnums)("searched", plan)
    assert got.extrapolated == "" and got.priced is not None


def test_layers_are_found_only_where_they_repeat():
    _, gpt = _lifted("gpt", num_layers=4)
    assert depth.layer_period(gpt) == (4, 1)
    # MoE layers alternate with dense ones: they repeat every 2, cut at 2 and 4
    _, moe = _lifted("moe", num_layers=6)
    assert depth.layer_period(moe) == (6, 2)
    assert depth.cut_depths(2) == (2, 4) and depth.cut_depths(1) == (1, 2)
    # the full step sums one auxiliary loss per MoE layer: the extra additions are cut off
    for k in (2, 4):
        m = depth.cut_map(moe, _lifted("moe", num_layers=k)[1], k)
        assert m is not None and len(m.removed_nodes) > 0
    _, odd = _lifted("moe", num_layers=3)  # dense, MoE, dense: no period divides it
    assert depth.layer_period(odd) is None
    _, mlp = _lifted("mlp")  # no layer_<i> scopes
    assert depth.layer_period(mlp) is None


def test_cut_map_keeps_the_first_layers_and_the_rest_of_the_step():
    _, full = _lifted("gpt", num_layers=5)
    _, cut = _lifted("gpt", num_layers=2)
    m = depth.cut_map(full, cut, 2)
    assert m is not None
    assert sorted(m.nodes.values()) == [n.id for n in cut.nodes]
    assert len(m.inputs) == len(cut.inputs) < len(full.inputs)
    assert depth.cut_map(full, cut, 3) is None  # the 2-layer step is not 3 layers of it


def _priced(compute, comm, peak, sent, count):
    return PricedStep(compute, comm, compute + comm, peak, sent,
                      {"all-gather": KindCost(count, sent, comm)})


def test_extrapolate_is_linear_and_refuses_shrinking_figures():
    a, b = _priced(1.0, 2.0, 100.0, 10.0, 3), _priced(1.5, 2.25, 120.0, 14.0, 5)
    got = depth.extrapolate(a, b, 2, 10)  # 8 more layers than a
    assert got.compute_s == pytest.approx(5.0) and got.comm_s == pytest.approx(4.0)
    assert got.total_s == pytest.approx(9.0) and got.peak_bytes == pytest.approx(260.0)
    assert got.bytes_sent == pytest.approx(42.0)
    assert got.per_kind["all-gather"] == KindCost(19, pytest.approx(42.0), pytest.approx(4.0))
    assert depth.extrapolate(b, a, 2, 10) is None


GPT6 = """\
description: a 6-layer GPT at test size
model: {name: gpt, size: tiny, overrides: {num_layers: 6}}
cluster: {hardware: a100-80gb, mesh: {shape: [2, 4], axes: [data, model]}}
search: {time_limit: 30}
"""


@pytest.mark.slow  # a full compile of the deep step: make test-all
def test_the_cli_prices_a_deep_zoo_step_from_shallow_copies(tmp_path, capsys, devices):
    """`shardplan search` of a 6-layer GPT: every candidate of the measured selection (and so
    every row of the table) is priced from the 1- and 2-layer copies, the notes say so, and
    nothing is compiled again for the table."""
    from shardplan.cli import main
    from shardplan.plan_file import load_plan

    path = tmp_path / "gpt6.yaml"
    path.write_text(GPT6)
    out = tmp_path / "out"
    assert main(["search", str(path), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "cut down to 1 and 2 layers" in err
    for phase in ("compiling the plan", "compiling expert"):
        assert phase not in err, phase
    notes = " ".join(load_plan(out / "plan.json").notes)
    for name in ("searched", "data_parallel", "fsdp", "two_d"):
        assert f"{name} " in notes
    assert notes.count("extrapolated from the step compiled at 1 and 2 of its 6 layers") == 4
