"""The plan cache: a second run of the same job loads its plan instead of planning; stale and
corrupt entries are ignored with a warning; writes leave no partial files."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import shardplan
from shardplan import cache as cache_mod
from tests.test_api import assert_tree_close, mlp_args, mlp_step

ROOT = pathlib.Path(__file__).resolve().parent.parent

# One run of a job: plan an MLP step (cache directory from $SHARDPLAN_CACHE), print the time
# `step.plan` took, the plan's own search time and the step's fingerprint.
JOB = """
import json, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
import shardplan
from shardplan import fingerprint
from shardplan.cost.hardware import get_profile
from shardplan.ir.trace import trace
from tests.conftest import auto_mesh
from tests.test_api import mlp_args, mlp_step

args = mlp_args(batch=64, width=128, layers=3)
mesh = auto_mesh((2, 4), ("data", "model"))
step = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu")
start = time.perf_counter()
plan = step.plan(*args)
plan_s = time.perf_counter() - start
fp = fingerprint.step_fingerprint(trace(mlp_step, args), mesh, get_profile("cpu"), step.options,
                                 donate_argnums=step.donate_argnums)
print(json.dumps({"plan_s": plan_s, "search_s": plan.search_s, "fingerprint": fp,
                  "specs": [str(s) for s in plan.in_specs.values()]}))
"""


def _run_job(cache_dir, hash_seed):
    env = {**os.environ, "SHARDPLAN_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT),
           "JAX_PLATFORMS": "cpu", "PYTHONHASHSEED": str(hash_seed)}
    out = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_second_run_of_a_job_loads_its_plan_in_under_a_second(tmp_path):
    first = _run_job(tmp_path, hash_seed=1)
    entries = list(tmp_path.glob("plan-*.json"))
    assert len(entries) == 1
    second = _run_job(tmp_path, hash_seed=2)
    print(f"plan: first run {first['plan_s']:.2f} s, second run {second['plan_s']:.2f} s")
    # The fingerprint is the same in two processes (different hash seeds), so is the entry.
    assert second["fingerprint"] == first["fingerprint"]
    assert entries[0].name == f"plan-{first['fingerprint'][:40]}.json"
    assert list(tmp_path.glob("plan-*.json")) == entries
    # The second run did not plan: it loaded the first run's plan (plan files keep no timing).
    assert first["search_s"] > 0 and second["search_s"] == 0.0
    assert second["specs"] == first["specs"]
    assert second["specs"] == first["specs"]
    assert second["plan_s"] < 1.0


def _plan_twice(cache_dir, mesh):
    """Plan the same step with two AutoSteps sharing `cache_dir`: (first plan, second plan)."""
    args = mlp_args(batch=64, width=128, layers=3)
    a = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", cache=cache_dir).plan(*args)
    b = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", cache=cache_dir).plan(*args)
    return a, b


def test_a_cached_plan_runs_like_the_planned_one(tmp_path, mesh2x4):
    args = mlp_args(batch=64, width=128, layers=3)
    planned = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=tmp_path)
    loaded = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=tmp_path)
    first = planned.plan(*args)
    assert first.search_s > 0 and loaded.plan(*args).search_s == 0.0  # loaded, not planned
    assert_tree_close(loaded(*args), planned(*args))
    assert_tree_close(loaded(*args), mlp_step(*args), rtol=2e-4, atol=2e-5)


def test_a_corrupt_entry_is_ignored_with_a_warning_and_replaced(tmp_path, mesh2x4):
    first, _ = _plan_twice(tmp_path, mesh2x4)
    (entry,) = tmp_path.glob("plan-*.json")
    entry.write_text('{"shardplan": "0.1.0+trunc')
    args = mlp_args(batch=64, width=128, layers=3)
    with pytest.warns(cache_mod.StaleCacheWarning, match="ignoring the plan cache entry"):
        plan = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=tmp_path).plan(*args)
    assert [str(s) for s in plan.input_specs] == [str(s) for s in first.input_specs]
    assert json.loads(entry.read_text())["shardplan"] == cache_mod.version()


def test_an_entry_of_another_version_is_stale(tmp_path, mesh2x4):
    first, _ = _plan_twice(tmp_path, mesh2x4)
    (entry,) = tmp_path.glob("plan-*.json")
    stored = json.loads(entry.read_text())
    stored["shardplan"] = "0.0.1+0123456789ab"
    stored["plan"]["inputs"][0]["spec"] = {"dims": [[], []], "partial": []}
    entry.write_text(json.dumps(stored))
    args = mlp_args(batch=64, width=128, layers=3)
    with pytest.warns(cache_mod.StaleCacheWarning, match="planned by shardplan 0.0.1"):
        plan = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=tmp_path).plan(*args)
    assert str(plan.input_specs[0]) == str(first.input_specs[0])


def test_other_options_meshes_or_profiles_are_other_entries(tmp_path, mesh2x4, mesh8):
    args = mlp_args(batch=64, width=128, layers=3)
    for mesh, hw, budget in ((mesh2x4, "cpu", None), (mesh8, "cpu", None),
                             (mesh2x4, "a100-80gb", None), (mesh2x4, "cpu", "1GiB")):
        shardplan.auto(mlp_step, mesh=mesh, hardware=hw, memory_budget=budget,
                       cache=tmp_path).plan(*args)
    assert len(list(tmp_path.glob("plan-*.json"))) == 4


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path, mesh2x4):
    first, _ = _plan_twice(tmp_path, mesh2x4)
    cache = cache_mod.PlanCache(tmp_path)
    for _ in range(3):
        assert cache.store("f" * 64, first) == cache.path("f" * 64)
    assert all(p.name.startswith("plan-") and p.suffix == ".json" for p in tmp_path.iterdir())
    assert [str(s) for s in cache.load("f" * 64).input_specs] == \
        [str(s) for s in first.input_specs]


def test_the_cache_option_and_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPLAN_CACHE", str(tmp_path))
    assert cache_mod.PlanCache.of(True).directory == tmp_path
    assert cache_mod.PlanCache.of(False) is None
    assert cache_mod.PlanCache.of(tmp_path / "x").directory == tmp_path / "x"
    monkeypatch.setenv("SHARDPLAN_CACHE", "off")
    assert cache_mod.PlanCache.of(True) is None
    monkeypatch.delenv("SHARDPLAN_CACHE")
    assert cache_mod.PlanCache.of(True).directory == pathlib.Path.home() / ".cache" / "shardplan"
