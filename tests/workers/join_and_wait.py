"""Joins the TF_CONFIG cluster at import, says so, then waits to be stopped."""

import time

import kerasmulti  # joins the cluster
import keras

kerasmulti.parallelize(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))
print("joined", flush=True)
time.sleep(300)
