"""The plan cache trusts nothing on disk: its key is every input that changes the plan (a
test fails when an option or an argument of shardplan.auto is missing from it), a bad entry
(unreadable, not a regular file, bad schema, wrong fingerprint, a plan that does not fit the
step) is ignored with one warning and replaced, the directory and entries are private to the
user; random corruptions of a plan file and a cache entry give PlanFileError or one warning,
fast, never another exception."""

import dataclasses
import inspect
import json
import os
import pathlib
import re
import stat
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import shardplan
from shardplan import cache as cache_mod
from shardplan import fingerprint
from shardplan.options import SearchOptions
from tests.conftest import auto_mesh
from tests.test_api import mlp_args, mlp_step

ARGS = mlp_args(batch=16, width=32, layers=2)

# -- the key --------------------------------------------------------------------------------

# A value of every SearchOptions field other than its default. A new field must be added here:
# the test below then checks that it reaches the key.
OPTION_VARIANTS = {
    "memory_budget": 2**30, "time_limit": 5.0, "solver_seed": 1, "workers": 2,
    "state_argnums": (0,), "batch_argnums": (1, 2), "pipeline": "auto",
    "num_micro_batches": 2, "num_stages": 2, "num_layers": 2, "schedule": "gpipe",
    "measure": True, "while_trips": 2.0, "hints": {"1": P("data")}, "remat": False,
    "model_constraints": "ignore",
    "deterministic": True, "grad_accumulation": 2,
}

# The arguments of shardplan.auto that do not change the plan, and why.
NOT_IN_KEY = {
    "plan": "a given plan is run as it is: nothing is planned or cached",
    "cache": "where plans are kept, not what they are",
    "options": "a SearchOptions: each of its fields is checked through OPTION_VARIANTS",
    "progress": "how planning is shown, not what it plans (tests/test_progress.py: the same plan with and without a reporter)",
    "search_options": "the fields of SearchOptions by keyword: checked as options",
}


class _Stop(Exception):
    pass


def _key(monkeypatch, tmp_path, fn=mlp_step, **auto_kwargs) -> str:
    """The cache key shardplan.auto looks up for these arguments (stopped before planning)."""
    seen = []

    def load(self, fp):
        seen.append(fp)
        raise _Stop

    monkeypatch.setattr(cache_mod.PlanCache, "load", load)
    kwargs = {"mesh": auto_mesh((2, 4), ("data", "model")), "hardware": "cpu", **auto_kwargs}
    with pytest.raises(_Stop):
        shardplan.auto(fn, cache=tmp_path, **kwargs).plan(*ARGS)
    return seen[0]


def _other_step(params, x, y):
    new, loss = mlp_step(params, x, y)
    return new, 2 * loss


def test_every_input_of_auto_is_in_the_key(monkeypatch, tmp_path):
    assert set(OPTION_VARIANTS) == {f.name for f in dataclasses.fields(SearchOptions)}, \
        "give the new SearchOptions field a value in OPTION_VARIANTS"
    keyed = {
        "fn": {"fn": _other_step},
        "mesh": {"mesh": auto_mesh((4, 2), ("data", "model"))},
        "hardware": {"hardware": "a100-80gb"},
        "donate_argnums": {"donate_argnums": (0,)},
    }
    params = set(inspect.signature(shardplan.auto).parameters)
    assert set(keyed) | set(NOT_IN_KEY) == params, \
        "a new argument of shardplan.auto: put it in the key, or in NOT_IN_KEY saying why"
    base = _key(monkeypatch, tmp_path)
    assert _key(monkeypatch, tmp_path) == base
    keys = {name: _key(monkeypatch, tmp_path, **kw) for name, kw in keyed.items()}
    keys.update({name: _key(monkeypatch, tmp_path, **{name: v})
                 for name, v in OPTION_VARIANTS.items()})
    assert base not in keys.values(), [n for n, k in keys.items() if k == base]
    assert len(set(keys.values())) == len(keys)
    # other device ids in the same shape, other versions of jax or shardplan
    devices = list(reversed(jax.devices()))
    flipped = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", "model"),
                                axis_types=(jax.sharding.AxisType.Auto,) * 2)
    assert _key(monkeypatch, tmp_path, mesh=flipped) != base
    real = fingerprint.versions()
    monkeypatch.setattr(fingerprint, "versions", lambda: {**real, "jax": "0.0.1"})
    assert _key(monkeypatch, tmp_path) != base


def test_a_donating_steps_plan_is_not_reused_without_donation(tmp_path, mesh2x4):
    donating = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=tmp_path,
                              donate_argnums=(0,)).plan(*ARGS)
    plain = shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=tmp_path).plan(*ARGS)
    assert donating.search_s > 0 and plain.search_s > 0  # planned twice: two keys
    assert len(list(tmp_path.glob("plan-*.json"))) == 2


# -- bad entries ----------------------------------------------------------------------------


def _entry(tmp_path, mesh):
    """Plan once into the cache at `tmp_path`: (the plan, its entry's path)."""
    plan = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", cache=tmp_path).plan(*ARGS)
    (entry,) = tmp_path.glob("plan-*.json")
    return plan, entry


def _replan(tmp_path, mesh):
    """Plan again through the cache: (the plan, the StaleCacheWarnings raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = shardplan.auto(mlp_step, mesh=mesh, hardware="cpu", cache=tmp_path).plan(*ARGS)
    return plan, [w for w in caught if issubclass(w.category, cache_mod.StaleCacheWarning)]


def _edit_entry(entry, edit):
    d = json.loads(entry.read_text())
    edit(d)
    entry.write_text(json.dumps(d))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["plan"]["inputs"][0]["spec"].update(dims=[[], [], []]),
     "does not apply to this step.*3 dimensions"),
    (lambda d: d["plan"]["inputs"][0]["spec"].update(dims=[["data"], ["data"]]),
     "mesh axis 'data' more than once"),
    (lambda d: d["plan"].update(fingerprint=None, junk=1), "unknown field 'junk'"),
    (lambda d: d.update(extra=1), "not a plan cache entry"),
    (lambda d: d.update(fingerprint="0" * 64), "the plan of another step"),
])
def test_a_wrong_entry_is_ignored_with_one_warning_and_replaced(tmp_path, mesh2x4, edit, match):
    first, entry = _entry(tmp_path, mesh2x4)
    _edit_entry(entry, edit)
    plan, caught = _replan(tmp_path, mesh2x4)
    assert len(caught) == 1 and caught[0].message.args[0].count("ignoring") == 1
    assert plan.search_s > 0  # planned again
    assert re.search(match, str(caught[0].message)), caught[0].message
    assert plan.input_specs == first.input_specs
    again, caught = _replan(tmp_path, mesh2x4)  # replaced: loads without a warning
    assert not caught and again.search_s == 0.0


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_an_entry_that_is_not_a_regular_file_is_ignored_without_blocking(tmp_path, kind):
    plan = shardplan.search(mlp_step, *ARGS, cluster="cpu", mesh_shape=(8,), axis_names=("x",))
    cache = cache_mod.PlanCache(tmp_path / "c")
    path = cache.store("f" * 64, plan)
    path.unlink()
    {"fifo": lambda: os.mkfifo(path), "dev-zero": lambda: path.symlink_to("/dev/zero"),
     "directory": path.mkdir}[kind]()
    start = time.perf_counter()
    with pytest.warns(cache_mod.StaleCacheWarning, match="not a regular file"):
        assert cache.load("f" * 64) is None
    assert time.perf_counter() - start < 1
    if kind != "directory":
        assert cache.store("f" * 64, plan) == path and cache.load("f" * 64) is not None


def test_the_directory_and_entries_are_private(tmp_path):
    plan = shardplan.search(mlp_step, *ARGS, cluster="cpu", mesh_shape=(8,), axis_names=("x",))
    cache = cache_mod.PlanCache(tmp_path / "new" / "cache")
    path = cache.store("a" * 64, plan)
    assert stat.S_IMODE(cache.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    shared = cache_mod.PlanCache(tmp_path / "shared")
    shared.directory.mkdir()
    shared.directory.chmod(0o777)
    with pytest.warns(cache_mod.StaleCacheWarning, match="other users may write to it"):
        assert shared.store("a" * 64, plan) is None
    assert not list(shared.directory.iterdir())
    (shared.directory / path.name).write_text(path.read_text())  # planted
    with pytest.warns(cache_mod.StaleCacheWarning, match="not using the plan cache directory"):
        assert shared.load("a" * 64) is None


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown needs root")
def test_a_directory_another_user_owns_is_not_used(tmp_path):
    other = cache_mod.PlanCache(tmp_path / "theirs")
    other.directory.mkdir(mode=0o700)
    os.chown(other.directory, 4321, -1)
    with pytest.warns(cache_mod.StaleCacheWarning, match="another user owns it"):
        assert other.load("a" * 64) is None


# -- random corruptions ---------------------------------------------------------------------


def _small_step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
    return w - 0.1 * g, loss


@pytest.fixture(scope="module")
def valid_plan():
    s = jax.ShapeDtypeStruct
    return shardplan.search(_small_step, s((16, 16), jnp.float32), s((32, 16), jnp.float32),
                            cluster="cpu", mesh_shape=(2, 4), axis_names=("x", "y"))


def _paths(x, prefix=()):
    yield prefix
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))


def _set(d, path, value):
    if not path:
        return value
    node = d
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return d


REPLACEMENTS = [None, True, 0, -1, 1.5, "", "x", "[/]\x1b[2J", [], {}, [[["x"]]], {"dims": 1},
                2**63, 10**19]


@st.composite
def corruptions(draw, d):
    """A corrupted text of the JSON value `d` and whether it must be refused."""
    d = json.loads(json.dumps(d))
    paths = list(_paths(d))
    path = draw(st.sampled_from(paths))
    kind = draw(st.sampled_from(["truncate", "type", "nan", "deep", "huge", "duplicate",
                                 "delete", "unknown"]))
    text = json.dumps(d)
    if kind == "truncate":
        return text[:draw(st.integers(0, len(text) - 1))], True
    if kind == "type":
        return json.dumps(_set(d, path, draw(st.sampled_from(REPLACEMENTS)))), False
    marker = '"__CORRUPTION__"'
    if kind == "delete" and path:
        node = d
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
        return json.dumps(d), False
    if kind == "unknown" and path:
        parent = d
        for p in path[:-1]:
            parent = parent[p]
        if isinstance(parent, dict):
            parent["unknown_field"] = 1
            return json.dumps(d), True
    text = json.dumps(_set(d, path, "__CORRUPTION__"))
    depth = draw(st.integers(65, 100_000))
    inner = {"nan": draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400"])),
             "deep": "[" * depth + "]" * depth,
             "huge": "[" + ",".join(["1"] * draw(st.integers(10_000, 200_000))) + "]",
             "duplicate": '{"k": 1, "k": 2}'}.get(kind, "null")
    return text.replace(marker, inner, 1), kind in ("nan", "deep", "duplicate")


PROPERTY = settings(max_examples=50, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(data=st.data())
def test_a_corrupt_plan_file_is_a_plan_file_error_or_a_valid_plan(valid_plan, data):
    text, refused = data.draw(corruptions(valid_plan.to_dict()))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.json")
        with open(path, "w") as f:
            f.write(text)
        start = time.perf_counter()
        try:
            plan = shardplan.load_plan(path)
        except shardplan.PlanFileError as e:
            assert e.path == path and "\x1b" not in str(e)
        else:
            assert not refused, "a corrupt file loaded"
            plan.summary()  # a plan that loads can be shown
        assert time.perf_counter() - start < 1


@PROPERTY
@given(data=st.data())
def test_a_corrupt_cache_entry_is_ignored_with_one_warning_or_loads(valid_plan, data):
    with tempfile.TemporaryDirectory() as tmp:
        cache = cache_mod.PlanCache(pathlib.Path(tmp))
        path = cache.store("e" * 64, valid_plan)
        text, refused = data.draw(corruptions(json.loads(path.read_text())))
        path.write_text(text)
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = cache.load("e" * 64)
        assert time.perf_counter() - start < 1
        assert len(caught) == (plan is None)
        assert all(issubclass(w.category, cache_mod.StaleCacheWarning) for w in caught)
        assert not (refused and plan is not None), "a corrupt entry loaded"
