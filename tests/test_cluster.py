"""Reading TF_CONFIG and joining a cluster: the errors a user can fix."""

from simulated import NEEDS_CLUSTER  # first: 3 simulated devices before TensorFlow starts

import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti._src import cluster as _cluster
from kerasmulti._src.data_parallel import feeding as _feeding
from kerasmulti._src.data_parallel.local_model import LocalParallelModel
from kerasmulti._src.multi_worker import tf_config as _tf_config
from kerasmulti._src.multi_worker import worker_inputs as _worker_inputs

WAIT_SCRIPT = os.path.join(os.path.dirname(__file__), "workers", "join_and_wait.py")


def test_no_tf_config_or_a_one_task_cluster_is_no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert _cluster.config() is None and _cluster.is_chief()
    monkeypatch.setenv("TF_CONFIG", _tf_config.tf_config(["localhost:1"], 0))
    assert _cluster.config() is None and _cluster.strategy() is None


@pytest.mark.parametrize(
    "config, chief",
    [
        (_tf_config.tf_config(["a:1", "b:2"], 0), True),
        (_tf_config.tf_config(["a:1", "b:2"], 1), False),
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
    with pytest.raises(_cluster.ClusterError, match=r"TF_CONFIG does not describe a cluster.*`kerasmulti launch` write it.*Received: TF_CONFIG="):
        _cluster.config()


def test_a_failed_join_is_reported_where_the_cluster_is_needed(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config.tf_config(["a:1", "b:2"], 1))
    monkeypatch.setattr(_cluster, "_start_error", OSError("port in use"))
    with pytest.raises(_cluster.ClusterError, match="Joining the TF_CONFIG cluster failed: port in use.*Received: TF_CONFIG="):
        _cluster.strategy()


# TensorFlow 2.21's errors when a join times out, on the chief and on another worker.
_BARRIER = (
    "Barrier timed out. Id: [Init]Wait_for_all_tasks_to_register::0. This usually happens because a task triggered "
    "the barrier too early or too slowly.\n# of tasks that reached the barrier: 1/3.\nThe first task at the barrier: "
    "/job:worker/replica:0/task:0. Some timed out task names:\n/job:worker/replica:0/task:2\n/job:worker/replica:0/task:1"
    "\n\nAdditional GRPC error information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.CoordinationService/RegisterTask:\n:UNKNOWN:Error received from peer {grpc_status:4, ...}"
)
_UNANSWERED = (
    "Deadline Exceeded\nAdditional GRPC error information from remote target /job:worker/replica:0/task:0 while calling "
    "/tensorflow.CoordinationService/RegisterTask:\n:UNKNOWN:Error received from peer  {grpc_status:4, ...}"
)


@pytest.mark.parametrize(
    "index, text, expected",
    [(0, _BARRIER, "Barrier timed out. Not every worker joined within 7 s: worker 1 (b:2), worker 2 (c:3) (set"),
     (1, _UNANSWERED, "Deadline Exceeded. Not every worker joined within 7 s: worker 0 (a:1) did not answer (set")],
)
def test_a_join_that_timed_out_names_the_workers_it_waited_for(monkeypatch, index, text, expected):
    monkeypatch.setenv("TF_CONFIG", _tf_config.tf_config(["a:1", "b:2", "c:3"], index))
    monkeypatch.setenv("KERASMULTI_JOIN_TIMEOUT", "7")
    monkeypatch.setattr(_cluster, "_start_error", tf.errors.DeadlineExceededError(None, None, text))
    with pytest.raises(_cluster.ClusterError) as caught:
        _cluster.strategy()
    message = str(caught.value)
    assert message.startswith(f"Joining the TF_CONFIG cluster failed: {expected}"), message
    assert "\n" not in message and "GRPC" not in message


def test_tf_config_set_after_the_import_is_explained(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", _tf_config.tf_config(["a:1", "b:2"], 1))
    monkeypatch.setattr(_cluster, "_start_error", None)
    monkeypatch.setattr(_cluster, "_join_requested", True)
    with pytest.raises(_cluster.ClusterError, match="TF_CONFIG was set after kerasmulti was imported.*before Python starts.*Received: TF_CONFIG task="):
        _cluster.strategy()


def test_a_cluster_nobody_asked_to_join_is_warned_about_and_trains_here(monkeypatch):
    # A training platform's TF_CONFIG, in a process that neither called
    # initialize() nor was started by the launcher.
    monkeypatch.setenv("TF_CONFIG", _tf_config.tf_config(["a:1", "b:2"], 1))
    monkeypatch.setattr(_cluster, "_warned_unjoined", False)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.warns(UserWarning, match=r"did not join the TF_CONFIG cluster.*kerasmulti.initialize\(\).*Received: TF_CONFIG task="):
        parallel = kerasmulti.parallelize(model, gpus=2)
    assert type(parallel) is LocalParallelModel and len(parallel.replica_devices) == 2


@pytest.mark.slow
def test_import_returns_at_once_under_a_tf_config_whose_peers_are_absent():
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": _tf_config.tf_config(["localhost:1", "localhost:2"], 0)}
    for name in ("KERASMULTI_SIMULATE_DEVICES", _cluster.ENV_JOIN):
        env.pop(name, None)
    # Joining would wait for the absent peers (600 s by default, past the
    # timeout below); without KERASMULTI_JOIN the import does not even load TensorFlow.
    script = "import sys, kerasmulti; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_tensorflow_running_before_the_import_is_explained():
    script = (
        "import tensorflow as tf; tf.constant(1)\n"  # TensorFlow runs first
        "import keras, kerasmulti\n"
        "kerasmulti.initialize()\n"
    )
    hosts = [f"localhost:{port}" for port in _tf_config.free_ports(2)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": _tf_config.tf_config(hosts, 0)}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode != 0
    assert "ClusterError" in result.stderr
    assert "TensorFlow ran before this worker joined" in result.stderr
    assert "kerasmulti.initialize() at the top of the script" in result.stderr
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
        _worker_inputs._batches(dataset)
    assert _worker_inputs._batches(tf.data.Dataset.from_tensor_slices(np.zeros((5, 2))).batch(2)) == 3


def _worker(index, hosts, script, **env):
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_CONFIG": _tf_config.tf_config(hosts, index), **env}
    environment.pop("KERASMULTI_SIMULATE_DEVICES", None)
    return subprocess.Popen(
        [sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment
    )


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1])
@NEEDS_CLUSTER
def test_a_worker_whose_peers_never_start_stops_with_an_error(index):
    # TensorFlow alone would wait an hour (the chief) and ignore SIGTERM.
    # A worker still waiting after 120 s (30 times its join timeout, room for
    # a busy machine's start-up) fails the test, and is not left behind.
    hosts = [f"localhost:{port}" for port in _tf_config.free_ports(2)]
    worker = _worker(index, hosts, WAIT_SCRIPT, KERASMULTI_JOIN_TIMEOUT="4")
    try:
        _, stderr = worker.communicate(timeout=120)
    finally:
        worker.kill()
    assert worker.returncode != 0
    assert "ClusterError" in stderr
    assert "Not every worker joined within 4 s" in stderr and "KERASMULTI_JOIN_TIMEOUT" in stderr
    # Whom it waited for: the chief lists the others; another worker names the chief.
    waited_for = f"worker 1 ({hosts[1]})" if index == 0 else f"worker 0 ({hosts[0]}) did not answer"
    assert f"joined within 4 s: {waited_for} (set" in stderr
    assert f'Received: TF_CONFIG=\'{_tf_config.tf_config(hosts, index)}\'' in stderr


@pytest.mark.slow
@NEEDS_CLUSTER
def test_workers_that_joined_stop_on_sigterm():
    # TensorFlow's own SIGTERM handler only logs; a launcher must be able to stop workers.
    hosts = [f"localhost:{port}" for port in _tf_config.free_ports(2)]
    workers = [_worker(i, hosts, WAIT_SCRIPT) for i in range(2)]
    try:
        for worker in workers:
            assert worker.stdout.readline().strip() == "joined"
        for worker in workers:
            worker.terminate()
        # Stopped by the signal, not by the join's own timeout or a kill (30 s: a busy machine's margin).
        assert [worker.wait(timeout=30) for worker in workers] == [-signal.SIGTERM] * 2
    finally:
        for worker in workers:
            worker.kill()
            worker.communicate()


def test_joining_a_cluster_on_a_tensorflow_before_2_20_is_refused(monkeypatch):
    # Those releases cannot put a deadline on joining: a missing worker would block the rest.
    from kerasmulti._src import keras_private as _keras_private

    monkeypatch.setattr(_keras_private, "tensorflow_version", lambda: (2, 19))
    monkeypatch.setenv("TF_CONFIG", _tf_config.tf_config(["localhost:1", "localhost:2"], 0))
    with pytest.raises(_cluster.ClusterError, match=r"needs TensorFlow 2.20 or later.*pip install 'tensorflow>=2.20'.*Received: tensorflow="):
        _cluster._join(5.0)


def test_joining_on_a_tensorflow_without_the_coordination_config_is_refused(monkeypatch):
    from kerasmulti._src import keras_private as _keras_private

    monkeypatch.setattr(_keras_private, "coordination_config_pb2", None)
    with pytest.raises(_cluster.ClusterError, match=r"cannot join a cluster: use a TensorFlow that setup.cfg declares.*Received: tensorflow="):
        _cluster._join(5.0)


def test_a_bad_join_timeout_is_refused(monkeypatch):
    monkeypatch.setenv("KERASMULTI_JOIN_TIMEOUT", "ten minutes")
    with pytest.raises(_cluster.ClusterError, match=r"positive number of seconds.*Received: KERASMULTI_JOIN_TIMEOUT='ten minutes'"):
        _cluster.join_timeout()
    monkeypatch.setenv("KERASMULTI_JOIN_TIMEOUT", "-5")
    with pytest.raises(_cluster.ClusterError, match=r"Received: KERASMULTI_JOIN_TIMEOUT='-5'"):
        _cluster.join_timeout()
    monkeypatch.setenv("KERASMULTI_JOIN_TIMEOUT", "90")
    assert _cluster.join_timeout() == 90.0
    monkeypatch.delenv("KERASMULTI_JOIN_TIMEOUT")
    assert _cluster.join_timeout() == _cluster.DEFAULT_JOIN_TIMEOUT_S


def test_the_shuffle_seed_follows_a_seeded_program_without_drawing_from_it():
    import random

    random.seed(3)
    first, drawn = _worker_inputs.shuffle_seed(), random.random()
    random.seed(3)
    assert _worker_inputs.shuffle_seed() == first
    assert random.random() == drawn  # the program's own random stream is untouched
    random.seed(4)
    assert _worker_inputs.shuffle_seed() != first


@pytest.mark.parametrize("validation", ["split", "arrays"])
def test_shuffled_worker_arrays_keep_the_validation_batch_size(validation):
    # The fit's batch size went with the training arrays: validation arrays came in 32-row batches,
    # so validation_steps=1 validated 32 rows, not 4. Learning rate 0: only the validation batch differs.
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(40, 3)).astype("float32"), rng.normal(size=(40, 1)).astype("float32")
    fit = dict(x=x, y=y, batch_size=4, epochs=1, shuffle=True, validation_steps=1, verbose=0)
    fit.update(dict(validation_split=0.5) if validation == "split" else dict(validation_data=(x[20:], y[20:])))
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    expected = model.fit(**fit).history["val_loss"]
    arguments = _worker_inputs.fit_arguments(None, _feeding.bound(keras.Model.fit, (), fit), seed=1)
    assert model.fit(**arguments).history["val_loss"] == pytest.approx(expected, rel=1e-6)


def test_worker_batches_are_copies_in_a_shared_order_and_endless_ones_stay_in_order():
    import keras

    rows = np.arange(12, dtype="float32")[:, None]

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return rows[3 * i: 3 * i + 3]

    class Endless(keras.utils.PyDataset):
        @property
        def num_batches(self):
            return None

        def __getitem__(self, i):
            return rows[:3] + i

    first, again = (_worker_inputs.WorkerBatches(Batches(), seed=5) for _ in range(2))
    order = [int(first[i][0, 0]) // 3 for i in range(4)]
    assert sorted(order) == [0, 1, 2, 3]
    assert order == [int(again[i][0, 0]) // 3 for i in range(4)]  # every worker draws the same
    assert not np.shares_memory(first[0], rows)  # TensorFlow may write into what it is given
    epochs = [order]
    for _ in range(5):
        first.on_epoch_end()
        epochs.append([int(first[i][0, 0]) // 3 for i in range(4)])
    assert len({tuple(e) for e in epochs}) > 1  # drawn anew each epoch
    endless = _worker_inputs.WorkerBatches(Endless(), seed=5)
    assert endless.num_batches is None and float(endless[2][0, 0]) == 2.0


@pytest.mark.slow  # a subprocess or a long fit: CI runs it, the fast tier does not
def test_the_barrier_and_the_gather_trace_once_per_strategy():
    # A tf.function made at every call would trace at every call, and
    # TensorFlow warns about retracing after five. In a fresh process: each
    # strategy object numbers its collectives from the same keys, so a second
    # strategy over the same devices in one process (other tests make one)
    # collides with the first's collectives, as TensorFlow does it; a worker
    # process holds one strategy.
    code = """
import kerasmulti
kerasmulti.simulate_devices(2)
import tensorflow as tf
from kerasmulti._src.multi_worker import worker_model as _worker_model
from kerasmulti._src.multi_worker import worker_inputs as _worker_inputs

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
steps = (_worker_model._barrier_step, _worker_inputs.gather_step)
before = [step.experimental_get_tracing_count() for step in steps]
for value in range(6):
    assert float(_worker_model._barrier_step(strategy)) == 2.0
    gathered = _worker_inputs.gather_step(strategy, tf.constant(value, tf.int64))
    assert gathered.numpy().tolist() == [value, value]
assert [step.experimental_get_tracing_count() for step in steps] == [count + 1 for count in before]
print("traced once")
"""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("KERASMULTI_SIMULATE_DEVICES", None)
    env.pop("TF_CONFIG", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "traced once" in result.stdout, result.stderr[-3000:]


class _Resolver:
    def __init__(self, spec, task_type, task_id):
        self.spec, self.task_type, self.task_id = spec, task_type, task_id

    def cluster_spec(self):
        return tf.train.ClusterSpec(self.spec)


class _Strategy:
    def __init__(self, resolver):
        self.cluster_resolver = resolver


@pytest.mark.parametrize(
    "spec, task, expected",
    [
        ({}, (None, None), (1, 0)),  # no TF_CONFIG: one worker
        ({"worker": ["a:1", "b:1", "c:1"]}, ("worker", 2), (3, 2)),
        ({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, ("chief", 0), (3, 0)),
        ({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, ("worker", 1), (3, 2)),  # after the chief
    ],
)
def test_worker_count_and_index_follow_tensorflows_numbering_and_are_read_once(spec, task, expected):
    from kerasmulti._src import cluster as _cluster
    from kerasmulti._src.keras_private import multi_worker_util

    resolver = _Resolver(spec, *task)
    strategy = _Strategy(resolver)
    assert (_cluster.worker_count(strategy), _cluster.worker_index(strategy)) == expected
    if spec:  # what MultiWorkerMirroredStrategy fixes when it is made
        cluster_spec = tf.train.ClusterSpec(spec)
        assert expected == (
            multi_worker_util.worker_count(cluster_spec, task[0]),
            multi_worker_util.id_in_cluster(cluster_spec, task[0], task[1]),
        )
    resolver.spec, resolver.task_type, resolver.task_id = {"worker": ["x:1"] * 9}, "worker", 8  # TF_CONFIG changed later
    assert (_cluster.worker_count(strategy), _cluster.worker_index(strategy)) == expected
