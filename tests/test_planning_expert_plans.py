"""The expert plans as Plans of the job's step (shardplan.planning.expert_plans): MaxText's
configuration is FSDP over the mesh with the scanned layers rematerialized, written for a
step with scanned layers only, and it runs to the single-device numbers."""

import dataclasses

import jax
import numpy as np
import pytest

import shardplan
from shardplan.cost.hardware import get_profile
from shardplan.intra import experts
from shardplan.ir.trace import trace
from shardplan.models import get_model
from shardplan.options import SearchOptions
from shardplan.planning import remat
from shardplan.planning.expert_plans import MAXTEXT, _written, expert_plans
from shardplan.planning.intra_op import plan_graph
from shardplan.planning.job import Job
from shardplan.strategies.spec import MeshShape
from shardplan.units import Deadline

# the step of a few hundred KB a chip that the TPU would hold in VMEM whole
# (intra/memory/fast_memory.py), which the ILP's rows keep: a budget set from the estimate
# would be one no layout meets
V5E = dataclasses.replace(get_profile("tpu-v5e"), fast_memory_bytes=0)


def _job(model, mesh):
    traced = trace(model.fn, model.args, model.state_argnums, model.batch_argnums)
    return Job.make(traced, MeshShape.of(mesh), V5E, SearchOptions(deterministic=True))


@pytest.fixture(scope="module")
def scanned():
    return get_model("llama", "tiny", batch_size=8, scan_layers=True, remat=False,
                     optimizer="sgd", num_kv_heads=4)


def test_maxtext_is_fsdp_of_the_rematerialized_step_and_runs_like_one_device(scanned, mesh2x4):
    job = _job(scanned, mesh2x4)
    plan, _ = plan_graph(job)
    written = expert_plans(job, plan, deadline=Deadline(60))
    mx = written[MAXTEXT]
    assert mx.remat and not written["fsdp"].remat
    assert mx.input_specs == written["fsdp"].input_specs  # FSDP over the whole mesh
    assert any(s.num_shards(mx.mesh) == 8 for s in mx.input_specs)
    assert any("MaxText's configuration" in n for n in mx.notes), mx.notes
    own = remat.job_for(mx, job)
    assert own.traced.remat is not None and own.traced is job.traced.rematerialized
    step = shardplan.auto(scanned.fn, mesh=mesh2x4, plan=mx, cache=False)
    want = jax.jit(scanned.fn)(*scanned.args)
    got = step(*scanned.args)
    np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5)
    old = jax.tree.leaves(scanned.args[:2])
    for g, w, o in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), old):
        np.testing.assert_allclose(np.asarray(g) - o, np.asarray(w) - o, rtol=1e-3, atol=1e-6)


def test_maxtext_needs_scanned_layers(mesh2x4):
    unrolled = get_model("llama", "tiny", batch_size=8, optimizer="sgd")
    job = _job(unrolled, mesh2x4)
    plan, _ = plan_graph(job)
    assert MAXTEXT not in expert_plans(job, plan, complete=False)


def test_an_expert_over_the_budget_is_laid_out_again_under_it(scanned, mesh2x4):
    # completed without a budget, then (needing more than the budget) again under it: the
    # expert's inputs kept, the rest laid out to fit, as MaxText's FSDP gathers each layer's
    # weights in the scan where the unbudgeted completion of Llama2-70B gathered them all
    job = _job(scanned, mesh2x4)
    plan, _ = plan_graph(job)
    fsdp = experts.expert_inputs(job.graph, plan.mesh)["fsdp"]
    free = _written(job, plan, "fsdp", fsdp, True, Deadline(60))
    budget = 0.9 * free.estimate.peak_bytes
    tight = job.replace(options=job.options.replace(memory_budget=budget))
    fitted = _written(tight, plan, "fsdp", fsdp, True, Deadline(60))
    assert fitted.input_specs == free.input_specs
    assert fitted.estimate.peak_bytes <= budget < free.estimate.peak_bytes
