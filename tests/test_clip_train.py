"""CLIP through the trainer (--task clip: minivit/clip/task.py run by minivit/train/loop.py): a tiny
run's files and summary, Ctrl-C then resume equal bit for bit to an uninterrupted run, and bad flags
refused by name before any file is written."""

import json
import math
import os
import signal

import numpy as np
import pytest

from minivit import captions as C
from minivit.weights import checkpoint as ckpt
from minivit import train as T
from minivit.clip import CLIP


@pytest.fixture(scope="module")
def data():
    return C.make_captioned_shapes(num_train=160, num_test=60, seed=1)     # a second to draw


def tiny(out, **kw):
    base = dict(task="clip", dataset="shapes", out=None if out is None else str(out), max_steps=6, epochs=None,
                batch_size=16, eval_every=3, progress=False, verbose=False)
    return T.TrainConfig(**{**base, **kw})


def test_a_tiny_clip_run_writes_its_files_and_zero_shot_summary(tmp_path, data):
    result = T.train(tiny(tmp_path / "run"), data=data)
    assert isinstance(result.model, CLIP) and sorted(os.listdir(tmp_path / "run")) == [
        "checkpoint.npz", "curves.png", "metrics.jsonl", "summary.json"]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["steps"] == 6 and s["train_config"]["task"] == "clip" and s["train_config"]["recipe"] == "clip-shapes"
    assert s["zero_shot_accuracy"] == s["final_val_accuracy"]
    seen = [k not in data.held_out for k in data.y_test]                # the split, counted here again
    assert s["zero_shot_accuracy"] == pytest.approx(np.mean(seen) * s["zero_shot_seen"]
                                                    + (1 - np.mean(seen)) * s["zero_shot_held_out"])
    assert s["eval_pairs"] == len(set(data.text_test))
    for k in ("image_to_text@1", "text_to_image@1", "image_to_text@5", "text_to_image@5"):
        assert 0 <= s[k] <= 1
    assert s["image_to_text@1"] <= s["image_to_text@5"] and s["text_to_image@1"] <= s["text_to_image@5"]
    assert 0 <= s["logit_scale"] <= math.log(100) and s["logit_scale"] != pytest.approx(math.log(1 / 0.07))
    assert math.isfinite(s["final_val_loss"]) and s["final_val_loss"] < 2 * math.log(16)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6] and records[-1]["zero_shot_seen"] == s["zero_shot_seen"]
    saved = ckpt.load_checkpoint(tmp_path / "run")
    assert saved["meta"]["extra"]["tokenizer"]["context_length"] == 16
    assert saved["meta"]["config"]["vocab_size"] == result.model.config.vocab_size


def test_the_step_is_the_contrastive_step_with_the_clamp(tmp_path, data):
    """One trainer step changes the weights as the written-out step does (loss, backward, AdamW, clamp)."""
    from minivit import augment as A
    from minivit.clip import contrastive_loss
    from minivit.optim import AdamW, default_no_decay

    result = T.train(tiny(None, max_steps=1, eval_every=1, warmup_steps=0, lr=1e-3), data=data)
    cfg = T.resolve(tiny(None, max_steps=1, eval_every=1, warmup_steps=0, lr=1e-3))
    model = CLIP(result.model.config, seed=0)
    tok = C.tokenizer_for(data, 16)
    idx = C.batch_indices(0, 16, 0, C.caption_ids(data.text_train))
    opt = AdamW(model, 1e-3, weight_decay=cfg.weight_decay, no_decay=default_no_decay(model.params))
    loss, dlogits = contrastive_loss(model.forward(A.normalize(data.x_train[idx], data.mean, data.std),
                                                   tok([data.text_train[i] for i in idx])))
    model.zero_grad(); model.backward(dlogits); opt.step(); model.clamp_logit_scale()
    assert result.history[0]["train_loss"] == pytest.approx(loss, rel=1e-6)
    for k, p in model.params.items():
        np.testing.assert_allclose(result.model.params[k], p, rtol=1e-5, atol=1e-7, err_msg=k)


def test_ctrl_c_then_resume_is_bit_for_bit_an_uninterrupted_run(tmp_path, data):
    full = T.train(tiny(tmp_path / "a"), data=data)

    def press_ctrl_c(record):
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)

    first = T.train(tiny(tmp_path / "b"), callback=press_ctrl_c, data=data)
    assert first.summary["interrupted"] and first.summary["steps"] == 3
    resumed = T.train(T.TrainConfig(out=str(tmp_path / "b"), resume=True, progress=False, verbose=False), data=data)
    assert resumed.summary["steps"] == 6 and isinstance(resumed.model, CLIP)
    for k, p in full.model.params.items():
        np.testing.assert_array_equal(np.asarray(p), np.asarray(resumed.model.params[k]), err_msg=k)
    assert resumed.summary["zero_shot_accuracy"] == full.summary["zero_shot_accuracy"]
    assert [r["step"] for r in resumed.history] == [3, 6]


@pytest.mark.parametrize("kw, match", [
    (dict(mixup=0.2), "--task clip has no use for --mixup 0.2"),
    (dict(augment="standard", depth=2), "--depth 2; --augment 'standard'"),
    (dict(model="vit_cifar_tiny"), "needs a CLIP preset, got --model 'vit_cifar_tiny'"),
    (dict(dataset="cifar10"), "captioned data set"),
    (dict(task="classify", recipe="clip-shapes"), "recipe 'clip-shapes' is one of --task clip, not --task classify"),
    (dict(precision="float16"), "--precision 'float16'"),
    (dict(batch_size=200), "batch_size 200 is larger than the 160 training images"),
])
def test_bad_flags_are_refused_before_any_file_is_written(tmp_path, data, kw, match):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        T.train(tiny(out, **kw), data=None if kw.get("dataset") else data)
    assert not out.exists()


def test_the_command_line_refuses_a_classifier_flag_by_name(tmp_path, capsys):
    out = tmp_path / "run"
    code = T.main(["--task", "clip", "--dataset", "shapes", "--cutmix", "1.0", "--out", str(out), "--no-progress"])
    assert code == 2 and "--cutmix 1.0" in capsys.readouterr().err and not out.exists()
