"""Test configuration: ``pytest --backend cupy`` (or MINIVIT_BACKEND=cupy) runs the suite on the GPU.

Tests build their inputs with NumPy and move them with ``minivit.asarray``, so each test runs unchanged
on either backend. Without a usable GPU, a cupy run skips every test, saying why.
"""

import os

import numpy as np
import pytest

import minivit
from minivit import backend


def pytest_addoption(parser):
    parser.addoption("--backend", default=None, choices=backend.BACKENDS,
                     help="array backend for the test suite (default: MINIVIT_BACKEND or numpy)")


def pytest_configure(config):
    name = config.getoption("--backend") or os.environ.get("MINIVIT_BACKEND", "numpy")
    config._minivit_backend = name
    config._minivit_skip = None
    if name == "cupy" and not backend.gpu_available():
        config._minivit_skip = "the cupy backend was asked for but CuPy or a usable GPU is missing here"
    else:
        minivit.set_backend(name)


def pytest_collection_modifyitems(config, items):
    if config._minivit_skip:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=config._minivit_skip))
    if not backend.gpu_available():
        for item in items:
            if item.get_closest_marker("gpu") is not None:   # (not item.keywords: it holds path names too)
                item.add_marker(pytest.mark.skip(reason="needs CuPy and a GPU"))


def pytest_report_header(config):
    return f"minivit backend: {config._minivit_backend}"


@pytest.fixture(autouse=True)
def _restore_backend(request):
    """Each test starts on the suite's backend, even if an earlier one switched."""
    name = request.config._minivit_backend
    if not request.config._minivit_skip:
        minivit.set_backend(name)
    yield
    if not request.config._minivit_skip:
        minivit.set_backend(name)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def arr(rng):
    """arr(*shape): a random float64 array on the current backend."""
    def make(*shape, dtype="float64"):
        return minivit.asarray(rng.standard_normal(shape), dtype=dtype)
    return make
