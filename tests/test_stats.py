"""--log-stats: the per-layer statistics records (minivit/train/stats.py) written into metrics.jsonl by the trainer,
checked against numbers computed by hand from the model and its parameters before and after the step."""

import dataclasses
import math

import numpy as np
import pytest

import minivit
from minivit import viz
from minivit.train import stats
from minivit.data import Dataset, make_shapes
from minivit.train.plot import plot_curves, plot_stats, read_metrics
from minivit.train import TrainConfig, train


@pytest.fixture(scope="module")
def data():
    (x, y), (xt, yt) = make_shapes(num_train=64, num_test=20, seed=1, img_size=16)
    return Dataset("shapes", x, y, xt, yt, [str(k) for k in range(10)], (0.3, 0.3, 0.3), (0.25, 0.25, 0.25))


def tiny(seed=0):
    return minivit.ViT(minivit.ViTConfig(img_size=16, patch_size=4, num_classes=10, embed_dim=16, depth=2,
                                         num_heads=2, mlp_ratio=2.0), seed=seed)


def cfg(out, **kw):
    base = dict(dataset="shapes", max_steps=4, batch_size=16, lr=1e-2, warmup_steps=0, eval_every=2,
                log_stats=2, augment="none", label_smoothing=0.0, progress=False, verbose=False, out=str(out),
                overwrite=True, backend="numpy")
    base.update(kw)
    return TrainConfig(**base)


def test_records_have_every_field_finite_and_leave_the_eval_readers_alone(tmp_path, data):
    result = train(cfg(tmp_path), model=tiny(), data=data)
    records = read_metrics(tmp_path, kind=None)
    assert ([(r.get("kind", "eval"), r["step"]) for r in records]
            == [("stats", 2), ("eval", 2), ("stats", 4), ("eval", 4)])
    evals, logged = read_metrics(tmp_path), read_metrics(tmp_path, kind="stats")
    assert [r["step"] for r in evals] == [2, 4] and all("kind" not in r for r in evals)
    assert result.history == evals                       # what the run returns holds evaluations only
    model = result.model
    stages = [name for name, _ in model.stages()]
    for r in logged:
        assert list(r["activations"]) == stages and list(r["blocks"]) == ["blocks.0", "blocks.1"]
        assert list(r["params"]) == list(model.params)
        numbers = [v for a in r["activations"].values() for v in a.values()]
        numbers += [v for b in r["blocks"].values() for v in b.values()]
        numbers += [v for p in r["params"].values() for v in p.values()]
        assert all(isinstance(v, float) and math.isfinite(v) for v in numbers)
        for b in r["blocks"].values():
            assert 0 < b["attn_entropy"] <= 1 + 1e-6 and 0 < b["attn_max"] <= 1 and 0 <= b["gelu_flat"] <= 1
        assert r["activations"]["norm"]["std"] == pytest.approx(1.0, abs=0.05)   # LayerNorm's output, at init weights
    plot_curves(tmp_path)                                 # the eval plot still reads the folder
    fig = plot_stats(tmp_path)
    assert all(ax.get_legend() is not None for ax in fig.axes)   # every panel says which line is which


def test_update_ratio_and_gradient_norm_against_the_parameters_before_and_after(tmp_path, data):
    """SGD without momentum or decay: theta' = theta - lr g, so ||theta' - theta|| = lr ||g|| exactly."""
    model = tiny()
    theta0 = model.state_dict()
    lr = 0.05
    result = train(cfg(tmp_path, max_steps=1, log_stats=1, eval_every=1, optimizer="sgd", momentum=0.0,
                       weight_decay=0.0, lr=lr), model=model, data=data)
    (record,) = read_metrics(tmp_path, kind="stats")
    theta1 = result.model.state_dict()
    for name, p in record["params"].items():
        delta = np.linalg.norm((theta1[name] - theta0[name]).astype(np.float64))
        norm0 = np.linalg.norm(theta0[name].astype(np.float64))
        assert p["param_norm"] == pytest.approx(norm0, rel=1e-6), name
        if norm0 > 0:
            assert p["update_ratio"] == pytest.approx(delta / norm0, rel=1e-4, abs=1e-9), name
        else:
            assert p["update_ratio"] is None
        assert p["grad_norm"] * lr == pytest.approx(delta, rel=1e-3, abs=1e-9), name


def test_activation_stats_match_the_stages_and_the_attention_weights(data):
    model = tiny(seed=3).eval()
    x = minivit.augment.normalize(data.x_train[:8], data.mean, data.std)
    acts, blocks = stats.activation_stats(model, x)
    assert model.training is False and model.blocks[0].attn.cache is None   # its mode restored, no cache kept
    h = x
    for name, layer in model.stages():                  # eval mode: no dropout, the same forward
        h = layer.forward(h)
        assert float(acts[name][0]) == pytest.approx(float(h.mean()), rel=1e-5, abs=1e-7), name
        assert float(acts[name][1]) == pytest.approx(float(h.std()), rel=1e-5), name
    attns = viz.attention_weights(model, x)
    for i, a in enumerate(attns):                       # (B, nh, N, N)
        entropy = -(a * np.log(a)).sum(-1).mean() / np.log(a.shape[-1])
        assert float(blocks[f"blocks.{i}"][0]) == pytest.approx(entropy, rel=1e-4)
        assert float(blocks[f"blocks.{i}"][1]) == pytest.approx(a.max(-1).mean(), rel=1e-4)


def test_gelu_flat_counts_the_inputs_below_minus_three(data):
    model = tiny()
    model.params["blocks.0.mlp.fc1.bias"][...] = -10.0     # every GELU input of block 0 deep in the flat tail
    x = minivit.augment.normalize(data.x_train[:4], data.mean, data.std)
    _, blocks = stats.activation_stats(model, x)
    assert float(blocks["blocks.0"][2]) == 1.0 and float(blocks["blocks.1"][2]) < 0.05


def test_resume_keeps_the_stats_records_once(tmp_path, data):
    train(cfg(tmp_path, max_steps=4, log_stats=1), model=tiny(), data=data)
    longer = dataclasses.replace(cfg(tmp_path, max_steps=6, log_stats=1), overwrite=False, resume=True)
    train(longer, data=data)
    assert [r["step"] for r in read_metrics(tmp_path, kind="stats")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(tmp_path)] == [2, 4, 6]


def test_bad_settings_are_refused(tmp_path, data):
    with pytest.raises(ValueError, match="log_stats must be a positive int"):
        train(cfg(tmp_path, log_stats=0), model=tiny(), data=data)
    with pytest.raises(ValueError, match="out is None"):
        train(dataclasses.replace(cfg(tmp_path), out=None), model=tiny(), data=data)
    with pytest.raises(ValueError, match="kind must be"):
        read_metrics(tmp_path, kind="eval_records")
