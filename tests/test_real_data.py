"""Training on real images, through the command line, on the CPU (marked slow; `make test` runs them).

Fashion-MNIST comes from Debian's package `dataset-fashion-mnist` (.ci/run installs it); the tests skip
when it is absent. They assert accuracy, never time: the time is printed in the summary for the record.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minivit.data import FASHION_MNIST_DIRS, load_fashion_mnist

pytestmark = pytest.mark.slow

HAVE_FASHION = any(os.path.isdir(d) for d in FASHION_MNIST_DIRS)
needs_fashion = pytest.mark.skipif(not HAVE_FASHION, reason="needs apt-get install dataset-fashion-mnist")


def run_cli(*args, timeout=1500):
    cmd = [sys.executable, "-m", "minivit.train", "--no-progress", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def summary_of(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


@needs_fashion
def test_fashion_mnist_cli_reaches_83_percent(tmp_path):
    out = str(tmp_path / "fashion")
    printed = run_cli("--dataset", "fashion-mnist", "--out", out)
    s = summary_of(out)
    print(printed[-600:])
    print(f"fashion-mnist: final {s['final_val_accuracy']:.4f} in {s['wall_seconds']:.0f} s "
          f"({s['images_per_second']:.0f} img/s, {s['steps']} steps)")
    assert s["final_val_accuracy"] >= 0.83, s


@needs_fashion
def test_folder_data_set_on_real_images(tmp_path):
    """Real Fashion-MNIST pictures written as PNG files in the ImageFolder layout, read back with Pillow."""
    from PIL import Image

    (x_train, y_train), (x_test, y_test) = load_fashion_mnist()
    names = {1: "trouser", 7: "sneaker", 8: "bag"}
    root = tmp_path / "images"
    for split, x, y, per_class in (("train", x_train, y_train, 300), ("val", x_test, y_test, 60)):
        for label, name in names.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in np.flatnonzero(y == label)[:per_class]:
                Image.fromarray(x[i, :, :, 0]).save(folder / f"{i}.png")
    out = str(tmp_path / "run")
    run_cli("--dataset", "folder", "--data-dir", str(root), "--img-size", "32", "--epochs", "12",
            "--batch-size", "50", "--embed-dim", "32", "--depth", "2", "--num-heads", "2", "--out", out)
    s = summary_of(out)
    print(f"folder: final {s['final_val_accuracy']:.4f} in {s['wall_seconds']:.0f} s")
    assert s["dataset"] == "folder" and s["config"]["num_classes"] == 3 and s["config"]["in_chans"] == 3
    assert s["final_val_accuracy"] >= 0.85, s        # three easy classes; chance is 33%


def test_shapes_demo_recipe_exceeds_90_percent(tmp_path):
    """`make demo`: the procedural data set is hard enough to need a few epochs, and the demo recipe
    gets past 90% in them."""
    out = str(tmp_path / "demo")
    run_cli("--dataset", "shapes", "--out", out)
    s = summary_of(out)
    print(f"shapes demo: final {s['final_val_accuracy']:.4f} in {s['wall_seconds']:.0f} s "
          f"({s['images_per_second']:.0f} img/s, {s['steps']} steps)")
    history = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert history[0]["val_acc"] < 0.9            # not solved after one epoch ...
    assert s["final_val_accuracy"] >= 0.90, s     # ... but after the recipe's few
