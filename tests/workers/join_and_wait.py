"""Joins the TF_CONFIG cluster with kerasmulti.initialize(), says so, then waits to be stopped."""

import lean  # noqa: F401, I001  (first: Keras' optional imports left out, 2 s a process)

import time

import kerasmulti

kerasmulti.initialize()  # joins the cluster
import keras  # noqa: E402

kerasmulti.parallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
print("joined", flush=True)
time.sleep(300)
