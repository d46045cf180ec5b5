"""Every test runs on 3 logical CPU devices, configured before TensorFlow starts."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import kerasmulti  # noqa: E402

DEVICES = 3
kerasmulti.simulate_devices(DEVICES)
