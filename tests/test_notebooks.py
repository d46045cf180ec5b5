"""The notebooks run top to bottom, and are committed with their outputs.

Each notebook runs in a fresh `python3` kernel, which jupyter_client starts
with this interpreter (`sys.executable`), so it sees the same environment as
the tests. The kernel inherits this process's environment: it simulates 3 CPU
devices through `KERASMULTI_SIMULATE_DEVICES` (a GPU machine uses its GPUs),
and imports `kerasmulti` from this checkout.
"""

import os
import re
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


# TensorFlow's C++ log lines (I0000 ..., oneDNN, CUDA probing): noise on a web page.
LOG_LINE = re.compile(r"^[IWE]\d{4} |oneDNN|cuInit|absl::InitializeLog|INFO:tensorflow:", re.M)
MAX_BYTES = 400_000


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids)
def test_notebook_is_committed_with_its_outputs(notebook):
    nb = nbformat.read(notebook, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert counts == list(range(1, len(code) + 1)), (
        f"{notebook.name}: not run top to bottom in one kernel (execution counts {counts}); "
        f"run `python notebooks/execute.py {notebook.stem}` and commit it"
    )
    assert any(cell.outputs for cell in code), f"{notebook.name} holds no outputs"
    outputs = [output for cell in code for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"], f"{notebook.name} saved an error"
    noise = [o.text for o in outputs if o.output_type == "stream" and LOG_LINE.search(o.text)]
    assert not noise, f"{notebook.name} shows TensorFlow log lines: {noise[0][:300]}"
    assert notebook.stat().st_size < MAX_BYTES, f"{notebook.name} is {notebook.stat().st_size} bytes"


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
    if "multi_worker" in notebook.name:
        from simulated import NEEDS_CLUSTER

        if NEEDS_CLUSTER.args[0]:
            pytest.skip(NEEDS_CLUSTER.kwargs["reason"])
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
