"""Data sets: readers for CIFAR-10, Fashion-MNIST and image folders, and a procedural shapes set.

Every reader returns host NumPy arrays: images uint8 (N, H, W, C) in NHWC order, labels int64 (N,).
The trainer moves batches to the backend later (``minivit.backend.asarray``). ``load_dataset(name)``
is the one entry point the trainer uses; it also gives each set's per-channel mean and std.

Glossary: N images, H, W height and width, C channels (3 for RGB, 1 for Fashion-MNIST), K classes.

Security: CIFAR-10 comes as Python pickles, and unpickling runs code chosen by whoever wrote the file.
So only the expected file names are read; with verify=True (the default) a file is unpickled only after
its MD5 equals the official one; and even then the unpickler accepts nothing but NumPy arrays,
lists, bytes and numbers.
"""

import codecs
import functools
import gzip
import hashlib
import io
import math
import os
import pickle
import re
import stat
import tarfile
import zlib
from dataclasses import dataclass

import numpy

from .memory import check_fits

try:  # what pickles use to rebuild an ndarray
    from numpy._core.multiarray import _reconstruct  # NumPy >= 2
    from numpy._core.numeric import _frombuffer
except ImportError:
    from numpy.core.multiarray import _reconstruct  # NumPy 1.x
    from numpy.core.numeric import _frombuffer

# ---------------------------------------------------------------------------------------------------
# CIFAR-10
# ---------------------------------------------------------------------------------------------------

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE = "cifar-10-python.tar.gz"
CIFAR10_ARCHIVE_SIZE = 170498071  # bytes of the official archive: the downloader fetches no more than this
CIFAR10_FOLDER = "cifar-10-batches-py"  # what the archive extracts to
CIFAR10_TRAIN_FILES = ["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"]
CIFAR10_TEST_FILE = "test_batch"
CIFAR10_META_FILE = "batches.meta"
CIFAR10_MD5 = {  # official values (FACTS.md, "Data")
    "cifar-10-python.tar.gz": "c58f30108f718f92721af3b95e74349a",
    "data_batch_1": "c99cafc152244af753f735de768cd75f",
    "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "data_batch_4": "634d18415352ddfa80567beed471001a",
    "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "test_batch": "40351d587109b95175f43aff81a1287e",
    "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
}
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _check_root(root, what="root"):
    """root as a str path, or a TypeError naming what was passed."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{what} must be a folder path (str or os.PathLike), got {type(root).__name__}: {root!r}")
    return os.fspath(root)


# The only globals a CIFAR-10 pickle may name. The official files were written by Python 2 with
# NumPy 1 (numpy.core.*); NumPy 2 writes numpy._core.*; Python 3 at protocol 2 writes bytes through
# _codecs.encode. All of these only build data.
_PICKLE_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("numpy", "ndarray"): numpy.ndarray,
    ("numpy", "dtype"): numpy.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """An unpickler that may build NumPy arrays, lists, bytes and numbers, and nothing that runs code."""

    def find_class(self, module, name):
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only NumPy arrays are expected")
        return _PICKLE_ALLOWED[(module, name)]


def _unpickle(raw, where):
    """The dict stored in the pickle bytes raw (keys are bytes); ValueError naming where if it is corrupt."""
    try:
        obj = _ArraysOnlyUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as err:  # UnpicklingError, EOFError, ValueError...: all mean "not a valid batch file"
        raise ValueError(f"{where}: not a valid CIFAR-10 pickle ({type(err).__name__}: {err})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a pickled dict, got {type(obj).__name__}")
    return obj


def _check_md5(raw, name, where, official):
    """Raise a ValueError naming the file when the bytes raw do not have the official MD5 of name."""
    got = hashlib.md5(raw).hexdigest()
    if got != official[name]:
        raise ValueError(
            f"{where}: md5 {got} differs from the official {official[name]}; refusing to read it "
            f"(a damaged or modified file; pass verify=False only for files you made yourself)"
        )


CIFAR10_MAX_BYTES = 32_000_000  # a batch file is 31,035,704 bytes (10000 pickled 3072-byte images)


def _check_cifar_size(size, where):
    """Refuse a CIFAR-10 file larger than any official one before it is read into memory."""
    if size > CIFAR10_MAX_BYTES:
        raise ValueError(f"{where}: {size:,} bytes, and no CIFAR-10 file is larger than {CIFAR10_MAX_BYTES:,}: "
                         f"a damaged or foreign file, not read; delete it and run data_scripts/download_cifar10.py")


def _read_cifar_files(root, names):
    """The raw bytes of the CIFAR-10 files names, from root/cifar-10-batches-py/ or from the archive.

    Returns {name: (bytes, where)} with where the path (or archive:member) to put in error messages.
    """
    folder = os.path.join(root, CIFAR10_FOLDER)
    archive = os.path.join(root, CIFAR10_ARCHIVE)
    found = {}
    if os.path.isdir(folder):
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"CIFAR-10 file missing: {path}")
            _check_cifar_size(os.path.getsize(path), path)
            with open(path, "rb") as f:
                found[name] = (f.read(), path)
        return found
    if os.path.isfile(archive):
        # read the members straight from the .tar.gz, in one pass (a gzip stream cannot seek back cheaply)
        wanted = {f"{CIFAR10_FOLDER}/{name}": name for name in names}
        try:
            with tarfile.open(archive, "r:gz") as tar:
                for member in tar:
                    if member.name in wanted and member.isfile():
                        _check_cifar_size(member.size, f"{archive}:{member.name}")
                        found[wanted[member.name]] = (tar.extractfile(member).read(), f"{archive}:{member.name}")
        except (tarfile.TarError, OSError, EOFError) as err:
            raise ValueError(f"{archive}: not a readable tar.gz archive ({err})") from None
        for name in names:
            if name not in found:
                raise FileNotFoundError(f"CIFAR-10 file missing: {archive} has no member {CIFAR10_FOLDER}/{name}")
        return found
    raise FileNotFoundError(
        f"CIFAR-10 not found: neither the folder {folder} nor the archive {archive} exists. "
        f"Run: python data_scripts/download_cifar10.py --root {root}"
    )


def _parse_cifar_batch(raw, where):
    """Images uint8 (n, 32, 32, 3) and labels int64 (n,) from one batch file's bytes."""
    d = _unpickle(raw, where)
    if b"data" not in d or b"labels" not in d:
        raise ValueError(f"{where}: a CIFAR-10 batch needs keys b'data' and b'labels', found {list(d)}")
    data = numpy.asarray(d[b"data"])
    if data.dtype != numpy.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{where}: b'data' must be uint8 (n, 3072), got {data.dtype} {data.shape}")
    labels = numpy.asarray(d[b"labels"], dtype=numpy.int64)  # (n,)
    if labels.shape != (data.shape[0],):
        raise ValueError(f"{where}: {labels.shape[0]} labels for {data.shape[0]} images")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{where}: labels must lie in 0..9, got {labels.min()}..{labels.max()}")
    # each row: the red plane's 1024 values row-major, then green, then blue
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (n, C, H, W) -> (n, H, W, C)
    return numpy.ascontiguousarray(images), labels


def load_cifar10(root, verify=True):
    """CIFAR-10 from root/cifar-10-batches-py/ or, failing that, straight from root/cifar-10-python.tar.gz.

    root: the folder holding either. verify: check each batch file's MD5 against the official value
    (and refuse a file that differs) before unpickling it.
    Returns ((x_train, y_train), (x_test, y_test)): uint8 (50000, 32, 32, 3), int64 (50000,),
    uint8 (10000, 32, 32, 3), int64 (10000,).
    """
    root = _check_root(root)
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be True or False, got {verify!r}")
    names = CIFAR10_TRAIN_FILES + [CIFAR10_TEST_FILE]
    files = _read_cifar_files(root, names)
    if verify:  # every checksum first: nothing is unpickled unless all of them pass
        for name in names:
            raw, where = files[name]
            _check_md5(raw, name, where, CIFAR10_MD5)
    train = [_parse_cifar_batch(*files[name]) for name in CIFAR10_TRAIN_FILES]
    x_train = numpy.concatenate([x for x, _ in train])  # (50000, 32, 32, 3)
    y_train = numpy.concatenate([y for _, y in train])  # (50000,)
    x_test, y_test = _parse_cifar_batch(*files[CIFAR10_TEST_FILE])  # (10000, 32, 32, 3), (10000,)
    return (x_train, y_train), (x_test, y_test)


def load_cifar10_classes(root, verify=True):
    """The 10 class names (list of str) stored in batches.meta under b'label_names'."""
    root = _check_root(root)
    raw, where = _read_cifar_files(root, [CIFAR10_META_FILE])[CIFAR10_META_FILE]
    if verify:
        _check_md5(raw, CIFAR10_META_FILE, where, CIFAR10_MD5)
    meta = _unpickle(raw, where)
    if b"label_names" not in meta:
        raise ValueError(f"{where}: batches.meta needs the key b'label_names', found {list(meta)}")
    return [n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in meta[b"label_names"]]


# ---------------------------------------------------------------------------------------------------
# Fashion-MNIST (IDX files, as Debian's dataset-fashion-mnist installs them)
# ---------------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------------
# An image folder: root/train/<class>/*.png, root/val/<class>/*.jpg (torchvision's ImageFolder layout)
# ---------------------------------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


def _check_img_size(img_size):
    """(H, W) from an int or a pair of positive ints; TypeError/ValueError otherwise."""
    if isinstance(img_size, bool):
        raise TypeError(f"img_size must be an int or a pair (H, W) of ints, got {img_size!r}")
    if isinstance(img_size, int):
        img_size = (img_size, img_size)
    if (not isinstance(img_size, (tuple, list)) or len(img_size) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in img_size)):
        raise TypeError(f"img_size must be an int or a pair (H, W) of ints, got {img_size!r}")
    if img_size[0] < 1 or img_size[1] < 1:
        raise ValueError(f"img_size must be positive, got {img_size!r}")
    return int(img_size[0]), int(img_size[1])


def _class_folders(split_dir):
    """Sorted names of the sub-folders of split_dir (hidden ones skipped); an error naming it if none."""
    if not os.path.isdir(split_dir):
        raise FileNotFoundError(f"image folder data set: {split_dir} does not exist (expected <root>/train/<class>/ "
                                f"and <root>/val/<class>/)")
    names = sorted(n for n in os.listdir(split_dir)
                   if not n.startswith(".") and os.path.isdir(os.path.join(split_dir, n)))
    if not names:
        raise ValueError(f"{split_dir} holds no class folders (expected {split_dir}/<class>/<image files>)")
    return names


def _image_files(class_dir):
    """Sorted paths of the image files in class_dir; a ValueError naming it if there are none."""
    paths = sorted(os.path.join(class_dir, n) for n in os.listdir(class_dir)
                   if not n.startswith(".") and n.lower().endswith(IMAGE_EXTENSIONS))
    if not paths:
        raise ValueError(f"{class_dir} holds no images (looked for {', '.join(IMAGE_EXTENSIONS)})")
    return paths


# The formats an image is opened in, and no other: Pillow would otherwise open EPS, PS and PDF files by their
# content (whatever their name) and run Ghostscript on them, a program from outside this project.
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP", "PPM")


def _to_8_bits(im, path):
    """A Pillow image of a wide mode (16-bit, 32-bit integer, float) as an 8-bit grey one, the full range
    mapped onto 0..255: 16-bit 0..65535 (a 32-bit integer image with values in that range is 16-bit data),
    float 0..1. Other values are refused by name: there is no telling what they mean."""
    from PIL import Image

    wide = numpy.asarray(im).astype(numpy.float64)  # (h, w)
    low, high = (float(wide.min()), float(wide.max())) if wide.size else (0.0, 0.0)
    if im.mode == "F":
        if not (numpy.isfinite(wide).all() and 0.0 <= low and high <= 1.0):
            raise ValueError(f"{path}: a float image (mode F) with values up to {high:g} (from {low:g}); minivit "
                             f"reads float images in 0..1 only: save it as 8- or 16-bit")
        scaled = wide * 255.0
    else:
        if low < 0 or high > 65535:
            raise ValueError(f"{path}: a 32-bit integer image (mode {im.mode}) with values from {low:g} to {high:g}; "
                             f"minivit reads integer images in 0..65535 only: save it as 8- or 16-bit")
        scaled = wide / 257.0  # 65535 -> 255
    return Image.fromarray(numpy.rint(scaled).clip(0, 255).astype(numpy.uint8))


def read_image(path, img_size, mode="RGB"):
    """One image file as uint8 (H, W, 3): turned upright by its EXIF orientation, converted to RGB (grey,
    palette, alpha dropped) and resized with bicubic interpolation to img_size = (H, W); with mode="L",
    grey (H, W, 1). Only IMAGE_FORMATS are opened (never EPS, PS or PDF, whose decoder runs Ghostscript).
    16-bit and 32-bit integer grey images are scaled to 8 bits (65535 -> 255), float ones from 0..1; other
    values are refused. A ValueError names a file that cannot be read, or one larger than Pillow's
    decompression-bomb limit (Image.MAX_IMAGE_PIXELS). The one reader of the folder data set and predict."""
    from PIL import Image, ImageOps  # imported here: only the folder data set and predict need Pillow

    H, W = _check_img_size(img_size)
    if mode not in ("RGB", "L"):
        raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}")
    try:                                    # a FIFO, socket or device would block open() or never end
        kind = os.stat(path).st_mode
    except OSError as err:
        raise ValueError(f"{path}: not a readable image ({err.strerror or err})") from None
    if not stat.S_ISREG(kind):
        what = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder"}.get(stat.S_IFMT(kind), "not a file")
        raise ValueError(f"{path}: {what}, not an image file: remove it or move it out of the image folder")
    try:
        with Image.open(path, formats=IMAGE_FORMATS) as im:
            im = ImageOps.exif_transpose(im)  # decoded, upright as a viewer shows it (a copy: outlives the file)
    except Image.DecompressionBombError as err:
        pixels = re.search(r"\((\d+) pixels\)", str(err))
        raise ValueError(f"{path}: {pixels.group(1) if pixels else 'too many'} pixels, more than Pillow's "
                         f"decompression-bomb limit (2 x PIL.Image.MAX_IMAGE_PIXELS = {2 * Image.MAX_IMAGE_PIXELS}); "
                         f"shrink the image, or raise that limit if you trust the file") from None
    except Image.UnidentifiedImageError:
        raise ValueError(f"{path}: not an image in a format minivit reads ({', '.join(IMAGE_FORMATS)}); EPS, PS "
                         f"and PDF are never opened (their decoder runs Ghostscript): convert it to PNG") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise ValueError(f"{path}: not a readable image ({err})") from None
    if im.mode.startswith("I") or im.mode == "F":  # wide grey: Pillow's convert would clip at 255
        im = _to_8_bits(im, path)
    im = im.convert(mode)
    if im.size != (W, H):  # Pillow sizes are (width, height)
        im = im.resize((W, H), Image.Resampling.BICUBIC)
    arr = numpy.asarray(im, dtype=numpy.uint8)  # (H, W, 3), or (H, W) for "L"
    return arr[..., None] if arr.ndim == 2 else arr  # (H, W, C)


def _read_split(split_dir, classes, img_size):
    """Images (N, H, W, 3) and labels (N,) of one split; labels index into classes (the train classes)."""
    images, labels = [], []
    for name in _class_folders(split_dir):
        for path in _image_files(os.path.join(split_dir, name)):
            images.append(read_image(path, img_size))  # (H, W, 3)
            labels.append(classes.index(name))
    return numpy.stack(images), numpy.asarray(labels, dtype=numpy.int64)  # (N, H, W, 3), (N,)


def load_image_folder(root, img_size):
    """An image classification set laid out as root/train/<class>/*.png and root/val/<class>/*.jpg.

    root: the folder. img_size: int or (H, W), every image is resized (bicubic) to it.
    Files ending in IMAGE_EXTENSIONS (any case) are read with read_image (IMAGE_FORMATS only) and converted to RGB.
    Classes are the train sub-folders sorted by name; val classes must be among them.
    Returns ((x_train, y_train), (x_val, y_val)), classes: uint8 (N, H, W, 3), int64 (N,), ... and a list.
    """
    root = _check_root(root)
    img_size = _check_img_size(img_size)
    train_dir, val_dir = os.path.join(root, "train"), os.path.join(root, "val")
    classes = _class_folders(train_dir)
    extra = sorted(set(_class_folders(val_dir)) - set(classes))
    if extra:
        raise ValueError(f"{val_dir} has classes that {train_dir} does not: {extra} "
                         f"(train classes: {classes})")
    x_train, y_train = _read_split(train_dir, classes, img_size)
    x_val, y_val = _read_split(val_dir, classes, img_size)
    return ((x_train, y_train), (x_val, y_val)), classes


def resize_images(x, img_size):
    """Resize uint8 images (N, H, W, C) to img_size = (H', W') with Pillow's bicubic filter, one by one.
    Returns uint8 (N, H', W', C); x itself when the size already matches."""
    H, W = _check_img_size(img_size)
    if x.ndim != 4 or x.dtype != numpy.uint8:
        raise ValueError(f"x must be uint8 (N, H, W, C), got {x.dtype} {x.shape}")
    if x.shape[1:3] == (H, W):
        return x
    from PIL import Image

    out = numpy.empty((x.shape[0], H, W, x.shape[3]), dtype=numpy.uint8)  # (N, H', W', C)
    for i in range(x.shape[0]):
        for c in range(x.shape[3]):  # one channel at a time: Pillow's "L" mode works for any C
            im = Image.fromarray(x[i, :, :, c])
            out[i, :, :, c] = numpy.asarray(im.resize((W, H), Image.Resampling.BICUBIC))
    return out


# ---------------------------------------------------------------------------------------------------
# shapes: a procedural 10-class set, drawn with vectorised NumPy (no files)
# ---------------------------------------------------------------------------------------------------

SHAPES_CLASSES = ["circle", "square", "triangle", "ring", "cross", "horizontal bar", "vertical bar",
                  "diamond", "two dots", "L-shape"]
# How hard `shapes` is. Tuned on the "demo" recipe of minivit.train (4 blocks of width 64, patch 4,
# AdamW 2e-3, batch 128, 10000 images per epoch; measured with a PyTorch copy of that model): about 55%
# test accuracy after epoch 1, 80-87% after 2, 89-92% after 4, 92% after 6. The hardest pair is cross
# against L-shape. Students: make it harder (more noise, texture, rotation, smaller shapes) and watch
# how many more epochs it takes.
SHAPES_RADIUS = (0.22, 0.40)  # the shape's size ("radius"), as a fraction of the image side
SHAPES_ROTATION = 0.08  # largest rotation, radians (about 5 degrees)
SHAPES_TEXTURE = 0.25  # strength of the background's sine texture and gradient (0: a flat colour)
SHAPES_NOISE = 8.0  # largest per-image std of the per-pixel noise, in grey levels


def _shape_mask(k, u, v):
    """Boolean mask (n, S, S) of shape class k, in coordinates u (right), v (down) where the shape's
    'radius' is 1. u, v: float (n, S, S), already rotated and scaled per image."""
    au, av = numpy.abs(u), numpy.abs(v)
    if k == 0:  # circle
        return u * u + v * v <= 1.0
    if k == 1:  # square (side 1.6: about the circle's area)
        return numpy.maximum(au, av) <= 0.8
    if k == 2:  # triangle, apex up: 1.8 high, base 2.0 wide
        return (v >= -1.0) & (v <= 0.8) & (au <= (v + 1.0) / 1.8)
    if k == 3:  # ring: a circle with a hole
        r2 = u * u + v * v
        return (r2 <= 1.0) & (r2 >= 0.5 * 0.5)
    if k == 4:  # cross (plus sign)
        return ((au <= 0.2) & (av <= 1.0)) | ((av <= 0.2) & (au <= 1.0))
    if k == 5:  # horizontal bar
        return (au <= 1.0) & (av <= 0.3)
    if k == 6:  # vertical bar
        return (au <= 0.3) & (av <= 1.0)
    if k == 7:  # diamond (a square standing on a corner)
        return au + av <= 1.0
    if k == 8:  # two dots, side by side
        return ((u - 0.6) ** 2 + v * v <= 0.38 ** 2) | ((u + 0.6) ** 2 + v * v <= 0.38 ** 2)
    if k == 9:  # L-shape: a vertical stroke on the left and a horizontal one at the bottom
        return ((u >= -0.9) & (u <= -0.35) & (av <= 1.0)) | ((v >= 0.45) & (v <= 1.0) & (u >= -0.9) & (u <= 0.9))
    raise ValueError(f"shape class must be in 0..9, got {k}")


def _draw_shapes(n, rng, S, chunk=500):
    """n images uint8 (n, S, S, 3) and balanced labels int64 (n,), every random choice taken from rng.
    Drawn chunk images at a time: the temporaries then stay in the CPU cache (about 3x faster)."""
    labels = rng.permutation(numpy.arange(n) % 10).astype(numpy.int64)  # (n,) each class n/10 times
    images = numpy.empty((n, S, S, 3), dtype=numpy.uint8)  # (n, S, S, 3)
    for start in range(0, n, chunk):
        images[start:start + chunk] = _draw_shape_images(labels[start:start + chunk], rng, S)
    return images, labels


def _draw_shape_images(labels, rng, S, fg=None, radius=None, cx=None):
    """One image uint8 (n, S, S, 3) of each label in labels (n,), every random choice taken from rng.
    fg (n, 1, 1, 3) colours, radius (n, 1, 1) and cx (n, 1, 1) in pixels: given (minivit/captions.py
    names them in its captions), they are used instead of drawn."""
    n = labels.shape[0]
    coords = (numpy.arange(S, dtype=numpy.float32) + 0.5)  # pixel centres (S,)
    yy, xx = coords[None, :, None], coords[None, None, :]  # (1, S, 1), (1, 1, S)

    # background: a dark random colour, a gradient and a random sine texture, all per image
    bg = rng.uniform(0, 110, size=(n, 1, 1, 3)).astype(numpy.float32)  # (n, 1, 1, 3)
    angle = rng.uniform(0, 2 * numpy.pi, size=(n, 1, 1)).astype(numpy.float32)
    freq = rng.uniform(0.3, 1.6, size=(n, 1, 1)).astype(numpy.float32)  # radians per pixel
    phase = rng.uniform(0, 2 * numpy.pi, size=(n, 1, 1)).astype(numpy.float32)
    wave = numpy.sin(freq * (numpy.cos(angle) * xx + numpy.sin(angle) * yy) + phase)  # (n, S, S)
    wave_amp = rng.uniform(0, SHAPES_TEXTURE * 45, size=(n, 1, 1, 3)).astype(numpy.float32)  # per channel
    grad_dir = rng.uniform(0, 2 * numpy.pi, size=(n, 1, 1)).astype(numpy.float32)
    grad = (numpy.cos(grad_dir) * (xx - S / 2) + numpy.sin(grad_dir) * (yy - S / 2)) / S  # (n, S, S) in [-.7, .7]
    grad_amp = rng.uniform(-SHAPES_TEXTURE * 60, SHAPES_TEXTURE * 60, size=(n, 1, 1, 3)).astype(numpy.float32)
    img = bg + wave[..., None] * wave_amp + grad[..., None] * grad_amp  # (n, S, S, 3)

    # the shape's colour: random too, but bright. With a random polarity (dark shapes on bright
    # grounds as often as the reverse) the demo ViT needs several times more epochs: before an edge
    # means anything it must first learn to compare each patch with the rest of the image.
    if fg is None:
        fg = rng.uniform(135, 255, size=(n, 1, 1, 3)).astype(numpy.float32)  # (n, 1, 1, 3)

    # geometry: size, position, rotation (small: a square must stay a square, not become a diamond)
    if radius is None:
        radius = rng.uniform(*SHAPES_RADIUS, size=(n, 1, 1)).astype(numpy.float32) * S  # (n, 1, 1) pixels
    if cx is None:
        cx = rng.uniform(0, 1, size=(n, 1, 1)).astype(numpy.float32) * (S - 2 * radius) + radius
    cy = rng.uniform(0, 1, size=(n, 1, 1)).astype(numpy.float32) * (S - 2 * radius) + radius
    theta = rng.uniform(-SHAPES_ROTATION, SHAPES_ROTATION, size=(n, 1, 1)).astype(numpy.float32)  # radians
    dx, dy = (xx - cx) / radius, (yy - cy) / radius  # (n, S, S) each
    u = numpy.cos(theta) * dx + numpy.sin(theta) * dy  # rotate the sampling grid
    v = -numpy.sin(theta) * dx + numpy.cos(theta) * dy  # (n, S, S)

    mask = numpy.zeros((n, S, S), dtype=bool)  # (n, S, S)
    for k in range(10):  # one vectorised draw per class, on the images of that class
        idx = numpy.flatnonzero(labels == k)
        mask[idx] = _shape_mask(k, u[idx], v[idx])

    img = numpy.where(mask[..., None], fg, img)  # (n, S, S, 3)
    noise_level = rng.uniform(0, SHAPES_NOISE, size=(n, 1, 1, 1)).astype(numpy.float32)  # (n, 1, 1, 1) per image
    img = img + noise_level * rng.standard_normal(size=(n, S, S, 3), dtype=numpy.float32)  # (n, S, S, 3)
    return numpy.clip(numpy.rint(img), 0, 255).astype(numpy.uint8)  # (n, S, S, 3)


def make_shapes(num_train=10000, num_test=2000, seed=0, img_size=32):
    """A procedural 10-class RGB data set: the class is the shape (SHAPES_CLASSES), drawn in a random
    bright colour, at a random size, position and small rotation, over a random darker textured
    background, plus pixel noise. Colour, size and position are drawn alike for every class.

    num_train, num_test: image counts (multiples of 10 give exactly balanced classes). seed: an int;
    train and test come from two independent streams spawned from it. img_size: S, images are S x S.
    Returns ((x_train, y_train), (x_test, y_test)): uint8 (num_train, S, S, 3), int64 (num_train,), ...
    """
    for name, value in (("num_train", num_train), ("num_test", num_test), ("seed", seed), ("img_size", img_size)):
        if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_train < 0 or num_test < 0:
        raise ValueError(f"num_train and num_test must be >= 0, got {num_train} and {num_test}")
    if img_size < 8:
        raise ValueError(f"img_size must be at least 8 pixels, got {img_size}")
    train, test = _drawn_shapes(int(num_train), int(num_test), int(seed), int(img_size))
    return tuple(a.copy() for a in train), tuple(a.copy() for a in test)  # the caller may change its copy


@functools.lru_cache(maxsize=2)
def _drawn_shapes(num_train, num_test, seed, img_size):
    """make_shapes' arrays, drawn once per process for each setting (drawing 12,000 images takes seconds;
    the tests and lessons ask for the same set again and again)."""
    train_seq, test_seq = numpy.random.SeedSequence(seed).spawn(2)  # independent streams
    train = _draw_shapes(num_train, numpy.random.default_rng(train_seq), img_size)
    test = _draw_shapes(num_test, numpy.random.default_rng(test_seq), img_size)
    return train, test


# lines: a procedural 4-class set whose class is a relation between neighbouring patches (lesson 9)
LINES_CLASSES = ("rows", "columns", "diagonals", "anti-diagonals")


def _draw_lines(n, rng, grid=8, tile=4, noise=8.0):
    """n images of grid x grid flat tiles of tile x tile pixels: every tile on one line of the class's
    direction (row r, column c, diagonal r - c, anti-diagonal r + c) has that line's random colour, plus
    pixel noise. A tile's colour alone is uniform in every class; a tile and its neighbours tell the class."""
    labels = rng.permutation(numpy.arange(n) % 4)                    # (n,) balanced classes
    r, c = numpy.mgrid[0:grid, 0:grid]                               # (g, g) each
    line = numpy.stack([r, c, r - c + grid, r + c])                  # (4, g, g): which line a tile is on
    colours = rng.uniform(0, 255, size=(n, 2 * grid + 1, 3))         # (n, lines, 3): one colour per line
    tiles = colours[numpy.arange(n)[:, None, None], line[labels]]    # (n, g, g, 3)
    img = numpy.repeat(numpy.repeat(tiles, tile, 1), tile, 2)        # (n, S, S, 3), S = g * tile
    img = img + rng.normal(0, noise, size=img.shape)                 # (n, S, S, 3)
    return numpy.clip(numpy.rint(img), 0, 255).astype(numpy.uint8), labels.astype(numpy.int64)


def make_lines(num_train=10000, num_test=2000, seed=0):
    """The `lines` set of lesson 9's second model: 32 x 32 RGB images, an 8 x 8 grid of 4 x 4 tiles, the
    class the direction along which tiles are equal (LINES_CLASSES). With 4 x 4 patches each patch is one
    tile, so no patch alone says anything: a model must compare a patch with its neighbours.
    Returns a Dataset (mean and std from its training images); train and test from two streams of seed."""
    for name, value in (("num_train", num_train), ("num_test", num_test), ("seed", seed)):
        if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_train < 1 or num_test < 1:
        raise ValueError(f"num_train and num_test must be >= 1, got {num_train} and {num_test}")
    train_seq, test_seq = numpy.random.SeedSequence(int(seed)).spawn(2)  # independent streams
    x_train, y_train = _draw_lines(int(num_train), numpy.random.default_rng(train_seq))
    x_test, y_test = _draw_lines(int(num_test), numpy.random.default_rng(test_seq))
    mean, std = channel_mean_std(x_train)
    return Dataset("lines", x_train, y_train, x_test, y_test, list(LINES_CLASSES), mean, std)


# ---------------------------------------------------------------------------------------------------
# The trainer's entry point
# ---------------------------------------------------------------------------------------------------

DATASETS = ("cifar10", "fashion-mnist", "folder", "shapes")


@dataclass
class Dataset:
    """A loaded data set: host uint8 images in NHWC order, int64 labels, names and normalisation."""

    name: str  # one of DATASETS
    x_train: numpy.ndarray  # uint8 (N, H, W, C)
    y_train: numpy.ndarray  # int64 (N,), values in 0..K-1
    x_test: numpy.ndarray  # uint8 (N_test, H, W, C): the test split (the val split for "folder")
    y_test: numpy.ndarray  # int64 (N_test,)
    classes: list  # K class names, index = label
    mean: tuple  # per channel, in [0, 1] units: normalise as (x / 255 - mean) / std
    std: tuple  # per channel

    @property
    def num_classes(self):
        return len(self.classes)

    @property
    def image_shape(self):
        """(H, W, C) of one image."""
        return tuple(self.x_train.shape[1:])


def channel_mean_std(x):
    """Per-channel mean and std of uint8 images x (N, H, W, C), in [0, 1] units, as two tuples of floats.
    Exact and cheap: computed from each channel's 256-bin histogram, never from a float copy of x."""
    if not isinstance(x, numpy.ndarray) or x.dtype != numpy.uint8 or x.ndim != 4 or x.size == 0:
        raise ValueError(f"x must be a non-empty uint8 array (N, H, W, C), got "
                         f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")
    levels = numpy.arange(256, dtype=numpy.float64) / 255.0  # (256,) pixel value in [0, 1]
    means, stds = [], []
    for c in range(x.shape[3]):
        counts = numpy.bincount(x[..., c].ravel(), minlength=256).astype(numpy.float64)  # (256,)
        p = counts / counts.sum()
        mean = float((p * levels).sum())
        var = float((p * (levels - mean) ** 2).sum())
        means.append(round(mean, 4))
        stds.append(round(var ** 0.5, 4))
    return tuple(means), tuple(stds)


def load_dataset(name, data_dir=None, img_size=None, verify=True):
    """Load a data set by name, with its class names and per-channel mean/std.

    name: "cifar10" (data_dir default "data"), "fashion-mnist" (data_dir default: the Debian folder),
    "folder" (data_dir required: root/train/<class>/, root/val/<class>/), "shapes" (generated).
    img_size: int or (H, W); images are resized to it (default: the set's own size; 32 for folder/shapes).
    verify: check official checksums (cifar10, fashion-mnist).
    Returns a Dataset. Mean/std: the published values for cifar10 and fashion-mnist (at the native size),
    computed from the training images for folder and shapes.
    """
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"unknown data set {name!r}; choose one of {DATASETS}")
    if data_dir is not None:
        data_dir = _check_root(data_dir, "data_dir")
    size = None if img_size is None else _check_img_size(img_size)

    if name == "cifar10":
        root = "data" if data_dir is None else data_dir
        (x_train, y_train), (x_test, y_test) = load_cifar10(root, verify=verify)
        classes, mean, std = list(CIFAR10_CLASSES), CIFAR10_MEAN, CIFAR10_STD
    elif name == "fashion-mnist":
        (x_train, y_train), (x_test, y_test) = load_fashion_mnist(data_dir, verify=verify)
        classes, mean, std = list(FASHION_MNIST_CLASSES), FASHION_MNIST_MEAN, FASHION_MNIST_STD
    elif name == "folder":
        if data_dir is None:
            raise ValueError("the 'folder' data set needs data_dir (a folder with train/<class>/ and val/<class>/)")
        ((x_train, y_train), (x_test, y_test)), classes = load_image_folder(data_dir, size or (32, 32))
        mean, std = channel_mean_std(x_train)
    else:  # shapes
        if size is not None and size[0] != size[1]:
            raise ValueError(f"the 'shapes' data set is square, got img_size {img_size!r}")
        (x_train, y_train), (x_test, y_test) = make_shapes(img_size=32 if size is None else size[0])
        classes = list(SHAPES_CLASSES)
        mean, std = channel_mean_std(x_train)

    if size is not None and name in ("cifar10", "fashion-mnist"):
        x_train, x_test = resize_images(x_train, size), resize_images(x_test, size)
    return Dataset(name, x_train, y_train, x_test, y_test, classes, tuple(mean), tuple(std))
