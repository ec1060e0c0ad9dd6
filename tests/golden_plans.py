"""Write (or compare with) the golden plans of the zoo at test size: the PartitionSpec of every
input, output and constrained value of `search(measure=False)` on 8 and 2x4 devices, keyed by
path as MaxText's named_shardings.json, one entry a line, so that a changed plan reads in a diff:

    "inputs":      {"0/layer_0/attn/qkv/kernel": [null, "model"], ...}   argument index first
    "outputs":     {"2": [], ...}                                         the step's outputs
    "constraints": {"jvp(Gpt)/layer_0/attn/dot_general#1": ["data", null, "model"], ...}

A dimension is null (whole), an axis name, or a list of axis names; a constrained value is
named by the scope and primitive of the equation that makes it (`#k`: its k-th such equation,
`:i`: its i-th output). The solves are limited by their work (SearchOptions.deterministic), so
a plan is the same at any load.

    python tests/golden_plans.py [model ...]   # rewrite tests/golden/*.json
"""

from __future__ import annotations

import collections
import json
import pathlib
import sys

MESHES = {"8": ((8,), ("devices",)), "2x4": ((2, 4), ("data", "model"))}
MODELS = ("bert", "gpt", "llama", "mlp", "moe", "vit", "wresnet")
GOLDEN = pathlib.Path(__file__).parent / "golden"
# Deterministic seconds of work per solve (SearchOptions.time_limit when deterministic).
WORK_S = 30.0
# The jax the goldens are planned with (the CI's Python 3.11 leg): another jax lifts slightly
# other graphs (jax 0.12 inlines jit-of-jit and rewrites tanh's backward), whose ties among
# layouts of equal cost break differently.
JAX = "0.10.2"


def spec_entries(spec) -> list:
    """A ShardSpec as PartitionSpec entries: per dimension None, an axis, or a list of axes."""
    assert not spec.partial, f"a plan's spec is never a partial sum: {spec}"
    return [None if not d else d[0] if len(d) == 1 else list(d) for d in spec.dims]


def leaf_paths(tree) -> list[str]:
    """The '/'-joined path of every leaf of `tree`, argument (or output) index first."""
    import jax

    from shardplan.options import path_str

    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def value_names(graph) -> dict[int, str]:
    """{value id: the scope and primitive of the equation that makes it, `#k` for its k-th
    such equation, `:i` for its i-th output where it has several}."""
    seen: collections.Counter = collections.Counter()
    names = {}
    for node in graph.nodes:
        base = f"{node.name}/{node.primitive}" if node.name else node.primitive
        k = seen[base]
        seen[base] += 1
        name = f"{base}#{k}" if k else base
        for i, v in enumerate(node.outputs):
            names[v] = f"{name}:{i}" if len(node.outputs) > 1 else name
    return names


def names_of(model: str) -> tuple[list[str], list[str], dict[int, str]]:
    """(input paths, output paths, constrained value names) of the zoo model's step."""
    import jax

    from shardplan import models
    from shardplan.ir.lift import lift
    from shardplan.ir.trace import trace

    step = models.get_model(model, abstract=True)
    traced = trace(step.fn, step.args, step.state_argnums, step.batch_argnums)
    graph = lift(traced.closed_jaxpr, traced.arg_info)
    return (leaf_paths(step.args), leaf_paths(jax.eval_shape(step.fn, *step.args)),
            value_names(graph))


def keyed(names, specs) -> dict[str, list]:
    names = list(names)
    assert len(names) == len(specs) and len(set(names)) == len(names), "paths must be unique"
    return dict(zip(names, (spec_entries(s) for s in specs)))


def plan_specs(model: str, mesh: str) -> dict:
    """The golden entry of `model`'s plan on `mesh`, planned now."""
    import shardplan
    from shardplan import models

    step = models.get_model(model, abstract=True)
    shape, axes = MESHES[mesh]
    plan = shardplan.search(step.fn, *step.args, cluster="cpu", mesh_shape=shape,
                            axis_names=axes, state_argnums=step.state_argnums,
                            batch_argnums=step.batch_argnums, time_limit=WORK_S,
                            deterministic=True)
    inputs, outputs, values = names_of(model)
    constrained = sorted(plan.constraints)
    return {"optimal": "(optimal)" in plan.solver,
            "inputs": keyed(inputs, plan.input_specs),
            "outputs": keyed(outputs, plan.output_specs),
            "constraints": keyed((values.get(v, f"value {v}") for v in constrained),
                                 [plan.constraints[v] for v in constrained])}


def dumps(entry: dict) -> str:
    """`entry` as JSON with one spec a line (a diff shows each spec that changed)."""
    lines = ["{", f' "optimal": {json.dumps(entry["optimal"])},']
    groups = ("inputs", "outputs", "constraints")
    for g in groups:
        items = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in entry[g].items()]
        lines.append(f' "{g}": {{' + ("\n" + ",\n".join(items) + "\n }" if items else "}")
                     + ("," if g != groups[-1] else ""))
    return "\n".join(lines) + "\n}\n"


def path(model: str, mesh: str) -> pathlib.Path:
    return GOLDEN / f"{model}-{mesh}.json"


if __name__ == "__main__":
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    GOLDEN.mkdir(exist_ok=True)
    for model in (sys.argv[1:] or MODELS):
        for mesh in MESHES:
            specs = plan_specs(model, mesh)
            path(model, mesh).write_text(dumps(specs))
            print("wrote", path(model, mesh), "" if specs["optimal"] else "NOT PROVEN OPTIMAL")
