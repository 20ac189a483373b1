"""Lessons 15 and 16 need Fashion-MNIST and never fall back to another data set: without the files their
first code cell stops with one error that says how to get them."""

import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["15_diagnosing_training.ipynb", "16_regularisation.ipynb"])
def test_lesson_stops_and_says_how_to_get_fashion_mnist(name, tmp_path, monkeypatch):
    cells = json.loads((NOTEBOOKS / name).read_text(encoding="utf-8"))["cells"]
    first = next("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    monkeypatch.chdir(NOTEBOOKS)                        # where the lesson runs (claims.py, assets/)
    monkeypatch.syspath_prepend(str(NOTEBOOKS))
    monkeypatch.setenv("MINIVIT_FASHION_MNIST", str(tmp_path))   # an empty folder
    monkeypatch.setenv("MINIVIT_QUICK", "1")
    import matplotlib
    matplotlib.use("Agg")
    with pytest.raises(FileNotFoundError) as err:
        exec(compile(first, name, "exec"), {})
    message = str(err.value)
    assert "needs Fashion-MNIST" in message and str(tmp_path) in message
    assert "apt-get install dataset-fashion-mnist" in message and "download_fashion_mnist.py" in message
    assert os.environ["MINIVIT_FASHION_MNIST"] == str(tmp_path)
