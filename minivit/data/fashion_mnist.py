"""Fashion-MNIST: its IDX files (as Debian's dataset-fashion-mnist installs them, or as downloaded), their
official checksums, and the reader, which never decompresses more than a file's header states.

Glossary: N images, H, W height and width (28), C channels (1).
"""

import gzip
import math
import os
import zlib

import numpy

from ..memory import check_fits
from .dataset import _check_md5, _check_root

FASHION_MNIST_DIRS = ["/usr/share/datasets/fashion-mnist"]
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"  # + file name
FASHION_MNIST_FILES = {  # split -> (images file, labels file), without the .gz
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
FASHION_MNIST_MD5 = {  # of the *decompressed* content: Debian re-gzipped the files (FACTS.md, "Data")
    "train-images-idx3-ubyte": "f4a8712d7a061bf5bd6d2ca38dc4d50a",
    "train-labels-idx1-ubyte": "9018921c3c673c538a1fc5bad174d6f9",
    "t10k-images-idx3-ubyte": "8181f5470baa50b63fa0f6fddb340f0a",
    "t10k-labels-idx1-ubyte": "15d484375f8d13e6eb1aabb0c3f46965",
}
FASHION_MNIST_GZ_MD5 = {  # of the official .gz downloads (Fashion-MNIST README; same values in torchvision)
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
FASHION_MNIST_GZ_SIZE = {  # bytes of the official .gz downloads: the downloader fetches no more than this
    "train-images-idx3-ubyte.gz": 26421880,
    "train-labels-idx1-ubyte.gz": 29515,
    "t10k-images-idx3-ubyte.gz": 4422102,
    "t10k-labels-idx1-ubyte.gz": 5148,
}
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
FASHION_MNIST_MEAN = (0.2860,)  # computed from the 60000 training images: 0.28604
FASHION_MNIST_STD = (0.3530,)  # likewise: 0.35302

IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension


def _find_idx_file(folder, name):
    """The path of name or name.gz in folder (the uncompressed one first), or None."""
    for candidate in (name, name + ".gz"):
        path = os.path.join(folder, candidate)
        if os.path.isfile(path):
            return path
    return None


def _read_idx_bytes(path, name, verify):
    """The decompressed content of an IDX file (gzip or not), MD5-checked against the official value.
    The header is read first and no more than the size it states is ever decompressed or read, so a gzip
    bomb (or a header claiming billions of images) is refused naming the size before it is allocated."""
    header_len = 16 if "images" in name else 8          # magic, count (and rows, cols for images)
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"   # the gzip magic number: decompress whatever the file is called
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as f:
            head = f.read(header_len)
            dims = [int.from_bytes(head[i:i + 4], "big") for i in range(4, len(head) - 3, 4)]
            size = header_len + math.prod(dims) if len(head) == header_len else len(head)
            check_fits(size, f"{path}: its header says {' x '.join(map(str, dims))} bytes of data, which",
                       "a damaged or edited file: delete it and download Fashion-MNIST again")
            raw = head + f.read(size - len(head) + 1)    # one byte more than the header states: a longer
    except (OSError, EOFError, zlib.error) as err:      # file is refused below, never read to its end
        raise ValueError(f"{path}: could not read or decompress it ({err})") from None
    if len(raw) > size:
        raise ValueError(f"{path}: holds more than the {size:,} bytes its header states (a damaged file or a "
                         f"decompression bomb): reading stopped there; delete it and download Fashion-MNIST again")
    if verify:
        _check_md5(raw, name, path, FASHION_MNIST_MD5)
    return raw


def _parse_idx_images(raw, path):
    """uint8 images (n, rows, cols, 1) from IDX bytes: magic 0x803, then n, rows, cols big-endian."""
    if len(raw) < 16:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX image header (16 bytes)")
    magic, n, rows, cols = (int.from_bytes(raw[i:i + 4], "big") for i in range(0, 16, 4))
    if magic != IDX_IMAGES_MAGIC:
        raise ValueError(f"{path}: magic number {magic:#010x}, expected {IDX_IMAGES_MAGIC:#010x} (IDX images)")
    if len(raw) != 16 + n * rows * cols:
        raise ValueError(f"{path}: header says {n} images of {rows}x{cols} ({16 + n * rows * cols} bytes), "
                         f"the file has {len(raw)} bytes")
    return numpy.frombuffer(raw, dtype=numpy.uint8, offset=16).reshape(n, rows, cols, 1).copy()  # (n, H, W, 1)


def _parse_idx_labels(raw, path):
    """int64 labels (n,) from IDX bytes: magic 0x801, then n big-endian, then n bytes."""
    if len(raw) < 8:
        raise ValueError(f"{path}: {len(raw)} bytes, too short for an IDX label header (8 bytes)")
    magic, n = int.from_bytes(raw[0:4], "big"), int.from_bytes(raw[4:8], "big")
    if magic != IDX_LABELS_MAGIC:
        raise ValueError(f"{path}: magic number {magic:#010x}, expected {IDX_LABELS_MAGIC:#010x} (IDX labels)")
    if len(raw) != 8 + n:
        raise ValueError(f"{path}: header says {n} labels ({8 + n} bytes), the file has {len(raw)} bytes")
    labels = numpy.frombuffer(raw, dtype=numpy.uint8, offset=8).astype(numpy.int64)  # (n,)
    if n and labels.max() > 9:
        raise ValueError(f"{path}: labels must lie in 0..9, found {labels.max()}")
    return labels


def _fashion_mnist_folder(root):
    """The first folder holding all four IDX files (plain or .gz), or a FileNotFoundError saying how to get them."""
    candidates = FASHION_MNIST_DIRS if root is None else [root, os.path.join(root, "fashion-mnist")]
    needed = [name for pair in FASHION_MNIST_FILES.values() for name in pair]
    for folder in candidates:
        if all(_find_idx_file(folder, name) for name in needed):
            return folder
    missing = needed if not os.path.isdir(candidates[0]) else \
        [n for n in needed if _find_idx_file(candidates[0], n) is None]
    raise FileNotFoundError(
        f"Fashion-MNIST not found in {', '.join(candidates)} (missing: {', '.join(n + '[.gz]' for n in missing)}). "
        f"Install it with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu, into {FASHION_MNIST_DIRS[0]}) "
        f"or run `python data_scripts/download_fashion_mnist.py` (into data/fashion-mnist)."
    )


def load_fashion_mnist(root=None, verify=True):
    """Fashion-MNIST from the four IDX files, gzip-compressed or not.

    root: folder with train-images-idx3-ubyte[.gz] etc. (root/fashion-mnist/ is also looked at);
    None searches FASHION_MNIST_DIRS (Debian's /usr/share/datasets/fashion-mnist).
    verify: check the MD5 of each file's decompressed content against the official value.
    Returns ((x_train, y_train), (x_test, y_test)): uint8 (60000, 28, 28, 1), int64 (60000,),
    uint8 (10000, 28, 28, 1), int64 (10000,).
    """
    if root is not None:
        root = _check_root(root)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    folder = _fashion_mnist_folder(root)
    splits = []
    for split in ("train", "test"):
        images_name, labels_name = FASHION_MNIST_FILES[split]
        images_path = _find_idx_file(folder, images_name)
        labels_path = _find_idx_file(folder, labels_name)
        x = _parse_idx_images(_read_idx_bytes(images_path, images_name, verify), images_path)  # (n, 28, 28, 1)
        y = _parse_idx_labels(_read_idx_bytes(labels_path, labels_name, verify), labels_path)  # (n,)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{images_path} has {x.shape[0]} images but {labels_path} has {y.shape[0]} labels")
        splits.append((x, y))
    return splits[0], splits[1]
