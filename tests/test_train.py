"""The trainer: outputs, exact resume, Ctrl-C, divergence, gradient accumulation, checkpoints, CLIs."""

import json
import os
import signal

import numpy as np
import pytest

import minivit
from minivit.weights import checkpoint as ckpt
from minivit.train import TrainConfig, TrainingDiverged, main, train

# a tiny model on a slice of `shapes`: each run takes a second or two
TINY = dict(dataset="shapes", embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0, batch_size=32,
            train_subset=256, epochs=2, progress=False, eval_batch_size=1000)


def tiny_cfg(tmp_path, **kw):
    return TrainConfig(**{**TINY, "out": str(tmp_path / "run"), **kw})


def params_of(model):
    return {k: minivit.to_numpy(v).copy() for k, v in model.params.items()}


def test_a_run_writes_metrics_summary_checkpoint_and_curves(tmp_path):
    result = train(tiny_cfg(tmp_path, eval_every=4))
    out = tmp_path / "run"
    assert sorted(os.listdir(out)) == ["checkpoint.npz", "curves.png", "metrics.jsonl", "summary.json"]
    lines = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [4, 8, 12, 16]            # 256 // 32 = 8 steps per epoch, 2 epochs
    summary = json.load(open(out / "summary.json"))
    for key in ("best_val_accuracy", "final_val_accuracy", "steps", "epochs", "wall_seconds",
                "images_per_second", "config", "backend"):
        assert key in summary
    assert summary["steps"] == 16 and summary["epochs"] == 2.0
    assert summary["final_val_accuracy"] == lines[-1]["val_acc"] == result.history[-1]["val_acc"]
    assert summary["best_val_accuracy"] == max(r["val_acc"] for r in lines)
    assert summary["config"]["embed_dim"] == 16 and summary["backend"] == minivit.get_backend()


def test_training_lowers_the_loss(tmp_path):
    # 64 images seen 25 times: the model starts to memorise them, so the training loss must fall
    result = train(tiny_cfg(tmp_path, epochs=25, lr=3e-3, train_subset=64, eval_every=10, warmup_epochs=0))
    losses = [r["train_loss"] for r in result.history]
    assert losses[-1] < losses[0] - 0.1, losses


STOCHASTIC = dict(augment="standard", drop_rate=0.1, drop_path_rate=0.1, mixup=0.4, random_erasing=0.3)


def test_ctrl_c_then_resume_is_bit_for_bit_an_uninterrupted_run(tmp_path):
    full = train(tiny_cfg(tmp_path / "a", eval_every=3, **STOCHASTIC))

    def press_ctrl_c(record):            # a real SIGINT, delivered to this process mid-run
        if record["step"] == 6:
            os.kill(os.getpid(), signal.SIGINT)

    first = train(tiny_cfg(tmp_path / "b", eval_every=3, **STOCHASTIC), callback=press_ctrl_c)
    assert first.summary["interrupted"] and first.summary["steps"] == 6   # stopped right after step 6
    resumed = train(TrainConfig(out=str(tmp_path / "b" / "run"), resume=True, progress=False))
    assert resumed.summary["steps"] == full.summary["steps"] == 16
    a, b = params_of(full.model), params_of(resumed.model)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    steps = [r["step"] for r in resumed.history]
    assert steps == sorted(steps) and steps[-1] == 16


def test_resume_without_a_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        train(TrainConfig(out=str(tmp_path / "nothing"), resume=True))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow that makes the loss NaN
def test_a_diverging_run_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg = tiny_cfg(tmp_path, lr=1e4, eval_every=1, warmup_epochs=0, optimizer="sgd", momentum=0.0)
    with pytest.raises(TrainingDiverged, match="loss became") as err:
        train(cfg)
    assert "Try a lower --lr" in str(err.value)
    saved = ckpt.load_checkpoint(tmp_path / "run" / "checkpoint.npz")
    step = saved["meta"]["extra"]["step"]
    assert step >= 1 and f"The last good checkpoint, of step {step}," in str(err.value)
    assert all(np.isfinite(v).all() for v in saved["params"].values())


def test_gradient_accumulation_gives_the_same_step(tmp_path):
    base = dict(dtype="float64", max_steps=3, epochs=None, eval_every=3, augment="none")
    one = train(tiny_cfg(tmp_path / "a", grad_accum=1, **base))
    four = train(tiny_cfg(tmp_path / "b", grad_accum=4, **base))
    a, b = params_of(one.model), params_of(four.model)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("kw, match", [
    (dict(recipe="turbo"), "unknown recipe 'turbo'"),
    (dict(optimizer="lamb"), "optimizer must be 'adamw' or 'sgd', got 'lamb'"),
    (dict(augment="heavy"), "augment must be one of"),
    (dict(batch_size=30, grad_accum=4), "grad_accum must be a positive int dividing batch_size=30"),
    (dict(batch_size=1000), "batch_size 1000 is larger than the 256 training images"),
    (dict(lr=-1.0), "lr must be > 0"),
    (dict(model="vit_gigantic"), "unknown model preset 'vit_gigantic'"),
    (dict(num_evals=0), "num_evals must be a positive int, got 0"),
    (dict(eval_every=4, num_evals=2), "give eval_every or num_evals, not both"),
])
def test_bad_settings_are_refused_by_name(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        train(tiny_cfg(tmp_path, **kw))


def test_cifar10_missing_without_fallback_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar"):
        train(TrainConfig(dataset="cifar10", data_dir=str(tmp_path), out=str(tmp_path / "run"), progress=False))


def test_cifar10_missing_with_fallback_says_so_and_trains(tmp_path, capsys):
    cfg = TrainConfig(dataset="cifar10", data_dir=str(tmp_path), fallback=True, out=str(tmp_path / "run"),
                      progress=False, max_steps=2, epochs=None, train_subset=64, batch_size=32, embed_dim=16,
                      depth=1, num_heads=2, eval_batch_size=2000)
    result = train(cfg)
    said = capsys.readouterr().out
    assert "CIFAR-10 is not available" in said and "falls back to" in said
    assert result.summary["dataset"] in ("fashion-mnist", "shapes") and result.summary["steps"] == 2


# ---- checkpoints --------------------------------------------------------------------------------


def test_checkpoint_round_trip_and_load_model(tmp_path):
    model = minivit.ViT(minivit.ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1,
                                          num_heads=2, drop_rate=0.1))
    path = ckpt.save_checkpoint(tmp_path / "m.npz", model, extra={"classes": ["a", "b", "c"]})
    loaded = minivit.load_model(path)
    assert loaded.config == model.config and loaded.checkpoint_meta["classes"] == ["a", "b", "c"]
    for k, v in params_of(model).items():
        np.testing.assert_array_equal(minivit.to_numpy(loaded.params[k]), v)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]     # no temporary left behind


def test_truncated_foreign_and_missing_checkpoints_are_named(tmp_path):
    model = minivit.ViT(minivit.ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1,
                                          num_heads=2))
    good = ckpt.save_checkpoint(tmp_path / "good.npz", model)
    raw = open(good, "rb").read()
    (tmp_path / "cut.npz").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "notes.txt").write_text("hello")
    np.savez(tmp_path / "plain.npz", a=np.zeros(3))
    for name, match in (("cut.npz", "cut.npz.*not a readable minivit checkpoint"),
                        ("notes.txt", "notes.txt.*not a readable minivit checkpoint"),
                        ("plain.npz", "plain.npz.*not a minivit checkpoint")):
        with pytest.raises(ValueError, match=match):
            minivit.load_model(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        minivit.load_model(tmp_path / "nowhere.npz")


def test_an_interrupted_write_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    model = minivit.ViT(minivit.ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1,
                                          num_heads=2))
    path = ckpt.save_checkpoint(tmp_path / "c.npz", model)
    before = open(path, "rb").read()

    def broken_savez(f, **arrays):
        f.write(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.numpy, "savez", broken_savez)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path, model)
    assert open(path, "rb").read() == before
    assert os.listdir(tmp_path) == ["c.npz"]


# ---- the other command lines ----------------------------------------------------------------------


def test_cli_train_predict_plot(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["--dataset", "shapes", "--embed-dim", "16", "--depth", "1", "--num-heads", "2",
                 "--batch-size", "32", "--train-subset", "128", "--max-steps", "4", "--out", str(out),
                 "--no-progress"])
    assert code == 0 and "final val accuracy" in capsys.readouterr().out
    from PIL import Image

    from minivit.data import make_shapes
    (x, _), _ = make_shapes(num_train=2, num_test=1)
    paths = []
    for i, img in enumerate(x):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(img).save(paths[-1])
    from minivit import predict
    from minivit.train import plot
    assert predict.main(paths + ["--checkpoint", str(out / "checkpoint.npz")]) == 0
    printed = capsys.readouterr().out
    assert printed.count("%") == 10 and "img0.png" in printed     # top-5 for each of the 2 images
    from minivit.data import SHAPES_CLASSES
    assert any(name in printed for name in SHAPES_CLASSES)
    os.remove(out / "curves.png")
    assert plot.main([str(out)]) == 0 and (out / "curves.png").exists()
    assert plot.main([str(tmp_path / "nope")]) == 2
    assert predict.main([str(tmp_path / "missing.png"), "--checkpoint", str(out / "checkpoint.npz")]) == 2


def test_num_registers_flag_builds_a_model_with_register_tokens(tmp_path):
    from minivit.train import _parser

    assert _parser().parse_args(["--num-registers", "2"]).num_registers == 2
    result = train(tiny_cfg(tmp_path, num_registers=2, epochs=None, max_steps=2, train_subset=64))
    assert result.model.config.num_registers == 2 and result.model.params["reg_token"].shape == (1, 2, 16)
    saved = ckpt.load_model(tmp_path / "run" / "checkpoint.npz")
    assert saved.config.num_registers == 2
