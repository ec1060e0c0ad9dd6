"""Coverage of the zoo: no primitive of a zoo model runs replicated unless the primitive table
says why (issue 32). Run under each jax of CI: the primitives a step traces to change with
the version (jax 0.12 has primitives of its own: primitives.NEW_NAMES)."""

import dataclasses

import pytest

import shardplan
from shardplan.models import get_config, get_model, list_models, list_sizes


def _cases():
    """(model, overrides) for every zoo model at its smallest size, in f32 and, where its
    config has a compute dtype, in bf16 (converts around every bf16 op); gpt, llama and moe
    also with scanned layers (the lifter's loop entry and exit)."""
    out = []
    for name in list_models():
        fields = {f.name for f in dataclasses.fields(get_config(name, list_sizes(name)[0]))}
        dtypes = ("float32", "bfloat16") if "dtype" in fields else ("float32",)
        out += [(name, {"dtype": d} if "dtype" in fields else {}) for d in dtypes]
    out += [("gpt", {"scan_layers": True}), ("llama", {"scan_layers": True}),
            ("moe", {"scan_layers": True, "moe_every": 1}),
            ("gpt", {"scan_layers": True, "dtype": "bfloat16"})]
    return out


@pytest.mark.parametrize(("name", "overrides"), _cases(),
                         ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_zoo_runs_nothing_replicated_unintended(name, overrides):
    step = get_model(name, list_sizes(name)[0], abstract=True, **overrides)
    cov = shardplan.coverage(step.fn, *step.args)
    assert cov.num_nodes > 0
    assert cov.unintended == (), str(cov)
