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


def _module_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (a TYPE_CHECKING block's
    and a try block's imports count; imports inside functions do not)."""
    import ast

    mods = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, p in mods.items():
        pkg = name if p.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.parse(p.read_text()).body:
            body = (node.body + node.orelse if isinstance(node, ast.If)
                    else node.body if isinstance(node, ast.Try) else [node])
            for s in body:
                if isinstance(s, ast.Import):
                    found |= {a.name for a in s.names}
                elif isinstance(s, ast.ImportFrom):
                    base = s.module or ""
                    if s.level:
                        up = pkg.split(".")[:len(pkg.split(".")) - (s.level - 1)]
                        base = ".".join(up + ([s.module] if s.module else []))
                    found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                              for a in s.names}
        graph[name] = {m for m in found if m in mods and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_round_a_cycle():
    """No import cycle between the package's modules at module level (import-linter's layer
    contracts order packages and layers; this checks every pair of modules)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = _module_imports()
    assert "shardplan.planning.driver" in graph["shardplan.api"]
    assert not _cycles(graph), _cycles(graph)


def test_no_module_is_over_450_lines():
    """Modules are split by concept before they grow past 450 lines."""
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
