"""Models with steps of their own across workers, against one process on the same global batches.

Run by `kerasmulti launch --workers 2 multi_worker_custom_steps.py OUT` (each
worker saves OUT/worker-<index>.npz), or as `multi_worker_custom_steps.py OUT
--reference` (the plain templates in one process, OUT/reference.npz). 16 rows
in global batches of 5: the workers take 3 and 2 rows, and of the last batch,
one row, one worker takes none. Phases, each trained 2 epochs (the models are
`custom_models.py`'s):

- gan: two optimizers (Adam, SGD) made outside the strategy's scope, built by
  their first apply inside the step; Keras' loss object; trackers.
- gan_batchnorm: its generator, called in training, normalises by the batch
  (BatchNormalization synchronised across the workers).
- vae: hand-written means over the rows, one optimizer.
- gan_xla, vae_xla (workers only): the same with jit_compile=True, compared with
  the uncompiled reference.
- counter: the guide's low-level step, with a step counter it assigns, and a
  statistic of its rows (the first replica's, on every worker).
- logging: a tracker whose update_state takes no sample_weight, and a vector log.
- listed_optimizers: a GAN keeping its two optimizers in a list.
- clipnorm, global_clipnorm, keras_step_clipnorm: clipped gradients (a custom step's and
  Keras' own), clipped as the global batch's.
- mixed_float16: a step that scales its loss (LossScaleOptimizer).
- compute_loss: compile()'s loss and metrics plus a penalty, Keras' own
  train_step on the template; then evaluate().
- test_step: evaluate() through the guide's test_step.
- predict_step: predict() through a step that returns a dict.
- draws (workers only): predict() through a step that draws random numbers.
- unseeded (workers only): a step drawing without a seed generator, refused.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import json
import os
import sys
import warnings

import keras  # noqa: E402
import numpy as np  # noqa: E402
from custom_models import (  # noqa: E402
    FEATURES,
    GAN,
    BatchNormGAN,
    ExtraLoss,
    GuideLowLevel,
    GuideTestStep,
    ListedGAN,
    Mixed,
    Rounded,
    functional,
    gan_compile,
    make_gan,
    mlp,
    sgd_compile,
    standard_compile,
    vae,
)

import kerasmulti  # first: joins the cluster before TensorFlow runs anything
from kerasmulti._src.utils import step_ops

out = sys.argv[1]
reference = "--reference" in sys.argv
index = 0 if reference else json.loads(os.environ["TF_CONFIG"])["task"]["index"]
results = {}
rng = np.random.default_rng(3)
x = rng.normal(size=(16, FEATURES)).astype("float32")
pairs = dict(x=x, y=rng.normal(size=(16, FEATURES)).astype("float32"))
FIT = dict(batch_size=5, epochs=2, shuffle=False, verbose=0)


def target(template):
    return template if reference else kerasmulti.parallelize(template)


def train(phase, template, compile_, data):
    model = target(template)
    compile_(model)
    history = model.fit(**data, **FIT).history
    for key, values in history.items():
        results[f"{phase}/history/{key}"] = np.asarray(values)
    for i, weight in enumerate(template.get_weights()):
        results[f"{phase}/weight{i}"] = weight
    return model


def batchnorm_gan(seed):
    keras.utils.set_random_seed(seed)
    generator = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(6), keras.layers.BatchNormalization(momentum=0.5),
         keras.layers.Dense(FEATURES)], name="generator",
    )
    return BatchNormGAN(mlp(1, "discriminator"), generator)


for phase, build in (("gan", lambda: make_gan(GAN, 1)), ("gan_batchnorm", lambda: batchnorm_gan(2))):
    gan = build()
    train(phase, gan, gan_compile, pairs)
    results[f"{phase}/iterations"] = np.asarray([o.iterations.numpy() for o in (gan.d_optimizer, gan.g_optimizer)])

noise = dict(x=x, y=rng.normal(size=(16, 2)).astype("float32"))
train("vae", vae(4), sgd_compile, noise)



def matmuls_outside_xla(model, data):
    """Matrix products one more epoch runs outside XLA on the chief (TensorFlow's profiler counts them exactly).

    The other worker runs the epoch unprofiled: TensorFlow's profiler, stopped
    in two worker processes of one machine at once, crashed one now and then.
    """
    def epoch():
        return model.fit(**data, batch_size=5, epochs=1, verbose=0)

    if index != 0:
        epoch()
        return -1
    ran = step_ops.count(epoch, steps=1)
    return sum(n for name, n in ran.by_type.items() if "MatMul" in name)


if not reference:  # the model calls as XLA programs on each replica, against the same reference
    for phase, model, compile_, data in (("gan", make_gan(GAN, 1), gan_compile, pairs), ("vae", vae(4), sgd_compile, noise)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = train(f"{phase}_xla", model, lambda m, c=compile_: c(m, jit_compile=True), data)
        results[f"{phase}_xla/replica_jit_compile"] = compiled.replica_jit_compile
        results[f"{phase}_xla/uncompiled_warnings"] = [str(w.message) for w in caught if "uncompiled" in str(w.message)]
        results[f"{phase}_xla/matmuls_outside_xla"] = matmuls_outside_xla(compiled, data)
    uncompiled = kerasmulti.parallelize(make_gan(GAN, 1))  # the control
    gan_compile(uncompiled)
    results["gan_xla/matmuls_outside_xla_uncompiled"] = matmuls_outside_xla(uncompiled, pairs)



class Watching(GuideLowLevel):
    """The guide's low-level step, also keeping a statistic of each batch's rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.last_mean = keras.Variable(0.0, trainable=False, name="last_mean")

    def train_step(self, data):
        self.last_mean.assign(keras.ops.mean(data[0]))  # the last batch's one row is the first replica's
        return super().train_step(data)


counter = functional(Watching, 5)
labelled = dict(x=x, y=rng.normal(size=(16, 1)).astype("float32"))
train("counter", counter, sgd_compile, labelled)
results["counter/steps_taken"] = counter.steps_taken.numpy()
results["counter/last_mean"] = counter.last_mean.numpy()



class Tracker(keras.metrics.Metric):
    """A running mean whose update_state takes no sample_weight."""

    def __init__(self, name):
        super().__init__(name=name)
        self.total = self.add_variable((), initializer="zeros", name="total")
        self.count = self.add_variable((), initializer="zeros", name="count")

    def update_state(self, value):
        self.total.assign_add(keras.ops.cast(value, "float32"))
        self.count.assign_add(1.0)

    def result(self):
        return self.total / self.count


class Logging(GuideLowLevel):
    """The guide's low-level step, also feeding a tracker without sample_weight and logging a vector."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.own = Tracker("own")

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric, self.own]

    def train_step(self, data):
        logs = super().train_step(data)
        self.own.update_state(keras.ops.mean(keras.ops.square(self(data[0]) - data[1])))
        return {**logs, "own": self.own.result(), "column_means": keras.ops.mean(data[0], axis=0)}


train("logging", functional(Logging, 11), sgd_compile, labelled)
train("listed_optimizers", make_gan(ListedGAN, 12), gan_compile, pairs)
# Keras clips the gradient, and checks it finite, as the global batch's.
clipped_sgd = lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.05))  # noqa: E731
train("clipnorm", vae(13), clipped_sgd, noise)
clipped_gan = lambda m: m.compile(keras.optimizers.Adam(0.01, global_clipnorm=0.05), keras.optimizers.SGD(0.05), keras.losses.BinaryCrossentropy(from_logits=True))  # noqa: E731
train("global_clipnorm", make_gan(GAN, 14), clipped_gan, pairs)
keras.utils.set_random_seed(15)
train("keras_step_clipnorm", mlp(1), lambda m: m.compile(optimizer=keras.optimizers.SGD(0.1, clipnorm=0.05), loss="mse"), labelled)
keras.mixed_precision.set_global_policy("mixed_float16")
try:
    train("mixed_float16", functional(Mixed, 16), sgd_compile, labelled)
finally:
    keras.mixed_precision.set_global_policy("float32")

model = train("compute_loss", functional(ExtraLoss, 6), standard_compile, labelled)
evaluated = model.evaluate(**labelled, batch_size=5, verbose=0, return_dict=True)
results.update({f"compute_loss/evaluate/{k}": np.asarray(v) for k, v in evaluated.items()})

model = target(functional(GuideTestStep, 7))
standard_compile(model)
evaluated = model.evaluate(**labelled, batch_size=5, verbose=0, return_dict=True)
results.update({f"test_step/{k}": np.asarray(v) for k, v in evaluated.items()})

predicted = target(functional(Rounded, 8)).predict(x, batch_size=5, verbose=0)
results.update({f"predict_step/{k}": v for k, v in predicted.items()})


class Noise(keras.Model):
    """A predict_step that draws from the model's own seed generator, as a GAN draws its latent vectors."""

    def __init__(self):
        super().__init__()
        self.seeds = keras.random.SeedGenerator(9)

    def call(self, x):
        return x

    def predict_step(self, data):
        return keras.random.normal((keras.ops.shape(data)[0], 1), seed=self.seeds)


if not reference:  # each replica draws its own numbers (with tf.distribute, the same ones)
    noise = Noise()
    noise(np.zeros((1, 1)))
    results["draws"] = kerasmulti.parallelize(noise).predict(np.zeros((8, 1)), batch_size=4, verbose=0)


class Unseeded(GAN):
    def train_step(self, data):
        return super().train_step((data, keras.random.normal(keras.ops.shape(data))))


if not reference:  # last: the refused step leaves the workers' collectives where they were
    unseeded = kerasmulti.parallelize(make_gan(Unseeded, 10))
    gan_compile(unseeded)
    try:
        unseeded.fit(x, batch_size=4, epochs=1, verbose=0)
    except ValueError as error:
        results["unseeded"] = str(error)

np.savez(os.path.join(out, "reference.npz" if reference else f"worker-{index}.npz"), **results)
