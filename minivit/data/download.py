"""Downloading and unpacking data set files: the one place that touches the network (the data sets' room
for it; ``minivit.download`` is its old name).

Used by ``data_scripts/download_cifar10.py`` and ``data_scripts/download_fashion_mnist.py``.
The rules it keeps:
- a file is written to NAME.part in the destination folder and renamed only once its MD5 matches the
  official value, so a half-written or wrong file never sits under the real name;
- no more than the file's known size is downloaded, and no longer than a deadline;
- a file already present with the right MD5 is not fetched again;
- an archive is unpacked only if every member stays inside the destination folder.
"""

import hashlib
import os
import shutil
import tarfile
import time
import urllib.error
import urllib.request

from tqdm import tqdm

CHUNK = 1 << 20  # read and hash 1 MiB at a time


class NetworkError(OSError):
    """The URL could not be reached (no network, refused, timed out, HTTP error). The message names it."""


def md5_of_file(path):
    """The MD5 hex digest of the file at path, read in chunks (the whole file never sits in memory)."""
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_md5_string(md5):
    if not isinstance(md5, str) or len(md5) != 32 or any(c not in "0123456789abcdef" for c in md5.lower()):
        raise ValueError(f"md5 must be a 32-character hex string, got {md5!r}")


def download_file(url, dest, md5, size=None, timeout=60.0, deadline=3600.0, progress=True):
    """Fetch url into the file dest, keeping it only if its MD5 equals md5.

    url: http(s):// or file:// address. dest: path of the final file (its folder is created).
    md5: the expected hex digest. size: the expected bytes, when known: a server that announces or sends
    more is cut off there (a wrong or endless file never fills the disk). timeout: seconds one read may
    wait; deadline: seconds the whole download may take (a server trickling bytes is given up on).
    The bytes go to dest + ".part", renamed to dest only once the MD5 matches, and removed on any failure.
    Returns dest. Skips the download if dest exists with the right MD5.
    Raises NetworkError when the URL cannot be reached, is too slow or breaks off; ValueError when the
    bytes have another MD5 or exceed size, or the disk has no room for them (nothing is left behind).
    """
    if not isinstance(url, str) or not url:
        raise TypeError(f"url must be a non-empty string, got {url!r}")
    if not isinstance(dest, (str, os.PathLike)):
        raise TypeError(f"dest must be a path (str or os.PathLike), got {type(dest).__name__}")
    _check_md5_string(md5)
    for name, value in (("size", size), ("timeout", timeout), ("deadline", deadline)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name} must be a number > 0 (or None), got {value!r}")
    dest = os.fspath(dest)
    md5 = md5.lower()

    if os.path.isfile(dest) and md5_of_file(dest) == md5:
        print(f"{dest}: already present, md5 verified; nothing to download")
        return dest

    folder = os.path.dirname(os.path.abspath(dest))
    os.makedirs(folder, exist_ok=True)
    part = dest + ".part"    # in the destination folder, so the final rename is atomic; a run killed
    try:                     # with SIGKILL leaves it, and the next run overwrites it
        _fetch(url, part, md5, size, timeout, time.monotonic() + deadline if deadline else None, progress)
        os.replace(part, dest)  # only now does the file appear under its real name
    finally:
        if os.path.exists(part):
            os.remove(part)
    return dest


def _fetch(url, part, md5, size, timeout, give_up_at, progress):
    """download_file's transfer: url's bytes into the file part, checked against size, the deadline and md5."""
    try:
        response = urllib.request.urlopen(url, timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError) as err:
        # URLError covers refused / unknown host / HTTP errors; ValueError an unknown scheme
        raise NetworkError(f"could not open {url}: {getattr(err, 'reason', err)}") from err
    with response:
        total = response.headers.get("Content-Length") if response.headers else None
        total = int(total) if total and total.isdigit() else None
        if size is not None and total is not None and total > size:
            raise ValueError(f"{url}: the server announces {total:,} bytes, and the file is {size:,}: the wrong file "
                             f"(or server); nothing was downloaded")
        needed = total or size or 0
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(part))).free
        if needed > free:
            raise ValueError(f"{url}: {needed:,} bytes to download, and {os.path.dirname(os.path.abspath(part))} has "
                             f"{free:,} bytes free: make room there (or choose another --root)")
        digest, got = hashlib.md5(), 0
        read = getattr(response, "read1", response.read)
        bar = tqdm(total=total or size, unit="B", unit_scale=True, desc=os.path.basename(part)[:-5],
                   disable=not progress)
        with bar, open(part, "wb") as out:
            while True:
                if give_up_at is not None and time.monotonic() > give_up_at:
                    raise NetworkError(f"download of {url} did not finish within its deadline ({got:,} bytes in); "
                                       f"the server is too slow: try again later, or fetch the file by hand")
                try:   # read1: what one receive brings (read would wait for a whole MiB from a trickling server)
                    chunk = read(CHUNK)
                except OSError as err:  # connection dropped or timed out half-way
                    raise NetworkError(f"download of {url} broke off: {err}") from err
                if not chunk:
                    break
                got += len(chunk)
                if size is not None and got > size:
                    raise ValueError(f"{url}: the server sent more than the file's {size:,} bytes: the wrong file "
                                     f"(or server); stopped there and deleted what came")
                try:
                    out.write(chunk)
                except OSError as err:  # the disk filled up after all (another program wrote to it)
                    raise ValueError(f"could not write {part}: {err.strerror or err}; make room in its folder and "
                                     f"run again") from None
                digest.update(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != md5:
        raise ValueError(
            f"{url}: downloaded bytes have md5 {digest.hexdigest()}, expected the official {md5}; "
            f"the file was deleted, nothing was written to {part[:-5]}"
        )


def _is_within(folder, path):
    """True when path (after resolving '..') lies inside folder."""
    folder = os.path.realpath(folder)
    path = os.path.realpath(path)
    return os.path.commonpath([folder, path]) == folder


def safe_extract_tar(archive, dest):
    """Unpack the tar archive (any compression) into the folder dest, refusing unsafe members.

    Refused, with a ValueError naming the member and nothing extracted: absolute paths, paths with '..',
    links (symbolic or hard) and special files (devices, fifos). Only folders and plain files are written.
    Returns the list of member names.
    """
    if not isinstance(archive, (str, os.PathLike)) or not isinstance(dest, (str, os.PathLike)):
        raise TypeError(f"archive and dest must be paths, got {archive!r} and {dest!r}")
    archive, dest = os.fspath(archive), os.fspath(dest)
    if not os.path.isfile(archive):
        raise FileNotFoundError(f"archive not found: {archive}")
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        # check everything first, so a bad member does not leave a half-unpacked folder behind
        for m in members:
            name = m.name
            parts = name.replace("\\", "/").split("/")
            if name.startswith(("/", "\\")) or os.path.isabs(name) or ".." in parts:
                raise ValueError(f"{archive}: refusing member {name!r}: absolute path or '..'")
            if not (m.isfile() or m.isdir()):
                raise ValueError(f"{archive}: refusing member {name!r}: not a plain file or folder (link or device)")
            if not _is_within(dest, os.path.join(dest, name)):
                raise ValueError(f"{archive}: refusing member {name!r}: it would land outside {dest}")
        for m in members:
            target = os.path.join(dest, m.name)
            if m.isdir():
                os.makedirs(target, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            src = tar.extractfile(m)
            with src, open(target, "wb") as out:
                for chunk in iter(lambda: src.read(CHUNK), b""):
                    out.write(chunk)
    return [m.name for m in members]


def no_network_message(url, folder, filenames):
    """The one paragraph printed when a download cannot reach the network: what failed and the manual way."""
    files = ", ".join(filenames)
    return (
        f"Could not download {url}: the network (or that server) is unreachable from this machine. "
        f"To continue without a network, fetch {files} on a computer that has one (from the same "
        f"address), check their MD5 against the values printed below, and copy them by hand into "
        f"{os.path.abspath(folder)}/ ; then run this script again: it verifies them and skips the download."
    )
