"""The notebooks: each runs top to bottom on 8 CPU devices, and none is committed with outputs;
their setup cells, one code for all, install shardplan from wherever the repository lives.
How long they take depends on the machine's load, so no verdict does: a cell that runs past
CELL_TIMEOUT_S is taken for a hang."""

import ast
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import types

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 900
# The repository's address is not known to the notebooks: a link naming its owner is a placeholder.
PLACEHOLDER = re.compile(r"OWNER|github\.com/[^/\s\"']+/shardplan|github/[^/\s\"']+/shardplan")


def execute(nb, cwd: pathlib.Path, timeout: float = CELL_TIMEOUT_S):
    """Run every cell in a fresh kernel of this interpreter (its ipykernel) in `cwd`. The
    kernel inherits this process's environment, JAX_PLATFORMS=cpu from conftest among it,
    so the notebooks' setup cells choose 8 CPU devices."""
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def test_there_are_notebooks():
    assert NAMES == ["01_quickstart.ipynb", "02_bring_your_model.ipynb", "03_pipelines.ipynb",
                     "04_cli_and_reports.ipynb"]


def test_the_kernel_is_this_interpreter(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import sys, os; print(sys.executable); print(os.getcwd())")])
    out = execute(nb, tmp_path, timeout=60).cells[0].outputs[0]["text"].split()
    assert out == [sys.executable, str(tmp_path)]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_clean(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
             and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"{name}: cells {dirty} hold outputs or execution counts; clear them "
                       "(Jupyter: Edit > Clear All Outputs) before committing")
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "File > Open notebook" in first.source \
        and "SHARDPLAN_SOURCE" in first.source, \
        f"{name}: the first cell says how to open it in Colab and what to set in the setup cell"
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in setup_cell(name), \
        f"{name}: the first code cell sets up 8 CPU devices when there is no accelerator"


def setup_cell(name: str) -> str:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    return next(c for c in nb.cells if c.cell_type == "code").source


@pytest.mark.parametrize("name", NAMES)
def test_no_placeholder_owner(name):
    text = (NOTEBOOKS / name).read_text()
    assert not PLACEHOLDER.findall(text), \
        f"{name} names a placeholder for the repository's owner: {PLACEHOLDER.findall(text)}"


@pytest.mark.parametrize("name", NAMES)
def test_setup_cell_opens_with_the_source_to_set(name):
    code = [line for line in setup_cell(name).splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert code[0] == 'SHARDPLAN_SOURCE = ""', f"{name}: the setup cell's first line is {code[0]!r}"


def test_setup_cells_are_identical():
    cells = {name: setup_cell(name) for name in NAMES}
    differ = [name for name in NAMES if cells[name] != cells[NAMES[0]]]
    assert not differ, f"the setup cells of {differ} differ from {NAMES[0]}'s: keep them one code"


@pytest.fixture
def setup_ns():
    """The setup cell's imports and functions, run in a namespace of their own: what the cell
    would install from, without installing anything or starting JAX."""
    tree = ast.parse(setup_cell(NAMES[0]))
    keep = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom | ast.FunctionDef)]
    ns: dict = {}
    code = compile(ast.Module(body=keep, type_ignores=[]), "setup cell", "exec")
    exec(code, ns)  # noqa: S102 - the cell's own code, as written
    return ns


def checkout(folder: pathlib.Path, name: str = "shardplan") -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0"\n')
    return folder


def test_setup_source_explicit_wins(setup_ns, tmp_path, monkeypatch):
    repo = checkout(tmp_path / "repo")
    (repo / "shardplan-0.1.0-py3-none-any.whl").write_text("")
    choose = setup_ns["shardplan_source"]
    assert choose("git+ssh://example/shardplan", cwd=repo, uploads=repo) \
        == "git+ssh://example/shardplan"
    monkeypatch.chdir(tmp_path)  # a relative path is made absolute: pip must not read it as a name
    assert choose("repo", cwd=repo, uploads=repo) == str(repo)


def test_setup_source_finds_a_checkout_walking_up(setup_ns, tmp_path):
    repo = checkout(tmp_path / "repo")
    checkout(repo / "notebooks", name="not-shardplan")  # another project's pyproject: passed by
    (repo / "notebooks" / "shardplan-0.1.0-py3-none-any.whl").write_text("")
    cwd = repo / "notebooks" / "work"
    cwd.mkdir()
    assert setup_ns["shardplan_source"]("", cwd=cwd, uploads=tmp_path / "none") == str(repo)


def test_setup_source_finds_the_newest_wheel(setup_ns, tmp_path):
    here, uploads = tmp_path / "here", tmp_path / "content"
    here.mkdir()
    uploads.mkdir()
    old = here / "shardplan-0.1.0-py3-none-any.whl"
    new = uploads / "shardplan-0.2.0-py3-none-any.whl"
    (here / "other-1.0-py3-none-any.whl").write_text("")
    for age, wheel in enumerate((new, old)):
        wheel.write_text("")
        os.utime(wheel, (1e9 - age, 1e9 - age))
    assert setup_ns["shardplan_source"]("", cwd=here, uploads=uploads) == str(new)
    new.unlink()
    assert setup_ns["shardplan_source"]("", cwd=here, uploads=uploads) == str(old)


def test_setup_source_none_says_what_to_set(setup_ns, tmp_path):
    with pytest.raises(RuntimeError, match="shardplan is not installed.*set SHARDPLAN_SOURCE"):
        setup_ns["shardplan_source"]("", cwd=tmp_path, uploads=tmp_path / "none")


def test_setup_install_pins_the_runtimes_jax(setup_ns):
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "Collecting jax\n", "ERROR: no match")

    setup_ns["subprocess"] = types.SimpleNamespace(run=run)
    jax_pin = f"jax=={importlib.metadata.version('jax')}"
    with pytest.raises(RuntimeError) as e:
        setup_ns["install_shardplan"]("/wheels/shardplan-0.1.0-py3-none-any.whl")
    assert calls == [[sys.executable, "-m", "pip", "install", "-q",
                      "/wheels/shardplan-0.1.0-py3-none-any.whl", jax_pin,
                      f"jaxlib=={importlib.metadata.version('jaxlib')}"]]
    message = str(e.value)
    assert jax_pin in message and "pyproject.toml" in message, message
    assert message.endswith("pip's last lines:\nCollecting jax\nERROR: no match"), message


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_on_cpu_devices(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    execute(nb, tmp_path)
    setup_output = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "8 devices" in setup_output, setup_output
