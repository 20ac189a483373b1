"""Reliability, third round (issue 29): no foreign program runs on an image, one run per folder, a resume
checks its data, checkpoint metadata is checked before it is used. Real files, real subprocesses where
the behaviour is a process's (a fake `gs` on PATH, two runs into one folder)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_FLAGS = ["--dataset", "shapes", "--train-subset", "256", "--embed-dim", "16", "--depth", "1", "--num-heads", "2",
              "--batch-size", "32", "--no-progress"]

EPS = b"""%!PS-Adobe-3.0 EPSF-3.0
%%BoundingBox: 0 0 16 16
%%EndComments
0 0 moveto 16 16 lineto stroke
showpage
%%EOF
"""


def python(*args, env=None, timeout=120):
    """python -m ... from the repository root, as a user runs it; returns the CompletedProcess."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def fake_gs(tmp_path):
    """A `gs` on PATH that only leaves a marker file behind: the test that it never runs. Returns (env, marker)."""
    bin_dir, marker = tmp_path / "bin", tmp_path / "gs-ran"
    bin_dir.mkdir()
    gs = bin_dir / "gs"
    gs.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    gs.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    return env, marker


def save_png(path, img):
    from PIL import Image

    Image.fromarray(img).save(path)
    return str(path)


def image_folder(root, classes=("a", "b"), n=2, size=8):
    """root/train/<class>/*.png and root/val/<class>/*.png, random pixels."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                save_png(root / split / name / f"{i}.png", rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    return root


# ---- 1. images: a named allow-list of formats, never a subprocess ----------------------------------------


def test_an_eps_named_png_is_refused_by_predict_and_the_folder_set_without_running_gs(tmp_path):
    env, marker = fake_gs(tmp_path)
    fake = tmp_path / "photo.png"
    fake.write_bytes(EPS)
    train = python("-m", "minivit.train", *TINY_FLAGS, "--max-steps", "1", "--out", str(tmp_path / "run"), env=env)
    assert train.returncode == 0, train.stderr
    got = python("-m", "minivit.predict", str(fake), "--checkpoint", str(tmp_path / "run"), env=env)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert f"{fake}: not an image in a format minivit reads" in got.stderr and "EPS" in got.stderr
    assert not marker.exists()

    root = image_folder(tmp_path / "images")
    (root / "train" / "a" / "x.png").write_bytes(EPS)
    got = python("-m", "minivit.train", "--dataset", "folder", "--data-dir", str(root), "--max-steps", "1",
                 "--batch-size", "2", "--no-progress", "--out", str(tmp_path / "run2"), env=env)
    assert got.returncode == 2 and "Traceback" not in got.stderr
    assert "x.png: not an image in a format minivit reads" in got.stderr
    assert not marker.exists()
    assert not (tmp_path / "run2").exists()          # refused before the run folder was made


def test_ps_and_pdf_are_refused_in_process_too(tmp_path, monkeypatch):
    from minivit.data import read_image

    env, marker = fake_gs(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    for name, raw in (("a.ps", b"%!PS-Adobe-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"), ("b.eps", EPS),
                      ("c.pdf", b"%PDF-1.4\n1 0 obj << >> endobj\ntrailer << >>\n%%EOF\n")):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ValueError, match="not an image in a format minivit reads"):
            read_image(tmp_path / name, 8)
    assert not marker.exists()


def test_exif_orientation_is_applied(tmp_path):
    from PIL import Image

    from minivit.data import read_image

    pixels = np.zeros((4, 8, 3), dtype=np.uint8)      # 4 high, 8 wide; its left half white
    pixels[:, :4] = 255
    exif = Image.Exif()
    exif[0x0112] = 6                                  # "rotate 90 degrees clockwise to display"
    Image.fromarray(pixels).save(tmp_path / "x.png", exif=exif)
    got = read_image(tmp_path / "x.png", (8, 4))      # displayed: 8 high, 4 wide, its top half white
    assert got.shape == (8, 4, 3)
    assert (got[:3] > 200).all() and (got[5:] < 50).all()


def test_wide_tiff_modes_are_scaled_to_the_full_range_or_refused_by_name(tmp_path):
    from PIL import Image

    from minivit.data import read_image

    ramp = np.linspace(0, 1, 64).reshape(8, 8)                                  # 0 .. 1
    expected = np.rint(ramp * 255).astype(np.uint8)
    Image.fromarray((ramp * 65535).round().astype(np.uint16)).save(tmp_path / "u16.tif")
    Image.fromarray((ramp * 65535).round().astype(np.int32)).save(tmp_path / "i32.tif")
    Image.fromarray(ramp.astype(np.float32)).save(tmp_path / "f32.tif")
    for name in ("u16.tif", "i32.tif", "f32.tif"):
        got = read_image(tmp_path / name, 8, mode="L")[..., 0]
        assert np.abs(got.astype(int) - expected).max() <= 1, name
    Image.fromarray(np.full((8, 8), 300.0, dtype=np.float32)).save(tmp_path / "f255.tif")
    Image.fromarray(np.full((8, 8), -5, dtype=np.int32)).save(tmp_path / "neg.tif")
    with pytest.raises(ValueError, match=r"f255.tif: a float image \(mode F\) with values up to 300"):
        read_image(tmp_path / "f255.tif", 8)
    with pytest.raises(ValueError, match=r"neg.tif: a 32-bit integer image \(mode I\) with values from -5"):
        read_image(tmp_path / "neg.tif", 8)


def test_the_decompression_bomb_limit_is_kept_and_named(tmp_path, monkeypatch):
    from PIL import Image

    from minivit.data import read_image

    save_png(tmp_path / "big.png", np.zeros((64, 64, 3), dtype=np.uint8))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)                       # 4096 > 2 x 1000
    with pytest.raises(ValueError, match=r"big.png: 4096 pixels, more than Pillow's decompression-bomb limit"):
        read_image(tmp_path / "big.png", 8)


# ---- 2. one run per folder ------------------------------------------------------------------------------


def start_run(out, *flags):
    """A real `python -m minivit.train` in the background; returns the Popen once it holds out's lock."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "minivit.train", *TINY_FLAGS, "--out", str(out), *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = Path(out) / ".lock"
    deadline = time.monotonic() + 120                 # generous: a loaded machine starts Python slowly
    while time.monotonic() < deadline:
        if lock.exists() and lock.read_text().strip() == str(proc.pid) and (Path(out) / "checkpoint.npz").exists():
            return proc
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"the run into {out} never took its lock and wrote a checkpoint")


def stop(proc):
    """SIGTERM, as a scheduler sends: the run saves and exits 143."""
    import signal

    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    return out


def test_a_second_run_into_a_folder_in_use_is_refused_naming_it_and_the_pid(tmp_path):
    from minivit.weights import checkpoint as ckpt
    from minivit.train.plot import read_metrics

    out = tmp_path / "run"
    first = start_run(out, "--max-steps", "100000", "--eval-every", "4")
    try:
        for extra in ([], ["--overwrite"], ["--resume"]):
            got = python("-m", "minivit.train", *TINY_FLAGS, "--max-steps", "8", "--out", str(out), *extra)
            assert got.returncode == 2, (extra, got.stderr)
            assert "Traceback" not in got.stderr and len(got.stderr.strip().splitlines()) == 1
            assert f"--out {out} is in use by another run (pid {first.pid}" in got.stderr, got.stderr
    finally:
        stop(first)
    records = read_metrics(out)
    steps = [r["step"] for r in records]
    every_4 = steps if steps[-1] % 4 == 0 else steps[:-1]        # SIGTERM may add a record where it stopped
    assert every_4 == list(range(4, 4 * len(every_4) + 1, 4))    # one run's records, none lost or interleaved
    assert steps == sorted(set(steps))
    saved = ckpt.load_checkpoint(out / "checkpoint.npz")["meta"]["extra"]["step"]
    assert saved >= steps[-1]
    assert not (out / ".lock").exists()                         # released

    second = start_run(out, "--resume", "--max-steps", "100000")   # the same for two --resume at once
    try:
        got = python("-m", "minivit.train", "--out", str(out), "--resume", "--no-progress")
        assert got.returncode == 2 and f"in use by another run (pid {second.pid}" in got.stderr, got.stderr
    finally:
        stop(second)
    steps = [r["step"] for r in read_metrics(out)]
    assert steps == sorted(set(steps)) and steps[:len(records)] == [r["step"] for r in records]


def test_the_lock_of_a_dead_process_is_taken_over_saying_so(tmp_path, capsys):
    from minivit.train import TrainConfig, train

    dead = subprocess.Popen(["true"])
    dead.wait()
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text(f"{dead.pid}\n")
    train(TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2, batch_size=32,
                      max_steps=2, progress=False, verbose=False, out=str(out)))
    assert f"the run of pid {dead.pid} ended without releasing it (killed?); taking it over" in capsys.readouterr().out
    assert (out / "checkpoint.npz").exists() and not (out / ".lock").exists()


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(tmp_path, monkeypatch, capsys):
    import minivit.train.tasks as trainer               # where the classifier's task finds train_step
    from minivit.train import TrainConfig, train

    cfg = TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2, batch_size=32,
                      max_steps=2, progress=False, verbose=False, out=str(tmp_path))
    train(cfg)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert set(before) == {"checkpoint.npz", "metrics.jsonl", "summary.json", "curves.png"}

    def broken_step(*args, **kwargs):
        raise RuntimeError("the new run fails at its first step")

    monkeypatch.setattr(trainer, "train_step", broken_step)
    with pytest.raises(RuntimeError, match="fails at its first step"):
        train(trainer.dataclasses.replace(cfg, overwrite=True, lr=0.5))
    assert "the run that --overwrite was to replace is back" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()

    train(trainer.dataclasses.replace(cfg, overwrite=True, lr=0.5))    # this one starts: the old run goes
    assert not (tmp_path / ".replaced-run").exists()
    assert (tmp_path / "checkpoint.npz").read_bytes() != before["checkpoint.npz"]


def test_a_run_refused_late_leaves_no_empty_out_behind(tmp_path):
    import minivit.train as trainer

    out = tmp_path / "new"
    cfg = trainer.TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2,
                              batch_size=32, max_steps=2, progress=False, verbose=True, out=str(out))
    real = trainer.tasks.announce_ops

    def failing(*args, **kwargs):                    # a failure after the folder was made, before the first step
        raise ValueError("late")

    trainer.tasks.announce_ops = failing
    try:
        with pytest.raises(ValueError, match="late"):
            trainer.train(cfg)
    finally:
        trainer.tasks.announce_ops = real
    assert not out.exists()


# ---- 3. a resume checks its data ------------------------------------------------------------------------


def folder_run(root, out, **kw):
    from minivit.train import TrainConfig, train

    return train(TrainConfig(dataset="folder", data_dir=str(root), img_size=8, patch_size=4, embed_dim=16, depth=1,
                             num_heads=2, batch_size=4, max_steps=2, progress=False, verbose=False, out=str(out), **kw))


def test_resume_refuses_renamed_added_or_other_data_naming_the_change(tmp_path):
    from minivit.train import TrainConfig, train

    root = image_folder(tmp_path / "images", classes=("a", "b"), n=4)
    out = tmp_path / "run"
    folder_run(root, out)
    for split in ("train", "val"):                               # a class folder renamed: labels would swap
        (root / split / "b").rename(root / split / "c")
    with pytest.raises(ValueError, match=r"data differ .*classes renamed: 'b' -> 'c'\. Resume on the run's own"):
        train(TrainConfig(out=str(out), resume=True, max_steps=4, progress=False, verbose=False))
    image_folder(root, classes=("b", "d"), n=4)                   # now a, b, c, d: two more
    with pytest.raises(ValueError, match=r"classes added: \['c', 'd'\]"):
        train(TrainConfig(out=str(out), resume=True, max_steps=4, progress=False, verbose=False))
    got = python("-m", "minivit.train", "--out", str(out), "--resume", "--max-steps", "4", "--no-progress")
    assert got.returncode == 2 and "classes added" in got.stderr and "Traceback" not in got.stderr

    from minivit.data import SHAPES_CLASSES, Dataset, channel_mean_std, make_shapes

    (x, y), (xt, yt) = make_shapes(64, 20, seed=1)
    shapes = Dataset("shapes", x, y, xt, yt, list(SHAPES_CLASSES), *channel_mean_std(x))
    with pytest.raises(ValueError, match=r"the data set is 'shapes', the run's was 'folder'"):
        train(TrainConfig(out=str(out), resume=True, max_steps=4, progress=False, verbose=False), data=shapes)


def test_labels_are_checked_against_the_models_class_count(tmp_path):
    from minivit.data import SHAPES_CLASSES, Dataset, channel_mean_std, make_shapes
    from minivit.model import ViT, ViTConfig
    from minivit.train import TrainConfig, train

    (x, y), (xt, yt) = make_shapes(64, 20, seed=1)
    shapes = Dataset("shapes", x, y, xt, yt, list(SHAPES_CLASSES), *channel_mean_std(x))
    model = ViT(ViTConfig(img_size=32, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2))
    with pytest.raises(ValueError, match=r"the model has 3 classes and shapes has 10"):
        train(TrainConfig(max_steps=1, batch_size=32, progress=False, verbose=False, out=None),
              model=model, data=shapes)


# ---- 4. checkpoint metadata is checked before it is used ------------------------------------------------


def rewrite_checkpoint(path, edit_meta=None, **arrays):
    """Edit a checkpoint by hand, as a user might: its metadata and any of its arrays."""
    import json

    with np.load(path) as npz:
        entries = {k: npz[k] for k in npz.files}
    meta = json.loads(str(entries["meta"]))
    if edit_meta is not None:
        edit_meta(meta)
    entries.update(meta=np.array(json.dumps(meta)), **arrays)
    np.savez(path, **entries)


def _set(path, value):
    def edit(meta):
        *keys, last = path
        d = meta
        for k in keys:
            d = d[k]
        d[last] = value
    return edit


BAD_META = {
    "step 3.5": (_set(["extra", "step"], 3.5), {},
                 r"extra\['step'\] \(the optimizer steps done\) must be an int >= 0, got 3.5"),
    "step '7'": (_set(["extra", "step"], "7"), {}, r"extra\['step'\] .* must be an int >= 0, got '7'"),
    "classes": (_set(["extra", "classes"], ["a", "b"]), {},
                r"extra\['classes'\] names 2 classes, and the model has 10"),
    "classes str": (_set(["extra", "classes"], "abc"), {}, r"extra\['classes'\] must be a list of class names"),
    "extra": (_set(["extra"], [1, 2]), {}, r"the metadata's 'extra' must be a dict, got \[1, 2\]"),
    "strings": (None, {"param/head.bias": np.array(["x"] * 10)}, r"the array 'param/head.bias' holds <U1 values"),
    "huge": (_set(["config", "embed_dim"], 1 << 20), {}, r"describes a model of at least 4,398,046,511,104 parameters"),
    "optimizer step": (_set(["optimizer", "step"], 2.5), {}, r"the optimizer's 'step' must be an int >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_META))
def test_bad_checkpoint_metadata_is_refused_in_one_line_before_any_file_is_touched(tmp_path, case, capsys):
    from minivit import predict
    from minivit.train import TrainConfig, main, train

    edit, arrays, match = BAD_META[case]
    out = tmp_path / "run"
    train(TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2, batch_size=32,
                      max_steps=4, eval_every=2, progress=False, verbose=False, out=str(out)))
    rewrite_checkpoint(out / "checkpoint.npz", edit, **arrays)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--max-steps", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "checkpoint.npz" in err
    import re

    assert re.search(match, err), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before      # metrics.jsonl untouched
    save_png(tmp_path / "x.png", np.zeros((32, 32, 3), np.uint8))
    assert predict.main([str(tmp_path / "x.png"), "--checkpoint", str(out)]) == 2
    assert re.search(match, capsys.readouterr().err)


# ---- 6. non-finite weights, 9. non-files in an image folder, 10. small ones -----------------------------


def test_non_finite_weights_are_refused_by_from_pretrained_init_and_in_the_optimizer_state(tmp_path, capsys):
    import minivit
    from minivit.train import TrainConfig, main, train

    out = tmp_path / "run"
    train(TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2, batch_size=32,
                      max_steps=2, progress=False, verbose=False, out=str(out)))
    ckpt = out / "checkpoint.npz"
    with np.load(ckpt) as npz:
        bias, moment = npz["param/head.bias"].copy(), npz["optim/exp_avg/head.bias"].copy()
    moment[0] = np.inf
    rewrite_checkpoint(ckpt, **{"optim/exp_avg/head.bias": moment})
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "1 optimizer buffers hold NaN or infinite values (optim/exp_avg/head.bias)" in err and str(ckpt) in err

    bias[0] = np.nan
    rewrite_checkpoint(ckpt, **{"param/head.bias": bias})
    with pytest.raises(ValueError, match=r"checkpoint.npz'?: 1 parameters hold NaN .*\(head.bias\); a damaged file"):
        minivit.from_pretrained(ckpt)
    assert main([*TINY_FLAGS, "--max-steps", "2", "--init", str(ckpt), "--out", str(tmp_path / "ft")]) == 2
    err = capsys.readouterr().err
    assert "head.bias" in err and "lower --lr" not in err and len(err.strip().splitlines()) == 1


def test_a_fifo_in_an_image_folder_is_refused_by_name_not_waited_on(tmp_path):
    from minivit.data import load_image_folder, read_image

    root = image_folder(tmp_path, n=2)
    os.mkfifo(root / "train" / "a" / "pipe.png")
    with pytest.raises(ValueError, match=r"pipe.png: a FIFO, not an image file: remove it"):
        load_image_folder(root, 8)
    with pytest.raises(ValueError, match=r"pipe.png: a FIFO"):
        read_image(root / "train" / "a" / "pipe.png", 8)                # what predict reads


def test_a_metrics_line_that_is_not_an_object_is_named(tmp_path):
    from minivit.train.plot import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n[1, 2, 3]\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is list '\[1, 2, 3\]', expected a JSON object"):
        read_metrics(tmp_path)


def test_a_one_class_folder_is_refused(tmp_path, capsys):
    from minivit.train import main

    root = image_folder(tmp_path / "images", classes=("only",), n=4)
    assert main(["--dataset", "folder", "--data-dir", str(root), "--max-steps", "1", "--batch-size", "2",
                 "--no-progress", "--out", str(tmp_path / "run")]) == 2
    assert "folder has 1 class in" in capsys.readouterr().err and not (tmp_path / "run").exists()


# ---- 5. --init and the model-shape flags ----------------------------------------------------------------


def test_init_refuses_model_shape_flags_by_name_and_records_the_real_config(tmp_path, capsys):
    import json

    from minivit.train import main

    pre = tmp_path / "pre"
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(pre)]) == 0
    capsys.readouterr()
    assert main([*TINY_FLAGS, "--max-steps", "2", "--init", str(pre / "checkpoint.npz"), "--depth", "3",
                 "--out", str(tmp_path / "ft")]) == 2
    err = capsys.readouterr().err
    assert "--depth 3 (the checkpoint's: 1)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "ft").exists()
    flags = ["--dataset", "shapes", "--train-subset", "256", "--batch-size", "32", "--no-progress"]   # demo recipe:
    assert main([*flags, "--max-steps", "2", "--init", str(pre / "checkpoint.npz"),                 # D 64, depth 4
                 "--out", str(tmp_path / "ft")]) == 0
    summary = json.loads((tmp_path / "ft" / "summary.json").read_text())
    assert summary["train_config"]["embed_dim"] == 16 and summary["train_config"]["depth"] == 1
    assert summary["config"]["embed_dim"] == 16
