"""The trained model committed for lessons 5 and 9 (notebooks/assets/shapes64_vit.npz): it loads, it is
small, and it reaches on its test split the accuracy that its README and lesson 9 state."""

from pathlib import Path

import numpy as np

import minivit
from minivit.augment import normalize
from minivit.weights.checkpoint import load_checkpoint
from minivit.data import load_dataset, resize_images

ASSETS = Path(__file__).resolve().parents[1] / "notebooks" / "assets"
MODEL = ASSETS / "shapes64_vit.npz"


def test_the_committed_model_loads_and_reaches_its_stated_accuracy():
    assert MODEL.stat().st_size < 2_000_000, "keep the committed model a few MB at most"
    model = minivit.load_model(str(MODEL), backend="numpy").eval()
    extra = load_checkpoint(str(MODEL))["meta"]["extra"]
    c = model.config
    assert (c.img_size, c.patch_size, c.grid_size, c.depth, c.num_heads) == ((64, 64), 8, (8, 8), 6, 4)
    assert extra["dataset"] == "shapes" and len(extra["classes"]) == c.num_classes == 10
    data = load_dataset("shapes")                             # drawn at 32 x 32 and resized, as the trainer did
    x = resize_images(data.x_test, (64, 64))                  # (2000, 64, 64, 3)
    pred = np.concatenate([model.forward(normalize(x[i:i + 500], extra["mean"], extra["std"])).argmax(1)
                           for i in range(0, len(x), 500)])
    accuracy = float((pred == data.y_test).mean())
    assert abs(accuracy - extra["test_accuracy"]) < 1e-9, (accuracy, extra["test_accuracy"])
    stated = f"{100 * extra['test_accuracy']:.2f}%"
    assert stated == "99.80%"
    assert stated in (ASSETS / "README.md").read_text()
    assert stated in (ASSETS.parent / "09_what_it_learned.ipynb").read_text()


LINES_MODEL = ASSETS / "lines_vit.npz"


def test_the_lines_model_reaches_its_accuracy_and_its_heads_spread_with_depth():
    """Lesson 9's second model (lines, 8 x 8 grid of 4 x 4 patches): its stated test accuracy, and the
    mean attention distances that lesson 9 and assets/README.md quote, recomputed from the weights: some
    heads of the first three blocks well below uniform attention, every head of the last three near it."""
    from minivit import viz
    from minivit.data import make_lines

    assert LINES_MODEL.stat().st_size < 2_000_000, "keep the committed model a few MB at most"
    model = minivit.load_model(str(LINES_MODEL), backend="numpy").eval()
    extra = load_checkpoint(str(LINES_MODEL))["meta"]["extra"]
    c = model.config
    assert ((c.img_size, c.patch_size, c.grid_size, c.depth, c.num_heads, c.num_classes)
            == ((32, 32), 4, (8, 8), 6, 4, 4))
    data = make_lines()                                       # the 10,000 + 2,000 images of seed 0 it was trained on
    assert list(extra["classes"]) == data.classes
    x = normalize(data.x_test, extra["mean"], extra["std"])
    pred = np.concatenate([model.forward(x[i:i + 500]).argmax(1) for i in range(0, len(x), 500)])
    accuracy = float((pred == data.y_test).mean())
    assert abs(accuracy - extra["test_accuracy"]) < 1e-9, (accuracy, extra["test_accuracy"])
    stated = f"{100 * extra['test_accuracy']:.2f}%"
    assert stated in (ASSETS / "README.md").read_text()
    assert stated in (ASSETS.parent / "09_what_it_learned.ipynb").read_text()

    d = viz.mean_attention_distance(viz.attention_weights(model, x[:128]), (8, 8), 4, 1)   # (6, 4) pixels
    np.testing.assert_allclose(d, extra["mean_attention_distance"], atol=2e-3)
    uniform = viz.patch_distances((8, 8), 4).mean()                                  # 16.55 px
    assert d[:3].min() < uniform - 4, d                        # local heads low down
    assert d[:3].max() - d[:3].min() > 4, d                    # ... beside global ones: a spread
    assert np.abs(d[3:] - uniform).max() < 1.5, d              # all near uniform high up
