"""Runs the notebooks top to bottom and saves them with their outputs.

The notebooks are committed with their outputs, so that a reader sees the
results on a web page without running anything. After changing a notebook
(or what it shows), run it again and commit the result:

    python notebooks/execute.py                    # every notebook
    python notebooks/execute.py 02_checkpointing   # one of them

Each runs in a fresh kernel on 3 simulated CPU devices (a GPU machine uses its
GPUs), in a temporary folder, so nothing it writes stays behind. The saved
outputs are what the notebook's Python code printed and plotted: TensorFlow's
C++ start-up lines go to this script's terminal instead. The test
suite runs them again (`tests/test_notebooks.py`) and checks the saved
outputs: complete, in order, free of errors and of TensorFlow's log lines.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
SIMULATED_DEVICES = "3"


def execute(path: Path, folder: str) -> nbformat.NotebookNode:
    """The notebook at `path`, run in a fresh kernel with `folder` as its working directory."""
    os.environ["KERASMULTI_SIMULATE_DEVICES"] = SIMULATED_DEVICES
    root = str(HERE.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": folder}},
        # What Python prints, not TensorFlow's C++ start-up lines, which it
        # writes to the process's stderr before any setting can silence them.
        extra_arguments=["--IPKernelApp.capture_fd_output=False"],
    )
    client.execute()
    return notebook


def main(names: list[str]) -> int:
    paths = [HERE / f"{name.removesuffix('.ipynb')}.ipynb" for name in names] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="kerasmulti-notebook-") as folder:
            notebook = execute(path, folder)
        nbformat.write(notebook, path)
        print(f"  saved with outputs ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
