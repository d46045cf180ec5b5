"""Saving a parallel model saves its template: the wrapper is a view.

A parallel model owns no weights, so every file it writes is the template's,
loadable with plain Keras, and loading fills the template, which the
parallel model trains.
"""

from __future__ import annotations


class TemplatePersistence:
    """`save`, `save_weights`, `load_weights`, `get_config` and `summary` on `self._template`."""

    def save(self, filepath, *args, **kwargs):
        """Saves the template model (see `keras.Model.save`).

        The template carries the parallel model's compile settings and
        optimizer (see `compile`), so a `.keras` file holds them, as
        `ModelCheckpoint` on a compiled model would, and
        `keras.models.load_model` returns a model ready to evaluate or
        continue training. Legacy `.h5` files are written without them
        (`include_optimizer=False`): Keras' legacy loader cannot read back
        some compile settings, such as `loss="mse"`.
        """
        if str(filepath).endswith(".h5"):
            kwargs.setdefault("include_optimizer", False)
        return self._template.save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        """Saves the template's weights (see `keras.Model.save_weights`)."""
        return self._template.save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        """Loads weights into the template (see `keras.Model.load_weights`)."""
        return self._template.load_weights(filepath, *args, **kwargs)

    def get_config(self):
        return self._template.get_config()

    def summary(self, *args, **kwargs):
        """Prints the template's summary, preceded by the replica devices."""
        print(
            f"Data-parallel over {len(self._replica_devices)} device(s): "
            f"{', '.join(self._replica_devices)}; merge on {self._merge_device}."
        )
        return self._template.summary(*args, **kwargs)
