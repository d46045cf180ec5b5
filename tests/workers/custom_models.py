"""Models with steps of their own: miniatures of Keras' guide and keras.io's examples.

Shared by `tests/data_parallel/test_custom_steps.py` (one process) and
`multi_worker_custom_steps.py` (across workers). Where an example draws random
numbers inside its step, the miniature takes them from the data instead, so
that one device's numbers can be expected.
"""

import keras
import numpy as np
import tensorflow as tf

FEATURES = 5

def mlp(outputs=1, name=None, activation=None):
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(outputs, activation=activation)],
        name=name,
    )


class GuideCompiledLoss(keras.Model):
    """The guide's first train_step: compile()'s loss and metrics, by hand."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return _update_metrics(self, loss, y, y_pred)


def _update_metrics(model, loss, y, y_pred, sample_weight=None):
    """The guide's loop: the loss tracker gets the loss, the others the labels and predictions."""
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
    return {m.name: m.result() for m in model.metrics}


class GuideLowLevel(keras.Model):
    """The guide's second: its own loss, trackers and `metrics`, a step counter."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.steps_taken = keras.Variable(0, dtype="int32", trainable=False, name="steps_taken")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = keras.losses.MeanSquaredError()(y, y_pred)  # a mean over the rows
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.steps_taken.assign_add(1)
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


class GuideSampleWeights(keras.Model):
    """The guide's third: sample weights through compute_loss and compute_metrics."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return _update_metrics(self, loss, y, y_pred, sample_weight)


class GuideTestStep(keras.Model):
    """The guide's test_step: evaluate() through compile()'s loss and metrics, by hand."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return _update_metrics(self, loss, y, y_pred)


class ExtraLoss(keras.Model):
    """compute_loss only: compile()'s loss plus a penalty on the outputs."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training=training)
        return loss + 0.1 * keras.ops.mean(keras.ops.square(y_pred))


class Mixed(keras.Model):
    """A step that scales its loss for mixed precision (LossScaleOptimizer)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(keras.ops.cast(self(x, training=True), "float32") - y))
            scaled = self.optimizer.scale_loss(loss)
        self.optimizer.apply(tape.gradient(scaled, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


class Rounded(keras.Model):
    """predict_step: post-processes each batch's predictions."""

    def predict_step(self, data):
        x = data[0] if isinstance(data, tuple) else data
        return {"score": self(x, training=False), "sign": keras.ops.sign(self(x, training=False))}


class ConstantWeight(keras.Model):
    """A custom step that updates its trackers with a weight every replica shares: a variable, and a float."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight = keras.Variable(1.0, trainable=False, name="weight")
        self.by_variable, self.by_float = keras.metrics.Mean(name="by_variable"), keras.metrics.Mean(name="by_float")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.by_variable.update_state(loss, sample_weight=self.weight)
        self.by_float.update_state(loss, sample_weight=2.0)
        return {"by_variable": self.by_variable.result(), "by_float": self.by_float.result()}

    @property
    def metrics(self):
        return [self.by_variable, self.by_float]


def functional(cls, seed):
    keras.utils.set_random_seed(seed)
    inner = mlp()
    inputs = keras.Input((FEATURES,))
    return cls(inputs, inner(inputs))


class GAN(keras.Model):
    """keras.io's GAN: no call, compile(d_optimizer, g_optimizer, loss_fn), two optimizers a step.

    The latent vectors come with the data (keras.io draws them in the step).
    """

    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real, latent = data
        fake = self.generator(latent)
        combined = keras.ops.concatenate([fake, real], axis=0)
        rows = keras.ops.shape(real)[0]
        labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        gradients = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(gradients, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(keras.ops.zeros((rows, 1)), self.discriminator(self.generator(latent)))
        gradients = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(gradients, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


class ListedGAN(GAN):
    """keras.io's GAN, keeping its optimizers in a list."""

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        keras.Model.compile(self)
        self.pair, self.loss_fn = [d_optimizer, g_optimizer], loss_fn

    d_optimizer = property(lambda self: self.pair[0])
    g_optimizer = property(lambda self: self.pair[1])


class ScoredGAN(GAN):
    """A GAN that scores its discriminator on the fake and real rows together (2 rows a batch row), and logs a host value."""

    def __init__(self, discriminator, generator):
        super().__init__(discriminator, generator)
        self.accuracy = keras.metrics.BinaryAccuracy(name="d_accuracy", threshold=0.0)

    @property
    def metrics(self):
        return super().metrics + [self.accuracy]

    def train_step(self, data):
        logs = super().train_step(data)
        real, latent = data
        rows = keras.ops.shape(real)[0]
        labels = keras.ops.concatenate([keras.ops.ones((rows, 1)), keras.ops.zeros((rows, 1))], axis=0)
        self.accuracy.update_state(labels, self.discriminator(keras.ops.concatenate([self.generator(latent), real], axis=0)))
        host = tf.numpy_function(lambda v: np.float32(2 * v), [logs["d_loss"]], tf.float32)  # of unknown rank
        return {**logs, "d_accuracy": self.accuracy.result(), "twice_d_loss": host}


class SubModelGAN(GAN):
    """A GAN of Keras 2's style: its generator and discriminator compiled, each with its optimizer."""

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        keras.Model.compile(self)
        self.discriminator.compile(optimizer=d_optimizer)
        self.generator.compile(optimizer=g_optimizer)
        self.loss_fn = loss_fn

    d_optimizer = property(lambda self: self.discriminator.optimizer)
    g_optimizer = property(lambda self: self.generator.optimizer)


class WGANGP(GAN):
    """keras.io's WGAN-GP: a gradient penalty through a nested tape (interpolation weights from the data)."""

    def train_step(self, data):
        real, latent = data
        alpha = keras.ops.linspace(0.1, 0.9, FEATURES)[None, :] * keras.ops.ones_like(real)
        with tf.GradientTape() as tape:
            fake = self.generator(latent)
            interpolated = real + alpha * (fake - real)
            with tf.GradientTape() as penalty_tape:
                penalty_tape.watch(interpolated)
                critic = self.discriminator(interpolated)
            slopes = penalty_tape.gradient(critic, [interpolated])[0]
            penalty = keras.ops.mean((keras.ops.sqrt(keras.ops.sum(keras.ops.square(slopes), axis=1)) - 1.0) ** 2)
            d_loss = keras.ops.mean(self.discriminator(fake)) - keras.ops.mean(self.discriminator(real)) + 10.0 * penalty
        gradients = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(gradients, self.discriminator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(penalty)
        return {m.name: m.result() for m in self.metrics}


class BatchNormGAN(GAN):
    """A GAN whose generator is called in training mode (its BatchNormalization normalises by the batch)."""

    def train_step(self, data):
        real, latent = data
        with tf.GradientTape() as tape:
            g_loss = keras.ops.mean(keras.ops.square(self.generator(latent, training=True) - real))
        gradients = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(gradients, self.generator.trainable_weights))
        self.g_loss_tracker.update_state(g_loss)
        self.d_loss_tracker.update_state(keras.ops.mean(self.discriminator(real)))
        return {m.name: m.result() for m in self.metrics}


class VAE(keras.Model):
    """keras.io's VAE: reconstruction and KL losses, trackers (the noise from the data)."""

    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.total_tracker = keras.metrics.Mean(name="total_loss")
        self.kl_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_tracker, self.kl_tracker]

    def train_step(self, data):
        x, noise = data
        with tf.GradientTape() as tape:
            moments = self.encoder(x)
            mean, log_var = moments[:, :2], moments[:, 2:]
            z = mean + keras.ops.exp(0.5 * log_var) * noise
            reconstruction = keras.ops.mean(keras.ops.sum(keras.ops.square(x - self.decoder(z)), axis=1))
            kl = keras.ops.mean(-0.5 * keras.ops.sum(1 + log_var - mean**2 - keras.ops.exp(log_var), axis=1))
            total = reconstruction + kl
        gradients = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_weights))
        self.total_tracker.update_state(total)
        self.kl_tracker.update_state(kl)
        return {"total_loss": self.total_tracker.result(), "kl_loss": self.kl_tracker.result()}


class Distiller(keras.Model):
    """keras.io's Distiller: a teacher, a student, compile(optimizer, metrics, student_loss_fn, ...)."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def call(self, x):
        return self.student(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            keras.ops.softmax(teacher / self.temperature, axis=1), keras.ops.softmax(y_pred / self.temperature, axis=1)
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss


class SimSiam(keras.Model):
    """keras.io's SimSiam: two views (given with the data), a predictor, stop_gradient."""

    def __init__(self, encoder, predictor):
        super().__init__()
        self.encoder, self.predictor = encoder, predictor
        self.loss_tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        first, second = data

        def negative_cosine(p, z):
            p = keras.ops.normalize(p, axis=1)
            z = keras.ops.normalize(keras.ops.stop_gradient(z), axis=1)
            return -keras.ops.mean(keras.ops.sum(p * z, axis=1))

        with tf.GradientTape() as tape:
            z1, z2 = self.encoder(first), self.encoder(second)
            loss = 0.5 * negative_cosine(self.predictor(z1), z2) + 0.5 * negative_cosine(self.predictor(z2), z1)
        variables = self.encoder.trainable_variables + self.predictor.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


def make_gan(cls, seed):
    keras.utils.set_random_seed(seed)
    return cls(mlp(1, "discriminator"), mlp(FEATURES, "generator"))


def vae(seed):
    keras.utils.set_random_seed(seed)
    decoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6, activation="relu"), keras.layers.Dense(FEATURES)])
    return VAE(mlp(4, "encoder"), decoder)


def distiller(seed):
    keras.utils.set_random_seed(seed)
    return Distiller(mlp(3, "student"), mlp(3, "teacher"))


def simsiam(seed):
    keras.utils.set_random_seed(seed)
    return SimSiam(mlp(4, "encoder"), keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)], name="predictor"))


def gan_compile(model, **options):
    model.compile(
        keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05), keras.losses.BinaryCrossentropy(from_logits=True), **options
    )


def distiller_compile(model, **options):
    model.compile(
        keras.optimizers.SGD(0.1), ["sparse_categorical_accuracy"],
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.losses.KLDivergence(), **options,
    )


def standard_compile(model, **options):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], **options)


def sgd_compile(model, **options):
    model.compile(optimizer=keras.optimizers.SGD(0.1), **options)
