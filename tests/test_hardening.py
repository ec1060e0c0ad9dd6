"""Issue 33, the terminal, configs and profiles, crashes and API misuse: every probe gives
the error the user should see, and the CLI its exit code (2 for bad input, 130 on Ctrl-C).
Plan files and the cache are tests/test_files.py and tests/test_cache*.py."""

import dataclasses
import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardplan
from shardplan import calibrate, cli_render, cluster, config, options
from shardplan.cli import main
from shardplan.cost.hardware import HardwareProfile
from shardplan.intra import hints as intra_hints
from shardplan.strategies.spec import MeshShape
from tests.conftest import auto_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NASTY = "\x1b[2J\x1b]0;pwned\x07\x1b]52;c;ZXZpbA==\x07[/] [bold]x[/bold]\x9b"
"""Clear screen, a window title, a clipboard write (OSC 52), rich markup, a C1 control."""


def _step(w, x):
    return w - 0.1 * jnp.mean(x @ w), jnp.sum(x @ w)


W = jax.ShapeDtypeStruct((64, 64), jnp.float32)
X = jax.ShapeDtypeStruct((32, 64), jnp.float32)


def _raw_controls(text: str) -> list[str]:
    return [c for c in text if c in "\x1b\x07\x9b"]


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


JOB = """\
model: {name: mlp, size: tiny}
cluster: {hardware: prof.yaml, mesh: {shape: [2, 4], axes: [data, model]}}
search: {time_limit: 5, measure: false}
output: {compare: false, formats: [json]}
"""

# -- the terminal -------------------------------------------------------------------------


def test_show_prints_a_plans_notes_and_hardware_inert(tmp_path, capsys):
    plan = shardplan.search(_step, W, X, cluster="cpu-8", time_limit=5, deterministic=True)
    plan = dataclasses.replace(plan, notes=(f"note {NASTY}",), hardware=f"hw {NASTY}")
    path = str(tmp_path / "plan.json")
    plan.save(path)
    assert main(["show", path]) == 0
    out = capsys.readouterr().out
    assert not _raw_controls(out)
    assert "\\x1b]52;c;ZXZpbA==\\x07" in out  # shown as written, not run
    assert "[/] [bold]x[/bold]" in out  # markup printed, not interpreted (nor a crash)


def test_search_prints_a_profile_name_with_escapes_and_markup_inert(tmp_path, capsys):
    _write(tmp_path, "prof.yaml", f"base: cpu\nname: {NASTY!r}\n".replace("'", '"'))
    job = _write(tmp_path, "job.yaml", JOB)
    assert main(["search", job, "--out", str(tmp_path / "out"), "-q"]) == 0
    out = capsys.readouterr().out
    assert not _raw_controls(out)
    assert "[/] [bold]x[/bold]" in out


def test_phases_and_shown_text_print_as_written():
    buf = io.StringIO()
    phases = cli_render.Phases(Console(file=buf, width=200))
    with phases(f"planning {NASTY}"):
        pass
    text = buf.getvalue()
    assert not _raw_controls(text)
    assert "[/] [bold]x[/bold]" in text and "\\x1b[2J" in text
    assert cli_render.plain("a\nb\x1bc") == "a\nb\\x1bc"  # lines kept, controls shown


def test_an_error_message_quoting_a_bad_key_is_printed_inert(tmp_path, capsys):
    _write(tmp_path, "prof.yaml", "base: cpu\n")
    job = _write(tmp_path, "job.yaml", JOB)
    assert main(["search", job, "-q", "--set", "model.\x1b]0;x\x07=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown key" in err and not _raw_controls(err)


# -- configs and profiles -----------------------------------------------------------------


@pytest.mark.parametrize("profile, message", [
    ("base: cpu\nname: [x\n", "not valid YAML"),
    ("base: cpu\nmemory_bytes: .inf\n", "memory_bytes must be a finite number"),
    ("base: cpu\npeak_flops: .inf\n", "peak_flops must be a finite number"),
    ("base: cpu\nintra_host: {bandwidth: .nan, latency: 1e-6}\n",
     "intra_host.bandwidth must be a finite number"),
    ("base: cpu\ndevices_per_host: .inf\n", "devices_per_host must be a finite number"),
    ("base: prof.yaml\n", "makes a cycle of profiles"),
    ("base: other.yaml\n", "prof.yaml -> ", ),
])
def test_a_bad_profile_exits_2_naming_the_file(tmp_path, capsys, profile, message):
    _write(tmp_path, "other.yaml", "base: prof.yaml\n")
    prof = _write(tmp_path, "prof.yaml", profile)
    job = _write(tmp_path, "job.yaml", JOB)
    assert main(["search", job, "-q"]) == 2
    err = capsys.readouterr().err
    assert message in err and prof in err, err
    assert "internal error" not in err
    with pytest.raises(ValueError, match="prof.yaml"):
        shardplan.search(_step, W, X, cluster=prof, num_devices=8)


def test_a_profile_base_is_read_relative_to_its_file(tmp_path):
    _write(tmp_path, "a.yaml", "base: cpu\nname: a\npeak_flops: 1e12\n")
    sub = tmp_path / "sub"
    sub.mkdir()
    b = _write(sub, "b.yaml", "base: ../a.yaml\nname: b\n")
    hw = shardplan.cost.hardware.get_profile(b)
    assert (hw.name, hw.peak_flops) == ("b", 1e12)


def test_profile_repeats_0_exits_2(capsys):
    assert main(["profile", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="repeats must be an int >= 1"):
        calibrate.best_time(lambda: None, repeats=0)


def test_a_one_device_profile_says_its_links_are_not_measured(devices):
    mesh = auto_mesh((1,), ("devices",))
    cal = calibrate.measure_profile(mesh, sizes=(2**12,), matmul=64, repeats=1)
    assert not cal.links and not cal.samples
    assert any("links NOT measured" in n for n in cal.notes)
    assert "links NOT measured" in cal.profile.source
    buf = io.StringIO()
    cli_render.print_profile(cal, Console(file=buf, width=200))
    assert "warning: links NOT measured" in buf.getvalue()


def test_the_docs_say_a_config_is_code():
    doc = config.ModelSection.model_fields["entry"].description
    assert "runs that code" in doc and "A config is code" in doc
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        assert "**A config is code.**" in f.read()


def test_a_config_with_an_absurd_budget_or_device_count_exits_2(tmp_path, capsys):
    _write(tmp_path, "prof.yaml", "base: cpu\n")
    job = _write(tmp_path, "job.yaml", JOB)
    assert main(["search", job, "-q", "--set", f"cluster.memory_budget={10**400}"]) == 2
    assert "more than any device has" in capsys.readouterr().err
    assert main(["search", job, "-q", "--set", "cluster.mesh={devices: 100000000}"]) == 2
    assert "at most 1,048,576 devices" in capsys.readouterr().err


# -- crashes ------------------------------------------------------------------------------


def test_a_donated_array_passed_again_is_named(devices):
    def step(params, x):
        return {"w": params["w"] - jnp.mean(x)}, jnp.sum(x)

    run = shardplan.auto(step, mesh=auto_mesh((8,), ("x",)), donate_argnums=(0,), time_limit=5,
                         deterministic=True)
    params, x = {"w": jnp.ones((64, 64))}, jnp.ones((32, 64))
    params, _ = run(params, x)  # now on the plan's sharding: the next call donates it
    new, _ = run(params, x)
    assert params["w"].is_deleted()
    with pytest.raises(ValueError, match=r"argument 0/w \(shape \(64, 64\)\) is a deleted "
                                         r"jax.Array: its buffer was donated"):
        run(params, x)
    run(new, x)  # what the step returned runs


def test_ctrl_c_while_compiling_exits_130(tmp_path):
    """SIGINT while the candidates compile: exit 130, one line, no crash from XLA's compile
    threads (shardplan.cli._exit_now), no temporary files left."""
    job = _write(tmp_path, "job.yaml", """\
        model: {name: mlp, size: tiny, batch_size: 256, overrides: {width: 256}}
        cluster: {hardware: a100-80gb, mesh: {shape: [2, 4], axes: [data, model]}}
        search: {time_limit: 20}
        output: {formats: [json]}
        """)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    # a test runner started in the background ignores SIGINT, and so would the child, as the
    # CLI keeps an ignored SIGINT ignored; a handler (unlike SIG_IGN) is not inherited
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardplan.cli", "search", job, "--out",
             str(tmp_path / "out")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            if line.startswith("compiling and pricing the candidates"):
                time.sleep(1.0)
                proc.send_signal(signal.SIGINT)
                break
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = "".join(err) + rest
    assert proc.returncode == 130, err[-2000:]
    assert err.rstrip().endswith("shardplan: interrupted"), err[-2000:]
    assert err.count("shardplan: interrupted") == 1
    assert "SIGSEGV" not in err and "Traceback" not in err
    assert list(tmp.iterdir()) == []


# -- API misuse ---------------------------------------------------------------------------


def test_a_mesh_of_another_size_than_the_cluster_is_an_error():
    with pytest.raises(ValueError, match=r"mesh_shape \(4, 8\) has 32 devices, the cluster "
                                         r"'tpu-v5e-16' 16"):
        shardplan.search(_step, W, X, cluster="tpu-v5e-16", mesh_shape=(4, 8))
    with pytest.raises(ValueError, match="num_devices=8 but cluster 'cpu-16' has 16"):
        shardplan.search(_step, W, X, cluster="cpu-16", num_devices=8)


def test_a_rule_naming_no_mesh_axis_is_an_error(mesh8):
    hints = shardplan.Hints({"1": P("devices")}, logical_axis_rules=[("batch", "dta")])
    with pytest.raises(ValueError, match=r"logical_axis_rules \('batch', 'dta'\) name mesh "
                                         r"axes the mesh does not have; its axes are 'devices'"):
        shardplan.search(_step, W, X, cluster="cpu-8", hints=hints)
    hints = shardplan.Hints({"1": P("x")}, logical_axis_rules=[("batch", ("x", "y"))])
    run = shardplan.auto(_step, mesh=mesh8, hints=hints)
    with pytest.raises(ValueError, match=r"\('batch', \('x', 'y'\)\) name mesh axes"):
        run.plan(W, X)


def test_double_star_patterns_match_in_polynomial_time():
    start = time.perf_counter()
    assert not options.path_matches("**/" * 40 + "b", "/".join(["a"] * 60) + "/c")
    assert options.path_matches("**/a/**/" * 20 + "c", "/".join(["a"] * 60) + "/c")
    assert time.perf_counter() - start < 0.5


def test_double_star_matching_agrees_with_the_recursive_definition():
    rng = random.Random(0)
    for _ in range(3000):
        pattern = "/".join(rng.choice(["**", "*", "a", "b", "a*", "?"])
                           for _ in range(rng.randint(1, 5)))
        path = "/".join(rng.choice(["a", "b", "ab", "0"]) for _ in range(rng.randint(1, 6)))
        assert options.path_matches(pattern, path) == intra_hints.matches(pattern, path), \
            (pattern, path)


def test_an_absurd_memory_budget_is_a_value_error():
    for make in (lambda: shardplan.SearchOptions(memory_budget=10**400),
                 lambda: shardplan.search(_step, W, X, cluster="cpu-8", memory_budget=10**400),
                 lambda: shardplan.auto(_step, memory_budget=10**400),
                 lambda: shardplan.auto(_step, memory_budget="1e30GiB")):
        with pytest.raises(ValueError, match="more than any device has"):
            make()


def test_auto_mesh_of_a_huge_device_count_is_refused_at_once():
    start = time.perf_counter()
    with pytest.raises(ValueError, match="at most 1,048,576 devices; 100,000,000 is more"):
        shardplan.search(_step, W, X, cluster="cpu", num_devices=10**8, mesh_shape="auto")
    assert time.perf_counter() - start < 1


def test_a_fixed_mesh_of_a_million_devices_plans_in_seconds():
    start = time.perf_counter()
    plan = shardplan.search(_step, W, X, cluster="cpu", mesh_shape=(1000, 1000), time_limit=5)
    assert plan.mesh.sizes == (1000, 1000)
    assert time.perf_counter() - start < 10


@dataclasses.dataclass(frozen=True)
class _FakePlan:
    mesh: Any
    estimate: Any
    notes: tuple = ()


class _Clock:
    """cluster's clock, advanced by the fake searches alone: the verdict holds at any load."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_auto_mesh_search_stops_at_the_time_limit(monkeypatch):
    calls, clock = [], _Clock()

    def slow_search(fn, *args, mesh_shape, axis_names, **kw):
        calls.append(mesh_shape)
        clock.now += 0.3
        return _FakePlan(MeshShape(tuple(axis_names), tuple(mesh_shape)),
                         dataclasses.make_dataclass("E", [("total_s", float)])(1.0))

    monkeypatch.setattr(cluster, "search", slow_search)
    monkeypatch.setattr(cluster, "time", clock)
    plan = cluster._search_meshes(_step, (W, X), HardwareProfile.uniform(), 1024, None,
                                  shardplan.SearchOptions(time_limit=0.5))
    assert len(calls) == 2  # of 10 meshes
    assert "8 more not planned (the time limit ran out)" in plan.notes[-1]


def test_axis_links_closed_form_agrees_with_the_devices():
    rng = random.Random(0)
    for _ in range(500):
        sizes = tuple(rng.choice([1, 2, 3, 4]) for _ in range(rng.randint(1, 3)))
        mesh = MeshShape(tuple(f"a{i}" for i in range(len(sizes))), sizes)
        hw = HardwareProfile.two_level(rng.choice([1, 2, 3, 4, 6, 8, 16]))
        n = mesh.num_devices
        assert hw.axis_links(mesh) == hw.axis_links(mesh, device_order=range(n)), (sizes, hw)


def test_global_args_misuse_is_named(mesh8):
    run = shardplan.auto(_step, mesh=mesh8)
    w, x = jnp.ones((64, 64)), jnp.ones((32, 64))
    with pytest.raises(ValueError, match=r"local_argnums has 5, but 2 arguments were given"):
        shardplan.global_args(run, w, x, local_argnums=(5,))
    with pytest.raises(TypeError, match="local_argnums must be an int or a tuple of ints"):
        shardplan.global_args(run, w, x, local_argnums="1")
    for wrong in (_step, None):
        with pytest.raises(TypeError, match="global_args takes the step shardplan.auto "
                                            "returned"):
            shardplan.global_args(wrong, w, x)
    placed = shardplan.global_args(run, w, x, local_argnums=-1)  # an int, from the end
    assert [a.shape for a in placed] == [(64, 64), (32, 64)]


def test_a_plan_on_a_mesh_with_other_axis_names_is_refused(mesh2x4):
    """docs/troubleshooting.md#reusing-a-plan: names and sizes are compared."""
    plan = shardplan.auto(_step, mesh=mesh2x4, time_limit=5, deterministic=True).plan(W, X)
    other = shardplan.auto(_step, mesh=auto_mesh((2, 4), ("a", "b")), plan=plan)
    with pytest.raises(ValueError, match="the given plan is for mesh data=2 x model=4, this "
                                         "mesh is a=2 x b=4"):
        other.plan(W, X)
    with open(os.path.join(ROOT, "docs", "troubleshooting.md")) as f:
        assert "The mesh check compares names and sizes" in f.read()


def test_exit_130_is_in_the_help_and_the_readme(capsys):
    assert main(["--help"]) == 0
    assert "\n  130  interrupted (Ctrl-C)" in capsys.readouterr().out
    with open(os.path.join(ROOT, "README.md")) as f:
        assert "| 130 |" in f.read()


def test_hint_patterns_as_the_planner_matches_them_are_linear():
    """intra.hints.matches (what the ILP's pins use) is options.path_matches: 40 `**` against
    a 60-deep path answers at once instead of exploring every split."""
    import time

    from shardplan.intra import hints as intra_hints

    start = time.perf_counter()
    assert not intra_hints.matches("**/" * 40 + "b", "/".join(["a"] * 60) + "/c")
    assert intra_hints.matches("params/**/kernel", "params/block_0/attn/kernel")
    assert time.perf_counter() - start < 1.0
