"""`python -m kerasmulti`: the `kerasmulti` command."""

import sys

if __name__ == "__main__":
    try:
        from kerasmulti._src.commands.cli import program
    except KeyboardInterrupt:  # Ctrl-C before the command could set its own handler
        print("kerasmulti: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(program())
