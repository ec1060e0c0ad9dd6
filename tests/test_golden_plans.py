"""The zoo's plans at test size stay what they were (tests/golden, written by
tests/golden_plans.py): refactors must not change a plan; a change that means to must rewrite
the golden files and say why in its commit."""

import json

import pytest

from tests import golden_plans


@pytest.mark.parametrize("mesh", sorted(golden_plans.MESHES))
@pytest.mark.parametrize("model", golden_plans.MODELS)
def test_plan_matches_golden(model, mesh):
    want = json.loads(golden_plans.path(model, mesh).read_text())
    assert golden_plans.plan_specs(model, mesh) == want
