"""kerasmulti: train and run an existing Keras 3 model on several devices.

Public API (everything else is private, under `kerasmulti._src`):

- `parallelize(model, gpus)`: data-parallel wrapper sharing the model's weights.
- `launch(function, workers=N)`: run a function as N workers of one cluster, from a notebook;
  inside it (or in a script started by `kerasmulti launch`), `parallelize` trains across workers.
- `parallel_predict(model, data, output=...)`: data-parallel, resumable batch inference.
- `device_scope(device)`, `on_device(layer, device)`: model parallelism, saved with the model
  in `.keras` files that plain Keras loads too; `load_model(path)` puts the placement back;
  `placement_summary(model)`, `remap_devices(model, mapping)`, `strip_placement(model)`.
- `pipeline(model, microbatches=M)`: a placed model's stages work at the same time on
  micro-batches (`gpus=N` cuts an unplaced model into N stages); a `PipelineModel`.
- `unwrap(parallel)`: the template model behind a parallel model.
- `available_devices()`, `simulate_devices(n)`: replica devices, real or simulated.
- `ParallelModelCheckpoint`: a drop-in `ModelCheckpoint` saving the template atomically.
- `ParallelBackupAndRestore`: `BackupAndRestore` that resumes a parallel model exactly.
- `ThroughputMonitor`: samples/s per device, step time split, imbalance, per epoch.
- `DeviceError`: a device request this machine cannot satisfy (a ValueError).
- `initialize()`: join the cluster that `TF_CONFIG` names (workers of `kerasmulti launch` join at import).
- `is_chief()`, `ClusterError`: in a cluster, the process that writes; a cluster that cannot go on.
- `LaunchError`: a launch request that cannot be started (a ValueError).

Importing kerasmulti changes nothing in Keras or the process. Each public
name is loaded from the module below on first use, so that the `kerasmulti`
command parses its arguments before TensorFlow loads, and so that
`simulate_devices` can still run before TensorFlow starts. Only two
environment variables act at import, both before TensorFlow's first op:
`KERASMULTI_SIMULATE_DEVICES` (split the CPU) and `KERASMULTI_JOIN`, which
`kerasmulti launch` sets in its workers (join the cluster).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kerasmulti._src import startup as _startup

__version__ = "0.1.0"

# Each public name and the module that defines it.
_PUBLIC = {
    "ClusterError": "kerasmulti._src.cluster",
    "initialize": "kerasmulti._src.cluster",
    "is_chief": "kerasmulti._src.cluster",
    "DeviceError": "kerasmulti._src.devices",
    "available_devices": "kerasmulti._src.devices",
    "simulate_devices": "kerasmulti._src.devices",
    "ParallelModel": "kerasmulti._src.data_parallel.parallel_model",
    "unwrap": "kerasmulti._src.data_parallel.parallel_model",
    "parallelize": "kerasmulti._src.parallelize",
    "ThroughputMonitor": "kerasmulti._src.data_parallel.monitor",
    "ParallelModelCheckpoint": "kerasmulti._src.callbacks.model_checkpoint",
    "ParallelBackupAndRestore": "kerasmulti._src.callbacks.backup_and_restore",
    "parallel_predict": "kerasmulti._src.inference.parallel_predict",
    "OnDevice": "kerasmulti._src.model_parallel.on_device",
    "device_scope": "kerasmulti._src.model_parallel.device_scope",
    "on_device": "kerasmulti._src.model_parallel.placement",
    "remap_devices": "kerasmulti._src.model_parallel.placement",
    "load_model": "kerasmulti._src.model_parallel.portable",
    "strip_placement": "kerasmulti._src.model_parallel.portable",
    "PlacementSummary": "kerasmulti._src.model_parallel.summary",
    "pipeline": "kerasmulti._src.model_parallel.pipeline",
    "PipelineModel": "kerasmulti._src.model_parallel.pipeline",
    "placement_summary": "kerasmulti._src.model_parallel.summary",
    "launch": "kerasmulti._src.multi_worker.launch",
    "LaunchError": "kerasmulti._src.multi_worker.tf_config",
}

__all__ = [
    "available_devices",
    "ClusterError",
    "device_scope",
    "DeviceError",
    "initialize",
    "is_chief",
    "launch",
    "LaunchError",
    "load_model",
    "on_device",
    "OnDevice",
    "parallel_predict",
    "ParallelBackupAndRestore",
    "parallelize",
    "ParallelModel",
    "ParallelModelCheckpoint",
    "pipeline",
    "PipelineModel",
    "placement_summary",
    "PlacementSummary",
    "remap_devices",
    "simulate_devices",
    "strip_placement",
    "ThroughputMonitor",
    "unwrap",
]

if TYPE_CHECKING:  # what readers, IDEs and type checkers see
    from kerasmulti._src.callbacks.backup_and_restore import ParallelBackupAndRestore
    from kerasmulti._src.callbacks.model_checkpoint import ParallelModelCheckpoint
    from kerasmulti._src.cluster import ClusterError, initialize, is_chief
    from kerasmulti._src.data_parallel.monitor import ThroughputMonitor
    from kerasmulti._src.data_parallel.parallel_model import ParallelModel, unwrap
    from kerasmulti._src.devices import DeviceError, available_devices, simulate_devices
    from kerasmulti._src.inference.parallel_predict import parallel_predict
    from kerasmulti._src.model_parallel.device_scope import device_scope
    from kerasmulti._src.model_parallel.on_device import OnDevice
    from kerasmulti._src.model_parallel.pipeline import PipelineModel, pipeline
    from kerasmulti._src.model_parallel.placement import on_device, remap_devices
    from kerasmulti._src.model_parallel.portable import load_model, strip_placement
    from kerasmulti._src.model_parallel.summary import PlacementSummary, placement_summary
    from kerasmulti._src.multi_worker.launch import launch
    from kerasmulti._src.multi_worker.tf_config import LaunchError
    from kerasmulti._src.parallelize import parallelize


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kerasmulti' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_startup.from_environment()
