"""The zoo's plans at test size stay what they were (tests/golden, written by
tests/golden_plans.py): refactors must not change a plan; a change that means to must rewrite
the golden files and say why in its commit."""

import json

import pytest

from tests import golden_plans

CASES = [(model, mesh) for model in golden_plans.MODELS for mesh in sorted(golden_plans.MESHES)
         if (model, mesh) not in golden_plans.UNPROVEN]


@pytest.mark.parametrize(("model", "mesh"), CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_plan_matches_golden(model, mesh):
    want = json.loads(golden_plans.path(model, mesh).read_text())
    assert want["optimal"], "a golden plan must be proven optimal (else it depends on the load)"
    assert golden_plans.plan_specs(model, mesh) == want
