"""A long inference job for the kill test, run as a separate process.

    python predict_to_file.py OUTPUT [--check]

Streams the predictions of a seeded model over seeded data into OUTPUT on 2
simulated devices. With --check it then compares the file with model.predict
and exits 1 on a mismatch.
"""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import kerasmulti  # noqa: E402

kerasmulti.simulate_devices(2)
import h5py  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

keras.utils.set_random_seed(0)
inputs = keras.Input((32,))
hidden = keras.layers.Dense(128, activation="relu")(inputs)
model = keras.Model(inputs, [keras.layers.Dense(64, name="features")(hidden), keras.layers.Dense(3, name="scores")(hidden)])
x = np.random.default_rng(0).normal(size=(6000, 32)).astype("float32")
print("started", flush=True)
kerasmulti.parallel_predict(model, x, gpus=2, batch_size=50, output=sys.argv[1], verbose=0)
print("finished", flush=True)
if "--check" in sys.argv:
    features, scores = model.predict(x, batch_size=500, verbose=0)
    with h5py.File(sys.argv[1], "r") as f:
        ok = np.allclose(f["features"][:], features, rtol=1e-5, atol=1e-5) and np.allclose(
            f["scores"][:], scores, rtol=1e-5, atol=1e-5
        )
        ok = ok and int(f.attrs["kerasmulti_rows_done"]) == len(x)
    sys.exit(0 if ok else 1)
