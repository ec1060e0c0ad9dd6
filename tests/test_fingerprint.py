"""Fingerprints of a traced step and of a plan: equal for equal inputs, different when what
the plan depends on (or decides) differs. Equality across processes is checked by
tests/test_cache.py (two runs of a job) and tests/test_multihost.py."""

import dataclasses

import jax

import shardplan
from shardplan import fingerprint
from shardplan.cost.hardware import get_profile
from shardplan.ir.trace import trace
from shardplan.options import SearchOptions as Options
from shardplan.strategies.spec import MeshShape, ShardSpec
from tests.conftest import auto_mesh
from tests.test_api import mlp_args, mlp_step

CPU = get_profile("cpu")
DEFAULT = Options()


def _fp(args, mesh, hw=CPU, options=DEFAULT, donate=()):
    return fingerprint.step_fingerprint(trace(mlp_step, args), mesh, hw, options,
                                        donate_argnums=donate)


def test_the_step_fingerprint_is_stable_and_sees_what_the_plan_depends_on(mesh2x4, mesh8):
    args = mlp_args(batch=16, width=32, layers=2)
    base = _fp(args, mesh2x4)
    assert base == _fp(mlp_args(batch=16, width=32, layers=2, seed=1), mesh2x4)  # values: no
    assert base != _fp(mlp_args(batch=32, width=32, layers=2), mesh2x4)
    assert base != _fp(mlp_args(batch=16, width=32, layers=3), mesh2x4)
    assert base != _fp(jax.tree_util.tree_map(lambda x: x.astype("bfloat16"), args), mesh2x4)
    assert base != _fp(args, mesh8)
    assert base != _fp(args, auto_mesh((2, 4), ("x", "y")))
    assert base != _fp(args, mesh2x4, get_profile("a100-80gb"))
    assert base != _fp(args, mesh2x4, dataclasses.replace(CPU, peak_flops=CPU.peak_flops * 2))
    assert base != _fp(args, mesh2x4, options=Options(memory_budget=2**30))
    assert base != _fp(args, mesh2x4, donate=(0,))  # donation frees buffers: another budget
    # A MeshShape (no devices) is keyed by names and sizes alone.
    shape = MeshShape(("data", "model"), (2, 4))
    assert _fp(args, shape) == _fp(args, MeshShape(("data", "model"), (2, 4))) != base


def test_the_jaxpr_text_has_no_memory_addresses():
    args = mlp_args(batch=8, width=16, layers=2)  # relu: a custom_jvp with function params
    text = fingerprint.jaxpr_text(trace(mlp_step, args).closed_jaxpr)
    assert " at 0x" not in text
    assert fingerprint.strip_addresses("<function f at 0x7f3a2b1c0d90>") == "<function f>"


def _plan(mesh2x4):
    return shardplan.auto(mlp_step, mesh=mesh2x4, hardware="cpu", cache=False).plan(
        *mlp_args(batch=64, width=128, layers=3))


def test_the_plan_fingerprint_sees_specs_not_timings(mesh2x4):
    plan = _plan(mesh2x4)
    fp = fingerprint.plan_fingerprint(plan)
    assert fp == fingerprint.plan_fingerprint(dataclasses.replace(plan, search_s=123.0))
    k = next(i for i, s in enumerate(plan.input_specs) if any(s.dims))
    specs = list(plan.input_specs)
    specs[k] = ShardSpec(((),) * len(specs[k].dims))
    other = dataclasses.replace(plan, input_specs=tuple(specs))
    assert fingerprint.plan_fingerprint(other) != fp
    diff = fingerprint.first_difference(plan.to_dict(), other.to_dict())
    assert diff.startswith(f"input {plan.input_names[k]!r}: spec P("), diff
    assert diff.endswith("vs P(None, None)"), diff
    assert fingerprint.first_difference(plan.to_dict(), plan.to_dict()) is None


def test_the_plan_fingerprint_sees_the_pipeline_kind_and_the_stages(mesh2x4):
    """Processes that chose different kinds of program (pipeline="auto") or stages differ."""
    plan = _plan(mesh2x4)
    spmd = dataclasses.replace(plan, pipeline_kind="spmd")
    assert fingerprint.plan_fingerprint(spmd) != fingerprint.plan_fingerprint(plan)
    assert fingerprint.first_difference(plan.to_dict(), spmd.to_dict()) == \
        "pipeline_kind: '' vs 'spmd'"
    a = {**plan.to_dict(), "stages": [{"layers": [0, 1], "devices": [0, 1]},
                                      {"layers": [2, 3], "devices": [2, 3]}]}
    b = {**a, "stages": [a["stages"][0], {"layers": [2, 3], "devices": [4, 5]}]}
    assert fingerprint.first_difference(a, b) == "pipeline stage 1 devices: [2, 3] vs [4, 5]"
    assert fingerprint.first_difference(a, {**a, "stages": a["stages"][:1]}) == \
        "number of pipeline stages: 2 vs 1"
