"""MAE through the trainer (--task mae: minivit/mae/task.py run by minivit/train/loop.py): a tiny pre-training
on shapes writes its checkpoint and reports the reconstruction loss; a fine-tune with --init from it starts
from the encoder's weights and trains; bad flags are refused by name."""

import json
import os

import numpy as np
import pytest

from minivit.weights import checkpoint as ckpt
from minivit import train as T
from minivit.data.dataset import Dataset, channel_mean_std
from minivit.data.synthetic import make_shapes
from minivit.mae import MAE


@pytest.fixture(scope="module")
def data():
    (x, y), (xt, yt) = make_shapes(num_train=128, num_test=48, seed=2)
    mean, std = channel_mean_std(x)
    return Dataset("shapes", x, y, xt, yt, [str(k) for k in range(10)], mean, std)


def pretrain(out, data, **kw):
    cfg = T.TrainConfig(**{**dict(task="mae", dataset="shapes", out=str(out), max_steps=6, epochs=None,
                                  batch_size=32, eval_every=3, progress=False, verbose=False), **kw})
    return T.train(cfg, data=data)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, data):
    out = tmp_path_factory.mktemp("mae") / "run"
    return out, pretrain(out, data)


def test_a_tiny_pretraining_writes_a_checkpoint_and_the_reconstruction_loss(pretrained):
    out, result = pretrained
    assert isinstance(result.model, MAE)
    assert {"checkpoint.npz", "summary.json", "metrics.jsonl"} <= set(os.listdir(out))
    s = json.loads((out / "summary.json").read_text())
    assert s["train_config"]["task"] == "mae" and s["train_config"]["recipe"] == "mae-shapes"
    assert s["reconstruction_loss"] == s["final_val_loss"] and 0 < s["reconstruction_loss"] < 5
    assert 0 <= s["knn_accuracy"] <= 1
    saved = ckpt.load_checkpoint(out)
    assert saved["meta"]["config"]["mask_ratio"] == 0.75
    for k, v in result.model.state_dict().items():
        np.testing.assert_array_equal(saved["params"][k], v)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]


def test_a_pretraining_shows_no_training_accuracy(tmp_path, data, capsys):
    """MAE has no labels in its steps: its records hold train_acc None (not a 0% that reads as a failure), the
    log line and the bar leave it out, and the curves draw the k-NN accuracy alone."""
    from minivit.train.plot import plot_curves
    pretrain(tmp_path / "run", data, verbose=True, progress=True)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train_acc"] for r in records] == [None, None]
    shown = capsys.readouterr()
    lines = [line for line in (shown.out + shown.err).replace("\r", "\n").splitlines() if "train loss" in line]
    assert len(lines) == 2 and all("| val loss" in line and "acc 0.00%" not in line for line in lines), lines
    assert "acc=" not in shown.err, shown.err[-300:]
    figure = plot_curves(str(tmp_path / "run"))
    assert [line.get_label() for line in figure.axes[1].lines] == ["validation"]


def test_the_reconstruction_loss_falls(tmp_path, data):
    pretrain(tmp_path / "longer", data, max_steps=24, eval_every=4, lr=3e-3, warmup_steps=2)
    records = [json.loads(line) for line in (tmp_path / "longer" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["val_loss"] for r in records if "val_loss" in r]
    assert losses[-1] < 0.9 * losses[0], losses


def test_finetuning_starts_from_the_encoder_and_trains(pretrained, data, tmp_path):
    out, _ = pretrained
    saved = ckpt.load_checkpoint(out)["params"]
    cfg = T.TrainConfig(dataset="shapes", init=str(out / "checkpoint.npz"), out=str(tmp_path / "ft"), max_steps=4,
                        epochs=None, batch_size=32, eval_every=4, progress=False, verbose=False)
    model = T.tasks.build_model(T.resolve(cfg), data)
    encoder = {k: v for k, v in saved.items() if not k.startswith(("mask_token", "decoder_"))}
    assert set(model.params) == set(encoder) | {"head.weight", "head.bias"}
    for k, v in encoder.items():                    # the encoder's weights, exactly
        np.testing.assert_array_equal(model.state_dict()[k], v)
    assert not np.any(model.state_dict()["head.weight"])          # a new zero head
    result = T.train(cfg, data=data)
    s = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert s["steps"] == 4 and s["train_config"]["pos_embed"] == "sincos2d"
    after = result.model.state_dict()
    assert any(not np.array_equal(after[k], encoder[k]) for k in encoder)   # it trained the encoder too
    assert np.any(after["head.weight"])


@pytest.mark.parametrize("flag, value", [("embed_dim", 32), ("mixup", 0.2), ("model", "vit_cifar_tiny")])
def test_classifier_flags_are_refused_by_name(flag, value):
    cfg = T.TrainConfig(task="mae", dataset="shapes", out=None, max_steps=1, **{flag: value})
    with pytest.raises(ValueError, match="--task mae"):
        T.resolve(cfg)


def test_the_experiment_writes_its_table_with_the_command(tmp_path):
    from minivit.data import load_dataset
    try:
        load_dataset("fashion-mnist")
    except FileNotFoundError:
        pytest.skip("experiments/mae.py runs on Fashion-MNIST, not installed here")
    from experiments import mae as experiment

    experiment.main(["--pretrain-steps", "2", "--steps", "2", "2", "--seeds", "2", "--n-test", "40",
                     "--out", str(tmp_path)])
    table = (tmp_path / "mae.md").read_text()
    assert "python -m experiments.mae --pretrain-steps 2" in table
    assert "| 1% (600) |" in table and "| 10% (6,000) |" in table and "+-" in table
    runs = json.loads((tmp_path / "mae.json").read_text())["runs"]
    assert len(runs) == 2 * 2 * 2 and {r["init"] for r in runs} == {"mae", "scratch"}


def test_an_mae_checkpoint_where_a_classifier_is_needed_is_refused_by_what_it_is(pretrained):
    """predict, load_model and from_pretrained need a ViT classifier: an MAE run's checkpoint is named as one,
    with the way to make a classifier of it (--init), not called an invalid ViTConfig."""
    import minivit
    out, _ = pretrained
    for load in (ckpt.load_model, minivit.from_pretrained):
        with pytest.raises(ValueError, match=r"is an MAE checkpoint .* --init"):
            load(str(out / "checkpoint.npz"))
