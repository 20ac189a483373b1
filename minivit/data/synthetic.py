"""Data sets drawn by the program, no files: `shapes` (10 shapes over textured grounds) and `lines`
(lesson 9: the class is a relation between neighbouring patches). Vectorised NumPy, seeded.

Glossary: N images, S image side, C channels (3), K classes.
"""

import functools

import numpy

from .dataset import Dataset, channel_mean_std

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
    fg (n, 1, 1, 3) colours, radius (n, 1, 1) and cx (n, 1, 1) in pixels: given (minivit/clip/captions.py
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
