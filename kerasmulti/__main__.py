"""`python -m kerasmulti`: the `kerasmulti` command."""

import sys

from kerasmulti._src.commands.cli import main

sys.exit(main())
