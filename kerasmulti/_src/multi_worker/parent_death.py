"""Workers that end with their launcher, also when it is killed outright.

A launcher stopped by SIGTERM, SIGHUP or Ctrl-C stops its workers itself
(`supervisor.py`). One killed by SIGKILL (`kill -9`, the OOM killer) cannot,
and its workers went on training unsupervised, racing a re-run of the
launcher for the backup. On Linux each worker asks the kernel for SIGTERM
when its launcher ends (`PR_SET_PDEATHSIG`), and so backs up its step and
exits as when its launcher stops it. Elsewhere nothing changes.

A started command is wrapped (`ended_with(command)`): this file runs as a
script in an isolated interpreter (no kerasmulti, no TensorFlow: it starts
in milliseconds), asks for the signal and replaces itself with the command,
which keeps it. A forked worker (`launch()` in a notebook) asks itself.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def ended_with(command: list[str]) -> list[str]:
    """`command`, run so that it receives SIGTERM when this process ends (Linux; elsewhere as it is)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-I", os.path.abspath(__file__), str(os.getpid()), *command]


def ask_for_sigterm(parent: int) -> None:
    """Asks for SIGTERM when process `parent` (this one's parent) ends; sends it now where it has ended already.

    The kernel signals when the *thread* that started this process ends:
    the launcher starts its workers from its main thread.
    """
    if not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return  # a worker that cannot ask runs as before
    if os.getppid() != parent:  # the launcher ended before the request
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":  # `ended_with`'s wrapper: <launcher pid> <command...>
    ask_for_sigterm(int(sys.argv[1]))
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as error:
        sys.stderr.write(f"kerasmulti launch: cannot run {sys.argv[2]}: {error.strerror}\n")
        sys.exit(127)  # a shell's "command not found"
