"""Whether this process is the `kerasmulti` command, which needs to know before TensorFlow loads.

Imports nothing heavy: `import kerasmulti` asks it before importing TensorFlow.
"""

from __future__ import annotations

import os
import sys


def started_by_command_line() -> bool:
    """True in the `kerasmulti` command (its script, or `python -m kerasmulti._cli`)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return os.path.basename(sys.argv[0]) == "kerasmulti" or "kerasmulti._cli" in argv
