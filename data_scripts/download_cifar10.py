"""Download CIFAR-10 (the python version, 163 MiB) into ROOT and unpack it to ROOT/cifar-10-batches-py/.

    python data_scripts/download_cifar10.py --root data/

The archive is saved to ROOT/cifar-10-python.tar.gz.part (no more than its official size, within an
hour), renamed only when its MD5 is the official one, then unpacked (refusing members with absolute
paths or '..'). Run it again and it only checks what is there.
Without a network: put cifar-10-python.tar.gz into ROOT/ by hand and run it again.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from minivit.data import CIFAR10_ARCHIVE, CIFAR10_ARCHIVE_SIZE, CIFAR10_FOLDER, CIFAR10_MD5, CIFAR10_URL  # noqa: E402
from minivit.download import NetworkError, download_file, md5_of_file, no_network_message, safe_extract_tar  # noqa: E402


def batches_verified(folder):
    """True when every batch file in folder is present with its official MD5."""
    names = [n for n in CIFAR10_MD5 if n != CIFAR10_ARCHIVE]
    return all(os.path.isfile(os.path.join(folder, n)) and md5_of_file(os.path.join(folder, n)) == CIFAR10_MD5[n]
               for n in names)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="data/",
                        help="folder for the archive and the extracted batches (default data/)")
    parser.add_argument("--url", default=CIFAR10_URL,
                        help="where to fetch the archive (a mirror; default the official page)")
    parser.add_argument("--md5", default=CIFAR10_MD5[CIFAR10_ARCHIVE],
                        help="expected MD5 of the archive (default the official one; "
                             "change it only for a mirror you trust)")
    args = parser.parse_args(argv)

    root = args.root
    folder = os.path.join(root, CIFAR10_FOLDER)
    archive = os.path.join(root, CIFAR10_ARCHIVE)
    if args.md5 == CIFAR10_MD5[CIFAR10_ARCHIVE] and batches_verified(folder):
        print(f"{folder}: all batch files present with their official MD5; nothing to do")
        return 0
    try:
        # skipped when the archive is already there and verified; a mirror's own archive may differ in size
        official = args.md5 == CIFAR10_MD5[CIFAR10_ARCHIVE]
        download_file(args.url, archive, args.md5, size=CIFAR10_ARCHIVE_SIZE if official else None)
    except NetworkError as err:
        print(no_network_message(args.url, root, [CIFAR10_ARCHIVE]))
        print(f"  {CIFAR10_ARCHIVE}  md5 {args.md5}")
        print(f"(the error was: {err})")
        return 1
    except ValueError as err:
        print(f"error: {err}")
        return 1
    print(f"unpacking {archive} into {root}")
    try:
        safe_extract_tar(archive, root)
    except ValueError as err:
        print(f"error: {err}")
        return 1
    print(f"done: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
