"""Every test runs on 3 logical CPU devices, configured before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# On a GPU machine the CPU devices below still initialise the GPU: take its
# memory as needed, so a GPU test's own process finds room.
os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")

import kerasmulti  # noqa: E402

DEVICES = 3
kerasmulti.simulate_devices(DEVICES)
