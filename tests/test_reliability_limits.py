"""Reliability, third round (issue 29), the rest: nothing allocated blind (7), the downloader's limits (8),
raw tracebacks made one clear line (10), and the smaller faults the issue lists. Each test failed before
its fix."""

import os
import zipfile

import numpy as np
import pytest

from test_reliability_more import TINY_FLAGS, save_png


def tiny_run(out, steps=2):
    from minivit.train import TrainConfig, train

    train(TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2, batch_size=32,
                      max_steps=steps, progress=False, verbose=False, out=str(out)))
    return out / "checkpoint.npz"


def rewrite_member(path, name, edit):
    """Rewrite one member of an .npz (a zip of .npy files) with edit(bytes) -> bytes, the rest unchanged."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[name] = edit(members[name])
    with zipfile.ZipFile(path, "w") as z:
        for n, raw in members.items():
            z.writestr(n, raw)


def lying_header(raw):
    """An .npy whose header claims 1e11 float32 values (400 GB) over the 10 it holds; same header length."""
    end = raw.index(b"\n") + 1
    header = raw[:end].replace(b"(10,)", b"(100000000000,)")
    header = header[:-1].rstrip(b" ")
    header += b" " * (end - len(header) - 1) + b"\n"
    return header + raw[end:]


# ---- 7. memory allocated blind --------------------------------------------------------------------------


def test_a_lying_npy_header_is_refused_before_it_is_allocated(tmp_path, capsys):
    import minivit
    from minivit import predict
    from minivit.train import main

    ckpt = tiny_run(tmp_path / "run")
    rewrite_member(ckpt, "param/head.bias.npy", lying_header)
    match = r"checkpoint.npz'?: the header of 'param/head.bias' declares \(100000000000,\) float32 \(400.0 GB\)"
    with pytest.raises(ValueError, match=match):
        minivit.from_pretrained(ckpt)                       # was a raw MemoryError (373 GiB)
    save_png(tmp_path / "x.png", np.zeros((32, 32, 3), np.uint8))
    capsys.readouterr()
    assert predict.main([str(tmp_path / "x.png"), "--checkpoint", str(ckpt)]) == 2
    assert main(["--out", str(tmp_path / "run"), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("declares (100000000000,) float32" in line for line in err)


def test_an_object_array_npz_is_refused_naming_the_file_and_the_array(tmp_path, capsys):
    import minivit
    from minivit.train import main

    ckpt = tiny_run(tmp_path / "run")
    arrays = dict(np.load(ckpt))
    arrays["param/head.bias"] = np.array([None] * 10, dtype=object)
    np.savez(ckpt, **arrays)
    with pytest.raises(ValueError, match=r"checkpoint.npz'?: the array 'param/head.bias' holds Python objects"):
        minivit.from_pretrained(ckpt)
    capsys.readouterr()
    assert main(["--out", str(tmp_path / "run"), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.npz" in err and "'param/head.bias' holds Python objects" in err    # was: no file named


def fashion_bomb(folder, extra_zeros=256 << 20):
    """Fashion-MNIST's four files, the training images a gzip bomb: an honest header for 60000 images, then
    47 MB + extra_zeros of zeros (a few hundred kB compressed)."""
    import gzip

    folder.mkdir(parents=True)
    sizes = {"train-images-idx3-ubyte": (0x803, 60000), "t10k-images-idx3-ubyte": (0x803, 10000),
             "train-labels-idx1-ubyte": (0x801, 60000), "t10k-labels-idx1-ubyte": (0x801, 10000)}
    for name, (magic, n) in sizes.items():
        dims = [n, 28, 28] if magic == 0x803 else [n]
        with gzip.open(folder / (name + ".gz"), "wb", compresslevel=1) as f:
            f.write(b"".join(v.to_bytes(4, "big") for v in [magic, *dims]))
            left = int(np.prod(dims)) + (extra_zeros if name.startswith("train-images") else 0)
            while left:
                f.write(bytes(min(left, 16 << 20)))
                left -= min(left, 16 << 20)
    return folder


def test_a_fashion_mnist_gzip_bomb_is_not_decompressed_whole(tmp_path):
    import tracemalloc

    from minivit.data import load_fashion_mnist

    folder = fashion_bomb(tmp_path / "fm")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: holds more than the 47,040,016 bytes its "
                                             r"header states \(a damaged file or a decompression bomb\)"):
            load_fashion_mnist(folder, verify=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 150e6, peak                        # was the whole 300 MB (8.5 GB for the bomb)


def test_an_idx_header_larger_than_memory_is_refused_with_the_figure(tmp_path, monkeypatch):
    import minivit.memory
    from minivit.data import load_fashion_mnist

    folder = fashion_bomb(tmp_path / "fm", extra_zeros=0)
    monkeypatch.setattr(minivit.memory, "available_memory", lambda: 10_000_000)      # a 10 MB machine
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: its header says 60000 x 28 x 28 bytes of "
                                         r"data, which needs 47.0 MB, and this machine has 10.0 MB"):
        load_fashion_mnist(folder, verify=False)


def test_a_cifar_file_larger_than_any_official_one_is_not_read(tmp_path):
    from minivit.data import load_cifar10

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ["batches.meta", *(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(b"x")
    os.truncate(folder / "data_batch_1", 8 << 30)                     # 8 GiB, sparse: takes no disk
    with pytest.raises(ValueError, match=r"data_batch_1: 8,589,934,592 bytes, and no CIFAR-10 file is larger"):
        load_cifar10(tmp_path)                                         # was read whole into memory


def test_the_evaluation_steps_of_a_long_run_are_a_rule_not_a_set():
    import sys

    from minivit.train import TrainConfig, evaluation_steps

    steps = evaluation_steps(TrainConfig(max_steps=10**12, eval_every=1), 10**12, 10)
    assert sys.getsizeof(steps) < 1000                  # was a set of every step: 1e12 of them, a raw MemoryError
    assert 1 in steps and 10**12 in steps and 0 not in steps and 10**12 + 1 not in steps
    spread = evaluation_steps(TrainConfig(max_steps=150, num_evals=4), 150, 10)
    assert [s for s in range(200) if s in spread] == [37, 75, 112, 150]


def test_an_img_size_beyond_memory_is_refused_with_the_figures_before_resizing(tmp_path, capsys):
    from minivit.train import main

    assert main([*TINY_FLAGS, "--img-size", "20000", "--max-steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()          # was a raw MemoryError (10.9 TiB) in resize_images
    assert len(err) == 1 and not (tmp_path / "run").exists()
    assert "--img-size 20000: the 2,256 images resized (2.7 TB) and one block's attention for a batch of 32" in err[0]
    assert "lower --img-size (or --batch-size, --train-subset), or raise --patch-size" in err[0]
