"""What a parallel model takes from its template besides its weights: compile settings, metrics, attributes.

A mixin of `ParallelModel` (`parallel_model.py`), which holds the template as
`_template` and its own steps' runner as `_custom` (`custom_steps.py`):

- compile: a template with steps of its own is compiled with its own
  signature; a template that comes compiled (loaded from a `.keras` file)
  compiles the parallel model alike at its first `fit`/`evaluate`; a template
  whose own dtype policy is `mixed_float16` gets Keras' loss scaling.
- metrics: those the template's steps update, or those its layers hold,
  which Keras leaves out of a model nested in another.
- attributes the template's own class or its user gave it, for callbacks
  written for the template (`self.model.steps_taken`).
- `fit`'s epoch iterator, kept (weakly) from Keras' `_maybe_symbolic_build`,
  where a resumed epoch passes over its trained batches (`callbacks/training_state.py`).
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Mapping

import keras

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled as _compiled


class TemplateAccess:
    """The parts of `ParallelModel` that reach into its template (see the module docstring)."""

    def _scale_losses(self) -> None:
        optimizer = self.optimizer
        if optimizer is not None and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self.optimizer = keras.optimizers.LossScaleOptimizer(optimizer, name="loss_scale_optimizer")

    def _compile_custom(self, args, kwargs, jit_compile) -> None:
        """compile() for a template with steps of its own: the template's compile, then this model's."""
        _compiled.check_jit_compile(jit_compile)
        # Not passed on: it says how this model runs the template's steps (a GAN's compile takes
        # none), and Keras would turn a template with a layer without XLA down with a warning.
        self._template.compile(*args, **kwargs)
        self._compile_as_template(jit_compile)

    def _compile_as_template(self, jit_compile="auto") -> None:
        """Compiles this model to run the compiled template's steps: its optimizer, no loss of its own.

        The model calls in each replica's step are compiled with XLA
        (`compiled_calls.py`) where `jit_compile` is True, or, at "auto",
        where Keras compiled the template's step (with a GPU).
        """
        self._compiled = None
        run_eagerly = getattr(self._template, "run_eagerly", False)
        if jit_compile == "auto":
            jit_compile = getattr(self._template, "jit_compile", False) is True
        self._custom.compiles = jit_compile and not run_eagerly and self._replica_count() > 1
        if self._replica_count() > 1:
            _warn_if_summed_loss(self._template, self._custom.overridden)
        keras.Model.compile(
            self, optimizer=self._template.optimizer, jit_compile=False, auto_scale_loss=False,
            run_eagerly=run_eagerly, steps_per_execution=getattr(self._template, "steps_per_execution", 1),
        )

    def _replica_count(self) -> int:
        """How many replicas run each step (across workers, the cluster's)."""
        return len(self._replica_devices)

    def _adopt_template_compile(self) -> None:
        """Compiles this model as the template was, if it was and this model is not yet.

        A model loaded from a `.keras` file comes compiled, its optimizer
        holding its state: the parallel model trains it without a new compile.
        """
        if self.compiled and self._custom is None:
            _warn_if_compiled_apart(self)
        if self.compiled or not getattr(self._template, "compiled", False):
            return
        if self._custom is not None:
            self._compile_as_template()
            return
        arguments = keras_private.compile_arguments(self._template)
        if arguments.get("jit_compile") is True and _compiled.xla_blockers(self._template):
            arguments["jit_compile"] = "auto"  # Keras records "auto" resolved (True with a GPU): it stays "auto"
        self._adopting = True  # the template keeps its own compile (its metrics' state, its steps)
        try:
            self.compile(**dict(arguments, optimizer=self._template.optimizer))
        finally:
            self._adopting = False

    @property
    def metrics(self):
        if self.__dict__.get("_custom") is not None:
            return self._template.metrics  # what the template's own steps update
        # Keras leaves out the metrics of a nested model (the template): those
        # its layers hold (a layer that tracks its activations) are reported,
        # as on one device; its compiled ones are this model's own.
        metrics = super().metrics
        template = self.__dict__.get("_template")
        if template is not None:
            for layer in keras_private.flatten_layers(template):
                if layer is template or not isinstance(layer, keras.Model):
                    metrics += [m for m in keras_private.own_metrics(layer) if all(m is not n for n in metrics)]
        return metrics

    def __getattr__(self, name):
        """Attributes the template's own class or the user gave it (a callback's `self.model.counter`).

        Called only when this model has no such attribute. Keras' own
        attributes and private names are not forwarded: the parallel model
        has its own, and Keras probes a model for private ones (a functional
        template's graph) that must not seem to be this model's.
        """
        template = self.__dict__.get("_template")
        if template is None or name.startswith("_"):
            raise AttributeError(name)
        if name in vars(template) or _defined_by_user_class(type(template), name):
            return getattr(template, name)
        if hasattr(type(template), name):  # Keras' (`inputs`) or a library's (keras_hub's `generate`)
            library = next(c for c in type(template).__mro__ if name in vars(c)).__module__.split(".")[0]
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}'; its template has {library}'s, which is "
                f"not lent. Use kerasmulti.unwrap(model).{name}. Received: name={name!r}"
            )
        raise AttributeError(
            f"'{type(self).__name__}' object has no attribute '{name}', and its template "
            f"'{template.name}' has none of its own to lend. Reach the template with "
            f"kerasmulti.unwrap(model). Received: name={name!r}"
        )

    def __setattr__(self, name, value):
        # Keras skips `self.x = value` where `self.x is value` already: a value only lent by the
        # template (`__getattr__`) would never become this model's own, and the model would follow
        # the template's later compile (its optimizer, not its loss). A placeholder makes it stored.
        if not name.startswith("_") and name not in self.__dict__ and "_template" in self.__dict__:
            self.__dict__[name] = _UNSET
        super().__setattr__(name, value)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        self._remember_epochs(iterator)
        super()._maybe_symbolic_build(iterator=iterator, data_batch=data_batch)

    def _get_metrics_result_or_logs(self, logs):
        # A resumed epoch whose batches were all trained already ran no step: its logs are the saved
        # metrics, or across workers (no metric saved) the logs of the backup's step (`training_state.skip_steps`).
        passed_over = not logs and self.__dict__.pop("_passed_over", False)
        if passed_over:
            return dict(passed_over) if isinstance(passed_over, dict) else self.get_metrics_result()
        return super()._get_metrics_result_or_logs(logs)

    def _remember_epochs(self, iterator) -> None:
        # The epoch iterator `fit` made: a resumed epoch passes over its trained batches there (`training_state`).
        self._fit_epochs = None if iterator is None else weakref.ref(iterator)

    def train_on_batch(self, *args, **kwargs):
        self._adopt_template_compile()
        return super().train_on_batch(*args, **kwargs)

    def test_on_batch(self, *args, **kwargs):
        self._adopt_template_compile()
        return super().test_on_batch(*args, **kwargs)


_UNSET = object()


def _defined_by_user_class(cls, name: str) -> bool:
    """Whether `name` is defined by a class of `cls`' hierarchy that is not Keras' own."""
    return any(name in vars(c) for c in cls.__mro__ if not c.__module__.startswith(("keras.", "keras_hub.")))


_warned_apart: weakref.WeakSet = weakref.WeakSet()  # templates warned about, once each


def _warn_if_compiled_apart(model) -> None:
    """Warns once where the template was compiled after the parallel model (by its user or another parallel model)."""
    template = model._template
    optimizer = getattr(template, "optimizer", None)
    if optimizer is None or optimizer is model.optimizer or template in _warned_apart:
        return
    _warned_apart.add(template)
    warnings.warn(
        "The template was compiled after the parallel model, directly or through another parallel model: this one "
        "trains and saves with its own compile; to change it, compile this one. "
        f"Received: template.optimizer={type(optimizer).__name__}",
        stacklevel=4,
    )


def _warn_if_summed_loss(template, overridden) -> None:
    """Warns where a template with steps of its own holds or is compiled with a loss summed over the rows (keras_hub's RetinaNet).

    Each replica's loss counts by its share of the rows (docs/data-parallel.md): exact for
    means, not for a sum that the step divides by a count over the whole batch.
    """
    held = [v for k, v in vars(template).items() if k != "_compile_loss"]  # its own, and those compiled (`loss`)
    summed = [v.name for v in _held_losses(held) if getattr(v, "reduction", None) == "sum"]
    if summed and overridden:
        warnings.warn(
            f"'{template.name}' runs its own steps with {summed}, sums over the rows: replicas weigh theirs by "
            "rows, exact for means only. Received: reduction='sum'",
            stacklevel=_user_stacklevel(),
        )


def _held_losses(values, depth: int = 3) -> list:
    """The `keras.losses.Loss` objects among `values`, also inside lists and dicts, `depth` levels deep."""
    found = [v for v in values if isinstance(v, keras.losses.Loss)]
    inner = [item for v in values if isinstance(v, (list, tuple, Mapping)) for item in (v.values() if isinstance(v, Mapping) else v)]
    return found + (_held_losses(inner, depth - 1) if inner and depth > 1 else [])


def _user_stacklevel() -> int:
    """The `stacklevel` of the first caller outside kerasmulti, for a warning raised where this is called."""
    frame, level = inspect.currentframe().f_back.f_back, 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith("kerasmulti."):
        frame, level = frame.f_back, level + 1
    return level
