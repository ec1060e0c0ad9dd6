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
