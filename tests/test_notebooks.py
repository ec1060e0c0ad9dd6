"""The notebooks: each runs top to bottom on 8 CPU devices, and none is committed with outputs.
How long they take depends on the machine's load, so no verdict does: a cell that runs past
CELL_TIMEOUT_S is taken for a hang."""

import pathlib
import sys

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
CELL_TIMEOUT_S = 900
COLAB = "https://colab.research.google.com/github/OWNER/shardplan/blob/main/notebooks/"


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
    assert first.cell_type == "markdown" and COLAB + name in first.source, \
        f"{name} must open with an 'Open in Colab' link to {COLAB + name}"
    setup = next(c for c in nb.cells if c.cell_type == "code").source
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in setup, \
        f"{name}: the first code cell sets up 8 CPU devices when there is no accelerator"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_on_cpu_devices(name, tmp_path):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    execute(nb, tmp_path)
    setup_output = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "8 devices" in setup_output, setup_output
