"""train() from Python: a given data set, an exact number of steps, evenly spaced evaluations, no files;
and experiments.common.fit, which is train() underneath."""

import dataclasses
import os

import numpy as np
import pytest

import minivit
from minivit import train as T
from minivit.data import Dataset, make_shapes
from minivit.optim import AdamW
from minivit.train import TrainConfig, TrainingDiverged, train

TINY = dict(embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0, batch_size=16, progress=False, verbose=False)


def tiny_data(n_train=48, n_test=20, name="shapes", num_classes=10):
    """A small in-memory Dataset; with num_classes < 10 the labels are folded into that many classes."""
    (x_train, y_train), (x_test, y_test) = make_shapes(n_train, n_test, seed=1)
    return Dataset(name, x_train, y_train % num_classes, x_test, y_test % num_classes,
                   [f"c{k}" for k in range(num_classes)], (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def count_optimizer_steps(monkeypatch):
    calls = []
    real = AdamW.step

    def step(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(AdamW, "step", step)
    return calls


def test_max_steps_alone_is_the_run_length_even_past_the_recipes_epochs(monkeypatch):
    calls = count_optimizer_steps(monkeypatch)
    data = tiny_data()                              # 48 images, batch 16: 3 steps per epoch
    # the demo recipe says 8 epochs = 24 steps; max_steps alone overrides that: exactly 30 steps
    result = train(TrainConfig(**TINY, max_steps=30, out=None), data=data)
    assert len(calls) == 30 and result.summary["steps"] == result.summary["total_steps"] == 30
    assert result.summary["train_config"]["epochs"] is None
    assert result.history[-1]["lr"] < 0.01 * result.summary["train_config"]["lr"]   # the cosine fits the run
    calls.clear()
    both = train(TrainConfig(**TINY, max_steps=30, epochs=2, out=None), data=data)
    assert len(calls) == 6 and both.summary["steps"] == 6                      # with epochs: the shorter


@pytest.mark.parametrize("steps, num_evals, expected", [(12, 4, [3, 6, 9, 12]), (10, 3, [3, 6, 10]),
                                                        (2, 5, [1, 2])])
def test_num_evals_spaces_the_evaluations_evenly(steps, num_evals, expected):
    result = train(TrainConfig(**TINY, max_steps=steps, num_evals=num_evals, out=None), data=tiny_data())
    assert [r["step"] for r in result.history] == expected


def test_out_none_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # a relative write (runs/default, ...) would land here

    def no_writes(*args, **kw):
        raise AssertionError("train(out=None) tried to write a file")

    for module, name in ((T.loop, "save_checkpoint"), (T.loop, "_append_jsonl"), (T.run_folder, "_write_json_atomic")):
        monkeypatch.setattr(module, name, no_writes)
    result = train(TrainConfig(**TINY, max_steps=4, num_evals=2, out=None), data=tiny_data())
    assert os.listdir(tmp_path) == [] and result.out is None
    assert len(result.history) == 2 and result.summary["steps"] == 4
    with pytest.raises(ValueError, match="resume needs out"):
        train(TrainConfig(**TINY, out=None, resume=True))


def test_a_given_data_set_is_trained_on_as_it_is():
    # two classes and 48 images: a model built for them, 3 steps per epoch; named fashion-mnist, it gets
    # that data set's recipe without anything being read from disk
    data = tiny_data(num_classes=2, name="fashion-mnist")
    result = train(TrainConfig(**TINY, epochs=2, out=None), data=data)
    assert result.model.config.num_classes == 2 and result.summary["steps"] == 6
    assert result.summary["dataset"] == "fashion-mnist" and result.summary["train_config"]["recipe"] == "fashion-cpu"
    # the evaluation is on data's test images: with every test label flipped, the accuracy is 1 - it
    flipped = dataclasses.replace(data, y_test=1 - data.y_test)
    again = train(TrainConfig(**TINY, epochs=2, out=None), data=flipped)
    assert again.history[-1]["val_acc"] == pytest.approx(1 - result.history[-1]["val_acc"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow that makes the loss NaN
def test_a_given_resnet_trains_and_a_divergence_says_at_which_step():
    from minivit.resnet import ResNet, ResNetConfig

    data = tiny_data()
    resnet = ResNet(ResNetConfig(img_size=32, widths=(4, 8), depths=(1, 1)))
    result = train(TrainConfig(**TINY, max_steps=2, out=None), model=resnet, data=data)
    assert result.model is resnet and result.summary["config"]["widths"] == [4, 8]
    with pytest.raises(TrainingDiverged) as err:
        train(TrainConfig(**TINY, max_steps=20, lr=1e6, optimizer="sgd", momentum=0.0, warmup_steps=0,
                          out=None), data=data)
    assert 0 <= err.value.step < 20 and f"at step {err.value.step} " in str(err.value)
    assert "checkpoint" not in str(err.value)                   # out=None: there is none to point to


# ---- experiments.common.fit: a thin wrapper around train() ---------------------------------------


def test_fit_is_train_underneath():
    from experiments import common

    data = tiny_data()
    ours = common.vit_for(data, dict(patch_size=8, embed_dim=16, depth=1, num_heads=2), seed=3)
    theirs = common.vit_for(data, dict(patch_size=8, embed_dim=16, depth=1, num_heads=2), seed=3)
    r = common.fit(ours, data, steps=5, batch_size=16, lr=2e-3, num_evals=2, seed=1)
    cfg = TrainConfig(max_steps=5, batch_size=16, lr=2e-3, weight_decay=0.05, warmup_steps=0, optimizer="adamw",
                      clip_grad=1.0, augment="none", label_smoothing=0.0, seed=1, num_evals=2, out=None,
                      progress=False, verbose=False)
    direct = train(cfg, model=theirs, data=data)
    for k, v in theirs.params.items():
        np.testing.assert_array_equal(minivit.to_numpy(ours.params[k]), minivit.to_numpy(v), err_msg=k)
    assert r["steps"] == 5 and [c["step"] for c in r["curve"]] == [2, 5]
    assert r["final_test_acc"] == direct.summary["final_val_accuracy"] and not r["diverged"]
    assert r["epochs"] == round(5 * 16 / 48, 2) and r["seconds_per_step"] > 0
    assert 0 < direct.summary["eval_seconds"] < direct.summary["wall_seconds"]    # s/step leaves evaluation out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fit_reports_a_diverged_run_instead_of_raising():
    from experiments import common

    data = tiny_data()
    model = common.vit_for(data, dict(patch_size=8, embed_dim=16, depth=1, num_heads=2))
    r = common.fit(model, data, steps=20, batch_size=16, lr=1e6, warmup=0.0, clip=None, num_evals=20)
    assert r["diverged"] and r["final_test_acc"] is None and r["steps"] < 20
    assert r["curve"][-1] == {"step": r["steps"] + 1, "test_acc": None, "diverged": True}


def test_a_recipe_sets_fields_that_have_a_usual_value():
    """The long recipe's cutmix 1.0 and random erasing 0.25 are applied (they were once dropped because the
    fields defaulted to 0.0, which looked given); a flag still overrides the recipe, and without either a
    field takes minivit.train.BASE's value."""
    from minivit.train import BASE, resolve

    long = resolve(TrainConfig(recipe="long"))
    assert (long.cutmix, long.random_erasing) == (1.0, 0.25)
    assert resolve(TrainConfig(recipe="long", cutmix=0.0)).cutmix == 0.0
    demo = resolve(TrainConfig(dataset="shapes"))
    assert {k: getattr(demo, k) for k in BASE} == BASE

