"""What a backup holds besides the weights, so that a resumed run is the uninterrupted one.

Keras' `save_weights` writes the weights and the optimizer. A run resumed
from them still differs from the run it continues in four ways, and the
backup carries each:

- Seeded layers (Dropout, noise) draw from `SeedGenerator` states, which
  `save_weights` leaves out: the resumed run would draw the first epoch's
  masks again. Their states travel in the backup file.
- Shuffled arrays: the order of each epoch is drawn from a seed
  (`data_parallel/epoch_order.py`), written to the backup's metadata.
- A backup written in the middle of an epoch: the resumed run starts that
  epoch again, passes over the batches already trained (read, not trained:
  `skip_steps`), and the epoch's metrics go on from their saved values, so
  the epoch's logs are those of the whole epoch; the optimizers' learning
  rates are the backup's again, whatever the epoch's start set them to
  (`optimizer_scalars`).
- Callbacks that decide from past epochs (`ReduceLROnPlateau`,
  `EarlyStopping`): their counters, best value and best weights
  (`callback_state.py`).

The optimizers' states are in the weights file; the parallel model's
`load_weights` puts them back also into optimizers Keras has not built yet
(a GAN's own, `data_parallel/persistence.py`).

All of it is written into the weights file (group `kerasmulti_state`), which
is replaced atomically, so the weights and the state never disagree.
"""

from __future__ import annotations

import json

import h5py
import numpy as np
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.callbacks import callback_state as _callback_state
from kerasmulti._src.data_parallel import custom_steps as _custom_steps
from kerasmulti._src.data_parallel.parallel_model import unwrap

_GROUP = "kerasmulti_state"


def seed_states(model) -> list:
    """The state variables of every `SeedGenerator` in the model, in a fixed order."""
    states, seen = [], set()
    for layer in keras_private.flatten_layers(unwrap(model)):
        for generator in keras_private.seed_generators(layer):
            if id(generator.state) not in seen:
                seen.add(id(generator.state))
                states.append(generator.state)
    return states


def write(model, path: str, attributes: dict) -> None:
    """Adds the seed states, the metrics' values and `attributes` to the weights file at `path`."""
    metrics = model.metrics_variables
    if any(isinstance(getattr(v, "value", v), tf.distribute.DistributedValues) for v in metrics):
        # Across workers each worker holds its own part of a metric, and
        # reading the whole is a collective the chief cannot run alone: a
        # resumed epoch's logs there cover the batches after the resume.
        metrics = []
    callbacks, best_weights = _callback_state.state(getattr(model, "_fit_callbacks", None))
    with h5py.File(path, "a") as f:
        f.attrs.update(attributes)
        group = f.create_group(_GROUP)
        group.attrs["callbacks"] = callbacks
        for name, variables in (("seeds", seed_states(model)), ("metrics", metrics)):
            part = group.create_group(name)
            for i, variable in enumerate(variables):
                part.create_dataset(str(i), data=np.asarray(variable))
        part = group.create_group("best_weights")
        for i, weights in enumerate(best_weights):
            if weights is not None:
                one = part.create_group(str(i))
                for j, value in enumerate(weights):
                    one.create_dataset(str(j), data=np.asarray(value))


def read(path: str) -> dict | None:
    """`{"seeds": [...], "metrics": [...], "callbacks": ...}` from a weights file; None where it holds none (Keras wrote it).

    "callbacks": the kept callbacks' state and best weights (`callback_state`), None in an older backup.
    """
    with h5py.File(path, "r") as f:
        if _GROUP not in f:
            return None
        group = f[_GROUP]
        state = {name: [group[name][str(i)][()] for i in range(len(group[name]))] for name in ("seeds", "metrics")}
        state["callbacks"] = None
        if "callbacks" in group.attrs:
            fields, best = group.attrs["callbacks"], group["best_weights"]
            weights = [[best[k][str(j)][()] for j in range(len(best[k]))] if k in best else None
                       for k in map(str, range(len(json.loads(fields))))]
            state["callbacks"] = (fields, weights)
        return state


def assign(variables: list, values: list, what: str) -> None:
    """Sets `variables` to `values`; raises ValueError when the model's no longer match them."""
    shapes = [tuple(v.shape) for v in variables]
    if shapes != [np.shape(value) for value in values]:
        raise ValueError(f"its {what} do not match the model's ({len(values)} saved, {len(variables)} now)")
    for variable, value in zip(variables, values):
        variable.assign(value)


def restore_metrics(model, values: list, batch) -> None:
    """Sets the metrics to a backup's `values`, building them first from `batch` where no step has yet."""
    if not values:  # none saved (across workers)
        return
    if len(model.metrics_variables) != len(values):
        # Keras builds the compiled metrics as the first step traces.
        keras_private.symbolic_build(model, batch)
    assign(model.metrics_variables, values, "metrics")


def optimizer_scalars(model) -> list:
    """The optimizers' scalar variables (learning rate, iterations, loss scale), each with its value now.

    A run resumed in the middle of an epoch calls that epoch's `on_epoch_begin`
    again, after the backup was read: a callback that sets the learning rate
    from its value (`LearningRateScheduler(lambda epoch, lr: lr * 0.5)`) would
    set it twice. The backup's values are put back as the first batch is read.
    """
    optimizers = [model.optimizer] + _custom_steps.optimizers(unwrap(model))
    pairs, seen = [], set()
    for optimizer in optimizers:
        for variable in getattr(optimizer, "variables", []):
            if len(variable.shape) == 0 and id(variable) not in seen:
                seen.add(id(variable))
                pairs.append((variable, np.asarray(variable)))
    return pairs


def skip_steps(model, steps: int, first_batch, logs: dict | None = None) -> None:
    """Makes `fit`'s next epoch pass over its first `steps` batches: read, not trained.

    Keras' `fit` starts an epoch at its first batch; a run resumed in the
    middle of it reads the batches already trained (so the epoch's order goes
    on where it stopped) without training on them, and `first_batch(batch)`
    is called with the first one read. On a parallel model the batches are
    read before the epoch's first step, so callbacks see only the steps that
    train, under their true batch numbers; on another model each is a step
    that trains nothing and returns the metrics as they are. An epoch wholly
    passed over logs the metrics as restored, or `logs` where given (the
    backup's step's, across workers, where no metric is saved).
    """
    epochs = getattr(model, "_fit_epochs", None)
    epochs = epochs() if epochs is not None else None
    if epochs is None:
        _skip_in_train_function(model, steps, first_batch)
        return

    per_call = getattr(model, "steps_per_execution", 1) or 1
    if steps % per_call:
        raise ValueError(
            f"The backup resumes after step {steps}, which steps_per_execution={per_call} does not reach. "
            f"Resume with the steps_per_execution it was written with. Received: steps_per_execution={per_call}"
        )

    def passing_over(enumerate_epoch=type(epochs)._enumerate_iterator):
        del epochs._enumerate_iterator  # the epochs after this one start at their first batch
        model._passed_over = logs or True  # until a step runs: an epoch wholly passed over logs the saved metrics
        for begin, end, batches in enumerate_epoch(epochs):
            for step in range(begin, min(end + 1, steps)):
                try:
                    batch = next(batches)
                except StopIteration:  # the input ended before the backup's step: so does the epoch
                    return
                if step == 0:
                    first_batch(batch)
            if end >= steps:
                model._passed_over = False
                yield begin, end, batches

    epochs._enumerate_iterator = passing_over


def _skip_in_train_function(model, steps: int, first_batch) -> None:
    original, per_call = model.train_function, getattr(model, "steps_per_execution", 1) or 1
    remaining = [steps]

    def skipping(iterator):
        if remaining[0] <= 0:
            model.train_function = original
            return original(iterator)
        for i in range(min(per_call, remaining[0])):
            batch = next(iterator)
            if i == 0 and remaining[0] == steps:
                first_batch(batch)
        remaining[0] -= per_call
        if remaining[0] <= 0:
            model.train_function = original
        return model.get_metrics_result()

    model.train_function = skipping
