"""`python -m kerasmulti`: the `kerasmulti` command."""

import sys

from kerasmulti._src.commands.cli import main

if __name__ == "__main__":
    sys.exit(main())
