"""Tests of minivit.data (readers, shapes, load_dataset) and minivit.download, with no network.

CIFAR-10 and Fashion-MNIST are tested on small files written here in the exact official formats; the
real Fashion-MNIST files are read too when Debian's dataset-fashion-mnist is installed.
"""

import gzip
import hashlib
import os
import pickle
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from minivit import data
from minivit.data import (
    CIFAR10_MD5, FASHION_MNIST_CLASSES, FASHION_MNIST_MD5, SHAPES_CLASSES, Dataset,
    channel_mean_std, load_cifar10, load_cifar10_classes, load_dataset, load_fashion_mnist,
    load_image_folder, make_shapes,
)
from minivit.download import NetworkError, download_file, md5_of_file, safe_extract_tar

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEBIAN_FASHION = "/usr/share/datasets/fashion-mnist"


# ---------------------------------------------------------------------------------------------------
# CIFAR-10, in the official format: protocol-2 pickles with bytes keys
# ---------------------------------------------------------------------------------------------------

CIFAR_PER_BATCH = 4  # images in each fake batch file


def _fake_cifar_batch(index, n, rng):
    """One batch dict as the official files hold it; data rows are [R plane | G plane | B plane]."""
    data_ = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)  # (n, 3072)
    labels = [int(v) for v in rng.integers(0, 10, size=n)]
    return {
        b"batch_label": f"training batch {index} of 5".encode(),
        b"labels": labels,
        b"data": data_,
        b"filenames": [f"img_{index}_{i}.png".encode() for i in range(n)],
    }


def write_fake_cifar10(root, n=CIFAR_PER_BATCH, seed=0, as_tar=False):
    """Write root/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta} (or the .tar.gz of
    them) in the official format. Returns {name: batch dict}."""
    rng = np.random.default_rng(seed)
    folder = os.path.join(root, "cifar-10-batches-py")
    os.makedirs(folder, exist_ok=True)
    batches = {}
    for i, name in enumerate(data.CIFAR10_TRAIN_FILES + ["test_batch"], start=1):
        batches[name] = _fake_cifar_batch(i, n, rng)
    meta = {
        b"num_cases_per_batch": n,
        b"label_names": [c.encode() for c in data.CIFAR10_CLASSES],
        b"num_vis": 3072,
    }
    for name, obj in list(batches.items()) + [("batches.meta", meta)]:
        with open(os.path.join(folder, name), "wb") as f:
            pickle.dump(obj, f, protocol=2)
    if as_tar:
        with tarfile.open(os.path.join(root, "cifar-10-python.tar.gz"), "w:gz") as tar:
            tar.add(folder, arcname="cifar-10-batches-py")
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        os.rmdir(folder)
    return batches


def test_cifar10_reads_official_format(tmp_path):
    batches = write_fake_cifar10(tmp_path)
    (x_train, y_train), (x_test, y_test) = load_cifar10(tmp_path, verify=False)
    n = CIFAR_PER_BATCH
    assert x_train.shape == (5 * n, 32, 32, 3) and x_train.dtype == np.uint8
    assert y_train.shape == (5 * n,) and y_train.dtype == np.int64
    assert x_test.shape == (n, 32, 32, 3) and y_test.dtype == np.int64
    assert y_train.tolist() == sum((batches[f"data_batch_{i}"][b"labels"] for i in range(1, 6)), [])
    assert y_test.tolist() == batches["test_batch"][b"labels"]
    assert x_train.flags.c_contiguous


def test_cifar10_rgb_planes_land_at_nhwc(tmp_path):
    """A known pixel: row 5, column 7 of image 2 of data_batch_3 gets (R, G, B) = (11, 22, 33)."""
    batches = write_fake_cifar10(tmp_path)
    row = batches["data_batch_3"][b"data"][2]
    row[0 * 1024 + 5 * 32 + 7] = 11  # red plane, row-major
    row[1 * 1024 + 5 * 32 + 7] = 22  # green plane
    row[2 * 1024 + 5 * 32 + 7] = 33  # blue plane
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_3", "wb") as f:
        pickle.dump(batches["data_batch_3"], f, protocol=2)
    (x_train, _), _ = load_cifar10(tmp_path, verify=False)
    image = x_train[2 * CIFAR_PER_BATCH + 2]  # batch 3 starts after two batches
    assert image[5, 7].tolist() == [11, 22, 33]
    # and the whole image matches the documented reshape
    expected = row.reshape(3, 32, 32).transpose(1, 2, 0)
    np.testing.assert_array_equal(image, expected)


def test_cifar10_verify_refuses_unofficial_files(tmp_path):
    write_fake_cifar10(tmp_path)
    with pytest.raises(ValueError, match="data_batch_1.*md5"):
        load_cifar10(tmp_path, verify=True)
    with pytest.raises(ValueError, match="batches.meta.*md5"):
        load_cifar10_classes(tmp_path, verify=True)


def test_cifar10_verify_does_not_unpickle_before_checksum(tmp_path):
    """A malicious pickle (it would create a file when loaded) is refused by its checksum, unloaded."""
    write_fake_cifar10(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump(Evil(), f, protocol=2)
    with pytest.raises(ValueError, match="md5"):
        load_cifar10(tmp_path, verify=True)
    assert not marker.exists()
    # with verify=False the restricted unpickler still refuses anything but arrays
    with pytest.raises(ValueError, match="test_batch"):
        load_cifar10(tmp_path, verify=False)
    assert not marker.exists()


def test_cifar10_missing_batch_is_named(tmp_path):
    write_fake_cifar10(tmp_path)
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_4")
    with pytest.raises(FileNotFoundError, match="data_batch_4"):
        load_cifar10(tmp_path, verify=False)


def test_cifar10_nothing_there_says_how_to_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="download_cifar10.py"):
        load_cifar10(tmp_path)


def test_cifar10_corrupt_pickle_is_named(tmp_path):
    write_fake_cifar10(tmp_path)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    path.write_bytes(path.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="data_batch_2"):
        load_cifar10(tmp_path, verify=False)


def test_cifar10_wrong_data_shape_is_named(tmp_path):
    batches = write_fake_cifar10(tmp_path)
    batches["test_batch"][b"data"] = batches["test_batch"][b"data"][:, :100]
    with open(tmp_path / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump(batches["test_batch"], f, protocol=2)
    with pytest.raises(ValueError, match="test_batch.*3072"):
        load_cifar10(tmp_path, verify=False)


def test_cifar10_from_tar_gz(tmp_path):
    batches = write_fake_cifar10(tmp_path, as_tar=True)
    assert not (tmp_path / "cifar-10-batches-py").exists()
    (x_train, y_train), (x_test, y_test) = load_cifar10(tmp_path, verify=False)
    assert x_train.shape == (5 * CIFAR_PER_BATCH, 32, 32, 3)
    assert y_test.tolist() == batches["test_batch"][b"labels"]
    assert load_cifar10_classes(tmp_path, verify=False) == data.CIFAR10_CLASSES
    with pytest.raises(ValueError, match="cifar-10-python.tar.gz:cifar-10-batches-py/data_batch_1"):
        load_cifar10(tmp_path, verify=True)


def test_cifar10_classes_from_meta(tmp_path):
    write_fake_cifar10(tmp_path)
    assert load_cifar10_classes(tmp_path, verify=False) == ["airplane", "automobile", "bird", "cat", "deer",
                                                            "dog", "frog", "horse", "ship", "truck"]


def test_cifar10_md5_table_is_complete():
    assert set(CIFAR10_MD5) == {"cifar-10-python.tar.gz", "data_batch_1", "data_batch_2", "data_batch_3",
                                "data_batch_4", "data_batch_5", "test_batch", "batches.meta"}
    assert all(len(v) == 32 for v in CIFAR10_MD5.values())


def test_cifar10_bad_arguments():
    with pytest.raises(TypeError, match="root"):
        load_cifar10(3)
    with pytest.raises(TypeError, match="verify"):
        load_cifar10("data", verify="yes")


# ---------------------------------------------------------------------------------------------------
# Fashion-MNIST: IDX files
# ---------------------------------------------------------------------------------------------------

def _idx_images(x):
    n, rows, cols = x.shape
    return (0x803).to_bytes(4, "big") + b"".join(v.to_bytes(4, "big") for v in (n, rows, cols)) + x.tobytes()


def _idx_labels(y):
    return (0x801).to_bytes(4, "big") + len(y).to_bytes(4, "big") + y.astype(np.uint8).tobytes()


def write_fake_fashion(folder, n_train=20, n_test=10, gz=True, seed=0):
    """Write the four IDX files (gzip-compressed or raw) with random content; returns the arrays."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    arrays = {}
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        y = rng.integers(0, 10, size=n).astype(np.uint8)
        arrays[split] = (x, y)
        images_name, labels_name = data.FASHION_MNIST_FILES[split]
        for name, raw in ((images_name, _idx_images(x)), (labels_name, _idx_labels(y))):
            path = os.path.join(folder, name + (".gz" if gz else ""))
            with open(path, "wb") as f:
                f.write(gzip.compress(raw) if gz else raw)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_reads_idx(tmp_path, gz):
    arrays = write_fake_fashion(tmp_path, gz=gz)
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(tmp_path, verify=False)
    assert x_train.shape == (20, 28, 28, 1) and x_train.dtype == np.uint8
    assert y_train.shape == (20,) and y_train.dtype == np.int64
    np.testing.assert_array_equal(x_train[..., 0], arrays["train"][0])
    np.testing.assert_array_equal(y_test, arrays["test"][1])
    assert x_test.shape == (10, 28, 28, 1)


def test_fashion_mnist_subfolder_and_verify(tmp_path):
    write_fake_fashion(tmp_path / "fashion-mnist")
    (x_train, _), _ = load_fashion_mnist(tmp_path, verify=False)  # root/fashion-mnist/ is found
    assert x_train.shape[0] == 20
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz.*md5"):
        load_fashion_mnist(tmp_path, verify=True)


def test_fashion_mnist_bad_magic_and_size(tmp_path):
    write_fake_fashion(tmp_path, gz=False)
    path = tmp_path / "t10k-labels-idx1-ubyte"
    raw = bytearray(path.read_bytes())
    raw[3] = 0x03  # magic 0x803: an image file where labels belong
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.*magic"):
        load_fashion_mnist(tmp_path, verify=False)
    raw[3] = 0x01
    path.write_bytes(bytes(raw[:-3]))  # three labels short
    with pytest.raises(ValueError, match="t10k-labels-idx1-ubyte.*bytes"):
        load_fashion_mnist(tmp_path, verify=False)


def test_fashion_mnist_count_mismatch(tmp_path):
    write_fake_fashion(tmp_path, gz=False)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_labels(np.zeros(7, np.uint8)))
    with pytest.raises(ValueError, match="20 images.*7 labels"):
        load_fashion_mnist(tmp_path, verify=False)


def test_fashion_mnist_corrupt_gzip_is_named(tmp_path):
    write_fake_fashion(tmp_path, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz"):
        load_fashion_mnist(tmp_path, verify=False)


def test_fashion_mnist_missing_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        load_fashion_mnist(tmp_path)
    message = str(err.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert "download_fashion_mnist.py" in message


def test_fashion_mnist_constants():
    assert len(FASHION_MNIST_CLASSES) == 10 and FASHION_MNIST_CLASSES[0] == "T-shirt/top"
    assert FASHION_MNIST_CLASSES[9] == "Ankle boot"
    assert set(FASHION_MNIST_MD5) == {n for pair in data.FASHION_MNIST_FILES.values() for n in pair}
    assert data.FASHION_MNIST_DIRS == ["/usr/share/datasets/fashion-mnist"]


@pytest.mark.skipif(not os.path.isdir(DEBIAN_FASHION), reason="dataset-fashion-mnist is not installed")
def test_fashion_mnist_real_debian_files():
    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(verify=True)
    assert x_train.shape == (60000, 28, 28, 1) and x_test.shape == (10000, 28, 28, 1)
    assert np.bincount(y_train).tolist() == [6000] * 10
    assert np.bincount(y_test).tolist() == [1000] * 10
    mean, std = channel_mean_std(x_train)
    assert mean == data.FASHION_MNIST_MEAN and std == data.FASHION_MNIST_STD


# ---------------------------------------------------------------------------------------------------
# An image folder
# ---------------------------------------------------------------------------------------------------

def _write_image_folder(root):
    from PIL import Image

    rng = np.random.default_rng(0)
    specs = {  # (split, class): list of (file name, Pillow mode, size)
        ("train", "cat"): [("a.png", "RGB", (20, 10)), ("b.JPG", "L", (8, 8)), ("c.png", "RGBA", (16, 16))],
        ("train", "dog"): [("d.jpeg", "RGB", (40, 30)), ("e.bmp", "RGB", (16, 16))],
        ("train", "emu"): [("f.gif", "P", (12, 12))],
        ("val", "dog"): [("g.png", "RGB", (16, 16))],
        ("val", "cat"): [("h.webp", "RGB", (16, 16))],
    }
    for (split, cls), files in specs.items():
        folder = root / split / cls
        folder.mkdir(parents=True)
        for name, mode, (w, h) in files:
            bands = {"RGB": 3, "L": 1, "RGBA": 4, "P": 1}[mode]
            pixels = rng.integers(0, 256, size=(h, w, bands), dtype=np.uint8)
            im = Image.fromarray(pixels[..., 0] if bands == 1 else pixels, mode="L" if bands == 1 else mode)
            if mode == "P":
                im = im.convert("P")
            im.save(folder / name)
    (root / "train" / "cat" / "notes.txt").write_text("not an image")  # skipped: not an image name


def test_image_folder_reads_and_resizes(tmp_path):
    _write_image_folder(tmp_path)
    ((x_train, y_train), (x_val, y_val)), classes = load_image_folder(tmp_path, 16)
    assert classes == ["cat", "dog", "emu"]
    assert x_train.shape == (6, 16, 16, 3) and x_train.dtype == np.uint8
    assert y_train.tolist() == [0, 0, 0, 1, 1, 2] and y_train.dtype == np.int64
    assert x_val.shape == (2, 16, 16, 3)
    assert y_val.tolist() == [0, 1]  # val/cat then val/dog: labels follow the train classes
    grey = x_train[1]  # b.JPG was grayscale: all three channels equal after convert("RGB")
    assert np.array_equal(grey[..., 0], grey[..., 1]) and np.array_equal(grey[..., 1], grey[..., 2])
    ((x_train, _), _), _ = load_image_folder(tmp_path, (12, 20))
    assert x_train.shape == (6, 12, 20, 3)


def test_image_folder_keeps_exact_pixels_at_native_size(tmp_path):
    from PIL import Image

    pixels = np.arange(4 * 4 * 3, dtype=np.uint8).reshape(4, 4, 3)
    for split in ("train", "val"):
        (tmp_path / split / "only").mkdir(parents=True)
        Image.fromarray(pixels).save(tmp_path / split / "only" / "x.png")
    ((x_train, _), _), _ = load_image_folder(tmp_path, 4)
    np.testing.assert_array_equal(x_train[0], pixels)


def test_image_folder_scales_16_bit_images_instead_of_clipping_them(tmp_path):
    from PIL import Image

    from minivit.data import read_image

    wide = (np.arange(8 * 8, dtype=np.uint16).reshape(8, 8) * 1000)        # 0 .. 63000 of 65535
    for split in ("train", "val"):
        (tmp_path / split / "only").mkdir(parents=True)
        Image.fromarray(wide).save(tmp_path / split / "only" / "x.png")       # a 16-bit grey PNG
    with Image.open(tmp_path / "train" / "only" / "x.png") as im:
        assert im.mode.startswith("I")                                      # Pillow reads it as 16-bit
    ((x_train, _), _), _ = load_image_folder(tmp_path, 8)
    expected = np.rint(wide / 257.0).astype(np.uint8)                       # 65535 -> 255, not clipped
    np.testing.assert_array_equal(x_train[0, ..., 0], expected)
    np.testing.assert_array_equal(x_train[0, ..., 2], expected)
    assert read_image(tmp_path / "val" / "only" / "x.png", 8, mode="L").shape == (8, 8, 1)


def test_image_folder_val_class_not_in_train(tmp_path):
    _write_image_folder(tmp_path)
    (tmp_path / "val" / "zebra").mkdir()
    with pytest.raises(ValueError, match="zebra"):
        load_image_folder(tmp_path, 16)


def test_image_folder_empty_class_folder_is_named(tmp_path):
    _write_image_folder(tmp_path)
    (tmp_path / "train" / "fox").mkdir()
    with pytest.raises(ValueError, match=r"train[/\\]fox"):
        load_image_folder(tmp_path, 16)


def test_image_folder_unreadable_image_is_named(tmp_path):
    _write_image_folder(tmp_path)
    (tmp_path / "train" / "dog" / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(ValueError, match="broken.png"):
        load_image_folder(tmp_path, 16)


def test_image_folder_missing_split_and_bad_size(tmp_path):
    with pytest.raises(FileNotFoundError, match="train"):
        load_image_folder(tmp_path, 16)
    _write_image_folder(tmp_path)
    with pytest.raises(ValueError, match="img_size"):
        load_image_folder(tmp_path, 0)
    with pytest.raises(TypeError, match="img_size"):
        load_image_folder(tmp_path, "16")


# ---------------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------------

def test_shapes_shape_dtype_balance():
    (x, y), (xt, yt) = make_shapes(num_train=200, num_test=50, seed=3)
    assert x.shape == (200, 32, 32, 3) and x.dtype == np.uint8
    assert y.shape == (200,) and y.dtype == np.int64
    assert xt.shape == (50, 32, 32, 3) and yt.dtype == np.int64
    assert np.bincount(y, minlength=10).tolist() == [20] * 10
    assert np.bincount(yt, minlength=10).tolist() == [5] * 10
    assert len(SHAPES_CLASSES) == 10 and len(set(SHAPES_CLASSES)) == 10
    assert x.std() > 30  # not blank images


def test_shapes_deterministic_and_streams_differ():
    (a, ya), (at, _) = make_shapes(num_train=100, num_test=100, seed=1)
    (b, yb), (bt, _) = make_shapes(num_train=100, num_test=100, seed=1)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(at, bt)
    assert not np.array_equal(a, at)  # train and test come from different streams
    (c, _), _ = make_shapes(num_train=100, num_test=100, seed=2)
    assert not np.array_equal(a, c)
    (_, _), (dt, _) = make_shapes(num_train=300, num_test=100, seed=1)
    np.testing.assert_array_equal(at, dt)  # the test set does not depend on num_train


def test_shapes_are_drawn_once_and_each_caller_gets_its_own_copy():
    (a, _), _ = make_shapes(num_train=20, num_test=10, seed=5)
    a[:] = 0                                   # a caller's change stays in its copy
    (b, _), _ = make_shapes(num_train=20, num_test=10, seed=5)
    assert b.std() > 30 and b.flags.writeable and b is not a


def test_shapes_other_size_and_bad_arguments():
    (x, _), _ = make_shapes(num_train=20, num_test=10, img_size=48)
    assert x.shape == (20, 48, 48, 3)
    with pytest.raises(TypeError, match="num_train"):
        make_shapes(num_train=10.0)
    with pytest.raises(ValueError, match="num_test"):
        make_shapes(num_test=-1)
    with pytest.raises(ValueError, match="img_size"):
        make_shapes(img_size=4)


def test_shapes_class_is_decided_by_shape_not_colour():
    """An image's mean colour and brightness carry no class information: a nearest-centroid classifier
    on them, fitted on one half and scored on the other, stays near chance (10%)."""
    (x, y), _ = make_shapes(num_train=4000, num_test=0, seed=0)
    features = np.concatenate([x.mean(axis=(1, 2)), x.std(axis=(1, 2))], axis=1)  # (N, 6)
    fit, score = slice(0, 2000), slice(2000, 4000)
    centroids = np.stack([features[fit][y[fit] == k].mean(0) for k in range(10)])  # (10, 6)
    distances = ((features[score][:, None, :] - centroids[None]) ** 2).sum(-1)  # (2000, 10)
    accuracy = (distances.argmin(1) == y[score]).mean()
    assert accuracy < 0.2, accuracy


def test_shapes_default_size_is_fast():
    """12000 images in under 6 s of CPU time (process time: other jobs on a shared machine count only through
    the caches they share; ~1.1-1.6 s measured at a load average of 8.5 on 2 cores, 2026-12-05). It guards
    against a per-pixel Python loop (100x slower), not against a few percent: speed lives in benchmarks/."""
    from minivit.data.synthetic import _drawn_shapes

    _drawn_shapes.cache_clear()        # draw them, not read them from the cache of an earlier test
    start = time.process_time()
    (x, _), (xt, _) = make_shapes()
    elapsed = time.process_time() - start
    assert x.shape[0] + xt.shape[0] == 12000
    assert elapsed < 6.0, f"make_shapes took {elapsed:.2f} s of CPU time for 12000 images"


def test_lines_tiles_are_equal_along_the_class_direction_only():
    """make_lines: balanced, deterministic; in each image the tiles are equal (up to noise) along its
    class's lines and not along the other directions; a single tile's colour says nothing of the class."""
    from minivit.data import LINES_CLASSES, make_lines

    d = make_lines(400, 40, seed=1)
    assert d.x_train.shape == (400, 32, 32, 3) and d.x_train.dtype == np.uint8 and d.num_classes == 4
    assert d.classes == list(LINES_CLASSES) and np.bincount(d.y_train).tolist() == [100] * 4
    assert np.array_equal(make_lines(400, 40, seed=1).x_test, d.x_test)
    assert not np.array_equal(make_lines(400, 40, seed=2).x_test, d.x_test)
    tiles = d.x_train.astype(float).reshape(400, 8, 4, 8, 4, 3).mean((2, 4))       # (n, 8, 8, 3) tile means
    steps = [(0, 1), (1, 0), (1, 1), (1, -1)]                                       # along a row, column, ...
    for k, (dr, dc) in enumerate(steps):
        a = tiles[:, max(0, -dr):8 - max(0, dr), max(0, -dc):8 - max(0, dc)]
        b = tiles[:, max(0, dr):8 + min(0, dr) or None, max(0, dc):8 + min(0, dc) or None]
        gap = np.abs(a - b).mean((1, 2, 3))                                          # (n,) mean step difference
        assert gap[d.y_train == k].max() < 5, LINES_CLASSES[k]                   # equal along its lines
        assert gap[d.y_train != k].min() > 30, LINES_CLASSES[k]                  # not along the others
    per_class = [tiles[d.y_train == k].mean() for k in range(4)]
    assert np.ptp(per_class) < 6, per_class                                    # colours alike in every class
    with pytest.raises(TypeError, match="num_train"):
        make_lines(10.0)
    with pytest.raises(ValueError, match="num_test"):
        make_lines(10, 0)


# ---------------------------------------------------------------------------------------------------
# load_dataset and channel statistics
# ---------------------------------------------------------------------------------------------------

def test_channel_mean_std_matches_numpy():
    x = np.random.default_rng(0).integers(0, 256, size=(5, 7, 9, 3), dtype=np.uint8)
    mean, std = channel_mean_std(x)
    np.testing.assert_allclose(mean, (x / 255).mean(axis=(0, 1, 2)), atol=6e-5)
    np.testing.assert_allclose(std, (x / 255).std(axis=(0, 1, 2)), atol=6e-5)
    with pytest.raises(ValueError, match="uint8"):
        channel_mean_std(x.astype(np.float32))


def test_load_dataset_shapes():
    ds = load_dataset("shapes")
    assert isinstance(ds, Dataset) and ds.name == "shapes"
    assert ds.x_train.shape == (10000, 32, 32, 3) and ds.x_test.shape == (2000, 32, 32, 3)
    assert ds.classes == SHAPES_CLASSES and ds.num_classes == 10 and ds.image_shape == (32, 32, 3)
    assert len(ds.mean) == 3 and len(ds.std) == 3
    np.testing.assert_allclose(ds.mean, ds.x_train.reshape(-1, 3).mean(0, dtype=np.float64) / 255, atol=1e-4)


def test_load_dataset_cifar10_and_folder(tmp_path):
    write_fake_cifar10(tmp_path / "cifar")
    ds = load_dataset("cifar10", data_dir=tmp_path / "cifar", verify=False)
    assert ds.mean == (0.4914, 0.4822, 0.4465) and ds.std == (0.2470, 0.2435, 0.2616)
    assert ds.classes[0] == "airplane" and ds.x_train.shape == (5 * CIFAR_PER_BATCH, 32, 32, 3)
    ds = load_dataset("cifar10", data_dir=tmp_path / "cifar", img_size=16, verify=False)
    assert ds.x_train.shape == (5 * CIFAR_PER_BATCH, 16, 16, 3)

    _write_image_folder(tmp_path / "folder")
    ds = load_dataset("folder", data_dir=tmp_path / "folder", img_size=8)
    assert ds.classes == ["cat", "dog", "emu"] and ds.x_train.shape == (6, 8, 8, 3)
    assert ds.x_test.shape == (2, 8, 8, 3)
    assert ds.mean == channel_mean_std(ds.x_train)[0]


def test_load_dataset_fashion_mnist_fake(tmp_path):
    write_fake_fashion(tmp_path)
    ds = load_dataset("fashion-mnist", data_dir=tmp_path, verify=False)
    assert ds.mean == (0.2860,) and ds.std == (0.3530,)
    assert ds.image_shape == (28, 28, 1) and ds.classes == FASHION_MNIST_CLASSES
    ds = load_dataset("fashion-mnist", data_dir=tmp_path, img_size=32, verify=False)
    assert ds.image_shape == (32, 32, 1)


def test_load_dataset_bad_arguments():
    with pytest.raises(ValueError, match="'mnist'.*cifar10"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="data_dir"):
        load_dataset("folder")


# ---------------------------------------------------------------------------------------------------
# minivit.download: file:// URLs and an unreachable port, no network
# ---------------------------------------------------------------------------------------------------

def _leftovers(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".part"))


def test_download_file_checksum_pass_and_skip(tmp_path, capsys):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3000))
    md5 = hashlib.md5(src.read_bytes()).hexdigest()
    dest = tmp_path / "out" / "file.bin"
    assert download_file(src.as_uri(), dest, md5, progress=False) == str(dest)
    assert dest.read_bytes() == src.read_bytes()
    assert _leftovers(dest.parent) == []
    before = os.stat(dest).st_mtime_ns
    download_file("http://127.0.0.1:9/never-asked", dest, md5, progress=False)  # present: no download
    assert os.stat(dest).st_mtime_ns == before
    assert "already present" in capsys.readouterr().out
    assert md5_of_file(dest) == md5


def test_download_file_checksum_fail_leaves_nothing(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(b"hello" * 100)
    dest = tmp_path / "out" / "file.bin"
    with pytest.raises(ValueError, match="md5"):
        download_file(src.as_uri(), dest, "0" * 32, progress=False)
    assert not dest.exists()
    assert os.listdir(dest.parent) == []  # no temporary file either


def test_download_file_unreachable(tmp_path):
    dest = tmp_path / "file.bin"
    with pytest.raises(NetworkError, match="127.0.0.1:9"):
        download_file("http://127.0.0.1:9/x", dest, "0" * 32, timeout=5, progress=False)
    assert os.listdir(tmp_path) == []


def test_download_file_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="md5"):
        download_file("file:///x", tmp_path / "f", "abc")
    with pytest.raises(TypeError, match="url"):
        download_file(None, tmp_path / "f", "0" * 32)


def test_safe_extract_tar_refuses_bad_members(tmp_path):
    import io

    good = tmp_path / "good.tar.gz"
    with tarfile.open(good, "w:gz") as tar:
        payload = b"content"
        info = tarfile.TarInfo("folder/a.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    assert safe_extract_tar(good, tmp_path / "x") == ["folder/a.txt"]
    assert (tmp_path / "x" / "folder" / "a.txt").read_bytes() == b"content"

    for name, kind in (("../escape.txt", tarfile.REGTYPE), ("/abs.txt", tarfile.REGTYPE),
                       ("link", tarfile.SYMTYPE)):
        bad = tmp_path / "bad.tar"
        with tarfile.open(bad, "w") as tar:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.SYMTYPE:
                info.linkname = "/etc/passwd"
            tar.addfile(info, io.BytesIO(b""))
        with pytest.raises(ValueError, match="refusing"):
            safe_extract_tar(bad, tmp_path / "y")
        assert not (tmp_path / "escape.txt").exists()


def _run_script(args, cwd):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_download_cifar10_script_without_network(tmp_path):
    """Unreachable URL: one clear paragraph and exit status 1, nothing left behind."""
    script = os.path.join(REPO, "data_scripts", "download_cifar10.py")
    result = _run_script([script, "--root", str(tmp_path), "--url", "http://127.0.0.1:9/x"], REPO)
    assert result.returncode == 1, result.stderr
    assert "cifar-10-python.tar.gz" in result.stdout + result.stderr
    assert "unreachable" in result.stdout + result.stderr
    assert os.listdir(tmp_path) == []


def test_download_cifar10_script_uses_present_archive(tmp_path, monkeypatch):
    """A verified archive already in ROOT is extracted without any download."""
    write_fake_cifar10(tmp_path, as_tar=True)
    archive = tmp_path / "cifar-10-python.tar.gz"
    md5 = md5_of_file(archive)
    script = os.path.join(REPO, "data_scripts", "download_cifar10.py")
    result = _run_script([script, "--root", str(tmp_path), "--url", "http://127.0.0.1:9/x", "--md5", md5], REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "cifar-10-batches-py" / "data_batch_1").is_file()


def test_download_fashion_mnist_script_without_network(tmp_path):
    script = os.path.join(REPO, "data_scripts", "download_fashion_mnist.py")
    result = _run_script([script, "--root", str(tmp_path), "--base-url", "http://127.0.0.1:9/"], REPO)
    assert result.returncode == 1, result.stderr
    assert "train-images-idx3-ubyte.gz" in result.stdout + result.stderr
    assert "unreachable" in result.stdout + result.stderr
