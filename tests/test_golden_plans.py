"""The zoo's plans at test size stay what they were (tests/golden, written by
tests/golden_plans.py, keyed by path): refactors must not change a plan; a change that means
to must rewrite the golden files and say why in its commit. The solves are limited by their
work, not the wall clock, so the verdict is the same at any load."""

import json

import jax
import pytest

from tests import golden_plans

CASES = [(model, mesh) for model in golden_plans.MODELS for mesh in sorted(golden_plans.MESHES)]


@pytest.mark.skipif(jax.__version__ != golden_plans.JAX,
                    reason=f"the goldens are planned with jax {golden_plans.JAX}: another jax's "
                           "graphs break ties among layouts of equal cost differently")
@pytest.mark.parametrize(("model", "mesh"), CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_plan_matches_golden(model, mesh):
    want = json.loads(golden_plans.path(model, mesh).read_text())
    assert want["optimal"], "a golden plan is one the solver proves optimal"
    got = golden_plans.plan_specs(model, mesh)
    changed = {g: sorted((k, want[g].get(k), got[g].get(k)) for k in want[g].keys() | got[g]
                         if want[g].get(k) != got[g].get(k))
               for g in ("inputs", "outputs", "constraints")}
    assert got == want, {g: c[:10] for g, c in changed.items() if c}  # (path, golden, now)


def test_golden_files_are_written_as_the_writer_writes_them():
    """One spec a line, in the writer's order: a rewrite's diff shows only what changed."""
    for model, mesh in CASES:
        text = golden_plans.path(model, mesh).read_text()
        assert golden_plans.dumps(json.loads(text)) == text, golden_plans.path(model, mesh)
