"""Downloading and unpacking data set files: the one place that touches the network.

Used by ``data_scripts/download_cifar10.py`` and ``data_scripts/download_fashion_mnist.py``.
The rules it keeps:
- a file is written under a temporary name in the destination folder and renamed only once its MD5
  matches the official value, so a half-written or wrong file never sits under the real name;
- a file already present with the right MD5 is not fetched again;
- an archive is unpacked only if every member stays inside the destination folder.
"""

import hashlib
import os
import tarfile
import tempfile
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


def download_file(url, dest, md5, timeout=60.0, progress=True):
    """Fetch url into the file dest, keeping it only if its MD5 equals md5.

    url: http(s):// or file:// address. dest: path of the final file (its folder is created).
    md5: the expected hex digest. Returns dest. Skips the download if dest exists with the right MD5.
    Raises NetworkError when the URL cannot be reached, ValueError when the bytes have another MD5
    (then nothing is left behind: neither dest nor the temporary file).
    """
    if not isinstance(url, str) or not url:
        raise TypeError(f"url must be a non-empty string, got {url!r}")
    if not isinstance(dest, (str, os.PathLike)):
        raise TypeError(f"dest must be a path (str or os.PathLike), got {type(dest).__name__}")
    _check_md5_string(md5)
    dest = os.fspath(dest)
    md5 = md5.lower()

    if os.path.isfile(dest) and md5_of_file(dest) == md5:
        print(f"{dest}: already present, md5 verified; nothing to download")
        return dest

    folder = os.path.dirname(os.path.abspath(dest))
    os.makedirs(folder, exist_ok=True)
    # the temporary file lives in the destination folder, so the final rename is atomic
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(dest) + ".", suffix=".part", dir=folder)
    try:
        digest = hashlib.md5()
        with os.fdopen(fd, "wb") as out:
            try:
                response = urllib.request.urlopen(url, timeout=timeout)
            except (urllib.error.URLError, OSError, ValueError) as err:
                # URLError covers refused / unknown host / HTTP errors; ValueError an unknown scheme
                raise NetworkError(f"could not open {url}: {getattr(err, 'reason', err)}") from err
            with response:
                total = response.headers.get("Content-Length") if response.headers else None
                total = int(total) if total and total.isdigit() else None
                bar = tqdm(total=total, unit="B", unit_scale=True, desc=os.path.basename(dest), disable=not progress)
                with bar:
                    while True:
                        try:
                            chunk = response.read(CHUNK)
                        except OSError as err:  # connection dropped or timed out half-way
                            raise NetworkError(f"download of {url} broke off: {err}") from err
                        if not chunk:
                            break
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        got = digest.hexdigest()
        if got != md5:
            raise ValueError(
                f"{url}: downloaded bytes have md5 {got}, expected the official {md5}; "
                f"the file was deleted, nothing was written to {dest}"
            )
        os.replace(tmp, dest)  # only now does the file appear under its real name
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dest


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
