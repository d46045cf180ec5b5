"""Settings for every test; the simulated devices are in `simulated.py`.

Nothing here imports TensorFlow: tests that need no TensorFlow never start it.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# On a GPU machine the CPU devices below still initialise the GPU: take its
# memory as needed, so a GPU test's own process finds room.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import itertools  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

_unseeded_rng = np.random.default_rng


@pytest.fixture(autouse=True)
def seeded_data(request, monkeypatch):
    """Makes every `np.random.default_rng()` a test draws without a seed reproducible.

    The seed comes from the test's id (or KERASMULTI_TEST_SEED, to draw other
    data) and is printed, so a failure shows how to reproduce it; each unseeded
    call in the test gets the next stream of that seed. Seeded calls are untouched.
    """
    seed = int(os.environ.get("KERASMULTI_TEST_SEED", zlib.crc32(request.node.nodeid.encode())))
    print(f"data seed: {seed} (KERASMULTI_TEST_SEED={seed} reproduces it)")
    calls = itertools.count()

    def default_rng(seed_or_none=None):
        if seed_or_none is None:
            return _unseeded_rng([seed, next(calls)])
        return _unseeded_rng(seed_or_none)

    monkeypatch.setattr(np.random, "default_rng", default_rng)
    yield seed


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The fast tier (`-m "not slow"`) runs each parametrized test once, with its first parameters.

    The other parameters (more model kinds, batch shapes, XLA, error cases)
    are marked slow: CI runs them all. First, before `-m` deselects.
    """
    seen = set()
    for item in items:
        if getattr(item, "callspec", None) is None:
            continue
        key = (str(item.path), item.originalname)
        if key in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(key)
    # The longest files first: each runs whole in one process (`--dist loadfile`), in this
    # order (`--no-loadscope-reorder`: pytest-xdist would start the files with the most tests
    # first), so that none starts last: the multi-worker tests (8 minutes, 13 tests) did,
    # and left the other process idle for their last 4 minutes.
    items.sort(key=lambda item: _LONGEST_FIRST.index(item.path.name) if item.path.name in _LONGEST_FIRST else len(_LONGEST_FIRST))


_LONGEST_FIRST = [
    "test_multiworker.py", "test_custom_steps.py", "test_conformance.py", "test_pipeline.py", "test_callbacks.py",
    "test_cli.py", "test_examples.py", "test_balance.py", "test_notebooks.py", "test_losses.py", "test_preemption.py",
]
