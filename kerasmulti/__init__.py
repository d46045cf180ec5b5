"""kerasmulti: train and run an existing Keras 3 model on several devices.

Public API (everything else is private):

- `parallelize(model, gpus)`: data-parallel wrapper sharing the model's weights.
- `launch(function, workers=N)`: run a function as N workers of one cluster, from a notebook;
  inside it (or in a script started by `kerasmulti launch`), `parallelize` trains across workers.
- `parallel_predict(model, data, output=...)`: data-parallel, resumable batch inference.
- `device_scope(device)`, `on_device(layer, device)`: model parallelism, saved with the model
  in `.keras` files that plain Keras loads too; `placement_summary(model)`,
  `remap_devices(model, mapping)`, `strip_placement(model)` (the model without placement).
- `unwrap(parallel)`: the template model behind a parallel model.
- `available_devices()`, `simulate_devices(n)`: replica devices, real or simulated.
- `ParallelModelCheckpoint`: a drop-in `ModelCheckpoint` saving the template atomically.
- `ParallelBackupAndRestore`: `BackupAndRestore` that resumes a parallel model exactly.
- `ThroughputMonitor`: samples/s per device, step time split, imbalance, per epoch.
- `DeviceError`: a device request this machine cannot satisfy (a ValueError).
- `initialize()`: join the cluster that `TF_CONFIG` names (workers of `kerasmulti launch` join at import).
- `is_chief()`, `ClusterError`: in a cluster, the process that writes; a cluster that cannot go on.
- `LaunchError`: a launch request that cannot be started (a ValueError).
"""

import os as _os

_os.environ.setdefault("KERAS_BACKEND", "tensorflow")
# TensorFlow's C++ INFO lines (oneDNN, CPU features) drown the CLI's output;
# warnings and errors still show. A value the user set wins.
_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from kerasmulti import _entry  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ClusterError",
    "DeviceError",
    "LaunchError",
    "OnDevice",
    "ParallelBackupAndRestore",
    "ParallelModel",
    "ParallelModelCheckpoint",
    "PlacementSummary",
    "available_devices",
    "device_scope",
    "initialize",
    "is_chief",
    "launch",
    "on_device",
    "parallel_predict",
    "parallelize",
    "placement_summary",
    "remap_devices",
    "simulate_devices",
    "strip_placement",
    "ThroughputMonitor",
    "unwrap",
]


def _import_public() -> None:
    """Imports TensorFlow and the public names, in the order their side effects need.

    Devices are simulated (from `KERASMULTI_SIMULATE_DEVICES`) and the
    cluster joined before TensorFlow's first op, which building a model runs.
    """
    global ClusterError, DeviceError, LaunchError, OnDevice, ParallelBackupAndRestore, ParallelModel
    global ParallelModelCheckpoint, PlacementSummary, available_devices, device_scope, initialize
    global is_chief, launch, on_device, parallel_predict, parallelize, placement_summary
    global remap_devices, simulate_devices, strip_placement, ThroughputMonitor, unwrap
    from kerasmulti._devices import DeviceError, available_devices, simulate_devices
    from kerasmulti._devices import _simulate_from_environment

    _simulate_from_environment()

    from kerasmulti import _cluster
    from kerasmulti._cluster import ClusterError, initialize, is_chief

    _cluster.start()

    from kerasmulti._parallel import ParallelModel, unwrap
    from kerasmulti._parallelize import parallelize
    from kerasmulti._backup import ParallelBackupAndRestore
    from kerasmulti._checkpoint import ParallelModelCheckpoint
    from kerasmulti._inference import parallel_predict
    from kerasmulti._monitor import ThroughputMonitor
    from kerasmulti._launch import launch
    from kerasmulti._tf_config import LaunchError
    from kerasmulti._on_device import OnDevice
    from kerasmulti._device_scope import device_scope
    from kerasmulti._placement import on_device, remap_devices
    from kerasmulti._portable import install, strip_placement
    from kerasmulti._summary import PlacementSummary, placement_summary

    install()  # model.save of a placed model writes a file plain Keras loads


# The command parses its arguments first and then calls `_import_public`:
# `kerasmulti --help` and argument errors answer without loading TensorFlow
# (seconds).
if not _entry.started_by_command_line():
    _import_public()
