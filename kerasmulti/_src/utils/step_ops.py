"""The TensorFlow operations a step runs outside XLA, counted by TensorFlow's profiler.

A step's fixed cost is what its executor pays per operation it runs outside
XLA (a few microseconds each on a GPU host): reading a variable, sending a
tensor to another device, an `AddN`. A step whose count grows with the number
of variables gets slower as the model grows, whatever the devices do. The
profiler records one host event per operation the executor runs, named
`name:Type`, and one per XLA program run (`...Executable::ExecuteAsyncOnStream`;
TensorFlow 2.16's XLA runtime on CPUs records none), so the count is exact and
does not depend on the machine's load (unlike a timing). Keras' own
XLA-compiled step runs one: its whole step.

`benchmarks/bench_step_ops.py` prints the counts; the tests hold the compiled
parallel step to a count that does not grow with the model.
"""

from __future__ import annotations

import collections
import glob
import re
import tempfile
from dataclasses import dataclass
from typing import Callable

import tensorflow as tf

from kerasmulti._src import keras_private

_OPERATION = re.compile(r"[^:\s]+:([A-Za-z_]\w*)")
_XLA_RUN = re.compile(r"\w*Executable::ExecuteAsyncOnStream")


@dataclass
class StepOps:
    """Per step: the operations run outside XLA by type, and the XLA programs run."""

    by_type: dict
    xla_programs: float

    @property
    def outside_xla(self) -> float:
        return sum(self.by_type.values())

    def top(self, n: int = 5) -> str:
        """The `n` most frequent types, as `Type count, ...`."""
        ranked = sorted(self.by_type.items(), key=lambda item: -item[1])[:n]
        return ", ".join(f"{name} {count:g}" for name, count in ranked)


def count(step: Callable[[], object], steps: int = 3) -> StepOps:
    """Runs `step()` `steps` times under the profiler; what one step ran, on average.

    Run `step` once before, so that tracing and compiling are not counted.
    """
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(steps):
                step()
        finally:
            tf.profiler.experimental.stop()
        events = collections.Counter()
        for path in glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True):
            space = keras_private.xplane_pb2.XSpace()
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
            for plane in space.planes:
                if plane.name.startswith("/host:"):
                    names = plane.event_metadata
                    events.update(names[e.metadata_id].name for line in plane.lines for e in line.events)
    by_type = collections.Counter()
    xla = 0
    for name, n in events.items():
        operation = _OPERATION.fullmatch(name)
        if operation:
            by_type[operation.group(1)] += n
        elif _XLA_RUN.fullmatch(name):
            xla += n
    return StepOps({name: n / steps for name, n in by_type.items()}, xla / steps)
