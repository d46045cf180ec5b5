"""What `import kerasmulti` does: only what the environment explicitly asks for.

Two things must happen before TensorFlow's first op, so they cannot wait for
the first public call: splitting the CPU into simulated devices when
`KERASMULTI_SIMULATE_DEVICES` is set, and joining the cluster of a worker
that `kerasmulti launch` (or `launch()`) started, which it marks with
`KERASMULTI_JOIN=1`. Without those variables importing kerasmulti loads
nothing and changes nothing. The `kerasmulti` command does both itself after
parsing its arguments, so `kerasmulti --help` answers without TensorFlow.
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
_COMMAND_MODULES = ("kerasmulti", "kerasmulti._src.commands.cli")


def started_by_command_line() -> bool:
    """True in the `kerasmulti` command: its script, or `python -m kerasmulti`."""
    if os.path.basename(sys.argv[0]) == "kerasmulti":
        return True
    argv = list(getattr(sys, "orig_argv", sys.argv))
    return any(flag == "-m" and module in _COMMAND_MODULES for flag, module in zip(argv, argv[1:]))


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
