"""Reading TF_CONFIG and joining a cluster: the errors a user can fix."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti import _cluster, _launch, _multiworker


def test_no_tf_config_or_a_one_task_cluster_is_no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert _cluster.config() is None and _cluster.is_chief()
    monkeypatch.setenv("TF_CONFIG", _launch.tf_config(["localhost:1"], 0))
    assert _cluster.config() is None and _cluster.strategy() is None


@pytest.mark.parametrize(
    "config, chief",
    [
        (_launch.tf_config(["a:1", "b:2"], 0), True),
        (_launch.tf_config(["a:1", "b:2"], 1), False),
        ('{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}', False),
        ('{"cluster": {"chief": ["c:1"], "worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}', True),
    ],
)
def test_the_chief_is_the_chief_task_or_else_worker_0(monkeypatch, config, chief):
    monkeypatch.setenv("TF_CONFIG", config)
    assert kerasmulti.is_chief() is chief


@pytest.mark.parametrize(
    "text",
    ["{not json", '{"cluster": {"worker": ["a:1", "b:2"]}}', '["a:1"]',
     '{"cluster": {"worker": "a:1,b:2"}, "task": {"type": "worker", "index": 0}}'],
)
def test_a_malformed_tf_config_is_refused(monkeypatch, text):
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(_cluster.ClusterError, match="kerasmulti launch` writes it for you.*Received: TF_CONFIG="):
        _cluster.config()


def test_a_failed_join_is_reported_where_the_cluster_is_needed(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _launch.tf_config(["a:1", "b:2"], 1))
    monkeypatch.setattr(_cluster, "_start_error", OSError("port in use"))
    with pytest.raises(_cluster.ClusterError, match="joining the cluster failed: port in use.*Received: TF_CONFIG="):
        _cluster.strategy()


def test_tf_config_set_after_the_import_is_explained(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _launch.tf_config(["a:1", "b:2"], 1))
    monkeypatch.setattr(_cluster, "_start_error", None)
    with pytest.raises(_cluster.ClusterError, match="Set TF_CONFIG before Python starts.*Received: TF_CONFIG task="):
        _cluster.strategy()


def test_tensorflow_running_before_the_import_is_explained():
    script = (
        "import tensorflow as tf; tf.constant(1)\n"  # TensorFlow runs first
        "import keras, kerasmulti\n"
        "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
        "kerasmulti.parallelize(model)\n"
    )
    hosts = [f"localhost:{port}" for port in _launch.free_ports(2)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": _launch.tf_config(hosts, 0)}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "ClusterError" in result.stderr
    assert "Import kerasmulti at the top of the script" in result.stderr
    assert "Received: TF_CONFIG task={'type': 'worker', 'index': 0}" in result.stderr


@pytest.mark.parametrize(
    "dataset, which",
    [
        (tf.data.Dataset.range(4).repeat(), "infinite"),
        (tf.data.Dataset.range(4).filter(lambda v: v > 1), "unknown"),
    ],
)
def test_a_per_worker_dataset_must_have_a_known_length(dataset, which):
    with pytest.raises(ValueError, match=f"assert_cardinality.*Received: cardinality={which}"):
        _multiworker._batches(dataset)
    assert _multiworker._batches(tf.data.Dataset.from_tensor_slices(np.zeros((5, 2))).batch(2)) == 3
