"""What `import kerasmulti` does: only what the environment explicitly asks for.

Two things must happen before TensorFlow's first op, so they cannot wait for
the first public call: splitting the CPU into simulated devices when
`KERASMULTI_SIMULATE_DEVICES` is set, and joining the cluster of a worker
that `kerasmulti launch` (or `launch()`) started, which it marks with
`KERASMULTI_JOIN=1`. Without those variables importing kerasmulti loads
nothing and changes nothing. The `kerasmulti` command simulates devices itself
after parsing its arguments (so `kerasmulti --help` answers without
TensorFlow), and never joins a cluster: `kerasmulti launch` starts the workers
that do.
"""

from __future__ import annotations

import os
import sys

ENV_SIMULATE = "KERASMULTI_SIMULATE_DEVICES"
ENV_JOIN = "KERASMULTI_JOIN"
ENV_CONFIG = "TF_CONFIG"
# sysexits' EX_TEMPFAIL, "try again": a launched worker whose port another
# process took exits with it, and its launcher starts the cluster again.
# (Here, with the variables above, so that the launcher needs no TensorFlow.)
EXIT_PORT_TAKEN = 75
# TensorFlow's PreemptionCheckpointHandler's "restart me": a job that SIGTERM
# stopped after backing up its step exits with it (`callbacks/preemption.py`).
REQUEUE_EXIT_CODE = 42
_COMMAND_MODULES = ("kerasmulti", "kerasmulti._src.commands.cli")


def started_by_command_line() -> bool:
    """True in the `kerasmulti` command: its script, or `python -m kerasmulti`."""
    if os.path.basename(sys.argv[0]) == "kerasmulti":
        return True
    # The interpreter's options come before the script or `-m module`; what
    # follows those is the program's own arguments.
    options = iter(getattr(sys, "orig_argv", sys.argv)[1:])
    for option in options:
        if option in ("-X", "-W"):  # they take a value
            next(options, None)
        elif option.startswith("-m"):
            return (option[2:] or next(options, "")) in _COMMAND_MODULES
        elif not option.startswith("-") or option.startswith("-c"):
            return False  # a script, or -c code
    return False


def from_environment() -> None:
    """Simulates devices and joins a launched cluster, where the environment asks for them."""
    if started_by_command_line():
        return
    if os.environ.get(ENV_SIMULATE, "").strip():
        from kerasmulti._src import devices

        devices.simulate_from_environment()
    if os.environ.get(ENV_JOIN) == "1":
        from kerasmulti._src import cluster

        cluster.start()
