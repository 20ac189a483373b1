"""Download the four Fashion-MNIST files (30 MiB) into ROOT/fashion-mnist/.

    python data_scripts/download_fashion_mnist.py --root data/

Each file is saved to NAME.part (no more than its official size) and renamed only when its MD5 is the
official one (the values the Fashion-MNIST README publishes for the .gz files). Files already there and
verified are skipped.
On Debian/Ubuntu, `apt-get install dataset-fashion-mnist` installs the same data without this script.
Then: load_dataset("fashion-mnist", data_dir="data/").
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from minivit.data import FASHION_MNIST_GZ_MD5, FASHION_MNIST_GZ_SIZE, FASHION_MNIST_URL  # noqa: E402
from minivit.download import NetworkError, download_file, no_network_message  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="data/", help="the files go to ROOT/fashion-mnist/ (default data/)")
    parser.add_argument("--base-url", default=FASHION_MNIST_URL,
                        help="folder URL the four .gz files are fetched from (default the official one)")
    args = parser.parse_args(argv)

    folder = os.path.join(args.root, "fashion-mnist")
    base = args.base_url if args.base_url.endswith("/") else args.base_url + "/"
    for name, md5 in FASHION_MNIST_GZ_MD5.items():
        try:
            download_file(base + name, os.path.join(folder, name), md5, size=FASHION_MNIST_GZ_SIZE[name])
        except NetworkError as err:
            print(no_network_message(base + name, folder, list(FASHION_MNIST_GZ_MD5)))
            for n, m in FASHION_MNIST_GZ_MD5.items():
                print(f"  {n}  md5 {m}")
            print("Or, on Debian/Ubuntu: `apt-get install dataset-fashion-mnist` puts the same files into "
                  "/usr/share/datasets/fashion-mnist, where load_dataset('fashion-mnist') finds them by itself.")
            print(f"(the error was: {err})")
            return 1
        except ValueError as err:
            print(f"error: {err}")
            return 1
    print(f"done: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
