"""One setting for NumPy's BLAS, made before NumPy is imported (minivit/__init__.py imports this first).

OpenBLAS keeps its idle threads spinning for about 0.1 s after each matrix product (2^28 cycles, its
default), so that a product right after starts sooner. But a spinning thread holds a core: minivit's
attention (minivit/kernels.py) runs its many small products on Python threads of its own, and with
OpenBLAS's threads spinning beside them those threads got no second core at all (a training step of
the CIFAR model on 2 cores: 395 ms; with OPENBLAS_THREAD_TIMEOUT=10, i.e. 2^10 cycles: 345 ms, and the
large products just as fast). The variable is only read when OpenBLAS loads, that is when NumPy is first
imported: so it is set here if NumPy is not loaded yet (``import minivit`` first; ``python -m
minivit.train`` does), and a value already in the environment is kept. The lessons' Jupyter kernel has it
in its environment (the Makefile installs the kernel so), since a notebook imports NumPy first.
"""

import os
import sys

if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "10")

# Whether OpenBLAS's idle threads sleep at once in this process: set before NumPy loaded, by us or by
# the caller's environment (then assumed to be set before the process started).
_timeout = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "").strip()
IDLE_BLAS_THREADS_SLEEP = _timeout.isdigit() and int(_timeout) <= 16   # 2^16 cycles: well under 0.1 ms
