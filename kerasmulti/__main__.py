"""`python -m kerasmulti`: the `kerasmulti` command."""

import sys

try:
    from kerasmulti._src.commands.cli import main, program  # noqa: F401  (main: the command's entry, for callers)
except KeyboardInterrupt:  # Ctrl-C before the command could set its own handler
    print("kerasmulti: interrupted", file=sys.stderr, flush=True)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(program())
