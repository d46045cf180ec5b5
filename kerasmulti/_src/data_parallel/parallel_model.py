"""`ParallelModel`: data parallelism for an existing Keras 3 model.

Built by `parallelize` (`parallelize.py`), which returns one of its two
kinds: `LocalParallelModel` (`local_model.py`) runs the replicas on this
process's devices, `WorkerModel` (`multi_worker/worker_model.py`) on every
worker's, through `tf.distribute`. What they share lives here: the wrapper
owns no weights but tracks the template, so training the wrapper trains the
template and saving either saves the template (`persistence.py`); it is
compiled as the template is and lends it attributes (`template_access.py`);
and a template with steps of its own runs them through one interface
(`run(step, data)`, `predict(data)`; `custom_steps.CustomSteps` in one
process, `worker_steps.WorkerSteps` across workers).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import call_checks as _call_checks
from kerasmulti._src.data_parallel import compiled as _compiled
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel import loss_parts as _loss_parts
from kerasmulti._src.data_parallel import persistence as _persistence
from kerasmulti._src.data_parallel import sync_batchnorm as _sync_batchnorm
from kerasmulti._src.data_parallel import template_access as _template_access


class ParallelModel(_persistence.TemplatePersistence, _template_access.TemplateAccess, keras.Model):
    """A data-parallel view of a template model; build it with `parallelize`.

    It is a `keras.Model`: compile, fit, evaluate, predict and call it as the
    template. It owns no weights (they are the template's), and `save`,
    `save_weights` and `load_weights` act on the template.

    Example:

    ```python
    import keras, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    parallel = kerasmulti.parallelize(model)
    print(parallel.replica_devices)
    ```
    """

    def __init__(self, template, devices, merge_device, **kwargs):
        # The template's dtype policy, casting nothing: under a global mixed policy, a float32
        # template gets its inputs as given and an optimizer without loss scaling, as on one device.
        super().__init__(name=f"parallel_{template.name}", dtype=template.dtype_policy, autocast=False, **kwargs)
        self._template = template
        self._replica_devices = list(devices)
        self._merge_device = merge_device
        self._batchnorm = _sync_batchnorm.batchnorm_layers(template)
        # The template's own steps, where it has some, run by the kind's executor.
        self._custom = self._custom_steps() if _custom_steps.overridden(template) else None
        self._compiled = None  # the replicas' XLA step (`compiled.py`), where this kind compiles them
        self._timing = None  # step timing (`ThroughputMonitor`, `split="auto"`)
        self._fit_calls = 0
        self._validates = None  # whether the running fit has validation data (`_fit_started`)
        self._fit_callbacks = []  # the running fit's callbacks (`_fit_started`)
        self._rows_probed = False  # `row_mixing.probe_once`: the first fit/evaluate/predict
        self._loss_probed = False  # `row_mixing.probe_loss_once`: the first fit
        self._template_on_host = False  # `cpu_relocation` moved the template's variables to the host
        if hasattr(template, "output_names"):
            self.output_names = template.output_names
        self.built = True

    def _custom_steps(self):
        """The runner of the template's own steps: `run(step, data)`, `predict(data)`, `overridden`, `compiles`."""
        raise NotImplementedError

    def _outer_jit_compile(self, jit_compile, run_eagerly: bool):
        """Prepares the replicas' compiled steps, if any; returns `jit_compile` for the step that spans them."""
        raise NotImplementedError

    def _new_timing(self):
        """A new step timing over this model's replicas (`balance.py`)."""
        raise NotImplementedError

    def compile(self, *args, jit_compile="auto", **kwargs):
        """Configures training as `keras.Model.compile`.

        The template is compiled with the same settings and shares the
        optimizer, so it can be evaluated on one device and saved with its
        training state. XLA compiles a step for one device, so with several
        devices of one process `jit_compile` applies to each replica's part of the step
        (forward pass, loss and gradients) on its own device
        (`compiled.py`): `"auto"` turns it on where Keras would (a GPU),
        True forces it (CPU devices too), False keeps the uncompiled
        replicas, whose BatchNormalization statistics are the whole batch's.

        A template with steps of its own (`custom_steps.py`) is compiled with its own `compile`
        signature (a GAN's `compile(d_optimizer, g_optimizer, loss_fn)`); XLA compiles its model calls.
        """
        if self._custom is not None:
            return self._compile_custom(args, kwargs, jit_compile)
        _call_checks.check_compile(args, kwargs)
        requested = jit_compile
        jit_compile = self._outer_jit_compile(jit_compile, kwargs.get("run_eagerly", False))
        super().compile(*args, jit_compile=jit_compile, **kwargs)
        auto_scale_loss = kwargs.get("auto_scale_loss", True)
        if auto_scale_loss and self._template.dtype_policy.name == "mixed_float16":
            # What Keras does for a mixed_float16 model, when only the
            # template (not the global policy) is mixed.
            self._scale_losses()
        # The template is compiled alike, sharing the optimizer: files saved
        # from either hold the training state, and a backup's layout is the
        # same in every process (it does not depend on whether a save ran).
        # Keras' compile config leaves auto_scale_loss out; without it the
        # template would wrap the shared optimizer in a LossScaleOptimizer.
        # Its `jit_compile` is the one asked for (for its own steps and files),
        # off where `cpu_relocation` put its weights on the host.
        if self.__dict__.get("_adopting") and self.optimizer is self._template.optimizer and not self._template_on_host:
            return  # compiled after the template, as it is (`_adopt_template_compile`)
        arguments = keras_private.compile_arguments(self)
        arguments.update(optimizer=self.optimizer, auto_scale_loss=auto_scale_loss)
        arguments.update(jit_compile=False if self._template_on_host else requested)
        _compiled.compile_as_given(self._template, arguments)

    def _resolve_auto_jit_compile(self):
        # Keras' "auto" for a model never compiled (predict straight after
        # parallelize): the outer step spans the devices, so XLA stays off.
        if len(self._replica_devices) > 1:
            return False
        return super()._resolve_auto_jit_compile()

    @property
    def replica_jit_compile(self) -> bool:
        """Whether each replica's step (a custom step: its model calls) runs compiled with XLA (see `compile`)."""
        return self._compiled is not None or (self._custom is not None and self._custom.compiles)

    @property
    def replica_devices(self) -> list[str]:
        """The devices replicas run on, in shard order."""
        return list(self._replica_devices)

    @property
    def split(self) -> list[float] | None:
        """Each device's proportion of a batch: None for even sizes; `split="auto"`: measured."""
        return None

    def _fit_started(self, arguments: dict) -> None:
        """Counts a `fit` call; notes whether it validates (a checkpoint's `val_` names) and its callbacks."""
        self._fit_calls += 1
        self._validates = arguments.get("validation_data") is not None or bool(arguments.get("validation_split"))
        callbacks = arguments.get("callbacks")
        self._fit_callbacks = list(getattr(callbacks, "callbacks", callbacks) or [])  # a backup keeps some's state

    def _time_steps(self) -> None:
        """Turns on step timing (`ThroughputMonitor`); the next fit traces its step again."""
        if self._timing is None:
            self._timing = self._new_timing()
            self.train_function = None

    def _updated_weights(self) -> list:
        """The trainable weights as read after this step's update (its end, for timing; compiled: one waits for all)."""
        weights = self.trainable_weights or [self.optimizer.iterations]
        return [tf.convert_to_tensor(v) for v in (weights[:1] if self._compiled is not None else weights)]

    def predict_step(self, data):
        if self._custom is not None and "predict_step" in self._custom.overridden:
            return self._custom.predict(data)
        return super().predict_step(data)

    def _aggregate_additional_loss(self, loss):
        # Regularisers and add_loss: each replica adds its share.
        return _loss_parts.additional_part(super()._aggregate_additional_loss(loss))


def unwrap(model: keras.Model) -> keras.Model:
    """Returns the template model behind a parallel model.

    Args:
        model: A model returned by `parallelize`, or any `keras.Model` (which
            is returned as it is).

    Returns:
        The template `keras.Model`, whose weights the parallel model trains.

    Raises:
        TypeError: If `model` is not a `keras.Model`.

    Example:

    ```python
    import keras, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    assert kerasmulti.unwrap(kerasmulti.parallelize(model)) is model
    ```
    """
    if isinstance(model, ParallelModel):
        return model._template
    if isinstance(model, keras.Model):
        return model
    raise TypeError(
        "unwrap() expects a keras.Model or a model returned by "
        f"kerasmulti.parallelize(). Received: model={type(model).__name__}"
    )
