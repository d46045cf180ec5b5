"""A step's plan, made once (`local_replicas.py`), and the kinds of parallel model that carry it out.

The plan decides which rows each replica takes, which count, and each
replica's share; every executor of a `LocalParallelModel` reads that one
plan. The numbers those executors give are checked against one device in
`test_conformance.py`, `test_compiled.py` and `test_custom_steps.py`.
"""

from simulated import DEVICES

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti
from kerasmulti._src.data_parallel import local_replicas
from kerasmulti._src.data_parallel.local_model import LocalParallelModel
from kerasmulti._src.model_parallel.pipeline import PipelineModel
from kerasmulti._src.multi_worker.worker_model import WorkerModel

CPUS = [f"/cpu:{i}" for i in range(DEVICES)]


def _replicas(split=None):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    return local_replicas.LocalReplicas(model, CPUS, "/cpu:0", split)


@pytest.mark.parametrize(
    "batch, sizes",
    [(DEVICES * 2 + 1, [3] + [2] * (DEVICES - 1)), (2, [1, 1]), (1, [1])],
)
def test_a_plan_gives_each_replica_its_rows_its_share_and_its_device(batch, sizes):
    plan = _replicas().plan(batch)
    assert [s.counted for s in plan.shards] == sizes and plan.devices == CPUS[: len(sizes)]
    assert [s.begin for s in plan.shards] == list(np.cumsum([0] + sizes[:-1]))
    np.testing.assert_allclose([float(s) for s in plan.shares], np.array(sizes) / batch, rtol=1e-7)


def test_a_plan_made_at_run_time_keeps_an_idle_replica_on_one_borrowed_row():
    # In a retraced step the batch is a tensor: every replica runs, the idle one on a row that does not count.
    plan = _replicas().plan(tf.constant(2))
    assert len(plan.shards) == DEVICES
    assert [int(s.counted) for s in plan.shards] == [1, 1] + [0] * (DEVICES - 2)
    assert [int(s.sliced) for s in plan.shards] == [1] * DEVICES
    assert [float(s) for s in plan.shares] == [0.5, 0.5] + [0.0] * (DEVICES - 2)


def test_a_measured_split_plans_by_the_proportions_variable():
    replicas = _replicas("auto")
    assert replicas.split is None and replicas.auto_split is not None
    replicas.auto_split.proportions.assign([0.5] + [0.5 / (DEVICES - 1)] * (DEVICES - 1))
    plan = replicas.plan(tf.constant(8))
    assert int(plan.shards[0].counted) == 4 and sum(int(s.counted) for s in plan.shards) == 8


def test_pieces_and_merge_give_back_the_batch_in_order():
    replicas = _replicas()
    x = tf.reshape(tf.range(14, dtype="float32"), (7, 2))
    plan = replicas.plan(7)
    pieces = replicas.pieces(x, plan)
    outputs = replicas.run(plan, lambda i: pieces[i] * 1.0)  # on the replica's device
    assert [o.device.endswith(f"CPU:{i}") for i, o in enumerate(outputs)] == [True] * DEVICES
    np.testing.assert_array_equal(replicas.merge(outputs, plan).numpy(), x.numpy())


def test_the_kinds_of_parallel_model_are_siblings_over_what_they_share():
    # One process and a cluster's workers share `ParallelModel`; neither overrides the other.
    assert issubclass(LocalParallelModel, kerasmulti.ParallelModel) and issubclass(WorkerModel, kerasmulti.ParallelModel)
    assert not issubclass(WorkerModel, LocalParallelModel) and issubclass(PipelineModel, LocalParallelModel)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    assert type(kerasmulti.parallelize(model, gpus=2)) is LocalParallelModel
