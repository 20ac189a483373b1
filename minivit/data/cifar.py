"""CIFAR-10: its official files and checksums, and the reader of its Python pickles.

Security: CIFAR-10 comes as Python pickles, and unpickling runs code chosen by whoever wrote the file.
So only the expected file names are read; with verify=True (the default) a file is unpickled only after
its MD5 equals the official one; and even then the unpickler accepts nothing but NumPy arrays,
lists, bytes and numbers.

Glossary: N images, H, W height and width, C channels.
"""

import codecs
import io
import os
import pickle
import tarfile

import numpy

from .dataset import _check_md5, _check_root

try:  # what pickles use to rebuild an ndarray
    from numpy._core.multiarray import _reconstruct  # NumPy >= 2
    from numpy._core.numeric import _frombuffer
except ImportError:
    from numpy.core.multiarray import _reconstruct  # NumPy 1.x
    from numpy.core.numeric import _frombuffer

# the official files
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
