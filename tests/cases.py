"""The shared conformance list: model kinds every parallel feature must handle.

Each case builds the same model twice from one seed (a reference for one
device and a template to parallelize), makes fresh random data, and says how to
compile it.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from typing import Callable

import keras
import numpy as np


@dataclasses.dataclass
class Case:
    name: str
    build: Callable[[], keras.Model]
    data: Callable[[np.random.Generator, int], tuple]
    compile_kwargs: Callable[[], dict]

    def pair(self, seed: int = 7):
        keras.utils.set_random_seed(seed)
        reference = self.build()
        keras.utils.set_random_seed(seed)
        template = self.build()
        return reference, template


def _sgd():
    return keras.optimizers.SGD(learning_rate=0.05, momentum=0.5)


def _binary(rng, n):
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (rng.random(n) > 0.5).astype("float32")


def _sequential():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def _binary_compile():
    return dict(
        optimizer=_sgd(),
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
    )


def _multi_io():
    a = keras.Input((4,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Dense(8, activation="tanh")(keras.layers.concatenate([a, b]))
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(2, name="reg")(h)
    return keras.Model([a, b], [cls, reg])


def _multi_io_data(rng, n):
    x = [rng.normal(size=(n, 4)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")]
    y = {"cls": rng.integers(0, 3, size=n), "reg": rng.normal(size=(n, 2)).astype("float32")}
    return x, y


def _multi_io_compile():
    return dict(
        optimizer=_sgd(),
        loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5},
        metrics={"cls": ["accuracy"], "reg": ["mae"]},
    )


def _dict_inputs():
    left = keras.Input((4,), name="left")
    right = keras.Input((2,), name="right")
    h = keras.layers.Dense(5, activation="relu")(keras.layers.concatenate([left, right]))
    return keras.Model({"left": left, "right": right}, keras.layers.Dense(1)(h))


def _dict_data(rng, n):
    x = {"left": rng.normal(size=(n, 4)).astype("float32"), "right": rng.normal(size=(n, 2)).astype("float32")}
    return x, rng.normal(size=(n, 1)).astype("float32")


def _mse_compile():
    return dict(optimizer=_sgd(), loss="mse", metrics=["mae"])


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="relu")
        self.out = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        return self.out(self.hidden(inputs))


def _subclassed():
    model = Subclassed()
    model(np.zeros((1, 6), "float32"))  # builds the weights
    return model


def _subclassed_built_by_shape():
    # The build the unbuilt-model error recommends: Keras marks the model
    # built, but its layers get their weights only at the first call.
    model = Subclassed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Keras: "does not have a build() method"
        model.build((None, 6))
    return model


def _regression(rng, n):
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _nested():
    inner = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="relu")], name="inner")
    x = keras.Input((6,))
    return keras.Model(x, keras.layers.Dense(1)(inner(x)))


def _batchnorm():
    return keras.Sequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.Conv2D(4, 3, padding="same"),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(momentum=0.5),
            keras.layers.Dense(1),
        ]
    )


def _image_data(rng, n):
    return rng.normal(size=(n, 5, 5, 2)).astype("float32") * 3 + 1, rng.normal(size=(n, 1)).astype("float32")


def _convnext():
    """A ConvNeXt block, reduced: its depthwise layer is a grouped convolution."""
    inputs = keras.Input((5, 5, 2))
    stem = keras.layers.Conv2D(8, 1)(inputs)
    h = keras.layers.Conv2D(8, 3, padding="same", groups=8)(stem)
    h = keras.layers.LayerNormalization(epsilon=1e-6)(h)
    h = keras.layers.Dense(32, activation="gelu")(h)
    h = keras.layers.Add()([stem, keras.layers.Dense(8)(h)])
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(h)))


def _rnn():
    return keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(1)])


def _sequence_data(rng, n):
    return rng.normal(size=(n, 5, 3)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


def _loaded():
    path = tempfile.mkdtemp() + "/saved.keras"
    _sequential().save(path)
    return keras.models.load_model(path)


CASES = [
    Case("sequential", _sequential, _binary, _binary_compile),
    Case("functional_multi_io", _multi_io, _multi_io_data, _multi_io_compile),
    Case("dict_inputs", _dict_inputs, _dict_data, _mse_compile),
    Case("subclassed", _subclassed, _regression, _mse_compile),
    Case("subclassed_built_by_shape", _subclassed_built_by_shape, _regression, _mse_compile),
    Case("nested", _nested, _regression, _mse_compile),
    Case("batchnorm", _batchnorm, _image_data, _mse_compile),
    Case("rnn", _rnn, _sequence_data, _mse_compile),
    Case("convnext_block", _convnext, _image_data, _mse_compile),
    Case("loaded", _loaded, _binary, _binary_compile),
]


def assert_same_weights(reference, template, atol=1e-5):
    assert len(reference.weights) == len(template.weights)
    for a, b in zip(reference.weights, template.weights):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=atol, err_msg=a.path)


def assert_same_logs(a: dict, b: dict, atol=1e-5):
    assert sorted(a) == sorted(b)
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=1e-4, atol=atol, err_msg=key)


_strategy = []


def worker_model(template):
    """A multi-worker model on one process's 2 CPUs: the strategy's several
    replicas per worker (a worker's GPUs), without starting workers.

    One strategy for the whole process: each strategy object numbers its
    collectives from the same keys, so a second one over the same devices
    meets the first's collectives (a shape mismatch, or silently shared
    parameters), as in a worker process, which holds one strategy.
    """
    import tensorflow as tf

    from kerasmulti._src.multi_worker import worker_model as _worker_model

    if not _strategy:
        _strategy.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _worker_model.adopt(template, _strategy[0])


class StopAfterBatches(keras.callbacks.Callback):
    """Ends training with RuntimeError("stopped") after `batches` batches: a kill's stand-in in one process.

    Put it after a backup callback, which then has saved first.
    """

    def __init__(self, batches):
        super().__init__()
        self.batches, self.seen = batches, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.batches:
            raise RuntimeError("stopped")

