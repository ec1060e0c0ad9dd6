"""docs/architecture.md draws the house: every module it names in its layer drawing exists,
and every module of the package is in the drawing (a module added or moved fails here until
the drawing says where it sits)."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shardplan"


def _drawing() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## The layers")
    block = text[start:].split("```")[1]
    return block


def _named() -> tuple[set[str], set[str]]:
    """(file names `x.py`, packages `x/` or `x/y/` from the package's root) the drawing
    names."""
    block = _drawing()
    files = set(re.findall(r"\b([a-z_0-9]+\.py)\b", block))
    packages = {p.rstrip("/") for p in re.findall(r"(?<![\w./])((?:[a-z_0-9]+/)+)", block)}
    return files, packages


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.name != "__init__.py" and "gpu_specs" not in p.parts)


def test_every_module_is_in_the_drawing():
    files, packages = _named()
    missing = [str(p.relative_to(PACKAGE)) for p in _modules() if p.name not in files]
    assert not missing, f"docs/architecture.md's layers do not name: {missing}"
    subpackages = {str(p.parent.relative_to(PACKAGE)) for p in PACKAGE.rglob("*/__init__.py")
                   if "gpu_specs" not in p.parts}
    assert subpackages <= packages, sorted(subpackages - packages)


def test_every_module_the_drawing_names_exists():
    files, packages = _named()
    have = {p.name for p in _modules()}
    assert files <= have, sorted(files - have)
    for name in packages:
        assert (PACKAGE / name / "__init__.py").exists(), name


def test_the_memory_budget_walks_from_auto_to_the_solver_through_six_modules(monkeypatch):
    """The walk docs/architecture.md draws: `auto`'s budget reaches the ILP solver
    (intra.solve.ilp.solve) through at most 6 modules of the package, none entered twice
    apart, and it is held by one options type (SearchOptions) on the way."""
    import dataclasses
    import importlib
    import inspect

    import jax
    import jax.numpy as jnp

    import shardplan
    from shardplan.intra.solve import ilp

    stacks = []
    solve = ilp.solve

    def spy(inp, *args, **kwargs):
        if inp.memory_budget is not None and not stacks:
            stacks.append([pathlib.Path(f.filename).resolve() for f in inspect.stack()])
        return solve(inp, *args, **kwargs)

    monkeypatch.setattr(ilp, "solve", spy)

    def step(w, x):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g

    mesh = jax.make_mesh((2, 4), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardplan.auto(step, mesh=mesh, memory_budget="1GiB", cache=False, time_limit=10,
                   deterministic=True).plan(jnp.ones((64, 32)), jnp.ones((16, 64)))
    assert stacks, "the solver was never given the budget"
    walk = [str(p.relative_to(PACKAGE)) for p in reversed(stacks[0])
            if p.is_relative_to(PACKAGE) and p.parent.name != "tests"]
    walk = walk[walk.index("api.py"):]  # the spy stands where ilp.solve is called
    modules = list(dict.fromkeys(walk))  # in order, each once
    assert len(modules) <= 6 and modules[-1] == "intra/planner.py", modules
    entered = [m for i, m in enumerate(walk) if i == 0 or walk[i - 1] != m]
    assert len(entered) == len(modules), f"a module is entered twice on the walk: {entered}"

    holders = []
    for path in _modules():
        name = "shardplan." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for cls_name, cls in vars(importlib.import_module(name)).items():
            if (cls_name.endswith("Options") and dataclasses.is_dataclass(cls)
                    and cls.__module__ == name
                    and "memory_budget" in {f.name for f in dataclasses.fields(cls)}):
                holders.append(cls_name)
    assert holders == ["SearchOptions"], holders
