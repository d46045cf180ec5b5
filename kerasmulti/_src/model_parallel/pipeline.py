"""`pipeline`: a placed model's stages work at the same time, on micro-batches.

A model placed over devices (`device_scope`, `on_device`) runs its stages one
after the other: while the second device works, the first waits. Cut into M
micro-batches, the batch runs as M replicas of the model on the same stages,
inside one step: TensorFlow runs an op as soon as its inputs are ready, so
stage 1 works on micro-batch m + 1 while stage 2 works on micro-batch m (the
forward and backward passes of GPipe, scheduled by the dataflow). The
replicas are a parallel model's (`data_parallel/`), all on the first stage's
device, their placed layers on their own: the loss, metrics, sample weights,
the losses layers add and BatchNormalization (the whole batch's statistics)
are the whole batch's, as on one device, and the gradients are summed.
With `schedule="1f1b"`, micro-batch m starts only once micro-batch m - S
has its gradients (S stages), so at most S micro-batches' activations are
kept at once, as in 1F1B (PipeDream-Flush), instead of all M (`schedules.py`).

An unplaced functional or Sequential model with `gpus=N` is cut into N stages
first: its layers, in the order the graph runs them, are split into N runs
whose largest cost (parameters and an estimate of each layer's multiply-adds
per row) is the least possible, and the model is rebuilt with the same layer
objects, each called on its stage's device (`rebuild.py`).
"""

from __future__ import annotations

import contextlib
import math

import keras
import tensorflow as tf

from kerasmulti._src import keras_private
from kerasmulti._src.data_parallel import compiled as _compiled
from kerasmulti._src.data_parallel import compiled_calls as _compiled_calls
from kerasmulti._src.data_parallel import relocation as _relocation
from kerasmulti._src.data_parallel.local_model import LocalParallelModel
from kerasmulti._src.data_parallel.parallel_model import ParallelModel, unwrap
from kerasmulti._src.data_parallel.wrap import check_model, warn_row_mixing
from kerasmulti._src.devices import DeviceError, known_devices, resolve_device, resolve_devices
from kerasmulti._src.model_parallel import schedules as _schedules
from kerasmulti._src.model_parallel import segments as _segments
from kerasmulti._src.model_parallel.on_device import OnDevice
from kerasmulti._src.model_parallel.rebuild import REBUILDABLE, rebuilt
from kerasmulti._src.utils.arguments import is_int


class PipelineModel(LocalParallelModel):
    """A placed model trained and run on micro-batches; made by `pipeline`.

    It shares every weight with its template (`kerasmulti.unwrap`), and saves
    the template, as a parallel model does.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    piped = kerasmulti.pipeline(model, gpus=2, microbatches=4)
    print(piped.stages, piped.microbatches)
    ```
    """

    def __init__(self, template, stages, microbatches: int, schedule: str = "gpipe"):
        # Each part is cut, and the outputs joined, on the host, as parallelize's merge does.
        super().__init__(template, [stages[0]] * microbatches, "/cpu:0")
        self.name = f"pipeline_{template.name}"
        self._stages = list(stages)
        self._schedule = schedule
        self._fallback_warned = []  # `schedules.InFlight`: a 1F1B step that runs GPipe's, once
        self._stage_xla = False  # the placed layers' calls as XLA programs (`compile`)
        self._segments = None  # (the template's layers, `segments.runs` of them), found at the first step

    def compile(self, *args, jit_compile="auto", **kwargs):
        """Configures training as `keras.Model.compile`.

        `jit_compile` runs the placed layers' calls, and their gradients, as
        XLA programs on their stages' devices (one per stage where the layers
        form a chain, `segments.py`): True forces it, "auto" turns it on
        where every stage is a GPU (as Keras turns XLA on with a GPU), False
        keeps the stages uncompiled. BatchNormalization layers run uncompiled
        (their statistics are the whole batch's), and so does a placed
        sub-model that holds one, after a warning.
        """
        if self._custom is not None:
            return super().compile(*args, jit_compile=jit_compile, **kwargs)
        _compiled.check_jit_compile(jit_compile)
        if jit_compile == "auto":
            jit_compile = all(tf.DeviceSpec.from_string(stage).device_type == "GPU" for stage in self._stages)
        self._stage_xla = jit_compile and not kwargs.get("run_eagerly", False)
        return super().compile(*args, jit_compile=False, **kwargs)

    @property
    def replica_jit_compile(self) -> bool:
        """Whether the placed layers' calls run as XLA programs on their stages' devices (see `compile`)."""
        return self._stage_xla

    def train_step(self, data):
        with self._compiled_stages():
            return super().train_step(data)

    def test_step(self, data):
        with self._compiled_stages():
            return super().test_step(data)

    def predict_step(self, data):
        with self._compiled_stages():
            return super().predict_step(data)

    def _microbatch_order(self):
        if self._schedule == "1f1b" and self.microbatches > len(self._stages):
            return _schedules.InFlight(len(self._stages), self._template.name, self._fallback_warned)
        return None

    def _sum_device(self, variable) -> str:
        # The variable's device, its stage's, where the micro-batches' gradients are: none crosses to the host.
        return variable.value.device

    def _compiled_stages(self):
        """While a step is traced: the placed layers' calls compiled, where `compile` asked for it."""
        if not self._stage_xla:
            return contextlib.nullcontext()
        layers = [id(layer) for layer in self._template.layers]
        if self._segments is None or self._segments[0] != layers:
            self._segments = (layers, _segments.runs(self._template))
        if self._segments[1] is not None:  # a chain of placed layers: one program per stage
            return _segments.compiled(self._template, self._segments[1])
        placed = []
        for wrapper in keras_private.flatten_layers(self._template, include_self=False):
            layer = getattr(wrapper, "layer", None)
            if isinstance(wrapper, OnDevice) and not isinstance(layer, keras.layers.BatchNormalization):
                if all(layer is not other for other in placed):  # a layer called twice: once
                    placed.append(layer)
        return _compiled_calls.compiled(placed)

    @property
    def stages(self) -> list[str]:
        """The devices the template's stages run on, in the order the graph first reaches them."""
        return list(self._stages)

    @property
    def schedule(self) -> str:
        """"gpipe" (every forward pass, then every backward pass) or "1f1b" (at most one micro-batch per stage in flight)."""
        return self._schedule

    @property
    def microbatches(self) -> int:
        """How many micro-batches each batch is cut into (a batch with fewer rows: one per row)."""
        return len(self._replica_devices)

    def summary(self, *args, print_fn=None, **kwargs):
        """Prints the template's summary, preceded by the stages and micro-batches."""
        (print_fn or print)(f"Pipelined over {len(self._stages)} stage(s): {', '.join(self._stages)}; {self.microbatches} micro-batches.")
        return self._template.summary(*args, print_fn=print_fn, **kwargs)


def pipeline(model: keras.Model, microbatches: int, gpus: int | None = None, schedule: str = "gpipe") -> PipelineModel:
    """Runs a model placed over devices as a pipeline of micro-batches.

    Each batch is cut along axis 0 into `microbatches` parts (sizes differ by
    at most one; a batch with fewer rows makes fewer parts), and the parts
    flow through the model's stages in one step, so the devices work at the
    same time instead of in turn. Results equal those of the model on one
    device with the whole batch: loss, metrics, gradients, sample and class
    weights, masks, the losses layers add, and BatchNormalization, whose
    statistics are the whole batch's (its layers then wait for every part,
    which costs overlap). Random draws (Dropout) are each part's own, as
    each replica's are with `parallelize`. A compiled model comes compiled. The returned model shares the template's weights:
    compile, fit, evaluate, predict and save it, with kerasmulti's callbacks,
    as a model from `parallelize`.

    The stages are the devices the model's layers are placed on
    (`device_scope`, `on_device`). With `gpus=N`, an unplaced functional or
    Sequential model is cut into N stages of similar cost on the first N
    devices of `available_devices()`, its layers in the order the graph runs
    them (`placement_summary(kerasmulti.unwrap(piped))` shows the cut).

    Args:
        model: A `keras.Model`: placed over at least two devices, or, with
            `gpus`, an unplaced functional or Sequential model.
        microbatches: How many parts each batch is cut into, at least 1. More
            parts overlap more, and each is a smaller step: 4 to 8 per stage
            is a start.
        gpus: Cut an unplaced model into this many stages, at least 2.
        schedule: "gpipe" runs every micro-batch's forward pass as soon as it
            can, keeping all their activations until the backward passes;
            "1f1b" starts micro-batch m once micro-batch m - S has its
            gradients (S stages), keeping at most S micro-batches'
            activations, for the same numbers. Not with BatchNormalization
            (every micro-batch must pass it first) or a step of the model's own.

    Returns:
        A `PipelineModel`.

    Raises:
        TypeError: If `model` is not a `keras.Model`, `microbatches` or
            `gpus` not an int, or `schedule` not a string.
        ValueError: If `microbatches` or `gpus` is out of range; if the
            model is not built, or comes from `parallelize`; if a placed
            model has one stage and no `gpus`, or a placed model is given
            `gpus`; if a model to cut is not functional or Sequential, or
            has fewer layers than stages; for an unknown `schedule`, or
            "1f1b" with BatchNormalization or a step of the model's own.
        DeviceError: If a stage's device does not exist on this machine.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)  # only without GPUs, before TensorFlow starts
    import keras, numpy as np
    first, second = kerasmulti.available_devices()[:2]
    inputs = keras.Input((8,))
    with kerasmulti.device_scope(first):
        hidden = keras.layers.Dense(32, activation="relu")(inputs)
    with kerasmulti.device_scope(second):
        outputs = keras.layers.Dense(1)(hidden)
    piped = kerasmulti.pipeline(keras.Model(inputs, outputs), microbatches=4)
    piped.compile(optimizer="adam", loss="mse")
    piped.fit(np.ones((64, 8)), np.ones((64, 1)), batch_size=16, verbose=0)
    ```
    """
    if isinstance(model, ParallelModel) and not isinstance(model, PipelineModel):
        raise ValueError(
            "pipeline() of a parallel model is not built yet (docs/model-parallel.md). Pass its template. "
            f"Received: model={model.name!r}"
        )
    if not is_int(microbatches):
        raise TypeError(
            f"pipeline() takes microbatches as an int, such as 4. Received: microbatches={microbatches!r}"
        )
    if microbatches < 1:
        raise ValueError(f"pipeline() needs microbatches of at least 1. Received: microbatches={microbatches!r}")
    check_model(model, "pipeline()", replicas=int(microbatches))  # one micro-batch: nothing is split
    template = unwrap(model)
    if microbatches > 1:
        warn_row_mixing(template, stacklevel=2, part="micro-batch")
    _schedules.check(schedule, template)
    placed, xla = stage_devices(template), False
    if gpus is None:
        if len(placed) < 2:
            raise ValueError(
                "pipeline() needs a model placed over 2+ devices (device_scope), or gpus= to cut it. "
                f"Received: stages={placed}"
            )
        missing = [device for device in placed if device not in known_devices()]
        if missing:  # a model loaded on another machine
            raise DeviceError(
                f"pipeline() got a model placed on {', '.join(missing)}, which this machine does not have. Move them "
                f"with kerasmulti.remap_devices(model, {{'{missing[0]}': '/cpu:0'}}). Received: stages={placed}"
            )
        stages = [resolve_device(device, "pipeline()") for device in placed]
    else:
        if placed:
            raise ValueError(
                f"pipeline() cuts unplaced models only; this one is placed. Drop gpus=. Received: gpus={gpus!r}"
            )
        if not is_int(gpus):
            raise TypeError(f"pipeline() takes gpus as an int, the number of stages. Received: gpus={gpus!r}")
        if gpus < 2:
            raise ValueError(f"pipeline() cuts a model into gpus= stages, at least 2. Received: gpus={gpus!r}")
        stages = resolve_devices(int(gpus), caller="pipeline()")
        # Compiled with XLA on: its stages get XLA (the placed copy's compile records it off, as Keras refuses it).
        xla = getattr(template, "compiled", False) and keras_private.compile_arguments(template).get("jit_compile") is True
        template = cut(template, stages)
        # Each stage's weights on its device, as device_scope creates them: a model too big for one device fits.
        devices = _variable_stages(template)
        _relocation.relocate(template, lambda variable: devices.get(id(variable)), sharing=[unwrap(model)])
        _without_xla(unwrap(model))
    piped = PipelineModel(template, stages, int(microbatches), schedule)
    piped._adopt_template_compile()  # a compiled model (loaded from a file) comes compiled, its optimizer and all
    if gpus is not None and xla and piped.compiled:
        piped._stage_xla = True  # as `compile(jit_compile=True)` sets it
    return piped


def _without_xla(model: keras.Model) -> None:
    """`model`'s own steps without XLA: its weights lie on several devices now, which one XLA program cannot read.

    Keras' `jit_compile="auto"` reads `supports_jit`; a model compiled with XLA on gets its steps made again.
    """
    model.supports_jit = False
    if getattr(model, "compiled", False) and model.jit_compile:
        model.jit_compile = False
        model.train_function = model.test_function = model.predict_function = None


def _variable_stages(model: keras.Model) -> dict:
    """The device of the stage each placed layer's variable belongs to, by the variable's id."""
    devices = {}
    for wrapper in keras_private.flatten_layers(model, include_self=False):
        if isinstance(wrapper, OnDevice):
            devices.update((id(variable), wrapper.device) for variable in wrapper.layer.variables)
    return devices


def stage_devices(model: keras.Model) -> list[str]:
    """The devices `model`'s placed layers run on, in the order its layers list them."""
    devices = []
    for layer in keras_private.flatten_layers(model, include_self=False):
        if isinstance(layer, OnDevice) and layer.device not in devices:
            devices.append(layer.device)
    return devices


def cut(model: keras.Model, devices: list[str]) -> keras.Model:
    """`model` rebuilt with its layers on `devices`, in graph order, in stages of balanced cost."""
    if type(model) not in REBUILDABLE:
        raise ValueError(
            "pipeline() cuts functional and Sequential models only; place a subclassed one with "
            f"device_scope. Received: model={type(model).__name__}"
        )
    layers = _in_graph_order(model)
    if len(layers) < len(devices):
        raise ValueError(
            f"pipeline() cannot cut {len(layers)} layer(s) into {len(devices)} stages. Pass fewer gpus=. "
            f"Received: gpus={len(devices)}"
        )
    stages = {}  # one wrapper per layer: a layer called twice goes through it twice, as before
    for stage, (start, end) in enumerate(_balanced(len(devices), [_cost(layer) for layer in layers])):
        for layer in layers[start:end]:
            # This cut's own wrapper, named as its layer: the model's outputs keep their names.
            stages[id(layer)] = OnDevice(layer, devices[stage], _validated=True, name=layer.name)
    # An operation that is not a layer (a keras.ops call, the mask Embedding adds) is not placed,
    # as in device_scope: TensorFlow chooses its device (docs/model-parallel.md).
    piped = rebuilt(model, lambda layer, node: stages.get(id(layer), layer))
    if model.compiled:  # compiled as the model was, with its optimizer and its state
        # Placed layers refuse XLA; the pipeline compiles each stage (`compile`).
        _compiled.compile_as_given(piped, dict(keras_private.compile_arguments(model), optimizer=model.optimizer))
    return piped


def _balanced(stages: int, costs: list) -> list[tuple[int, int]]:
    """`stages` runs of `costs` covering it in order, none empty, whose largest sum is the least possible."""
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: the least largest sum of k runs covering costs[:i]; cut[k][i]: where the last run starts.
    best = [[math.inf] * (len(costs) + 1) for _ in range(stages + 1)]
    cut = [[0] * (len(costs) + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, len(costs) + 1):
            for j in range(k - 1, i):
                largest = max(best[k - 1][j], prefix[i] - prefix[j])
                if largest < best[k][i]:
                    best[k][i], cut[k][i] = largest, j
    runs, end = [], len(costs)
    for k in range(stages, 0, -1):
        runs.append((cut[k][end], end))
        end = cut[k][end]
    return runs[::-1]


def _in_graph_order(model: keras.Model) -> list:
    if isinstance(model, keras.Sequential):
        return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    by_depth = keras_private.nodes_by_depth(model)
    layers = []
    for depth in sorted(by_depth, reverse=True):
        for node in by_depth[depth]:
            if isinstance(node.operation, keras.layers.Layer) and not node.is_input and node.operation not in layers:
                layers.append(node.operation)
    return layers


def _cost(layer) -> float:
    """Parameters, plus multiply-adds per row: each weight once per output position (a Dense: once)."""
    parameters = layer.count_params() if layer.built else 0
    try:
        shape = tuple(layer.output.shape)
    except (AttributeError, ValueError):  # a layer called more than once: its weights count
        shape = None
    positions = math.prod(d or 1 for d in shape[1:-1]) if shape is not None and len(shape) > 2 else 1
    outputs = math.prod(d or 1 for d in shape[1:]) if shape is not None else 0
    return parameters + parameters * positions + outputs
