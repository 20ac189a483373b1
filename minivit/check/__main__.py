"""python -m minivit.check: see minivit/check/__init__.py, or run it with --help."""

import sys

from .command import main

sys.exit(main())
