"""The planning driver's choices beyond the shardings: gradient accumulation chosen where
memory binds (SearchOptions.grad_accumulation), planned and run equal to one device, kept in
plan files, and counted when no plan fits (shardplan.planning.driver)."""

import jax
import numpy as np
import pytest

import shardplan
from tests.test_accumulate import _activation_heavy


def _whole_and_accumulated(mesh, m):
    step, args = _activation_heavy()
    plans = [shardplan.auto(step, mesh=mesh, cache=False, grad_accumulation=k).plan(*args)
             for k in (1, m)]
    return step, args, plans


def _three_steps_equal(planned, step, args):
    single = jax.jit(step)
    a = b = args
    for _ in range(3):
        out_p, out_s = planned(*a), single(*b)
        np.testing.assert_allclose(np.asarray(out_p[2]), np.asarray(out_s[2]), rtol=2e-5)
        for x, y in zip(jax.tree.leaves(out_p[:2]), jax.tree.leaves(out_s[:2])):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
        a, b = (*out_p[:2], *args[2:]), (*out_s[:2], *args[2:])


def test_accumulation_is_chosen_where_memory_binds_and_runs_equal_to_one_device(mesh2x4):
    step, args, (whole, four) = _whole_and_accumulated(mesh2x4, 4)
    assert whole.grad_accumulation == 1 and four.grad_accumulation == 4
    assert four.estimate.peak_bytes < 0.6 * whole.estimate.peak_bytes
    budget = int(0.8 * whole.estimate.peak_bytes)  # the step as a whole does not fit
    planned = shardplan.auto(step, mesh=mesh2x4, cache=False, memory_budget=budget)
    plan = planned.plan(*args)
    assert plan.grad_accumulation > 1 and plan.fits(), (plan.grad_accumulation, plan.notes)
    assert any("gradients accumulated over" in n and "grad_accumulation='auto'" in n
               for n in plan.notes), plan.notes
    assert "gradients accumulated over" in plan.summary()
    _three_steps_equal(planned, step, args)


def test_without_a_binding_budget_the_step_runs_as_a_whole(mesh2x4):
    step, args = _activation_heavy()
    plan = shardplan.auto(step, mesh=mesh2x4, cache=False, memory_budget="1GiB").plan(*args)
    assert plan.grad_accumulation == 1
    # and the report says why (issue 31: what accumulation was chosen, and why)
    assert any(n.startswith("grad_accumulation='auto': not accumulated, the step as a whole "
                            "fits") for n in plan.notes)


def test_an_accumulated_plan_saved_and_adopted_runs_the_accumulated_step(mesh2x4, tmp_path):
    step, args = _activation_heavy()
    plan = shardplan.auto(step, mesh=mesh2x4, cache=False, grad_accumulation=2).plan(*args)
    plan.save(tmp_path / "plan.json")
    loaded = shardplan.load_plan(tmp_path / "plan.json")
    assert loaded.grad_accumulation == 2
    _three_steps_equal(shardplan.auto(step, mesh=mesh2x4, plan=loaded), step, args)


def test_search_without_devices_accumulates_as_asked():
    step, args = _activation_heavy()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    plans = [shardplan.search(step, *abstract, cluster="cpu", mesh_shape=(2, 4),
                              grad_accumulation=k) for k in (1, 4)]
    assert [p.grad_accumulation for p in plans] == [1, 4]
    assert plans[1].estimate.peak_bytes < 0.6 * plans[0].estimate.peak_bytes


def test_a_budget_no_plan_meets_names_the_least_memory_counting_accumulation():
    step, args = _activation_heavy()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    with pytest.raises(shardplan.InfeasibleMemory) as e:
        shardplan.search(step, *abstract, cluster="cpu", mesh_shape=(2, 4),
                         memory_budget=2**10)
    notes = " ".join(getattr(e.value, "__notes__", []))
    assert "gradients accumulated over" in notes and "micro-batches" in notes, notes
    whole = shardplan.search(step, *abstract, cluster="cpu", mesh_shape=(2, 4))
    assert e.value.min_bytes < whole.estimate.peak_bytes


def test_grad_accumulation_is_checked_when_made():
    with pytest.raises(ValueError, match="grad_accumulation=0"):
        shardplan.SearchOptions(grad_accumulation=0)
    with pytest.raises(ValueError, match="pipeline"):
        shardplan.SearchOptions(grad_accumulation=2, pipeline=True)


def test_the_step_as_a_whole_is_bounded_at_once_where_a_rematerialized_step_follows(
        monkeypatch):
    """remat='auto': the step as written is only bounded when it does not fit (its least
    memory is searched for only where nothing else is left to plan: the search took the
    whole time limit of a Llama 7B on 16 chips, benchmarks/plan_at_size.py)."""
    from shardplan.intra.solve import least_memory
    from tests.test_remat import BUDGET, mlp_args, mlp_step

    real, calls = least_memory.least, []
    monkeypatch.setattr(least_memory, "least", lambda inp: calls.append(1) or real(inp))
    kw = {"cluster": "cpu-8", "time_limit": 20, "deterministic": True, "memory_budget": BUDGET}
    plan = shardplan.search(mlp_step, *mlp_args(), **kw)  # remat="auto"
    assert plan.remat and plan.fits() and not calls
    with pytest.raises(shardplan.InfeasibleMemory) as e:
        shardplan.search(mlp_step, *mlp_args(), remat=False, grad_accumulation=1, **kw)
    assert calls and e.value.exact  # nothing else to plan: the least is searched for
    # accumulation, where it may be chosen, fits the step as written
    assert shardplan.search(mlp_step, *mlp_args(), remat=False, **kw).grad_accumulation > 1


def test_a_zoo_step_written_with_jax_value_and_grad_accumulates_where_memory_binds():
    """The zoo's steps take their gradient with jax.value_and_grad: accumulation is a choice
    for them too (shardplan.grad.routing_jax_gradients), chosen where the step as a whole
    does not fit."""
    from shardplan.models import get_model

    m = get_model("gpt", "tiny", abstract=True, batch_size=256, seq_len=64, dropout_rate=0.0)
    kw = {"cluster": "cpu", "mesh_shape": (2, 4), "time_limit": 20, "deterministic": True,
          "state_argnums": m.state_argnums, "batch_argnums": m.batch_argnums}
    whole = shardplan.search(m.fn, *m.args, grad_accumulation=1, **kw)
    plan = shardplan.search(m.fn, *m.args, memory_budget=int(0.8 * whole.estimate.peak_bytes),
                            **kw)
    assert plan.grad_accumulation > 1 and plan.fits(), (plan.grad_accumulation, plan.notes)
