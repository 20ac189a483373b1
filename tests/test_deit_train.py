"""python -m minivit.train --distill TEACHER: a DistilledViT trained by the loop, taught by a ResNet teacher
(minivit/deit/task.py). A tiny run on `shapes` writes a checkpoint that reloads; a teacher that cannot be read,
or whose classes differ, is refused by name; the teacher keeps no caches and is not trained."""

import dataclasses
import json

import numpy as np
import pytest

import minivit
from minivit.weights.checkpoint import save_checkpoint
from minivit.deit import DistilledViT, load_model
from minivit.deit.task import DistillTask, load_teacher
from minivit.resnet import ResNet, ResNetConfig
from minivit.train import TrainConfig, main, resolve, set_up, train

TINY = dict(dataset="shapes", embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0, batch_size=32, train_subset=128,
            max_steps=4, progress=False, eval_batch_size=1000, verbose=False)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A small ResNet trained for a few steps on `shapes` by the trainer, as a teacher is made: its run folder."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    cfg = TrainConfig(**{**TINY, "out": str(out)})
    data = minivit.data.load_dataset("shapes")
    model = ResNet(ResNetConfig(img_size=data.image_shape[:2], in_chans=3, num_classes=10, widths=(8,), depths=(1,)))
    train(cfg, model=model)
    return out


def test_a_tiny_distilled_run_writes_a_checkpoint_that_reloads(tmp_path, teacher):
    result = train(TrainConfig(**{**TINY, "distill": str(teacher), "out": str(tmp_path / "run")}))
    model = result.model
    assert isinstance(model, DistilledViT) and result.summary["steps"] == 4
    assert result.summary["train_config"]["task"] == "distill"
    assert result.summary["train_config"]["distill_kind"] == "hard"
    reloaded = load_model(tmp_path / "run")
    meta = reloaded.checkpoint_meta
    x = minivit.data.augment.normalize(minivit.data.load_dataset("shapes").x_test[:4], meta["mean"], meta["std"],
                                       "float32")
    np.testing.assert_array_equal(reloaded.forward(x), model.eval().forward(x))
    assert reloaded.checkpoint_meta["distill"] == {"teacher": str(teacher), "kind": "hard", "tau": 3.0, "alpha": 0.1}
    # the one loader of the README (and predict, which calls it) hands a distilled run to deit's loader
    for load in (minivit.load_model, minivit.from_pretrained):
        same = load(str(tmp_path / "run" / "checkpoint.npz"))
        assert isinstance(same, DistilledViT)
        np.testing.assert_array_equal(same.eval().forward(x), model.eval().forward(x))


def test_the_command_line_soft_and_resume(tmp_path, teacher, capsys):
    out = str(tmp_path / "cli")
    args = ["--dataset", "shapes", "--distill", str(teacher), "--distill-kind", "soft", "--distill-tau", "2",
            "--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--batch-size", "32", "--train-subset", "128",
            "--out", out, "--no-progress"]
    assert main(args + ["--max-steps", "2"]) == 0
    assert "final val accuracy" in capsys.readouterr().out
    assert main(args + ["--max-steps", "4", "--resume"]) == 0
    summary = json.load(open(tmp_path / "cli" / "summary.json"))
    assert summary["steps"] == 4 and summary["train_config"]["distill_kind"] == "soft"
    assert summary["train_config"]["distill_tau"] == 2.0


def test_the_teacher_keeps_no_caches_and_is_not_trained(tmp_path, teacher):
    run = set_up(TrainConfig(**{**TINY, "distill": str(teacher), "out": None}))
    task = run.task
    assert isinstance(task, DistillTask) and not task.teacher.training
    before = task.teacher.state_dict()
    x, y = task.batch(0)
    loss, correct, _ = task.train_step(x, y)
    assert np.isfinite(loss) and 0 <= correct <= 32
    assert all(layer.cache is None for layer in task.teacher.sublayers())
    after = task.teacher.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert not any(p is q for p in run.model.params.values() for q in task.teacher.params.values())


def test_a_teacher_that_cannot_be_read_is_named(tmp_path):
    missing = tmp_path / "no-teacher"
    with pytest.raises(ValueError, match=f"--distill '{missing}': the teacher checkpoint cannot be read"):
        train(TrainConfig(**{**TINY, "distill": str(missing), "out": str(tmp_path / "run")}))
    assert not (tmp_path / "run").exists()              # refused before the run folder was made
    assert main(["--dataset", "shapes", "--distill", str(missing), "--max-steps", "1", "--out",
                 str(tmp_path / "r2"), "--no-progress"]) == 2


def test_a_teacher_of_other_classes_is_named(tmp_path):
    path = tmp_path / "three.npz"
    save_checkpoint(str(path), ResNet(ResNetConfig(img_size=32, num_classes=3, widths=(8,), depths=(1,))))
    with pytest.raises(ValueError, match=r"three.npz'?: the teacher has 3 classes, but shapes has 10"):
        train(TrainConfig(**{**TINY, "distill": str(path), "out": None}))
    data = minivit.data.load_dataset("shapes")
    renamed = dataclasses.replace(data, classes=[f"c{i}" for i in range(10)])
    good = tmp_path / "ten.npz"
    save_checkpoint(str(good), ResNet(ResNetConfig(img_size=32, num_classes=10, widths=(8,), depths=(1,))),
                    extra={"classes": list(data.classes)})
    load_teacher(good, data)                             # the same names: taken
    with pytest.raises(ValueError, match=r"the teacher has 10 classes \['"):
        load_teacher(good, renamed)


def test_distill_flags_are_checked():
    with pytest.raises(ValueError, match="--task distill needs --distill TEACHER_CHECKPOINT"):
        resolve(TrainConfig(dataset="shapes", task="distill"))
    with pytest.raises(ValueError, match="not --task clip"):
        resolve(TrainConfig(dataset="shapes", task="clip", distill="t.npz"))
    with pytest.raises(ValueError, match="distill_kind must be 'hard' or 'soft', got 'warm'"):
        resolve(TrainConfig(dataset="shapes", distill="t.npz", distill_kind="warm"))
    with pytest.raises(ValueError, match=r"distill_alpha must be in \[0, 1\], got 2"):
        resolve(TrainConfig(dataset="shapes", distill="t.npz", distill_alpha=2))
    assert resolve(TrainConfig(dataset="shapes", distill="t.npz")).task == "distill"


def test_what_a_distilled_run_cannot_do_is_refused(tmp_path, teacher):
    with pytest.raises(ValueError, match="--distill does not support --grad-accum 2"):
        train(TrainConfig(**{**TINY, "distill": str(teacher), "grad_accum": 2, "out": None}))


def test_the_experiment_writes_its_table(tmp_path):
    """experiments/distill.py --quick: a teacher per size, the ViT alone and distilled per seed, the table."""
    from experiments import distill

    results = distill.main(["--quick", "--out", str(tmp_path), "--sizes", "128", "--seeds", "1"])
    assert [(r["model"], r["n_train"]) for r in results["runs"]] == [("vit", 128), ("distilled", 128)]
    assert results["teachers"][0]["arch"] == "resnet"
    text = (tmp_path / "distill_quick.md").read_text()
    assert "| 128 |" in text and "`python -m experiments.distill --quick --out" in text
    assert (tmp_path / "distill_quick.json").exists()
