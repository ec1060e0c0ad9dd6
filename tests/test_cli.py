"""The `shardplan` command in-process: search end to end, show, bench, and its exit codes."""

import csv
import glob
import json
import os
import textwrap

import pytest

from shardplan.cli import main
from shardplan.plan_file import load_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MLP = """\
description: a small MLP whose plan splits its weights
model: {name: mlp, size: tiny, batch_size: 4096, overrides: {width: 512}}
cluster: {hardware: a100-80gb, mesh: {shape: [2, 4], axes: [data, model]}}
search: {time_limit: 20}
"""


def _write(tmp_path, text=MLP, name="job.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_search_end_to_end_then_show(tmp_path, capsys, devices):
    out = tmp_path / "out"
    assert main(["search", _write(tmp_path), "--out", str(out), "--verify"]) == 0
    captured = capsys.readouterr()
    for name in ("plan.json", "comparison.json", "report.md", "step_time.png", "memory.png"):
        assert (out / name).exists(), name
    # per-layer costs come from the cost model: drawn when the searched plan was kept (an
    # expert plan kept by the measured selection has no per-operator costs)
    kept_searched = bool(load_plan(out / "plan.json").ops)
    assert (out / "cost_per_layer.png").exists() == kept_searched
    for text in ("mesh data=2 x model=4", "input shardings", "plan vs baselines",
                 "plan (XLA)", "data_parallel (XLA)", "fsdp (XLA)", "two_d (XLA)",
                 "fits budget", "predicted vs compiled", "communication sent / device"):
        assert text in captured.out, text
    assert "planning mlp-tiny on mesh data=2 x model=4" in captured.err
    # the measured search compiled the plan and the expert plans: the table reuses them
    for phase in ("compiling the plan", "compiling baseline", "compiling expert"):
        assert phase not in captured.err, phase
    plan = load_plan(out / "plan.json")
    assert plan.mesh.sizes == (2, 4)
    assert any(s.dims != ((),) * len(s.dims) for s in plan.input_specs), "not all replicated"
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["plan"]["total_s"] > 0
    assert set(comparison["baselines"]) == {"data_parallel", "fsdp", "two_d"}
    assert all(b["total_s"] > 0 for b in comparison["baselines"].values())
    # data parallel all-reduces every f32 gradient over 8 devices: 2 x 7/8 of the params' bytes
    from shardplan.models import get_model

    params = get_model("mlp", "tiny", abstract=True, batch_size=4096, width=512).num_params
    dp = comparison["baselines"]["data_parallel"]
    assert dp["per_kind"]["all-reduce"]["bytes_sent"] >= 2 * 7 / 8 * 4 * params
    md = (out / "report.md").read_text()
    assert "![Memory per device against the budget](memory.png)" in md

    assert main(["show", str(out / "plan.json")]) == 0
    shown = capsys.readouterr().out
    assert "shardplan plan on mesh data=2 x model=4" in shown and "input shardings" in shown


def test_impossible_budget_exits_3_with_the_least_memory(tmp_path, capsys, devices):
    code = main(["search", _write(tmp_path), "--out", str(tmp_path / "o"), "-q",
                 "--set", "cluster.memory_budget=1KiB", "--set", "output.compare=false"])
    err = capsys.readouterr().err
    assert code == 3
    assert "smallest memory any plan needs is" in err and "1.00 KiB" in err
    assert "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("override, key", [
    ("model.sise=gpt2-124m", "model.sise"),
    ("search.pipeline=sometimes", "search.pipeline"),
    ("cluster.memory_budget=-3", "cluster.memory_budget"),
    ("model.name=resnet", "model.name"),
    ("model.size=gpt2-124m", "model.size"),
    ("cluster.hardware=tpu-v9", "cluster.hardware"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path, capsys, override, key):
    assert main(["search", _write(tmp_path), "--set", override]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardplan: error: ") and key in err, err
    assert "Traceback" not in err


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main([]) == 2
    assert main(["search"]) == 2
    assert main(["search", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["search", _write(tmp_path), "--set", "oops"]) == 2
    assert "key.path=value" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "junk.json").write_text('{"format": 1}')
    assert main(["show", str(tmp_path / "junk.json")]) == 2
    assert "plan has no 'mesh'" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "nowhere")]) == 2


def test_device_count_searches_mesh_shapes(tmp_path, capsys, devices):
    out = tmp_path / "out"
    path = _write(tmp_path)
    assert main(["search", path, "--out", str(out), "-q", "--set", "cluster.mesh={devices: 8}",
                 "--set", "output.compare=false", "--set", "search.measure=false"]) == 0
    meshes = json.loads((out / "comparison.json").read_text())["meshes"]
    assert set(meshes) == {"devices=8", "data=2 x model=4", "data=4 x model=2"}
    chosen = load_plan(out / "plan.json")
    best = min(meshes, key=meshes.get)
    assert best == " x ".join(f"{n}={s}" for n, s in zip(chosen.mesh.names, chosen.mesh.sizes))
    assert "Meshes tried" in (out / "report.md").read_text()


def test_meshes_over_64_devices_show_estimates_only(tmp_path, capsys, devices):
    out = tmp_path / "out"
    assert main(["search", _write(tmp_path), "--out", str(out), "-q",
                 "--set", "cluster.mesh.shape=[16, 8]"]) == 0
    printed = capsys.readouterr().out
    assert "not compiled: the mesh has 128 devices" in printed
    assert "data_parallel (XLA)" not in printed
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["plan"] is None and comparison["baselines"] == {}


ENTRY = """\
import jax
import jax.numpy as jnp


def make(width=64):
    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    return step, (jax.ShapeDtypeStruct((width, width), jnp.float32),
                  jax.ShapeDtypeStruct((32, width), jnp.float32))
"""


def test_entry_functions(tmp_path, capsys, monkeypatch, devices):
    (tmp_path / "my_steps.py").write_text(ENTRY)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, """\
        model: {entry: "my_steps:make", kwargs: {width: 128}}
        cluster: {hardware: a100-80gb, mesh: {shape: [8]}}
        output: {formats: [json]}
    """)
    assert main(["search", path, "--out", str(tmp_path / "a"), "-q"]) == 0
    out = capsys.readouterr().out
    # a (fn, args) entry gets the expert plans beside the plan, compiled and priced
    assert "plan (XLA)" in out and "data_parallel" in out and "fsdp" in out
    report = json.loads((tmp_path / "a" / "comparison.json").read_text())
    assert {"data_parallel", "fsdp"} <= set(json.dumps(report).split('"')), report
    assert main(["search", path, "--out", str(tmp_path / "b"), "-q", "--set",
                 'model={entry: "shardplan.models:get_model", kwargs: {name: mlp}}',
                 "--set", "output.compare=false", "--set", "search.measure=false"]) == 0
    assert main(["search", path, "-q", "--set", "model.entry=my_steps:nothing"]) == 2
    assert "model.entry" in capsys.readouterr().err


def test_bench(tmp_path, capsys, devices):
    bench = tmp_path / "bench"
    bench.mkdir()
    _write(bench, MLP, "a-mlp-2x4.yaml")
    _write(bench, MLP.replace("shape: [2, 4], axes: [data, model]", "shape: [8]"), "b-mlp-8.yaml")
    _write(bench, MLP + "output: {compare: false}\n", "c-small.yaml")
    (bench / "c-small.yaml").write_text((bench / "c-small.yaml").read_text().replace(
        "a100-80gb,", "a100-80gb, memory_budget: 1KiB,"))
    out = tmp_path / "out"
    assert main(["bench", str(bench), "--out", str(out), "-q"]) == 5  # c-small fits no plan
    captured = capsys.readouterr()
    printed = captured.out
    assert "1 of 3 bench configs failed: c-small (no plan fits" in captured.err
    assert "plan / best" in printed and "a-mlp-2x4" in printed
    with open(out / "bench.csv") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"a-mlp-2x4", "b-mlp-8", "c-small"}
    a = rows["a-mlp-2x4"]
    assert float(a["plan_s"]) > 0 and float(a["fsdp_s"]) > 0 and float(a["two_d_s"]) > 0
    assert float(a["plan_over_best"]) > 0 and float(a["search_s"]) > 0
    assert rows["b-mlp-8"]["megatron_s"] and not rows["b-mlp-8"]["two_d_s"]
    assert "no plan fits" in rows["c-small"]["plan_s"]
    md = (out / "bench.md").read_text()
    assert "| a-mlp-2x4 | mlp-tiny | data=2 x model=4 | a100-80gb |" in md
    assert (out / "a-mlp-2x4" / "report.md").exists()

    (bench / "d-bad.yaml").write_text("model: {name: mlp, colour: red}\n")
    assert main(["bench", str(bench), "--out", str(out)]) == 2
    assert "colour" in capsys.readouterr().err


SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                 + glob.glob(os.path.join(ROOT, "configs", "bench", "*.yaml")))


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_shipped_config_plans(path, tmp_path, devices):
    """Planning only (compiling on 64 CPU devices needs a fresh process)."""
    assert main(["search", path, "--out", str(tmp_path), "-q",
                 "--set", "output.compare=false", "--set", "search.measure=false"]) == 0
    assert (tmp_path / "plan.json").exists()


def test_entry_imports_from_the_current_and_the_config_directory(tmp_path):
    """The console script (not in-process, no PYTHONPATH): `mymodel.py` beside the config or
    in the current directory is found."""
    import subprocess
    import sys

    (tmp_path / "mymodel.py").write_text(ENTRY)
    job = textwrap.dedent("""\
        model: {entry: "mymodel:make", kwargs: {width: 64}}
        cluster: {hardware: a100-80gb, mesh: {shape: [2]}}
        search: {measure: false, time_limit: 5}
        output: {formats: [json], compare: false}
    """)
    (tmp_path / "job.yaml").write_text(job)
    script = os.path.join(os.path.dirname(sys.executable), "shardplan")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for cwd, config in ((tmp_path, "job.yaml"), (elsewhere, str(tmp_path / "job.yaml"))):
        done = subprocess.run([script, "search", config, "--out", "out", "-q"], cwd=cwd,
                              check=False,
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert (cwd / "out" / "plan.json").exists()


@pytest.mark.parametrize("text, what", [
    ("[1, 2, 3]", "holds list, not a plan object"),
    ('{"version": 2, "mesh": {"names": ["x"], "sizes": [', "not valid JSON"),
    ('{"version": 2, "mesh": {"names": ["x"], "sizes": ["eight"]}}', "should be an integer"),
])
def test_show_a_broken_plan_file_exits_2_without_a_traceback(tmp_path, capsys, text, what):
    (tmp_path / "plan.json").write_text(text)
    assert main(["show", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert what in err and "Traceback" not in err


BROKEN_ENTRY = """\
def helper():
    raise RuntimeError("my model is broken")


def make():
    helper()


def wrong():
    return 42
"""


def test_an_entry_that_raises_exits_2_showing_the_users_frames(tmp_path, capsys, monkeypatch):
    (tmp_path / "broken_steps.py").write_text(BROKEN_ENTRY)
    (tmp_path / "import_fails.py").write_text("import numpy\nraise ValueError('bad import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _write(tmp_path, 'model: {entry: "broken_steps:make"}\n'
                  "cluster: {hardware: a100-80gb, mesh: {shape: [8]}}\n")
    assert main(["search", path, "-q"]) == 2
    err = capsys.readouterr().err
    assert "RuntimeError: my model is broken" in err and "broken_steps.py" in err
    assert "in helper" in err and "shardplan/cli.py" not in err and "Traceback" not in err
    assert main(["search", path, "-q", "--set", "model.entry=broken_steps:wrong"]) == 2
    assert "returned int" in capsys.readouterr().err
    assert main(["search", path, "-q", "--set", "model.entry=import_fails:make"]) == 2
    err = capsys.readouterr().err
    assert "ValueError: bad import" in err and "import_fails.py" in err


def test_internal_errors_exit_1_with_a_traceback_only_under_debug(tmp_path, capsys, monkeypatch):
    import shardplan

    def boom(*args, **kwargs):
        raise KeyError("oops")

    monkeypatch.setattr(shardplan, "search", boom)
    path = _write(tmp_path)
    assert main(["search", path, "-q"]) == 1
    err = capsys.readouterr().err
    assert "internal error: KeyError" in err and "--debug" in err and "Traceback" not in err
    assert main(["--debug", "search", path, "-q"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_time_limit_with_no_plan_exits_4(tmp_path, capsys, monkeypatch):
    import shardplan

    def slow(*args, **kwargs):
        raise shardplan.SearchTimeout(20.0, "no plan within the limit")

    monkeypatch.setattr(shardplan, "search", slow)
    assert main(["search", _write(tmp_path), "-q"]) == 4
    err = capsys.readouterr().err
    assert "time limit of 20 s ran out" in err and "Traceback" not in err


def test_pipeline_settings_are_rejected_or_noted(tmp_path, capsys):
    path = _write(tmp_path)
    for mode in ("true", "spmd", "mpmd"):
        assert main(["search", path, "-q", "--set", f"search.pipeline={mode}"]) == 2
        assert "search.pipeline" in capsys.readouterr().err
    assert main(["search", path, "-q", "--set", "search.num_micro_batches=4"]) == 2


def test_exit_codes_are_in_the_help_and_the_readme(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for code in range(6):
        assert f"\n  {code}  " in text
        assert f"| {code} |" in readme
