"""Imported first by the suite's worker scripts: leaves out Keras' optional imports, which they never use.

Keras imports scikit-learn (for its scikit-learn wrappers) and matplotlib (for
its image gallery) whenever they are installed, and the suite's environment has
both, for the demo and the notebooks: about 2 s of CPU in every process, a third
of its start-up, and the suite starts such processes over a hundred times. No
worker script uses either, so both are marked absent here (`None` in
`sys.modules`): Keras' `import` fails as if they were not installed, and it goes
on without them, as it does on a machine without them. kerasmulti never imports
them. The commands, the docstrings' examples and the notebooks that the suite
runs import them as a user's would.
"""

import sys

for _name in ("sklearn", "matplotlib"):
    sys.modules.setdefault(_name, None)
