"""The array backend: NumPy on the CPU, CuPy on the GPU.

This is the only module in minivit that knows CuPy exists. Everything else asks an array which module
it belongs to (``xp = get_array_module(x)``, CuPy's own idiom) and calls ``xp.exp``, ``xp.matmul``...,
so the same line of layer code runs on both.

The *current* backend (``set_backend`` or the ``MINIVIT_BACKEND`` environment variable) decides only
two things: where a new model allocates its parameters, and where ``asarray`` puts a batch. CuPy is
imported the first time it is chosen, never before.
"""

import os

import numpy

BACKENDS = ("numpy", "cupy")

_current = None  # "numpy" | "cupy"; None until first asked (then read from MINIVIT_BACKEND)
_cupy = None  # the cupy module, once imported


def _import_cupy():
    """Import CuPy and check that a GPU can actually be used; raise a clear error saying which part is missing."""
    global _cupy
    if _cupy is not None:
        return _cupy
    try:
        import cupy
    except ImportError as err:
        raise RuntimeError(
            "the 'cupy' backend was chosen but CuPy is not installed "
            f"({err}). Install the build that matches your CUDA: pip install cupy-cuda12x "
            "(or cupy-cuda13x), or use set_backend('numpy')."
        ) from None
    try:
        available = bool(cupy.cuda.is_available())
    except Exception as err:  # a broken driver can raise instead of returning False
        raise RuntimeError(f"CuPy is installed but the CUDA driver could not be queried: {err}") from None
    if not available:
        raise RuntimeError(
            "the 'cupy' backend was chosen and CuPy is installed, but no usable GPU was found "
            "(cupy.cuda.is_available() is False: no device or no driver). Use set_backend('numpy')."
        )
    _cupy = cupy
    return cupy


def _check_name(name):
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")


def set_backend(name):
    """Choose where new models and batches live: 'numpy' (CPU) or 'cupy' (GPU)."""
    global _current
    _check_name(name)
    if name == "cupy":
        _import_cupy()
    _current = name


def get_backend():
    """The name of the current backend ('numpy' unless set_backend or MINIVIT_BACKEND chose 'cupy')."""
    global _current
    if _current is None:
        name = os.environ.get("MINIVIT_BACKEND", "numpy").strip().lower() or "numpy"
        if name not in BACKENDS:
            raise ValueError(f"MINIVIT_BACKEND must be one of {BACKENDS}, got {name!r}")
        set_backend(name)
    return _current


def backend_module(name=None):
    """The array module (numpy or cupy) of the named backend, default the current one."""
    name = get_backend() if name is None else name
    _check_name(name)
    return _import_cupy() if name == "cupy" else numpy


def get_array_module(*arrays):
    """numpy or cupy, whichever the arrays belong to (numpy for plain Python numbers)."""
    if _cupy is not None:
        return _cupy.get_array_module(*arrays)
    return numpy


def backend_of(x):
    """'cupy' for a CuPy array, else 'numpy'."""
    return "cupy" if _cupy is not None and isinstance(x, _cupy.ndarray) else "numpy"


def is_array(x):
    """True for a numpy.ndarray or a cupy.ndarray."""
    return isinstance(x, numpy.ndarray) or (_cupy is not None and isinstance(x, _cupy.ndarray))


def to_numpy(x):
    """A host NumPy array with x's values (a copy from the GPU; x itself when it already is NumPy)."""
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        return _cupy.asnumpy(x)
    return numpy.asarray(x)


def as_numpy(value):
    """A host NumPy copy of value, C-contiguous: a NumPy or CuPy array, or a PyTorch tensor (detached and moved to
    the CPU first), as a published checkpoint's state dict holds them (convert.py, clip/model.py)."""
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return to_numpy(value).copy()


def asarray(x, dtype=None, backend=None):
    """x as an array of the given backend (default: the current one), copied across devices if needed."""
    xp = backend_module(backend)
    if xp is numpy:
        return numpy.asarray(to_numpy(x), dtype=dtype)
    return xp.asarray(x, dtype=dtype)


def host_rng(seed):
    """A NumPy random Generator on the host. Parameters are drawn on the host and then moved, so a seed
    gives the same model on both backends."""
    return numpy.random.default_rng(seed)


def erf(x):
    """The error function, elementwise, on x's own device (cupyx.scipy.special on the GPU, scipy.special
    on the CPU)."""
    if _cupy is not None and isinstance(x, _cupy.ndarray):
        import cupyx.scipy.special

        return cupyx.scipy.special.erf(x)
    import scipy.special

    return scipy.special.erf(x)


def synchronize(x=None):
    """Wait for the GPU to finish queued work (a no-op on NumPy). Needed before timing CuPy code."""
    if _cupy is not None and (x is None or isinstance(x, _cupy.ndarray)):
        _cupy.cuda.get_current_stream().synchronize()


def gpu_available():
    """True when the cupy backend could be chosen here (CuPy installed and a usable GPU)."""
    try:
        _import_cupy()
    except RuntimeError:
        return False
    return True
