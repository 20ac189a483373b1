"""OpenBLAS's idle threads put to sleep at once, whatever was imported first.

OpenBLAS keeps its idle threads spinning for about 0.1 s after each matrix product (2^28 cycles, its
default), so that a product right after starts sooner. But a spinning thread holds a core: minivit's
attention (minivit/fast/attention.py) runs its many small products on Python threads of its own, and with
OpenBLAS's threads spinning beside them those threads got no second core at all (a training step of
the CIFAR model on 2 cores: 395 ms; with OPENBLAS_THREAD_TIMEOUT=10, i.e. 2^10 cycles: 345 ms, and the
large products just as fast).

OpenBLAS reads OPENBLAS_THREAD_TIMEOUT when it loads (when NumPy is first imported) and uses it when it
starts its threads. So:
- ``import minivit`` before NumPy sets the variable here, in time (``python -m minivit.train`` does);
- after NumPy (a script or a notebook that imports NumPy first), ``idle_blas_threads_sleep()`` sets it
  and then has OpenBLAS read its environment again (``openblas_read_env``) and stop its threads
  (``blas_thread_shutdown_``, what OpenBLAS itself does before a fork); the next product starts them
  again, with the new timeout. fast/attention.py calls it before attention first shares its work among threads;
- a value the caller put in the environment is kept, even a long one.
"""

import ctypes
import os
import sys
import threading

SLEEP_AFTER = "10"  # log2 of the cycles an idle thread spins before it sleeps: 2^10, about half a microsecond


def _short(value):
    return value.strip().isdigit() and int(value) <= 16   # 2^16 cycles: well under 0.1 ms


_caller_set = "OPENBLAS_THREAD_TIMEOUT" in os.environ
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", SLEEP_AFTER)

# Whether OpenBLAS's idle threads sleep at once in this process: set before NumPy loaded, by us or by the
# caller's environment (assumed to be there before the process started).
IDLE_BLAS_THREADS_SLEEP = "numpy" not in sys.modules or _caller_set
IDLE_BLAS_THREADS_SLEEP = IDLE_BLAS_THREADS_SLEEP and _short(os.environ.get("OPENBLAS_THREAD_TIMEOUT", ""))

_lock = threading.Lock()
_restarted = None   # None: not tried yet; then True / False


def idle_blas_threads_sleep():
    """True when OpenBLAS's idle threads sleep at once in this process, after setting it up if it was
    too late for the import-time setting (see the module's docstring). False when it cannot be done: the
    caller set a long timeout, or the BLAS is not an OpenBLAS that exports these functions."""
    global _restarted
    if IDLE_BLAS_THREADS_SLEEP:
        return True
    with _lock:
        if _restarted is None:
            _restarted = False if _caller_set else _restart_openblas_threads()
        return _restarted


def _restart_openblas_threads():
    try:
        import threadpoolctl
    except ImportError:
        return False
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = SLEEP_AFTER
    done = False
    for info in threadpoolctl.threadpool_info():
        if info.get("internal_api") != "openblas":
            continue
        try:
            lib = ctypes.CDLL(info["filepath"])          # the library already loaded: the same handle
            read_env, shutdown, timeout = lib.openblas_read_env, lib.blas_thread_shutdown_, lib.openblas_thread_timeout
        except (OSError, AttributeError):                 # another BLAS, or an OpenBLAS without them
            continue
        timeout.restype = ctypes.c_int
        read_env()                                        # OPENBLAS_THREAD_TIMEOUT read again
        shutdown()                                        # threads stopped; the next product starts new ones
        done = timeout() == int(SLEEP_AFTER)
    return done
