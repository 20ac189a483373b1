"""The backend switch: where arrays live, and clear errors when CuPy or a GPU is missing."""

import sys
import types

import numpy as np
import pytest

import minivit
from minivit import backend


def test_numpy_backend_round_trip():
    minivit.set_backend("numpy")
    x = minivit.asarray([[1, 2], [3, 4]], dtype="float32")
    assert isinstance(x, np.ndarray) and x.dtype == np.float32
    assert minivit.get_array_module(x) is np
    assert minivit.to_numpy(x) is x or np.array_equal(minivit.to_numpy(x), x)
    assert minivit.get_backend() == "numpy"


def test_unknown_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="'tensorflow'"):
        minivit.set_backend("tensorflow")


def test_environment_variable_is_checked(monkeypatch):
    monkeypatch.setattr(backend, "_current", None)
    monkeypatch.setenv("MINIVIT_BACKEND", "jax")
    with pytest.raises(ValueError, match="MINIVIT_BACKEND.*'jax'"):
        backend.get_backend()


def test_cupy_missing_says_install(monkeypatch):
    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(RuntimeError, match="CuPy is not installed.*cupy-cuda12x"):
        minivit.set_backend("cupy")


def test_cupy_without_gpu_says_no_gpu(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(RuntimeError, match="no usable GPU"):
        minivit.set_backend("cupy")
    assert backend._cupy is None  # nothing half-chosen


def test_cupy_is_not_imported_unless_chosen():
    if backend.get_backend() == "numpy":
        assert backend._cupy is None or backend.gpu_available()


def test_erf_matches_math():
    import math
    x = np.linspace(-4, 4, 41)
    assert np.allclose(backend.erf(minivit.asarray(x)).tolist(), [math.erf(v) for v in x], rtol=0, atol=1e-15)
