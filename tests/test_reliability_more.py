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
