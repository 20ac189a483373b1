"""``python -m minivit.train ...``: the command line (main, in loop.py), its flags generated from TrainConfig."""

import sys

from .. import distributed
from . import main

sys.exit(distributed.exit_status(main()))   # with several ranks, an error on one ends them all
