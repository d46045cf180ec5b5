"""Every error or warning message the docs quote is the one the code produces.

The quotes are read out of the pages themselves (README.md, benchmarks/README.md,
docs/*.md), so when a page changes, its test follows it. A quote is a code
span (or a line of a fenced block) that starts with the exception's or
warning's class name, as Python prints it:

    `DeviceError: parallelize() was asked for 4 devices but ... Received: gpus=4`

"..." in a quote leaves out a part of the message: the parts around it must
appear in order, the first at the start and the last at the end. Markdown
renders a line break inside a code span as a space, so whitespace runs compare
as one space.

For every quote one producer below (chosen by the regular expression it
registers with) runs the real code on the situation the page describes and
returns the messages it raised or warned. A quote that no producer claims fails,
and so does a producer that no page quotes any more.
"""

import simulated  # noqa: F401  (first: 3 simulated devices before TensorFlow starts)

import dataclasses
import json
import re
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import kerasmulti

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# How Python prints an exception or a warning: its class name, a colon, the message.
# (`kerasmulti: error: ...` is the command line's form, argparse's.)
MESSAGE = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Warning)|kerasmulti(?: [\w-]+)?: error): ")
ELLIPSIS = re.compile(r"\.\.\.|…")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclasses.dataclass(frozen=True)
class Quote:
    page: str  # relative to the repository root
    line: int
    text: str  # whitespace runs collapsed to one space

    def __str__(self):
        return f"{self.page}:{self.line}: {self.text}"


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", ANSI.sub("", text)).strip()


def code_spans(markdown: str):
    """(line, text) of every inline code span and of every line of a fenced block.

    CommonMark's rule: a span opens with a run of n backticks and closes at the
    next run of exactly n; it may cross line breaks (but not a blank line), and
    one space just inside each end is dropped when both are there.
    """
    prose, fenced = [], []
    fence = None
    for number, line in enumerate(markdown.splitlines(keepends=True), 1):
        opener = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if fence is None and opener:
            fence = opener.group(1)
            prose.append("\n")
        elif fence is not None:
            if line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
                fence = None
            else:
                fenced.append((number, line.strip()))
            prose.append("\n")
        else:
            prose.append(line)
    text = "".join(prose)
    spans = []
    for match in re.finditer(r"(?<!`)(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", text, re.S):
        content = match.group(2).replace("\n", " ")
        if content.startswith(" ") and content.endswith(" ") and content.strip():
            content = content[1:-1]
        spans.append((text.count("\n", 0, match.start()) + 1, content))
    return sorted(spans + fenced)


def quotes(page: Path) -> list[Quote]:
    name = str(page.relative_to(ROOT))
    return [Quote(name, line, _normal(text)) for line, text in code_spans(page.read_text()) if MESSAGE.match(_normal(text))]


def matches(quoted: str, produced: str) -> bool:
    """True when `produced` is `quoted`, its elided parts ("...") aside."""
    quoted, produced = _normal(quoted), _normal(produced)
    if not ELLIPSIS.search(quoted):
        return quoted == produced
    pieces = [piece.strip() for piece in ELLIPSIS.split(quoted)]
    if not (produced.startswith(pieces[0]) and produced.endswith(pieces[-1])):
        return False
    position = len(pieces[0])
    for piece in pieces[1:-1]:
        found = produced.find(piece, position)
        if found < 0:
            return False
        position = found + len(piece)
    return position <= len(produced) - len(pieces[-1])


# ---------------------------------------------------------------- producers

PRODUCERS = {}  # the quote's regular expression -> the function that produces its message


def produces(pattern, slow=False):
    def register(function):
        function.slow = slow
        PRODUCERS[re.compile(pattern)] = function
        return function

    return register


def _raised(function, *args, **kwargs) -> list[str]:
    try:
        function(*args, **kwargs)
    except Exception as error:  # any type: its message is what is checked
        return [f"{type(error).__name__}: {error}"]
    return []


def _tiny_model():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])


@produces(r"^DeviceError: parallelize\(\) was asked for \d+ devices but this machine has")
def _too_many_devices(quote, monkeypatch):
    """`parallelize(model, gpus=n)` on the machine the quote describes (its device list)."""
    n = int(re.search(r"asked for (\d+) devices", quote).group(1))
    listed = re.search(r"this machine has \d+ \(([^)]*)\)", quote).group(1).split(", ")
    from kerasmulti._src import devices

    monkeypatch.setattr(devices, "available_devices", lambda: list(listed))
    return _raised(kerasmulti.parallelize, _tiny_model(), gpus=n)


@produces(r"^ValueError: .*Received: workers_with_monitor=")
def _monitor_on_some_workers(quote, monkeypatch):
    """`fit` with a monitor on this worker, while other workers of the cluster pass none.

    The in-process multi-worker model of `cases.worker_model` is one worker;
    the others' answers to the gather that the check runs first are added to
    this worker's (a real 2-worker run: tests/multi_worker/test_multiworker.py).
    """
    from cases import worker_model

    from kerasmulti._src.multi_worker import worker_inputs

    with_monitor, workers = map(int, re.search(r"workers_with_monitor=(\d+) of (\d+)", quote).groups())
    gather = worker_inputs.gather_step

    def cluster_gather(strategy, value):
        mine = gather(strategy, value)  # this worker, which passes a monitor
        return tf.concat([mine] * with_monitor + [tf.zeros_like(mine)] * (workers - with_monitor), 0)

    monkeypatch.setattr(worker_inputs, "gather_step", cluster_gather)
    parallel = worker_model(_tiny_model())
    parallel.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((8, 5), "float32"), np.ones((8, 1), "float32")
    return _raised(parallel.fit, x, y, batch_size=4, verbose=0, callbacks=[kerasmulti.ThroughputMonitor()])


@produces(r"`merge_call` called while defining a new graph")
def _keras_accumulation_under_the_strategy(quote, monkeypatch):
    """Keras' own gradient accumulation in a multi-worker model (keras-team/keras#20582).

    kerasmulti accumulates itself there; switched off, Keras' `cond` runs and
    crashes. If this stops raising, Keras fixed it: update the page.
    """
    from cases import worker_model

    from kerasmulti._src.multi_worker import accumulation

    monkeypatch.setattr(accumulation, "accumulates", lambda optimizer: False)
    parallel = worker_model(_tiny_model())
    parallel.compile(optimizer=keras.optimizers.Adam(gradient_accumulation_steps=2), loss="mse")
    x, y = np.ones((8, 5), "float32"), np.ones((8, 1), "float32")
    return _raised(parallel.fit, x, y, batch_size=4, verbose=0)


@produces(r"^UserWarning: Model doesn't support `jit_compile=True`")
def _placed_model_compiled_with_xla(quote, monkeypatch):
    """`compile(jit_compile=True)` on a model with a placed layer."""
    inputs = keras.Input((5,))
    with kerasmulti.device_scope("/cpu:1"):
        outputs = keras.layers.Dense(1)(inputs)
    model = keras.Model(inputs, outputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    return [f"{w.category.__name__}: {w.message}" for w in caught]


_PARAMETER_SERVER = textwrap.dedent(
    """
    import json, sys
    import keras, tensorflow as tf

    cluster = tf.train.ClusterSpec(json.loads(sys.argv[1]))
    servers = [tf.distribute.Server(cluster, job_name=job, task_index=0, start=True) for job in ("worker", "ps")]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.1)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)

    @tf.function
    def step():
        def replica():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(model(tf.ones((4, 8))) ** 2)
            gradients = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(gradients, model.trainable_variables))
            return loss
        return strategy.run(replica)

    try:
        coordinator.schedule(step)
        coordinator.join()
        print(json.dumps(None))
    except Exception as error:
        last = [line.strip() for line in str(error).splitlines() if line.strip()][-1]
        name = type(error).__name__
        print(json.dumps(last if last.startswith(name + ": ") else f"{name}: {last}"))
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


@produces(r"^AttributeError: 'ShardedVariable' object", slow=True)
def _sharded_parameter_variables(quote, monkeypatch):
    """A Keras model trained by `ParameterServerStrategy` with a `variable_partitioner`.

    In a subprocess (one worker and one parameter server on localhost, with a
    coordinator): the strategy connects the process to its cluster for good.
    """
    cluster = {"worker": [f"localhost:{_free_port()}"], "ps": [f"localhost:{_free_port()}"]}
    result = subprocess.run(
        [sys.executable, "-c", _PARAMETER_SERVER, json.dumps(cluster)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    produced = json.loads(result.stdout.strip().splitlines()[-1])
    return [] if produced is None else [produced]


# -------------------------------------------------------------------- tests

QUOTES = [quote for page in PAGES for quote in quotes(page)]


def _producer(quote: Quote):
    found = [function for pattern, function in PRODUCERS.items() if pattern.search(quote.text)]
    assert found, f"{quote}\nno test produces this quoted message: add a producer to {Path(__file__).name}"
    assert len(found) == 1, f"{quote}\nis claimed by several producers: {[f.__name__ for f in found]}"
    return found[0]


def _param(quote: Quote):
    claimed = [function for pattern, function in PRODUCERS.items() if pattern.search(quote.text)]
    slow = [pytest.mark.slow] if any(function.slow for function in claimed) else []
    return pytest.param(quote, marks=slow, id=f"{quote.page}:{quote.line}")


@pytest.mark.parametrize("quote", [_param(quote) for quote in QUOTES])
def test_the_quoted_message_is_what_the_code_produces(quote, monkeypatch):
    produced = _producer(quote)(quote.text, monkeypatch)
    assert any(matches(quote.text, message) for message in produced), (
        f"{quote.page}:{quote.line} quotes\n    {quote.text}\nbut the code produces\n    "
        + ("\n    ".join(_normal(message) for message in produced) or "nothing")
    )


def test_every_producer_has_its_quote():
    unused = [function.__name__ for pattern, function in PRODUCERS.items() if not any(pattern.search(quote.text) for quote in QUOTES)]
    assert not unused, f"no page quotes what these produce any more; remove them or the quote's change: {unused}"


def test_messages_are_quoted_with_their_class_name():
    """A message quoted without its class (`Received: ...` alone) would escape the tests above."""
    loose = [
        f"{page.relative_to(ROOT)}:{line}: {text}"
        for page in PAGES
        for line, text in code_spans(page.read_text())
        if "Received: " in text and not MESSAGE.match(_normal(text))
    ]
    assert not loose, 'quote messages as `ErrorName: message` ("..." for left-out parts):\n' + "\n".join(loose)


def test_quotes_are_found_where_markdown_puts_them():
    page = textwrap.dedent(
        """\
        A ``RuntimeError: a `name` in
          the message`` across lines, and `ValueError: ... Received: x=1`.

        ```text
        KeyError: 'in a fenced block'
        ```

        `not a message`, ``ValueError`` alone, `TypeError: not

        closed across a paragraph`.
        """
    )
    found = [(line, _normal(text)) for line, text in code_spans(page) if MESSAGE.match(_normal(text))]
    assert found == [
        (1, "RuntimeError: a `name` in the message"),
        (2, "ValueError: ... Received: x=1"),
        (5, "KeyError: 'in a fenced block'"),
    ]


@pytest.mark.parametrize(
    "quoted,produced,expected",
    [
        ("ValueError: a b c", "ValueError: a  b\nc", True),
        ("ValueError: a b c", "ValueError: a b c d", False),
        ("ValueError: ... Received: x=1", "ValueError: anything. Received: x=1", True),
        ("ValueError: ... Received: x=1", "ValueError: anything. Received: x=12", False),
        ("ValueError: ... Received: x=1", "TypeError: anything. Received: x=1", False),
        ("RuntimeError: ... middle ...", "RuntimeError: \x1b[1mstart middle end\x1b[0m", True),
        ("RuntimeError: ... middle ...", "RuntimeError: start muddle end", False),
        ("E: a ... a", "E: a", False),
    ],
)
def test_elided_quotes_match_piecewise(quoted, produced, expected):
    assert matches(quoted, produced) is expected
