"""Data sets: readers for CIFAR-10, Fashion-MNIST and image folders, and procedural sets drawn by the program.

Every reader returns host NumPy arrays: images uint8 (N, H, W, C) in NHWC order, labels int64 (N,).
The trainer moves batches to the backend later (``minivit.backend.asarray``). ``load_dataset(name)``
is the one entry point the trainer uses; it also gives each set's per-channel mean and std.

The rooms:
    dataset.py        the Dataset record, channel_mean_std, the checks every reader shares
    cifar.py          CIFAR-10: official files and MD5s, a pickle reader that builds only arrays
    fashion_mnist.py  Fashion-MNIST: IDX files, gzip or not, MD5-checked
    folders.py        read_image, image folders (train/<class>/, val/<class>/), resize_images
    synthetic.py      `shapes` and `lines`, drawn with NumPy: no files
    augment.py        batch augmentation on the backend's arrays (minivit.data.augment)
    download.py       fetching and unpacking the files: the one place that touches the network
Every public name of the readers is here too: ``from minivit.data import load_dataset, make_shapes``.

Glossary: N images, H, W height and width, C channels (3 for RGB, 1 for Fashion-MNIST), K classes.
"""

from .cifar import (CIFAR10_ARCHIVE, CIFAR10_ARCHIVE_SIZE, CIFAR10_CLASSES, CIFAR10_FOLDER, CIFAR10_MAX_BYTES,
                    CIFAR10_MD5, CIFAR10_MEAN, CIFAR10_META_FILE, CIFAR10_STD, CIFAR10_TEST_FILE, CIFAR10_TRAIN_FILES,
                    CIFAR10_URL, load_cifar10, load_cifar10_classes)
from .dataset import Dataset, _check_root, channel_mean_std
from .fashion_mnist import (FASHION_MNIST_CLASSES, FASHION_MNIST_DIRS, FASHION_MNIST_FILES, FASHION_MNIST_GZ_MD5,
                            FASHION_MNIST_GZ_SIZE, FASHION_MNIST_MD5, FASHION_MNIST_MEAN, FASHION_MNIST_STD,
                            FASHION_MNIST_URL, IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, load_fashion_mnist)
from .folders import IMAGE_EXTENSIONS, IMAGE_FORMATS, _check_img_size, load_image_folder, read_image, resize_images
from .synthetic import (LINES_CLASSES, SHAPES_CLASSES, SHAPES_NOISE, SHAPES_RADIUS, SHAPES_ROTATION, SHAPES_TEXTURE,
                        make_lines, make_shapes)

__all__ = ["CIFAR10_ARCHIVE", "CIFAR10_ARCHIVE_SIZE", "CIFAR10_CLASSES", "CIFAR10_FOLDER", "CIFAR10_MAX_BYTES",
           "CIFAR10_MD5", "CIFAR10_MEAN", "CIFAR10_META_FILE", "CIFAR10_STD", "CIFAR10_TEST_FILE",
           "CIFAR10_TRAIN_FILES", "CIFAR10_URL", "load_cifar10", "load_cifar10_classes", "Dataset",
           "channel_mean_std", "FASHION_MNIST_CLASSES", "FASHION_MNIST_DIRS", "FASHION_MNIST_FILES",
           "FASHION_MNIST_GZ_MD5", "FASHION_MNIST_GZ_SIZE", "FASHION_MNIST_MD5", "FASHION_MNIST_MEAN",
           "FASHION_MNIST_STD", "FASHION_MNIST_URL", "IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "load_fashion_mnist",
           "IMAGE_EXTENSIONS", "IMAGE_FORMATS", "load_image_folder", "read_image", "resize_images", "LINES_CLASSES",
           "SHAPES_CLASSES", "SHAPES_NOISE", "SHAPES_RADIUS", "SHAPES_ROTATION", "SHAPES_TEXTURE", "make_lines",
           "make_shapes", "DATASETS", "load_dataset"]

# ---------------------------------------------------------------------------------------------------
# The trainer's entry point
# ---------------------------------------------------------------------------------------------------

DATASETS = ("cifar10", "fashion-mnist", "folder", "shapes")


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
