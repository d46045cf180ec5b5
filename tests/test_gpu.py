"""Checks that only a GPU can answer, skipped on machines without one.

The test process runs on simulated CPU devices (conftest.py), so the checks run
in their own process (workers/gpu_checks.py), which splits the first GPU in two.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import os
import subprocess
import sys

import pytest
import tensorflow as tf

WORKER = os.path.join(os.path.dirname(__file__), "workers", "gpu_checks.py")


@pytest.mark.slow
@pytest.mark.skipif(not tf.config.list_physical_devices("GPU"), reason="needs a GPU")
def test_parallel_and_placed_models_match_one_gpu_on_two_logical_gpus():
    # The worker configures its own devices, and sets a memory limit per logical GPU.
    unset = ("KERASMULTI_SIMULATE_DEVICES", "TF_FORCE_GPU_ALLOW_GROWTH")
    env = {key: value for key, value in os.environ.items() if key not in unset}
    result = subprocess.run([sys.executable, WORKER], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    passed = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(passed) == 6, result.stdout
