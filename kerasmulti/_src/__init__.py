"""kerasmulti's implementation; the public names are in `kerasmulti/__init__.py`.

Folders are concepts, and imports point one way: each part below uses only
those listed after it (`model_parallel`'s `remap_devices` also clears what
`inference` kept for a model).

- `commands/`: the `kerasmulti` command (demo, devices, predict, launch).
- `parallelize.py`: the public entry, one process or a cluster's workers.
- `callbacks/`, `inference/`, `model_parallel/`, `multi_worker/`: what is
  built on data parallelism (and placement, for model_parallel).
- `data_parallel/`: the parallel model, its training step and its parts.
- `devices.py`, `cluster.py`, `keras_private/`, `startup.py`: the
  process's devices, its cluster membership, every private Keras and
  TensorFlow name used, and what `import kerasmulti` does.
- `utils/`: atomic file writes, other processes' CPU load, fault points,
  argument checks.
"""
