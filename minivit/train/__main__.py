"""``python -m minivit.train ...``: the command line (main, in loop.py), its flags generated from TrainConfig."""

import sys

from .. import distributed
from . import main

if __name__ == "__main__":          # imported (pkgutil.walk_packages, a test), it runs nothing
    sys.exit(distributed.exit_status(main()))   # with several ranks, an error on one ends them all
