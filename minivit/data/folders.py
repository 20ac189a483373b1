"""Images from files: read_image (the one reader of the folder data set and of predict), an image
folder laid out as torchvision's ImageFolder, and resize_images. Pillow is imported only when called.

Glossary: N images, H, W height and width, C channels.
"""

import os
import re
import stat

import numpy

from .dataset import _check_root

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
