"""kerasmulti's implementation; the public names are in `kerasmulti/__init__.py`.

Folders are concepts, and imports point one way, from the top down:

- `commands/`: the `kerasmulti` command (demo, devices, predict, launch).
- `parallelize.py`: the public entry, one process or a cluster's workers.
- `callbacks/`, `inference/`, `model_parallel/`, `multi_worker/`: what is
  built on data parallelism (and placement, for model_parallel).
- `data_parallel/`: the parallel model, its training step and its parts.
- `devices.py`, `cluster.py`, `startup.py`: the process's devices, its
  cluster membership, and what `import kerasmulti` does.
- `keras_private.py`: every private Keras and TensorFlow name used.
- `utils/`: atomic file writes, other processes' CPU load, fault points.
"""
