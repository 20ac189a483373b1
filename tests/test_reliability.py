"""Never lose a run, never keep a bad checkpoint, name every OS error (issue 13): real runs of a tiny model
on a slice of `shapes`, real signals, real files. Most runs take well under a second; the SIGTERM test
starts one real `python -m minivit.train` process."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import minivit
from minivit.weights import checkpoint as ckpt
from minivit import predict
from minivit.data import SHAPES_CLASSES, Dataset, channel_mean_std, make_shapes
from minivit.model import ViT, ViTConfig
from minivit.optim import WarmupCosine
from minivit.train.plot import read_metrics
from minivit.train import TrainConfig, TrainingDiverged, main, train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(embed_dim=16, depth=1, num_heads=2, mlp_ratio=2.0, batch_size=32, progress=False, verbose=False)
TINY_FLAGS = ["--dataset", "shapes", "--train-subset", "256", "--embed-dim", "16", "--depth", "1", "--num-heads", "2",
              "--batch-size", "32", "--no-progress"]


@pytest.fixture(scope="module")
def data():
    """256 training and 200 test images of `shapes`: 8 steps of 32 per epoch."""
    (x, y), (x_test, y_test) = make_shapes(256, 200, seed=1)
    return Dataset("shapes", x, y, x_test, y_test, list(SHAPES_CLASSES), *channel_mean_std(x))


def run(out, data, callback=None, **kw):
    return train(TrainConfig(**{**TINY, "out": str(out), **kw}), callback=callback, data=data)


def resume(out, data, callback=None, **kw):
    return train(TrainConfig(out=str(out), resume=True, progress=False, verbose=False, **kw), callback=callback,
                 data=data)


def ctrl_c_at(step):
    def press(record):                    # a real SIGINT, delivered to this process mid-run
        if record["step"] == step:
            os.kill(os.getpid(), signal.SIGINT)
    return press


def files_of(folder):
    return {name: (Path(folder) / name).read_bytes() for name in sorted(os.listdir(folder))}


def mode(path):
    return os.stat(path).st_mode & 0o777


def rewrite_checkpoint(path, edit_meta=None, **arrays):
    """Edit a checkpoint by hand, as a user might: its metadata and any of its arrays."""
    with np.load(path) as npz:
        entries = {k: npz[k] for k in npz.files}
    meta = json.loads(str(entries["meta"]))
    if edit_meta is not None:
        edit_meta(meta)
    entries.update(meta=np.array(json.dumps(meta)), **arrays)
    np.savez(path, **entries)


def save_png(path, img):
    from PIL import Image

    Image.fromarray(img).save(path)
    return str(path)


# ---- 1. divergence ------------------------------------------------------------------------------------


def test_a_diverged_run_keeps_the_last_finite_checkpoint_and_names_its_step(tmp_path, data, monkeypatch):
    # step 3's validation loss is NaN while its training loss was finite: that state is neither recorded
    # nor saved; step 2's (finite) checkpoint is the one kept, and the message says so. The NaN is put in
    # the third evaluation's result: the step at which a real run at a huge learning rate first overflows
    # depends on the last bits of every product (BLAS, the fast kernels), and this test is about what the
    # trainer does then, not about when. (test_train.py diverges a run for real.)
    import minivit.train.tasks as trainer               # where the classifier's task finds evaluate

    real_evaluate, calls = trainer.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(1)
        loss, acc = real_evaluate(*args, **kwargs)
        return (float("nan") if len(calls) == 3 else loss), acc

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    with pytest.raises(TrainingDiverged, match="the validation loss became nan at step 3") as err:
        run(tmp_path, data, optimizer="sgd", momentum=0.0, warmup_steps=0, eval_every=1, max_steps=40)
    assert len(calls) == 3
    saved = ckpt.load_checkpoint(tmp_path / "checkpoint.npz")
    step = saved["meta"]["extra"]["step"]
    assert step == 2 and err.value.step == 3
    assert f"The last good checkpoint, of step {step}, is kept at {tmp_path / 'checkpoint.npz'}" in str(err.value)
    assert all(np.isfinite(v).all() for v in saved["params"].values())
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["val_loss"]) for r in records)
    model = minivit.load_model(tmp_path)                  # what predict would use: finite probabilities
    [(_, top)] = predict.predict(model, [save_png(tmp_path / "x.png", data.x_test[0])])
    assert all(np.isfinite(p) for _, p in top)


def test_non_finite_params_names_exactly_the_arrays_holding_nan_or_inf():
    from minivit.train import non_finite_params

    model = minivit.ViT(minivit.ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=2,
                                          num_heads=2), seed=0)
    assert non_finite_params(model) == []
    model.params["blocks.1.mlp.fc2.bias"][1] = np.inf
    model.params["blocks.0.attn.qkv.weight"][0, 0] = np.nan
    assert sorted(non_finite_params(model)) == ["blocks.0.attn.qkv.weight", "blocks.1.mlp.fc2.bias"]


def test_non_finite_parameters_are_refused_by_name_by_load_model_predict_and_resume(tmp_path, data, capsys):
    run(tmp_path, data, max_steps=2, eval_every=2)
    path = tmp_path / "checkpoint.npz"
    bad = ckpt.load_checkpoint(path)["params"]["blocks.0.attn.qkv.weight"].copy()
    bad[0, 0] = np.nan
    rewrite_checkpoint(path, **{"param/blocks.0.attn.qkv.weight": bad})
    with pytest.raises(ValueError, match=r"1 parameters hold NaN or infinite values \(blocks.0.attn.qkv.weight\)"):
        minivit.load_model(path)
    image = save_png(tmp_path / "x.png", data.x_test[0])
    assert predict.main([image, "--checkpoint", str(path)]) == 2
    assert "blocks.0.attn.qkv.weight" in capsys.readouterr().err
    with pytest.raises(ValueError, match="blocks.0.attn.qkv.weight"):
        resume(tmp_path, data)


# ---- 2 and 4. run folders -----------------------------------------------------------------------------


def test_an_out_that_holds_a_run_is_refused_and_left_exactly_as_it_was(tmp_path, data):
    out = tmp_path / "not" / "yet" / "there"                  # missing parents are created
    run(out, data, max_steps=8, eval_every=4)
    before = files_of(out)
    assert sorted(before) == ["checkpoint.npz", "curves.png", "metrics.jsonl", "summary.json"]
    assert len({mode(out / name) for name in before}) == 1    # the checkpoint's mode is the others' (not 0600)
    with pytest.raises(ValueError,
                       match=r"already holds a run .*continue it with --resume, replace it with --overwrite"):
        run(out, data, max_steps=8)
    with pytest.raises(ValueError, match="label_smoothing must be in"):   # a bad flag: refused before any write
        run(out, data, max_steps=8, overwrite=True, label_smoothing=2.0)
    with pytest.raises(ValueError, match="not both"):
        run(out, data, resume=True, overwrite=True)
    assert files_of(out) == before
    replaced = run(out, data, max_steps=4, eval_every=2, overwrite=True)
    assert [r["step"] for r in read_metrics(out)] == [2, 4] and replaced.summary["steps"] == 4


def test_os_errors_end_in_one_line_naming_the_path_with_exit_code_2(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    for out, cause in ((a_file, "a file is in the way"), (a_file / "run", "is a file")):
        assert main(TINY_FLAGS + ["--max-steps", "2", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {out}:") and cause in err, err
    assert main(TINY_FLAGS + ["--epochs", "inf", "--out", str(tmp_path / "r")]) == 2   # not an OverflowError
    assert capsys.readouterr().err == "error: epochs must be > 0 and finite, got inf\n"
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_a_read_only_out_is_found_before_the_first_step(tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(TINY_FLAGS + ["--max-steps", "2", "--out", str(out)]) == 2
    finally:
        out.chmod(0o755)
    said = capsys.readouterr()
    assert said.err.count("\n") == 1 and f"error: {out}:" in said.err and "Permission denied" in said.err
    assert "training" not in said.out and os.listdir(out) == []


# ---- 3 and 5. resume ----------------------------------------------------------------------------------


def test_resume_keeps_the_cadence_applies_a_new_length_and_refuses_the_rest(tmp_path, data, capsys):
    first = run(tmp_path, data, max_steps=12, eval_every=3, callback=ctrl_c_at(6))
    assert first.summary["steps"] == 6
    again = resume(tmp_path, data, callback=ctrl_c_at(9))       # the run's cadence, not once per epoch (8)
    assert [r["step"] for r in again.history] == [3, 6, 9] and again.summary["steps"] == 9
    done = resume(tmp_path, data)
    assert [r["step"] for r in done.history] == [3, 6, 9, 12]
    capsys.readouterr()
    longer = resume(tmp_path, data, max_steps=20, eval_every=5)  # a finished run, continued
    said = capsys.readouterr().out
    assert "the run now ends at step 20 instead of 12" in said and "schedule is recomputed for 20 steps" in said
    assert "evaluations and checkpoints every 5 steps (the run had them every 3 steps)" in said
    assert [r["step"] for r in read_metrics(tmp_path)] == [3, 6, 9, 12, 15, 20] and longer.summary["steps"] == 20
    c = longer.summary["train_config"]
    schedule = WarmupCosine(c["lr"], 20, warmup_steps=round(c["warmup_epochs"] * 8))
    assert longer.history[-2]["lr"] == schedule(14)              # step 15 ran with the 20-step schedule
    before = files_of(tmp_path)
    with pytest.raises(ValueError, match="the run is already at step 20, past the 5 steps"):
        resume(tmp_path, data, max_steps=5)
    with pytest.raises(ValueError, match=r"--embed-dim 64 \(the run's: 16\); --lr 0.1 \(the run's: 0.003\)"):
        resume(tmp_path, data, embed_dim=64, lr=0.1)
    assert files_of(tmp_path) == before


def test_a_flag_given_at_its_usual_value_is_still_a_change_on_resume(tmp_path, data):
    """--seed 0 or --dtype float32 asked for on resume of a run that had --seed 3 and float64: given, so
    refused by name, though 0 and float32 are what a run takes when no flag and no recipe says."""
    run(tmp_path, data, max_steps=4, seed=3, dtype="float64", mixup=0.2)
    before = files_of(tmp_path)
    with pytest.raises(ValueError, match=r"--mixup 0.0 \(the run's: 0.2\); --seed 0 \(the run's: 3\); "
                                         r"--dtype 'float32' \(the run's: 'float64'\)"):
        resume(tmp_path, data, seed=0, mixup=0.0, dtype="float32")
    assert files_of(tmp_path) == before
    again = resume(tmp_path, data, max_steps=6)                  # not given: the run's own
    assert again.summary["train_config"]["seed"] == 3 and again.model.dtype == "float64"


def test_a_torn_last_line_and_records_past_the_checkpoint_are_dropped_on_resume(tmp_path, data, capsys):
    run(tmp_path, data, max_steps=8, eval_every=4, callback=ctrl_c_at(4))
    metrics = tmp_path / "metrics.jsonl"
    record = json.loads(metrics.read_text())
    with open(metrics, "a") as f:                    # a record the checkpoint never saw, then a kill mid-append
        f.write(json.dumps({**record, "step": 6}) + "\n")
        f.write('{"step": 8, "train_lo')
    capsys.readouterr()
    result = resume(tmp_path, data)
    said = capsys.readouterr()
    assert f"warning: {metrics}: dropped its torn last line 3" in said.err
    assert f"dropped 1 record(s) of {metrics} written after the checkpoint's step 4" in said.out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [4, 8]
    assert result.summary["steps"] == 8


def test_a_checkpoint_without_its_training_state_is_named(tmp_path, data):
    run(tmp_path, data, max_steps=2, eval_every=2)
    rewrite_checkpoint(tmp_path / "checkpoint.npz", edit_meta=lambda meta: meta.pop("extra"))
    with pytest.raises(ValueError, match=r"checkpoint.npz' holds no training state to resume \(no train_config, step"):
        resume(tmp_path, data)
    assert minivit.load_model(tmp_path).checkpoint_meta == {}    # the model itself still loads


# ---- 6. SIGTERM, stale temporaries, file modes ----------------------------------------------------------


def test_sigterm_saves_a_checkpoint_and_exits_143_and_the_next_start_cleans_up(tmp_path, capsys):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "minivit.train", *TINY_FLAGS, "--max-steps", "100000", "--eval-every", "2",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "MINIVIT_BACKEND": "numpy"})
    try:
        for line in proc.stdout:                 # the first evaluation: the loop is running
            if line.startswith("epoch"):
                break
        proc.send_signal(signal.SIGTERM)
        said, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["signal"] == "SIGTERM" and summary["interrupted"]
    assert f"SIGTERM at step {summary['steps']}: checkpoint saved" in said
    assert ckpt.load_checkpoint(out)["meta"]["extra"]["step"] == summary["steps"]
    assert mode(out / "checkpoint.npz") == mode(out / "summary.json") == mode(out / "metrics.jsonl")
    # a write that a SIGKILL cut short leaves its temporary file; the next start removes it
    stale = out / ".checkpoint-0badc0de.npz.tmp"
    stale.write_bytes(b"half a checkpoint")
    result = train(TrainConfig(out=str(out), resume=True, max_steps=summary["steps"] + 1, progress=False,
                               verbose=False))
    assert not stale.exists() and "removed 1 temporary file(s) of an interrupted write" in capsys.readouterr().out
    assert result.summary["steps"] == summary["steps"] + 1


# ---- 7. load_state_dict ---------------------------------------------------------------------------------


def test_load_state_dict_checks_and_casts_every_array_before_copying_any():
    model = ViT(ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1, num_heads=2))
    before = model.state_dict()
    names = list(before)
    state = {k: v + 1.0 for k, v in before.items()}                       # good arrays first, in dict order
    state[names[-1]] = np.full(before[names[-1]].shape, "0.5")             # right shape, strings
    state[names[-2]] = np.full(before[names[-2]].shape, None, dtype=object)  # right shape, an object array
    with pytest.raises(ValueError, match="nothing was changed.*not numeric arrays") as err:
        model.load_state_dict(state)
    assert f"{names[-1]}: dtype <U3" in str(err.value) and f"{names[-2]}: dtype object" in str(err.value)
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    model.load_state_dict({k: v.astype(np.float64) + 1.0 for k, v in before.items()})   # cast to float32
    assert model.params[names[0]].dtype == np.float32
    np.testing.assert_allclose(minivit.to_numpy(model.params[names[0]]), before[names[0]] + 1.0, rtol=1e-6)


# ---- 8. the smaller ones --------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(epochs=float("inf")), "epochs must be > 0 and finite, got inf"),
    (dict(train_subset=-5), "train_subset must be a positive int"),
    (dict(train_subset=0), "train_subset must be a positive int"),
    (dict(train_subset=1000), "train_subset 1000 is more than the 256 training images"),
    (dict(label_smoothing=2.0), r"label_smoothing must be in \[0, 1\), got 2.0"),
    (dict(warmup_steps=-1), "warmup_steps must be >= 0 and finite, got -1"),
])
def test_bad_numbers_are_refused_before_a_step(tmp_path, data, kw, match):
    with pytest.raises(ValueError, match=match):
        run(tmp_path / "run", data, **kw)
    assert not (tmp_path / "run").exists()


def test_empty_batches_and_misshaped_gradients_are_named(rng):
    model = ViT(ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1, num_heads=2))
    with pytest.raises(ValueError, match=r"empty batch, shape \(0, 8, 8, 3\)"):
        model.forward(minivit.asarray(np.zeros((0, 8, 8, 3)), dtype="float32"))
    model.forward(minivit.asarray(rng.standard_normal((4, 8, 8, 3)), dtype="float32"))
    with pytest.raises(ValueError, match="dlogits has 3 rows but the last forward had a batch of 4"):
        model.backward(minivit.asarray(np.zeros((3, 3)), dtype="float32"))
    logits = minivit.asarray(rng.standard_normal((2, 3)))
    with pytest.raises(ValueError, match="empty batch"):
        minivit.cross_entropy(logits[:0], minivit.asarray(np.zeros(0, dtype=np.int64)))
    with pytest.raises(ValueError, match="soft targets must be probabilities"):   # a negative loss otherwise
        minivit.cross_entropy(logits, minivit.asarray(np.array([[1.5, -0.5, 0.0], [0.0, 1.0, 0.0]])))


@pytest.mark.parametrize("kw, error, match", [
    (dict(mlp_ratio=float("inf")), ValueError, "mlp_ratio must be a positive finite number, got inf"),
    (dict(qkv_bias="no"), TypeError, "qkv_bias must be True or False, got 'no'"),
    (dict(img_size=(0, 0)), ValueError, r"img_size must be positive, got \(0, 0\)"),
])
def test_vit_config_names_the_bad_value(kw, error, match):
    with pytest.raises(error, match=match):
        ViTConfig(**{**dict(img_size=8, patch_size=4, embed_dim=8, depth=1, num_heads=2), **kw})


def test_predict_classifies_what_it_can_and_names_the_rest(tmp_path, data, capsys, monkeypatch):
    import PIL.Image

    run(tmp_path / "run", data, max_steps=2, eval_every=2)
    good = [save_png(tmp_path / f"img{i}.png", data.x_test[i]) for i in range(2)]
    broken = tmp_path / "broken.png"
    broken.write_text("not an image")
    huge = save_png(tmp_path / "huge.png", np.zeros((100, 100, 3), np.uint8))
    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", 4000)   # 100x100 is then over Pillow's bomb limit
    code = predict.main([good[0], str(broken), huge, good[1], "--checkpoint", str(tmp_path / "run"), "--top", "3"])
    said = capsys.readouterr()
    assert code == 2 and said.out.count("%") == 6 and good[1] in said.out     # both good ones, top-3 each
    assert f"{broken}: not an image in a format minivit reads" in said.err
    assert f"{huge}: 10000 pixels, more than Pillow's decompression-bomb limit" in said.err
    with pytest.raises(SystemExit):
        predict.main([good[0], "--checkpoint", str(tmp_path / "run"), "--top", "-1"])
    assert "--top: must be a positive int, got -1" in capsys.readouterr().err


def test_help_shows_no_default_for_on_off_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--keep-head", "--no-progress", "--resume", "--overwrite", "--download"):
        after = text.split(flag + " ", 2)[-1]
        assert not after.split(" --")[0].count("(default:"), (flag, after[:120])


def test_a_fallback_run_lands_in_its_data_sets_folder_and_says_what_it_trains(tmp_path, capsys):
    cfg = dict(TINY, dataset="cifar10", data_dir=str(tmp_path / "no-cifar"), fallback=True, train_subset=64,
               max_steps=2, eval_batch_size=2000, verbose=True, out=str(tmp_path / "runs" / "{dataset}"))
    result = train(TrainConfig(**cfg))
    name = result.summary["dataset"]
    assert name in ("fashion-mnist", "shapes") and result.out == str(tmp_path / "runs" / name)
    assert "vit_cifar_tiny with embed_dim, depth, num_heads changed: D=16, depth=1" in capsys.readouterr().out
    again = train(TrainConfig(**{**cfg, "resume": True, "max_steps": 3}))     # `make train ARGS=--resume`
    assert again.out == result.out and again.summary["steps"] == 3


def test_a_damaged_cifar10_is_moved_aside_for_the_download_or_fallen_back_from(tmp_path, monkeypatch, capsys):
    from minivit import data as D

    root = tmp_path / "data"
    (root / D.CIFAR10_FOLDER).mkdir(parents=True)
    for name in D.CIFAR10_TRAIN_FILES + [D.CIFAR10_TEST_FILE]:
        (root / D.CIFAR10_FOLDER / name).write_bytes(b"not the official bytes")
    monkeypatch.setattr(D, "CIFAR10_URL", (tmp_path / "offline.tar.gz").as_uri())   # the download fails at once
    cfg = dict(TINY, dataset="cifar10", data_dir=str(root), train_subset=64, max_steps=1, eval_batch_size=2000,
               out=None)
    with pytest.raises(ValueError, match="differs from the official"):                # neither: the error, as before
        train(TrainConfig(**cfg))
    fell_back = train(TrainConfig(**cfg, fallback=True))                           # no download: falls back
    assert fell_back.summary["dataset"] != "cifar10" and (root / D.CIFAR10_FOLDER).is_dir()
    capsys.readouterr()
    result = train(TrainConfig(**cfg, download=True, fallback=True))
    said = capsys.readouterr().out
    assert f"moved it aside to {root / D.CIFAR10_FOLDER}.damaged" in said and "the download failed" in said
    assert (root / (D.CIFAR10_FOLDER + ".damaged")).is_dir() and not (root / D.CIFAR10_FOLDER).exists()
    assert result.summary["dataset"] != "cifar10" and "falls back to" in said
