"""The notebooks run top to bottom, and are committed without outputs.

Each notebook runs in a fresh `python3` kernel, which jupyter_client starts
with this interpreter (`sys.executable`), so it sees the same environment as
the tests. The kernel inherits this process's environment: it simulates 3 CPU
devices through `KERASMULTI_SIMULATE_DEVICES` (a GPU machine uses its GPUs),
and imports `kerasmulti` from this checkout.
"""

import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
SIMULATED_DEVICES = "3"


def _ids(path):
    return path.name


def _kernel_environment(monkeypatch):
    monkeypatch.setenv("KERASMULTI_SIMULATE_DEVICES", SIMULATED_DEVICES)
    pythonpath = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(ROOT)] + ([pythonpath] if pythonpath else []))
    )


def _execute(nb, path):
    from nbclient import NotebookClient

    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path)}},
    )
    return client.execute()


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks found in {ROOT / 'notebooks'}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids)
def test_notebook_outputs_are_stripped(notebook):
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{notebook.name}: code cells {dirty} hold outputs or execution counts; "
        "clear them before committing (e.g. `jupyter nbconvert --clear-output "
        f"--inplace notebooks/{notebook.name}`)"
    )


@pytest.mark.slow
def test_kernel_runs_this_python(tmp_path, monkeypatch):
    _kernel_environment(monkeypatch)
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell(
                "import os, sys\n"
                "print(sys.executable)\n"
                "print(os.environ['KERASMULTI_SIMULATE_DEVICES'])"
            )
        ]
    )
    _execute(nb, tmp_path)
    stdout = "".join(
        output.text
        for output in nb.cells[0].outputs
        if output.output_type == "stream" and output.name == "stdout"
    )
    executable, devices = stdout.split()
    assert os.path.samefile(executable, sys.executable)
    assert devices == SIMULATED_DEVICES


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids)
def test_notebook_runs(notebook, tmp_path, monkeypatch):
    _kernel_environment(monkeypatch)
    nb = nbformat.read(notebook, as_version=4)
    _execute(nb, tmp_path)
    errors = [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.outputs
        if output.output_type == "error"
    ]
    assert not errors, errors
