"""Every public docstring's example runs as written.

Each example runs in a fresh Python process, in an empty folder, on 2
simulated devices (as a reader without GPUs would run it), and must exit 0.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import inspect
import os
import re
import subprocess
import sys

import pytest

import kerasmulti

pytestmark = pytest.mark.slow


def _examples():
    for name in sorted(kerasmulti.__all__):
        doc = inspect.getdoc(getattr(kerasmulti, name)) or ""
        for k, code in enumerate(re.findall(r"```python\n(.*?)```", doc.split("Example:", 1)[-1], re.S)):
            yield pytest.param(code, id=f"{name}-{k}")


def test_every_public_name_has_an_example_to_run():
    names = {param.id.rsplit("-", 1)[0] for param in _examples()}
    assert names == set(kerasmulti.__all__)


@pytest.mark.parametrize("code", _examples())
def test_example_runs_as_written(code, tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERASMULTI_SIMULATE_DEVICES": "2"}
    env.pop("TF_CONFIG", None)
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, f"{code}\n---\n{result.stderr[-3000:]}"
