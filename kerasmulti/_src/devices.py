"""Devices that replicas can run on, real or simulated, and their validation.

A replica device is a GPU when the machine has any. Without GPUs the CPU can be
split into logical devices (`simulate_devices`) so that code written for
`gpus=4` runs unchanged on a laptop or a CI machine. TensorFlow fixes its
logical devices the first time it initialises them, so simulation must happen
before any model, tensor or device query exists.
"""

from __future__ import annotations

import os
import warnings
from typing import Sequence

import tensorflow as tf

from kerasmulti._src import cluster as _cluster
from kerasmulti._src import startup
from kerasmulti._src.utils.arguments import is_int, is_positive_int

ENV_SIMULATE = startup.ENV_SIMULATE


class DeviceError(ValueError):
    """A device request that this machine cannot satisfy.

    A `ValueError`, so `except ValueError` keeps working. Its message lists
    the devices that exist and ends with `Received: ...`.

    Example:

    ```python
    import keras, kerasmulti
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    try:
        kerasmulti.parallelize(model, gpus=64)
    except kerasmulti.DeviceError as error:
        print(error)
    ```
    """


def _canonical(name: str) -> str:
    spec = tf.DeviceSpec.from_string(name)
    return f"/device:{spec.device_type}:{spec.device_index}"


def available_devices() -> list[str]:
    """Lists the devices that replicas can use on this machine.

    GPUs come first and alone: when the machine has any GPU, only GPUs are
    listed. Without GPUs the list holds the CPU's logical devices, which are
    several after `simulate_devices(n)` and one (`/device:CPU:0`) otherwise.

    Returns:
        A list of canonical TensorFlow device names, such as
        `["/device:GPU:0", "/device:GPU:1"]`.

    Example:

    ```python
    import kerasmulti
    print(kerasmulti.available_devices())  # ['/device:CPU:0'] on a laptop
    ```
    """
    gpus = _local(tf.config.list_logical_devices("GPU"))
    devices = gpus or _local(tf.config.list_logical_devices("CPU"))
    return [_canonical(d.name) for d in devices]


def _local(devices):
    """This process's devices: in a cluster TensorFlow lists every task's."""
    parsed = _cluster.config()
    if parsed is None:
        return devices
    job, task = parsed["task"]["type"], int(parsed["task"]["index"])
    specs = [tf.DeviceSpec.from_string(d.name) for d in devices]
    return [d for d, spec in zip(devices, specs) if spec.job in (None, job) and spec.task in (None, task)]


def known_devices() -> list[str]:
    """Canonical names of every logical device (CPUs and GPUs) of this process."""
    # Listing initialises TensorFlow's devices, which cannot change afterwards,
    # so the first answer stays true: OnDevice asks on every eager call.
    global _KNOWN
    if _KNOWN is None:
        _KNOWN = [_canonical(d.name) for d in _local(tf.config.list_logical_devices())]
    return list(_KNOWN)


_KNOWN = None


def _count_and_names(devices: Sequence[str]) -> str:
    return f"{len(devices)} ({', '.join(devices)})"


def simulate_devices(n: int) -> list[str]:
    """Splits the CPU into `n` logical devices so multi-GPU code runs without GPUs.

    Each logical device runs its own ops, so `parallelize(model, gpus=n)`
    executes exactly the code path it would on `n` GPUs. It must be called
    before TensorFlow initialises its devices (before any model or tensor is
    created). Setting the environment variable `KERASMULTI_SIMULATE_DEVICES=n`
    before `import kerasmulti` does the same, for notebooks and the CLI.
    Calling it again with the same `n` is harmless.

    Args:
        n: Number of logical CPU devices, at least 1.

    Returns:
        The devices `available_devices()` will list: the `n` CPU devices, or
        the GPUs on a machine that has some. Without GPUs, TensorFlow is not
        initialised by the call, so `tf.config.threading` can still be set.

    Raises:
        ValueError: If `n` is not a positive int.
        RuntimeError: If TensorFlow has already initialised its devices with a
            different configuration.

    Example:

    ```python
    import kerasmulti
    kerasmulti.simulate_devices(2)   # first thing in the program
    print(kerasmulti.available_devices())
    ```
    """
    if not is_positive_int(n):
        raise ValueError(
            f"simulate_devices() needs n as a positive int. Received: n={n!r}"
        )
    _configure(n)
    if tf.config.list_physical_devices("GPU"):  # listing physical devices initialises nothing
        return available_devices()
    return [f"/device:CPU:{i}" for i in range(n)]


def _configure(n: int) -> None:
    """Sets up n logical CPU devices without initialising TensorFlow's devices.

    Listing devices would initialise them, after which threading can no longer
    be configured; so this only configures, and listing is left to the caller.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == n:
        return
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError as error:
        existing = len(tf.config.list_logical_devices("CPU"))
        if existing == n:
            return  # already as asked
        # TensorFlow fixes its logical devices when it first initialises them.
        raise RuntimeError(
            f"simulate_devices({n}) came too late: TensorFlow made {existing} CPU device(s). "
            f"Restart Python and call it first, or set {ENV_SIMULATE}={n}. "
            f"Received: n={n}"
        ) from error


def environment_count() -> int | None:
    """`KERASMULTI_SIMULATE_DEVICES` as a number of devices; None where it is not set."""
    value = os.environ.get(ENV_SIMULATE, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < 1:
        raise ValueError(
            f"{ENV_SIMULATE} must be a positive int, the number of logical CPU devices. "
            f"Received: {ENV_SIMULATE}={value!r}"
        )
    return n


def simulate_from_environment() -> None:
    n = environment_count()
    if n is None:
        return
    try:
        _configure(n)
    except RuntimeError as error:
        warnings.warn(str(error), stacklevel=3)


def _check_count(caller: str, n: int, devices: list[str]) -> None:
    if n > len(devices):
        # Simulated devices are CPUs, which are not offered beside GPUs.
        simulate = "" if any("GPU" in d for d in devices) else (
            f", or call kerasmulti.simulate_devices({n}) before TensorFlow starts "
            "to try it on the CPU"
        )
        raise DeviceError(
            f"{caller} was asked for {n} devices but this machine has "
            f"{_count_and_names(devices)}. Pass gpus={len(devices)}{simulate}. Received: gpus={n}"
        )


def resolve_devices(
    gpus: int | Sequence[int] | None = None,
    devices: Sequence[str] | None = None,
    caller: str = "parallelize()",
) -> list[str]:
    """Turns a `gpus=` or `devices=` request into canonical device names.

    Raises `DeviceError` (a `ValueError`) naming the devices that exist when
    the request cannot be met.
    """
    existing = available_devices()
    if gpus is not None and devices is not None:
        raise DeviceError(
            f"{caller} takes either gpus= or devices=, not both. Received: gpus={gpus!r}, devices={devices!r}"
        )
    if devices is not None:
        return _resolve_names(devices, caller)
    if gpus is None:
        return existing
    if not (is_int(gpus) or isinstance(gpus, (list, tuple))):
        raise DeviceError(
            f"{caller} expects gpus as a positive int, a list of ids, or None for all "
            f"{_count_and_names(existing)}. Received: gpus={gpus!r}"
        )
    if is_int(gpus):
        gpus = int(gpus)
        if gpus < 1:
            raise DeviceError(
                f"{caller} needs at least one device; gpus must be 1 or more "
                f"(this machine has {_count_and_names(existing)}). Received: gpus={gpus}"
            )
        _check_count(caller, gpus, existing)
        return existing[:gpus]
    ids = list(gpus)
    if not ids or not all(is_int(i) for i in ids):
        raise DeviceError(
            f"{caller} expects gpus as a non-empty list of int ids; this machine has {_count_and_names(existing)}. "
            f"Received: gpus={gpus!r}"
        )
    if len(set(ids)) != len(ids):
        raise DeviceError(
            f"{caller} got the same device id twice. Remove the duplicates. Received: gpus={gpus!r}"
        )
    missing = [i for i in ids if not 0 <= i < len(existing)]
    if missing:
        raise DeviceError(
            f"{caller} got id(s) {missing} that do not exist; this machine has "
            f"{_count_and_names(existing)}, ids 0 to {len(existing) - 1}. Received: gpus={gpus!r}"
        )
    return [existing[int(i)] for i in ids]


def _known_name(name, known: list[str], caller: str, received: str) -> str:
    try:
        canonical = _canonical(name) if isinstance(name, str) else None
    except ValueError:
        canonical = None
    if canonical not in known:
        raise DeviceError(
            f"{caller} got a device that does not exist. Known devices: {', '.join(known)}. "
            f"{_use_instead(known)} Received: {received}"
        )
    return canonical


def _use_instead(known: list[str]) -> str:
    """What to name instead of a missing device: without GPUs, the (simulated) CPU devices."""
    if any("GPU" in name for name in known):
        return "Use one of them."
    cpus = sum("CPU" in name for name in known)
    # simulate_devices() makes CPU devices, never GPUs: '/gpu:0' cannot be made to exist.
    names = "'/cpu:0'" if cpus == 1 else f"'/cpu:0' to '/cpu:{cpus - 1}'"
    return f"Without GPUs, use {names}, or kerasmulti.simulate_devices(n) for n CPU devices."


def resolve_device(device: str, caller: str) -> str:
    """One device name, canonical; a `DeviceError` listing the known ones if it does not exist."""
    if not isinstance(device, str):
        raise TypeError(
            f"{caller} takes a device name as a string, such as '/gpu:1'. "
            f"Received: device={device!r}"
        )
    known = known_devices()
    return _known_name(device, known, caller, f"device={device!r}")


def _resolve_names(devices: Sequence[str], caller: str) -> list[str]:
    known = known_devices()
    if isinstance(devices, str) or not devices:
        raise DeviceError(
            f"{caller} expects devices as a non-empty list of names. Known devices: "
            f"{', '.join(known)}. Received: devices={devices!r}"
        )
    names = [_known_name(name, known, caller, f"devices={list(devices)!r}") for name in devices]
    if len(set(names)) != len(names):
        raise DeviceError(
            f"{caller} got the same device twice. Remove the duplicates. Received: devices={list(devices)!r}"
        )
    return names
