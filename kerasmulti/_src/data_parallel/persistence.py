"""Saving a parallel model saves its template: the wrapper is a view.

A parallel model owns no weights, so every file it writes is the template's,
loadable with plain Keras, and loading fills the template, which the
parallel model trains. The paths are checked first (a missing folder, a
folder where a file goes, a damaged file), and weights Keras refuses after
loading the layers that fit are put back as they were. Keras saves no weights
of a model it does not consider built, which a model without `call` (a GAN)
never is: once all its parts have weights it is marked built, so its
checkpoints and backups are written and read as any model's.

Files are written and read with this model's compile settings and optimizer,
which the template holds (`compile` shares them), unless it was compiled again
afterwards, by its user or by another parallel model of it: then the
template's are swapped for this model's during the write or read, and put
back as they were.

Keras loads an optimizer's state only into an optimizer that has its
variables, which it makes at the first step: loaded before it (a resume),
the state is skipped with a warning. Loading weights fills them all: the
compiled optimizer is built first, and the ones a model keeps itself (a
GAN's `d_optimizer`, `g_optimizer`, built in the model's own first step) load
their saved state as Keras builds them.
"""

from __future__ import annotations

import contextlib
import io
import warnings
import zipfile

import h5py
import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel.custom_steps import parts_built
from kerasmulti._src.utils.arguments import check_readable_file, check_save_path


class TemplatePersistence:
    """`save`, `save_weights`, `load_weights`, `export` and `summary` on `self._template`; no `get_config`."""

    def save(self, filepath, *args, **kwargs):
        """Saves the template model (see `keras.Model.save`).

        The file holds the parallel model's compile settings and optimizer
        (see `compile`, and the module docstring), as
        `ModelCheckpoint` on a compiled model would, and
        `keras.models.load_model` returns a model ready to evaluate or
        continue training. Legacy `.h5` files are written without them
        (`include_optimizer=False`): Keras' legacy loader cannot read back
        some compile settings, such as `loss="mse"`.
        """
        zipped = kwargs.get("zipped", args[1] if len(args) > 1 else None)
        check_save_path("save", filepath, folder_allowed=zipped is False)
        if str(filepath).endswith(".h5"):
            kwargs.setdefault("include_optimizer", False)
        _built_once_parts_are(self._template)
        with self._compiled_as_this():
            return self._template.save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Saves the template's weights (see `keras.Model.save_weights`)."""
        check_save_path("save_weights", filepath)
        _built_once_parts_are(self._template)
        with self._compiled_as_this():
            return self._template.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Loads weights into the template (see `keras.Model.load_weights`); a file that does not fit changes nothing."""
        check_readable_file(filepath, "weights", not_found=FileNotFoundError)
        _built_once_parts_are(self._template)
        template = self._template
        with self._compiled_as_this(), _unchanged_if_refused(template, filepath):
            with optimizers_loaded(template, filepath, getattr(self, "_strategy", None)):
                return template.load_weights(filepath, *args, **kwargs)

    def export(self, filepath, *args, **kwargs):
        """Exports the template (see `keras.Model.export`): it serves on one device, as any Keras model."""
        return self._template.export(filepath, *args, **kwargs)

    def get_config(self):
        """Refused: Keras would save this wrapper's class with the template's config, a file none can load."""
        # `keras.saving.save_model(parallel)` and `to_json()` come here, not to `save`.
        raise NotImplementedError(
            "A parallel model has no config of its own. Save it with model.save(path), which writes its template, "
            f"or use kerasmulti.unwrap(model). Received: model={self.name!r}"
        )

    def _compiled_as_this(self):
        """Inside: the template has this model's compile settings and optimizer (see the module docstring)."""
        template = self._template
        # A template with steps of its own trains with its own compile; an uncompiled one has none to put back.
        if self._custom is not None or not (self.compiled and template.compiled) or template.optimizer is self.optimizer:
            return contextlib.nullcontext()
        return _compiled_as(template, dict(keras_private.compile_arguments(self), optimizer=self.optimizer))

    def summary(self, *args, **kwargs):
        """Prints the template's summary, preceded by the replica devices."""
        print(
            f"Data-parallel over {len(self._replica_devices)} device(s): "
            f"{', '.join(self._replica_devices)}; merge on {self._merge_device}."
        )
        return self._template.summary(*args, **kwargs)


@contextlib.contextmanager
def _compiled_as(template, arguments: dict):
    """Inside: `template` compiled with `arguments`; after, its compile settings and optimizer as they were."""
    found = dict(vars(template))
    own = dict(keras_private.compile_arguments(template), optimizer=template.optimizer)
    # auto_scale_loss=False: each optimizer is already as its model trains it (wrapped for mixed_float16 or not).
    template.compile(**arguments, auto_scale_loss=False)
    compiled = [name for name, value in found.items() if vars(template).get(name) is not value]
    try:
        yield
    finally:
        template.compile(**own, auto_scale_loss=False)  # what Keras tracks by name (its optimizer) as it was
        # ... and the very objects the user's compile made (loss, metrics, traced steps), not new ones.
        vars(template).update({name: found[name] for name in compiled})


@contextlib.contextmanager
def optimizers_loaded(template, filepath, strategy=None):
    """Inside: loading `filepath` into `template` fills its optimizers too, also those Keras has not built."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():  # a worker's optimizer is the strategy's
        unbuilt = _optimizer_states(template, filepath)
    with warnings.catch_warnings():
        for optimizer in unbuilt:  # loaded as Keras builds it: its warning says otherwise
            warnings.filterwarnings("ignore", message=f"Skipping variable loading for optimizer '{optimizer.name}'")
        yield
    for optimizer, saved in unbuilt.items():
        _load_when_built(optimizer, saved)


def _optimizer_states(template, filepath) -> dict:
    """Builds the compiled optimizer if `filepath` holds its state; returns the model's own unbuilt ones' saved states."""
    optimizer = getattr(template, "optimizer", None)
    own = {name: o for name, o in vars(template).items() if isinstance(o, keras.optimizers.Optimizer) and o is not optimizer}
    if (optimizer is None or optimizer.built) and all(o.built for o in own.values()):
        return {}  # nothing Keras would skip: the file is read once, by Keras
    unbuilt = {}
    with _weights_file(str(filepath)) as f:
        if f is None:
            return unbuilt
        if optimizer is not None and not optimizer.built and len(f.get("optimizer/vars", ())) > len(optimizer.variables):
            optimizer.build(template.trainable_variables)
        for name, candidate in own.items():
            saved = f.get(f"{name}/vars")  # where Keras writes a model's attribute
            if not candidate.built and saved is not None and len(saved) > len(candidate.variables):
                unbuilt[candidate] = {key: saved[key][()] for key in saved}
    return unbuilt


@contextlib.contextmanager
def _weights_file(path: str):
    """The HDF5 weights of a `.weights.h5` or `.keras` file (None for others, or one h5py cannot read)."""
    try:
        if path.endswith(".keras"):
            with zipfile.ZipFile(path) as archive:
                source = io.BytesIO(archive.read("model.weights.h5"))
        elif path.endswith(".weights.h5"):
            source = path
        else:
            source = None
        f = None if source is None else h5py.File(source, "r")
    except (OSError, KeyError, zipfile.BadZipFile):  # Keras' own load says what is wrong with the file
        f = None
    try:
        yield f
    finally:
        if f is not None:
            f.close()


def _load_when_built(optimizer, saved: dict) -> None:
    # What it has before it is built (its step count, learning rate) is read
    # now, so a callback before the first step sees the saved step; all of it
    # as Keras builds it, or none if the saved optimizer was another (Keras warns).
    pending = vars(optimizer).get("build")
    if pending is not None:  # loaded again before its first step: the latest file wins
        pending.saved = saved
    else:
        build, before = optimizer.build, [variable.numpy() for variable in optimizer.variables]

        def build_then_load(variables):
            build(variables)
            del optimizer.build  # the class's own again
            with tf.init_scope():  # once, now: not an assignment in every step's graph
                if len(build_then_load.saved) != len(optimizer.variables):  # another optimizer's: Keras skips it
                    for variable, value in zip(optimizer.variables, before):
                        variable.assign(value)
                optimizer.load_own_variables(build_then_load.saved)

        build_then_load.saved = saved
        optimizer.build = build_then_load
    for i, variable in enumerate(optimizer.variables):
        variable.assign(saved[str(i)])


def _built_once_parts_are(template) -> None:
    # What the user of a GAN does by hand (`gan.built = True`): its parts hold every weight.
    if not template.built and parts_built(template):
        template.built = True


@contextlib.contextmanager
def _unchanged_if_refused(template, filepath):
    """Puts the weights back when Keras refuses a file after loading the layers that fit it."""
    optimizer = getattr(template, "optimizer", None)
    variables = list(template.variables) + (list(optimizer.variables) if optimizer is not None else [])
    values = [v.numpy() for v in variables]
    try:
        yield
    except Exception as error:
        for variable, value in zip(variables, values):
            variable.assign(value)
        if not isinstance(error, ValueError) or not any(s in str(error) for s in ("could not be loaded", "mismatch")):
            raise
        from kerasmulti._src.model_parallel.on_device import OnDevice  # an error's words only

        placed = any(isinstance(layer, OnDevice) for layer in keras_private.flatten_layers(template))
        # A pipeline cut with gpus=N is placed though its user placed nothing (docs/model-parallel.md).
        hint = " (a placed model's .weights.h5 holds its placed layout: move weights to or from a plain model in a .keras file)"
        raise ValueError(
            f"load_weights() could not load the file into '{template.name}': its weights do not fit this "
            f"model's ({keras_load_reason(error)}); the weights are unchanged. Load a file from this model"
            f"{hint if placed else ''}, or pass skip_mismatch=True. Received: filepath={str(filepath)!r}"
        ) from error


def keras_load_reason(error: Exception) -> str:
    """Keras' reason for refusing a weights file, without the dump of values its message ends with."""
    return " ".join(str(error).split("Target variable:")[0].split())[:400]
