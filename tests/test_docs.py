"""The docs: the generated references match the code, and every relative link in the README,
docs/ and the notebooks points at a file (and heading) inside the repository."""

import importlib.util
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# written in another branch; links to it may dangle until it lands
PENDING = {DOCS / "architecture.md"}


def _load(name):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_generated_from_the_docstrings():
    gen = _load("gen_api")
    assert (DOCS / "api.md").read_text() == gen.render(), \
        "docs/api.md is stale: run `python docs/gen_api.py` and commit it"


def test_api_reference_covers_the_public_surface():
    import shardplan

    text = (DOCS / "api.md").read_text()
    for name in shardplan.__all__:
        assert f"`shardplan.{name}`" in text, name


def test_cli_reference_is_generated_from_the_schema_and_the_parser():
    gen = _load("gen_cli")
    current = (DOCS / "cli.md").read_text()
    assert current == gen.render(current), \
        "docs/cli.md is stale: run `python docs/gen_cli.py` and commit it"


def test_cli_reference_lists_every_config_key():
    from shardplan.config import Config

    text = (DOCS / "cli.md").read_text()
    gen = _load("gen_cli")
    for key, cls in gen._sections(Config, ""):
        for name, field in cls.model_fields.items():
            if not field.exclude:
                dotted = f"{key}.{name}" if key else name
                assert f"| `{dotted}` |" in text, dotted


def _markdown_sources():
    """(path, markdown text) of the README, every doc and every notebook's markdown cells."""
    yield ROOT / "README.md", (ROOT / "README.md").read_text()
    for path in sorted(DOCS.glob("*.md")):
        yield path, path.read_text()
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        yield path, "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def _anchors(text: str) -> set[str]:
    """The ids GitHub gives the headings of a Markdown file (repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links():
    for path, text in _markdown_sources():
        text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold no links
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+:", target):  # relative links only
                yield path, target


@pytest.mark.parametrize("source,target", [(str(p.relative_to(ROOT)), t) for p, t in _links()])
def test_relative_link_resolves_inside_the_repository(source, target):
    base = (ROOT / source).parent
    file_part, _, anchor = target.partition("#")
    dest = (base / file_part).resolve() if file_part else (ROOT / source)
    assert dest == ROOT or ROOT in dest.parents, f"{source} links outside the repository: {target}"
    if dest in PENDING and not dest.exists():
        return
    assert dest.exists(), f"{source}: broken link {target}"
    if anchor and dest.suffix == ".md":
        assert anchor in _anchors(dest.read_text()), f"{source}: no heading #{anchor} in {dest.name}"


def test_readme_points_to_nothing_outside_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "shared/" not in text and "../" not in text
    for target in ("docs/", "notebooks/"):
        assert f"]({target}" in text, f"the README links to {target}"


def test_colab_links_name_their_notebook_and_no_other_host():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        text = path.read_text()
        hosts = set(re.findall(r"https?://([^/\s\"')]+)", text))
        assert hosts <= {"colab.research.google.com", "github.com"}, (path.name, hosts)
        assert f"github/OWNER/shardplan/blob/main/notebooks/{path.name}" in text, path.name
