"""python -m minivit.check: see minivit/check/__init__.py, or run it with --help."""

import sys

from .command import main

if __name__ == "__main__":          # imported (pkgutil.walk_packages, a test), it runs nothing
    sys.exit(main())
