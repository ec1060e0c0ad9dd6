"""report.md, its plots and the bench tables, from hand-made plans and priced programs."""


import pytest

from shardplan import report, report_plots
from shardplan.analysis.price import KindCost, PricedStep
from shardplan.plan import Estimate, OpRow, Plan, Stage
from shardplan.strategies.spec import MeshShape, ShardSpec

MiB = 2**20


def _plan(stages=()) -> Plan:
    ops = [OpRow("dot_general", f"jvp(GPT)/layer_{i}/mlp", "dot m0:data", 1e-3 * (i + 1), 1e-4)
           for i in (0, 2, 10)]
    ops += [OpRow("add", "transpose(jvp(GPT))/layer_2/attn", "[data,-]", 5e-4, 0.0),
            OpRow("mul", "", "replicated", 2e-4, 0.0)]
    return Plan(
        mesh=MeshShape(("data", "model"), (2, 4)), hardware="a100-80gb",
        input_names=("[0]['layer_0']['w']", "[0]['layer_1']['w']", "[2]['x']"),
        input_specs=(ShardSpec((("model",), ())), ShardSpec((("model",), ())),
                     ShardSpec((("data",), ()))),
        output_names=("[0]['layer_0']['w']",), output_specs=(ShardSpec((("model",), ())),),
        constraints={}, estimate=Estimate(0.0167, 0.002, 300 * MiB, 100 * MiB, 50 * MiB),
        memory_budget=400 * MiB, ops=tuple(ops), stages=tuple(stages), search_s=1.5,
        solver="test")


def _priced(total, peak, comm=1e-3) -> PricedStep:
    return PricedStep(total - comm, comm, total, peak, 10 * MiB,
                      {"all-reduce": KindCost(2, 10 * MiB, comm)})


def _run(**kw) -> report.Run:
    baselines = {"data_parallel": _priced(0.008, 900 * MiB),  # faster, does not fit
                 "fsdp": _priced(0.020, 200 * MiB),
                 "two_d": _priced(0.012, 390 * MiB),
                 "megatron": "failed: ValueError: boom"}
    args = {"label": "gpt-test", "description": "a test run", "hardware": "a100-80gb",
            "budget": 400 * MiB, "plan": _plan(), "num_params": 1_000_000,
            "priced_plan": _priced(0.010, 350 * MiB), "baselines": baselines,
            "meshes": {"data=2 x model=4": 0.0187, "devices=8": "no plan fits (needs 1 GiB)"}}
    return report.Run(**{**args, **kw})


def test_layer_of_op_names():
    assert report.layer_of("jvp(GPT)/layer_3/mlp") == "layer_3"
    assert report.layer_of("transpose(jvp(MLP))/block_12/fc_in") == "block_12"
    assert report.layer_of("layer_7") == "layer_7"
    assert report.layer_of("jvp(GPT)/wte.attend") is None
    assert report.layer_of("player_1/x") is None


def test_cost_by_layer_in_layer_order_with_the_rest_and_resharding():
    rows = report.cost_by_layer(_plan())
    assert [r[0] for r in rows] == ["layer_0", "layer_2", "layer_10", "other", "outside the ops"]
    by = {r[0]: r for r in rows}
    assert by["layer_2"][1] == pytest.approx(3e-3 + 5e-4)
    assert by["other"][1] == pytest.approx(2e-4)
    # the estimate's communication beyond the ops' own (3 x 0.1 ms) is resharding between them
    assert by["outside the ops"][2] == pytest.approx(0.002 - 3e-4)


def test_best_baseline_is_the_fastest_that_fits():
    run = _run()
    name, _ = run.best_baseline()
    assert name == "two_d"  # data_parallel is faster but over the budget
    assert run.ratio() == pytest.approx(0.010 / 0.012)
    assert run.best_fits() and run.ratio_text().startswith("plan / best baseline (two_d)")
    over = _run(budget=100 * MiB)
    assert over.best_baseline()[0] == "data_parallel" and not over.best_fits()
    assert "no baseline fits" in over.ratio_text()
    assert _run(priced_plan=None).ratio() is None
    assert _run(baselines={}).best_baseline() is None


def test_comparison_rows():
    rows = report.comparison_rows(_run())
    names = [r[0] for r in rows]
    assert names == ["plan (cost model)", "plan (XLA)", "data_parallel (XLA)", "fsdp (XLA)",
                     "two_d (XLA)", "megatron"]
    dp = rows[2]
    assert dp[6] == "NO" and dp[4] == "0.80x"
    assert "boom" in rows[-1][-1]


def test_write_report(tmp_path):
    run = _run(verification=report.Verification(50 * MiB, 60 * MiB, 300 * MiB, 350 * MiB,
                                                 0.0167, 0.009, {"all-reduce": (2, 60 * MiB)}))
    written = report_plots.write_report(run, str(tmp_path))
    names = sorted(p.rsplit("/", 1)[1] for p in written)
    assert names == ["cost_per_layer.png", "memory.png", "report.md", "step_time.png"]
    for name in [n for n in names if n.endswith(".png")]:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "report.md").read_text()
    for text in ("# shardplan: gpt-test on a100-80gb", "| two_d (XLA) |", "![", "memory.png",
                 "Predicted vs compiled", "reduce-scatter", "Meshes tried",
                 "`[0]['layer_*']['w']`", "## Use this plan",
                 'shardplan.load_plan("plan.json")', "mesh = jax.make_mesh((2, 4), ('data', 'model'))", "| 2 |", "plan / best baseline (two_d): 0.83x"):
        assert text in md, text
    only_md = report_plots.write_report(run, str(tmp_path / "md"), formats=("md",))
    assert [p.rsplit("/", 1)[1] for p in only_md] == ["report.md"]


def test_pipeline_report_draws_a_timeline(tmp_path):
    pytest.importorskip("shardplan.timeline")
    est = Estimate(0.004, 0.001, 100 * MiB, 50 * MiB)
    plan = _plan(stages=(Stage((0, 5), (1, 4), (0, 1, 2, 3), est),
                         Stage((6, 11), (1, 4), (4, 5, 6, 7), est)))
    written = report_plots.write_report(_run(plan=plan, num_micro_batches=4), str(tmp_path))
    assert str(tmp_path / "timeline.png") in written
    md = (tmp_path / "report.md").read_text()
    assert "Pipeline stages" in md and "timeline.png" in md


def test_one_memory_figure_for_a_plan_that_fits_by_estimate_and_not_once_compiled(tmp_path):
    """300 MiB by the cost model fits 400 MiB; compiled, the plan needs 450 MiB: the summary,
    the table, the JSON and the plot all say 450 MiB and over, the estimate kept as such."""
    priced = _priced(0.010, 450 * MiB)
    plan = report.compiled_plan(_plan(), priced)
    run = _run(plan=plan, priced_plan=priced)
    assert run.plan_peak() == (450 * MiB, "compiled by XLA") and not run.fits(450 * MiB)
    summary = plan.summary()
    assert "(compiled by XLA)" in summary and "450.00 MiB" in summary and "OVER" in summary
    rows = {r[0]: r for r in report.comparison_rows(run)}
    assert rows["plan (XLA)"][5:7] == ["450.00 MiB", "NO"]
    assert rows["plan (cost model)"][5:7] == ["300.00 MiB", "(estimate)"]
    assert rows["plan (cost model)"][3] == "18.700 ms"  # the model's own step time
    d = plan.to_dict()
    assert d["estimate"]["peak_bytes"] == 450 * MiB and d["model_estimate"]["peak_bytes"] == 300 * MiB
    assert next(r[0] for r in report.memory_rows(run)) == "plan (XLA)"
    assert "plan (cost model)" not in [r[0] for r in report.memory_rows(run)]
    md = report.report_markdown(run)
    assert "peak memory (compiled by XLA): 450.00 MiB per device: DOES NOT FIT" in md


def test_kept_expert_shows_the_searched_plans_model_not_zeros():
    """measure=True kept an expert's input shardings, which the cost model never priced: the
    comparison shows the searched plan's cost model, labelled so, not a row of zeros."""
    import dataclasses

    from shardplan.planning.compiled import MeasuredProgram
    searched = _plan()
    kept = dataclasses.replace(searched, estimate=Estimate(0.0, 0.0, 0.0, 100 * MiB),
                               candidates=(MeasuredProgram("searched", searched),))
    rows = {r[0]: r for r in report.comparison_rows(_run(plan=kept))}
    assert "plan (cost model)" not in rows
    assert rows["searched plan (cost model)"][3] == "18.700 ms"
    assert "searched plan (cost model)" not in [r[0] for r in report.memory_rows(_run(plan=kept))]
    bare = dataclasses.replace(kept, candidates=())
    assert next(r[0] for r in _run(plan=bare).rows()) == "plan (XLA)"


def _sums(rows):
    return sum(r[1] for r in rows), sum(r[2] for r in rows)


def test_cost_by_layer_adds_up_to_the_cost_models_step():
    """The per-layer plot divides the estimate among the layers: where the ops' own costs sum
    to more than the estimate (it combines all-reduces across layers), the shares scale down;
    where to less, the rest is a group outside the ops. Either way the bars add up to the step."""
    import dataclasses

    over = dataclasses.replace(_plan(), estimate=Estimate(0.010, 1e-4, 300 * MiB, 100 * MiB))
    rows = report.cost_by_layer(over)
    assert [r[0] for r in rows] == ["layer_0", "layer_2", "layer_10", "other"]
    assert _sums(rows) == pytest.approx((0.010, 1e-4))
    by = {r[0]: r for r in rows}
    assert by["layer_10"][1] / by["layer_0"][1] == pytest.approx(11.0)  # shares kept
    assert _sums(report.cost_by_layer(_plan())) == pytest.approx((0.0167, 0.002))
    # measure=True: the estimate is the compiled program's; the plot is the cost model's
    compiled = report.compiled_plan(_plan(), _priced(0.005, 350 * MiB))
    assert _sums(report.cost_by_layer(compiled)) == pytest.approx((0.0167, 0.002))
    # without layer names: by primitive, the costliest 11 and the rest, still the whole step
    ops = tuple(OpRow(f"p{i}", "", "replicated", 1e-4 * (i + 1), 0.0) for i in range(20))
    flat = dataclasses.replace(_plan(), ops=ops)
    rows = report.cost_by_layer(flat)
    assert [r[0] for r in rows[-2:]] == ["other primitives", "outside the ops"] and len(rows) == 13
    assert _sums(rows) == pytest.approx((0.0167, 0.002))


def _search(tmp_path, config_text: str, *sets: str):
    from shardplan import cli

    config = tmp_path / "job.yaml"
    config.write_text(config_text)
    out = tmp_path / "out"
    code = cli.main(["search", str(config), "--out", str(out), "-q",
                     "--set", "output.compare=false", "--set", "search.measure=false",
                     *(x for s in sets for x in ("--set", s))])
    assert code == 0
    return out


def _snippet(report_md: str) -> str:
    section = report_md.split("## Use this plan", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_use_this_plan_snippet_runs_for_a_zoo_model(tmp_path, monkeypatch, devices):
    """The snippet in report.md, run as written next to plan.json, builds the config's model
    with arrays and runs its step (three arguments and three results) with the plan."""
    out = _search(tmp_path, "model: {name: mlp, size: tiny}\n"
                            "cluster: {hardware: cpu, mesh: {shape: [2, 4], axes: [data, model]}}\n")
    code = _snippet((out / "report.md").read_text())
    assert "params, opt_state, loss = step(params, opt_state, batch)" in code, code
    assert "donate_argnums=(0, 1)" in code and "get_model('mlp', 'tiny'" in code
    monkeypatch.chdir(out)
    ns: dict = {}
    exec(compile(code, "report.md", "exec"), ns)  # noqa: S102 - the snippet, run as written
    assert ns["loss"].shape == () and bool(ns["loss"] > 0)
    step_plan = ns["step"].plan(ns["params"], ns["opt_state"], ns["batch"])
    assert step_plan.in_specs == ns["plan"].in_specs


def test_the_use_this_plan_snippet_runs_for_an_entry_step(tmp_path, monkeypatch, devices):
    """A step of the user's own (model.entry) with other argument names, a fourth argument and
    two results: the snippet calls it with its own names; the user binds them."""
    (tmp_path / "twoargs.py").write_text('''\
import jax, jax.numpy as jnp
from shardplan.models import TrainStep


def make():
    def update(weights, momentum, inputs, scale):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((inputs @ w) ** 2))(weights)
        momentum = 0.9 * momentum + g
        return weights - scale * momentum, momentum, loss

    w = jnp.ones((64, 32)) / 64
    args = (w, jnp.zeros_like(w), jnp.ones((16, 64)), jnp.float32(0.1))
    return TrainStep("mine", update, args, state_argnums=(0, 1), batch_argnums=(2,),
                     num_params=64 * 32, description="")
''')
    out = _search(tmp_path, 'model: {entry: "twoargs:make"}\n'
                            "cluster: {hardware: cpu, mesh: {shape: [8], axes: [devices]}}\n")
    code = _snippet((out / "report.md").read_text())
    call = "weights, momentum, loss = step(weights, momentum, inputs, scale)"
    assert call in code and "donate_argnums=(0, 1)" in code, code
    monkeypatch.syspath_prepend(str(tmp_path))
    import twoargs

    ts = twoargs.make()
    monkeypatch.chdir(out)
    ns = dict(zip(("weights", "momentum", "inputs", "scale"), ts.args), train_step=ts.fn)
    exec(compile(code, "report.md", "exec"), ns)  # noqa: S102 - the snippet, run as written
    want = ts.fn(*twoargs.make().args)
    assert float(ns["loss"]) == pytest.approx(float(want[2]), rel=1e-5)


def test_without_the_call_the_snippet_passes_the_arguments_through():
    md = report.report_markdown(_run())
    code = _snippet(md)
    assert "outputs = step(*args)" in code and "donate_argnums" not in code
    compile(code, "report.md", "exec")
