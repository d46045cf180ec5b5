"""The public API is frozen and documented."""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import inspect
import os
import subprocess
import sys

import pytest

import kerasmulti

PUBLIC = [
    "ClusterError",
    "DeviceError",
    "LaunchError",
    "OnDevice",
    "ParallelBackupAndRestore",
    "ParallelModel",
    "ParallelModelCheckpoint",
    "PipelineModel",
    "PlacementSummary",
    "available_devices",
    "device_scope",
    "initialize",
    "is_chief",
    "launch",
    "load_model",
    "on_device",
    "parallel_predict",
    "pipeline",
    "parallelize",
    "placement_summary",
    "remap_devices",
    "simulate_devices",
    "strip_placement",
    "ThroughputMonitor",
    "unwrap",
]


def test_all_is_frozen():
    assert sorted(kerasmulti.__all__) == sorted(PUBLIC)


def test_every_public_name_has_a_docstring_with_an_example():
    for name in PUBLIC:
        obj = getattr(kerasmulti, name)
        doc = inspect.getdoc(obj) or ""
        assert doc, f"{name} has no docstring"
        assert "Example:" in doc, f"{name}'s docstring has no Example"


def test_every_public_name_is_loaded_from_the_module_named_for_it():
    for name in PUBLIC:
        obj = getattr(kerasmulti, name)
        assert obj.__module__ == kerasmulti._PUBLIC[name], name
    assert sorted(dir(kerasmulti)) == sorted(set(dir(kerasmulti)) | set(PUBLIC))
    with pytest.raises(AttributeError, match="has no attribute 'parallelise'"):
        kerasmulti.parallelise


_IMPORT_CHECK = """
import os, sys
import keras
from keras.src.saving import saving_lib
before = (saving_lib.save_model, saving_lib.load_model, saving_lib.load_weights_only, keras.models.load_model)
import kerasmulti
kerasmulti.parallelize  # the public names load, and with them TensorFlow
after = (saving_lib.save_model, saving_lib.load_model, saving_lib.load_weights_only, keras.models.load_model)
print(before == after, os.environ.get("TF_CPP_MIN_LOG_LEVEL"), "kerasmulti._src.model_parallel.portable" in sys.modules)
"""


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_importing_kerasmulti_changes_nothing_in_keras_or_the_process():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CPP", "KERASMULTI"))}
    result = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "None", "False"]


def test_importing_kerasmulti_without_the_environment_variables_loads_no_tensorflow():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERASMULTI")}
    script = "import sys, kerasmulti; print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "False"]


@pytest.mark.slow
def test_keras_on_another_backend_is_refused_with_a_clear_error():
    # jax and torch are not installed here: Keras is made to report another backend.
    script = (
        "import keras; keras.backend.backend = lambda: 'jax'\n"
        "import kerasmulti\n"
        "try:\n    kerasmulti.parallelize\nexcept ImportError as error:\n    print(error)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kerasmulti runs Keras on TensorFlow, but Keras uses another backend. Set KERAS_BACKEND=tensorflow" in result.stdout
    assert result.stdout.strip().endswith("Received: backend='jax'")


@pytest.mark.slow
def test_the_command_runs_keras_on_tensorflow_whatever_the_users_default(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    script = "import os, sys; sys.argv = ['kerasmulti', 'devices']; from kerasmulti.__main__ import main; main(); print(os.environ['KERAS_BACKEND'])"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "tensorflow"
