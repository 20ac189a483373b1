"""The data sets' common room: the Dataset record every reader fills, and the checks the readers share.

A Dataset holds host NumPy arrays: images uint8 (N, H, W, C) in NHWC order, labels int64 (N,), the class
names and the per-channel mean and std that normalise the images.

Glossary: N images, H, W height and width, C channels (3 for RGB, 1 for Fashion-MNIST), K classes.
"""

import hashlib
import os
from dataclasses import dataclass

import numpy


def _check_root(root, what="root"):
    """root as a str path, or a TypeError naming what was passed."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"{what} must be a folder path (str or os.PathLike), got {type(root).__name__}: {root!r}")
    return os.fspath(root)


def _check_md5(raw, name, where, official):
    """Raise a ValueError naming the file when the bytes raw do not have the official MD5 of name."""
    got = hashlib.md5(raw).hexdigest()
    if got != official[name]:
        raise ValueError(
            f"{where}: md5 {got} differs from the official {official[name]}; refusing to read it "
            f"(a damaged or modified file; pass verify=False only for files you made yourself)"
        )


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
