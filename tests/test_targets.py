"""Where plans are compiled: the TPU compiler on compile-only devices of the slice when libtpu is
installed, XLA:CPU standing in otherwise (saying why); the measured selection, the compiled
memory check, `lower()` and the CLI on the TPU compiler."""

import textwrap
import warnings

import jax
import jax.numpy as jnp
import pytest

import shardplan
from shardplan.analysis import hlo, targets
from shardplan.cli import main
from shardplan.cost.hardware import get_profile
from shardplan.models import get_model
from shardplan.plan_file import plan_from_dict
from shardplan.strategies.spec import MeshShape

V5E, V5P, V6E = (get_profile(n) for n in ("tpu-v5e", "tpu-v5p", "tpu-v6e"))
SHAPE = MeshShape(("data", "model"), (2, 4))


def _needs_libtpu():
    if targets.libtpu_version() is None:
        pytest.skip("libtpu is not installed (the TPU compiler): pip install -e '.[dev,tpu]'")


def _mlp():
    return get_model("mlp", "tiny", abstract=True, batch_size=256, width=256, dtype="bfloat16")


@pytest.mark.parametrize("hw, n, name", [
    (V5E, 8, "v5e:2x4"), (V5E, 16, "v5e:4x4"), (V5E, 256, "v5e:16x16"), (V5E, 1, "v5e:1x1"),
    (V6E, 32, "v6e:4x8"), (V5P, 4, "v5p:2x2x1"), (V5P, 8, "v5p:2x2x2"), (V5P, 16, "v5p:2x2x4")])
def test_a_slice_of_n_chips_is_the_cloud_topology(hw, n, name):
    assert targets.topology_name(hw, n) == name


def test_a_mesh_axis_may_split_a_torus_axis():
    """8 x 8 on v5p's 4x4x4 torus (configs/mixtral-8x7b-tpu-v5p-128.yaml): no mesh axis is a
    product of torus axes, so one is split (mesh_utils' allow_split_physical_axes); every
    chip is used once."""
    _needs_libtpu()
    mesh = targets.tpu_mesh(V5P, MeshShape(("data", "model"), (8, 8)))
    assert mesh.devices.shape == (8, 8) and len({d.id for d in mesh.devices.flat}) == 64


def test_a_count_that_makes_no_slice_names_the_known_ones():
    with pytest.raises(targets.TargetError, match=r"12 tpu-v5e chips .* v5e:2x4, v5e:4x4"):
        targets.topology_name(V5E, 12)


def test_the_tpu_compiler_compiles_for_a_tpu_profile_whatever_the_users_devices(devices):
    _needs_libtpu()
    cpu = targets.cpu_mesh(SHAPE)
    mesh, compiler = targets.compile_mesh(V5E, SHAPE, cpu)
    assert {d.platform for d in mesh.devices.flat} == {"tpu"}
    assert mesh.devices.shape == (2, 4) and mesh.axis_names == ("data", "model")
    assert compiler.platform == "tpu" and compiler.topology == "v5e:2x4"
    assert not compiler.stands_in
    assert f"libtpu {targets.libtpu_version()}" in compiler.describe()
    assert "TPU v5 lite" in compiler.describe()


def test_without_libtpu_xla_cpu_stands_in_and_says_how_to_install(monkeypatch, devices):
    monkeypatch.setattr(targets, "libtpu_version", lambda: None)
    with pytest.warns(UserWarning, match=r"compiled by XLA:CPU.*shardplan\[tpu\]"):
        mesh, compiler = targets.compile_mesh(V5E, SHAPE)
    assert {d.platform for d in mesh.devices.flat} == {"cpu"}
    assert compiler.stands_in and "libtpu is not installed" in compiler.describe()
    with pytest.raises(targets.TargetError, match=r"pip install \"shardplan\[tpu\]\""):
        targets.tpu_devices(V5E, 8)


def test_v4_is_compiled_on_cpu_and_says_why(devices):
    with pytest.warns(UserWarning, match="TensorCores, not chips"):
        _, compiler = targets.compile_mesh(get_profile("tpu-v4"), SHAPE)
    assert compiler.platform == "cpu" and compiler.stands_in


def test_a_cpu_profile_compiles_on_the_users_devices_without_a_word(mesh2x4):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh, compiler = targets.compile_mesh(get_profile("cpu"), SHAPE, mesh2x4)
    assert mesh is mesh2x4 and not compiler.stands_in and compiler.describe().startswith("XLA:CPU")


def test_auto_lowers_and_compiles_for_a_mesh_of_compile_only_tpu_devices(tpu_v5e_2x4):
    m = _mlp()
    step = shardplan.auto(m.fn, mesh=tpu_v5e_2x4, hardware="tpu-v5e",
                          state_argnums=m.state_argnums, batch_argnums=m.batch_argnums,
                          measure=False, cache=False)
    plan = step.plan(*m.args)
    compiled = step.lower(*m.args).compile()
    stats = hlo.analyze(compiled)
    assert stats.platform == "tpu"
    # the plan's input shardings are the compiled program's
    got = jax.tree_util.tree_leaves(compiled.input_shardings[0])
    want = jax.tree_util.tree_leaves(plan.in_shardings)
    assert [g.spec for g in got] == [w.spec for w in want]
    assert {d.platform for d in plan.device_mesh.devices.flat} == {"tpu"}


def test_measured_selection_on_cpu_devices_is_judged_by_the_tpu_compiler(mesh2x4):
    _needs_libtpu()
    m = _mlp()
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="tpu-v5e", measure=True, cache=False,
                          state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    plan = step.plan(*m.args)
    assert "the TPU compiler" in plan.compiled_by and "v5e:2x4" in plan.compiled_by
    assert plan.estimate_source == f"compiled by {plan.compiled_by}"
    compiled = [c for c in plan.candidates if c.stats is not None]
    assert len(compiled) >= 3 and all(c.stats.platform == "tpu" for c in compiled)
    assert any("measured (compiled by the TPU compiler" in n for n in plan.notes)
    # the plan still runs on the user's (CPU) devices
    assert plan.device_mesh is mesh2x4
    again = plan_from_dict(plan.to_dict())
    assert again.compiled_by == plan.compiled_by


def test_a_plan_over_hbm_is_never_said_to_fit(mesh2x4):
    """Under a budget the searched plan is compiled by the TPU compiler; a budget below what
    any plan needs leaves a plan that is not said to fit."""
    _needs_libtpu()
    m = _mlp()
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="tpu-v5e", cache=False,
                          memory_budget=64 * 1024, time_limit=8, deterministic=True,
                          grad_accumulation=1,  # the step as written: one program compiled
                          state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = step.plan(*m.args)
        except shardplan.InfeasibleMemory:
            return  # the model alone knew it cannot fit
    assert plan.fits() is False
    assert "the TPU compiler" in plan.compiled_by


def test_the_cli_names_the_tpu_compiler_and_rejects_a_slice_it_does_not_know(tmp_path, capsys,
                                                                               devices):
    _needs_libtpu()
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""\
        model: {name: mlp, size: tiny, batch_size: 256, overrides: {width: 256}}
        cluster: {hardware: tpu-v5e, mesh: {shape: [2, 4], axes: [data, model]}}
        search: {time_limit: 20, measure: false}
        output: {compare: false}
        """))
    assert main(["search", str(job), "--out", str(tmp_path / "out"), "--verify"]) == 0
    assert "compiled by the TPU compiler (libtpu" in capsys.readouterr().out
    job.write_text(job.read_text().replace("shape: [2, 4]", "shape: [3, 4]"))
    assert main(["search", str(job), "--out", str(tmp_path / "out2"), "--verify"]) == 2
    err = capsys.readouterr().err
    assert "12 tpu-v5e chips make no TPU slice" in err and "v5e:4x4" in err


def test_a_program_is_compiled_once(monkeypatch, mesh2x4):
    from shardplan.planning import compiled as compiled_mod

    calls = []
    real = compiled_mod.compile_for_analysis
    monkeypatch.setattr(compiled_mod, "compile_for_analysis", lambda low: calls.append(1) or real(low))
    lowered = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((64, 64), jnp.float32))
    assert compiled_mod.analyzed(lowered, mesh2x4) is compiled_mod.analyzed(lowered, mesh2x4)
    assert len(calls) == 1


def test_search_on_a_tpu_cluster_hands_back_the_compiled_programs(devices):
    """No devices but the TPU compiler: shardplan.search(cluster="tpu-v5e-16", measure=True)
    compiles every candidate for the v5e:4x4 slice; each holds its peak per chip and its
    collectives."""
    _needs_libtpu()
    m = _mlp()
    plan = shardplan.search(m.fn, *m.args, cluster="tpu-v5e-16", mesh_shape=(4, 4),
                            axis_names=("data", "model"), measure=True, time_limit=30,
                            deterministic=True,
                            state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    assert "v5e:4x4" in plan.compiled_by
    searched = plan.candidates[0]
    assert searched.name == "searched" and searched.stats.platform == "tpu"
    assert searched.stats.peak_bytes > 0 and searched.priced.peak_bytes == searched.stats.peak_bytes
    assert {c.stats.platform for c in plan.candidates if c.stats is not None} == {"tpu"}
    dp = next(c for c in plan.candidates if c.name == "data_parallel")
    assert any(op.kind == "all-reduce" and op.group_size == 16 for op in dp.stats.collectives)


def test_a_program_past_hbm_is_refused_and_never_said_to_fit(mesh2x4, monkeypatch):
    """The TPU compiler refuses a program past HBM (RESOURCE_EXHAUSTED); the compiled memory
    check then says the plan needs what the compiler said, over the budget, and warns."""
    _needs_libtpu()
    text = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
            "temporaries (35.16G) exceeds available HBM (15.75G).")
    assert targets.hbm_refusal(text) == (35.16 * 2**30, 15.75 * 2**30)
    assert targets.hbm_refusal("INTERNAL: something else (3.0G)") is None
    # its memory space assignment's refusal (Llama2-70B on v5e 16x16, libtpu 0.0.42.1)
    oom = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran "
           "out of memory in memory space hbm. Used 16.21G of 15.75G hbm. Exceeded hbm capacity "
           "by 470.13M.")
    assert targets.hbm_refusal(oom) == (16.21 * 2**30, 15.75 * 2**30)
    from shardplan.planning import compiled as compiled_mod

    def refuse(lowered):
        raise RuntimeError(text)

    monkeypatch.setattr(compiled_mod, "compile_for_analysis", refuse)
    monkeypatch.setattr(compiled_mod, "_COMPILED", {})
    m = _mlp()
    step = shardplan.auto(m.fn, mesh=mesh2x4, hardware="tpu-v5e", cache=False,
                          memory_budget="15GiB", time_limit=8, deterministic=True,
                          grad_accumulation=1,  # the step as written: one program compiled
                          state_argnums=m.state_argnums, batch_argnums=m.batch_argnums)
    with pytest.warns(UserWarning, match="refused each for want of memory"):
        plan = step.plan(*m.args)
    assert plan.fits() is False and plan.estimate.peak_bytes == 35.16 * 2**30
    assert any("refused for want of memory" in n for n in plan.notes)
