"""Batch augmentation on the backend's arrays (NumPy on the CPU, CuPy on the GPU): the data sets' room for
what is done to a batch on its way to the model (``minivit.augment`` is its old name).

Every function takes a whole batch x (B, H, W, C) and works on all its images at once: random crops are
gathers with index arrays, erasing is a mask built by broadcasting, RandAugment applies each operation to
the subset of images that drew it. There is no Python loop over the images of a batch.

Random decisions (offsets, flips, which operation, mixing weights) are drawn on the host from a
numpy.random.Generator that the caller passes in (make it with ``minivit.backend.host_rng(seed)``), and
only then moved to x's device. So one seed gives bit-identical batches on NumPy and on CuPy; the pixel
arithmetic itself is elementwise (each step rounded the same way on both) or exact integer work.

This module never imports numpy or cupy at the top: ``xp = get_array_module(x)`` picks the module.

Glossary: B batch, H, W, C image height, width, channels, K classes.
"""

import math

from ..backend import get_array_module

POLICIES = ("none", "standard", "randaug")


def _check_batch(x, what="x"):
    """(B, H, W, C) of a 4-D array, or a ValueError/TypeError naming what came instead."""
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"{what} must be a NumPy or CuPy array (B, H, W, C), got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{what} must have shape (B, H, W, C), got shape {tuple(x.shape)}")
    return x.shape


def _check_rng(rng):
    if not hasattr(rng, "integers") or not hasattr(rng, "random"):
        raise TypeError(f"rng must be a numpy.random.Generator (minivit.backend.host_rng(seed)), got {rng!r}")


def _is_float(x):
    return x.dtype.kind == "f"


# ---------------------------------------------------------------------------------------------------
# normalise, crop, flip, erase
# ---------------------------------------------------------------------------------------------------

def normalize(x, mean, std, dtype="float32"):
    """out = (x / 255 - mean) / std, per channel.

    x: (..., C) pixel values in 0..255 (uint8, or float on that scale). mean, std: C floats in [0, 1]
    units (or one float for all channels). Returns a float array of dtype, same shape, same module as x.
    """
    if not hasattr(x, "dtype"):
        raise TypeError(f"x must be a NumPy or CuPy array, got {type(x).__name__}")
    xp = get_array_module(x)
    mean = tuple(mean) if isinstance(mean, (tuple, list)) else (mean,)
    std = tuple(std) if isinstance(std, (tuple, list)) else (std,)
    C = x.shape[-1] if x.ndim else 0
    if len(mean) not in (1, C) or len(std) not in (1, C):
        raise ValueError(f"mean and std need 1 or C={C} values (x has shape {tuple(x.shape)}), "
                         f"got mean {mean} and std {std}")
    if any(s <= 0 for s in std):
        raise ValueError(f"std must be positive, got {std}")
    if xp.dtype(dtype).kind != "f":
        raise ValueError(f"dtype must be a float type, got {dtype!r}")
    mean = xp.asarray(mean, dtype=dtype)  # (C,)
    std = xp.asarray(std, dtype=dtype)  # (C,)
    scale = xp.asarray(255, dtype=dtype)
    return (x.astype(dtype) / scale - mean) / std  # (..., C)


def random_crop_flip(x, rng, padding=4, flip=True):
    """Pad each image with `padding` zeros on every side, take a random H x W window of it, and mirror
    it left-right with probability 1/2 (if flip).

    x: (B, H, W, C), any dtype. rng: numpy.random.Generator. Returns an array like x (same shape, dtype,
    module). Note: applied after normalize, the zero padding is the data set's mean colour.
    """
    B, H, W, C = _check_batch(x)
    _check_rng(rng)
    if not isinstance(padding, int) or isinstance(padding, bool) or padding < 0:
        raise ValueError(f"padding must be an int >= 0, got {padding!r}")
    xp = get_array_module(x)
    offsets = rng.integers(0, 2 * padding + 1, size=(B, 2))  # (B, 2) top, left of the window, host
    flips = rng.random(B) < 0.5  # (B,) host
    p = padding
    padded = xp.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))  # (B, H+2p, W+2p, C), zeros around
    rows = xp.asarray(offsets[:, 0:1]) + xp.arange(H)  # (B, H) source row of each output row
    cols = xp.asarray(offsets[:, 1:2]) + xp.arange(W)  # (B, W) source column of each output column
    if flip:
        cols = xp.where(xp.asarray(flips)[:, None], cols[:, ::-1], cols)  # (B, W) reversed for flipped images
    batch = xp.arange(B)[:, None, None]  # (B, 1, 1)
    return padded[batch, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C)


def random_erasing(x, rng, p=0.25, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0.0):
    """With probability p per image, fill one random rectangle with value (Zhong et al. 2017).

    The rectangle's area is a fraction uniform in `scale` of H*W, its aspect h/w log-uniform in `ratio`,
    clipped to the image. x: (B, H, W, C). Returns an array like x.
    """
    B, H, W, C = _check_batch(x)
    _check_rng(rng)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    if not (len(scale) == 2 and 0 < scale[0] <= scale[1] <= 1):
        raise ValueError(f"scale must be (lo, hi) with 0 < lo <= hi <= 1, got {scale!r}")
    if not (len(ratio) == 2 and 0 < ratio[0] <= ratio[1]):
        raise ValueError(f"ratio must be (lo, hi) with 0 < lo <= hi, got {ratio!r}")
    xp = get_array_module(x)
    # host: one rectangle per image
    apply = rng.random(B) < p  # (B,)
    area = rng.uniform(scale[0], scale[1], size=B) * H * W  # (B,) pixels
    aspect = ratio[0] * (ratio[1] / ratio[0]) ** rng.random(B)  # (B,) h / w, log-uniform in ratio
    h = (area * aspect) ** 0.5  # (B,) so that h * w = area and h / w = aspect
    w = (area / aspect) ** 0.5  # (B,)
    h = h.round().clip(1, H).astype(int)
    w = w.round().clip(1, W).astype(int)
    top = (rng.random(B) * (H - h + 1)).astype(int)  # (B,) in 0..H-h
    left = (rng.random(B) * (W - w + 1)).astype(int)  # (B,) in 0..W-w
    # device: the mask by broadcasting
    r = xp.arange(H)[None, :]  # (1, H)
    c = xp.arange(W)[None, :]  # (1, W)
    top, h, left, w = (xp.asarray(a)[:, None] for a in (top, h, left, w))  # (B, 1) each
    in_rows = (r >= top) & (r < top + h)  # (B, H)
    in_cols = (c >= left) & (c < left + w)  # (B, W)
    mask = in_rows[:, :, None] & in_cols[:, None, :] & xp.asarray(apply)[:, None, None]  # (B, H, W)
    return xp.where(mask[..., None], xp.asarray(value, dtype=x.dtype), x)  # (B, H, W, C)


# ---------------------------------------------------------------------------------------------------
# mixup, cutmix: mix pairs of images and their targets
# ---------------------------------------------------------------------------------------------------

def _soft_targets(y, num_classes, xp, dtype):
    """Targets (B, K) in dtype from labels (B,) (one-hot) or from soft targets already (B, K)."""
    y = xp.asarray(y)
    if y.ndim == 1:
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise ValueError(f"integer labels need num_classes (an int >= 1), got {num_classes!r}")
        if y.dtype.kind not in "iu":
            raise TypeError(f"labels (B,) must be integers, got {y.dtype}")
        return xp.eye(num_classes, dtype=dtype)[y]  # (B, K)
    if y.ndim == 2:
        if num_classes is not None and y.shape[1] != num_classes:
            raise ValueError(f"targets have {y.shape[1]} classes, num_classes says {num_classes}")
        return y.astype(dtype)  # (B, K)
    raise ValueError(f"y must be labels (B,) or soft targets (B, K), got shape {tuple(y.shape)}")


def _check_alpha(alpha):
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"alpha must be a number > 0 (the Beta(alpha, alpha) parameter), got {alpha!r}")


def mixup(x, y, rng, alpha, num_classes=None):
    """mixup (Zhang et al. 2018): x' = lam * x + (1 - lam) * x[perm], the same for the targets,
    with one lam ~ Beta(alpha, alpha) for the batch and perm a random pairing of its images.

    x: float (B, H, W, C). y: int labels (B,) with num_classes, or soft targets (B, K).
    Returns (x_mixed (B, H, W, C), targets (B, K)), both of x's float dtype.
    """
    B = _check_batch(x)[0]
    _check_rng(rng)
    _check_alpha(alpha)
    if not _is_float(x):
        raise TypeError(f"mixup needs float images (normalise first), got {x.dtype}")
    xp = get_array_module(x)
    targets = _soft_targets(y, num_classes, xp, x.dtype)  # (B, K)
    if targets.shape[0] != B:
        raise ValueError(f"{B} images but {targets.shape[0]} targets")
    lam = float(rng.beta(alpha, alpha))
    perm = xp.asarray(rng.permutation(B))  # (B,)
    lam_x = xp.asarray(lam, dtype=x.dtype)  # a 0-d array: the arithmetic stays in x's dtype
    x_mixed = lam_x * x + (1 - lam_x) * x[perm]  # (B, H, W, C)
    y_mixed = lam_x * targets + (1 - lam_x) * targets[perm]  # (B, K)
    return x_mixed, y_mixed


def cutmix(x, y, rng, alpha, num_classes=None):
    """CutMix (Yun et al. 2019): paste a random box of x[perm] into x; targets mix by the pasted area.

    lam ~ Beta(alpha, alpha); the box has sides H*sqrt(1-lam), W*sqrt(1-lam) around a random centre,
    clipped to the image, the same box for the whole batch; targets = a * y + (1 - a) * y[perm] with
    a = 1 - box area / (H*W). x: (B, H, W, C) any dtype. y: int labels (B,) with num_classes, or (B, K).
    Returns (x_mixed like x, targets (B, K) float: x's dtype if float, else float32).
    """
    B, H, W, C = _check_batch(x)
    _check_rng(rng)
    _check_alpha(alpha)
    xp = get_array_module(x)
    tdtype = x.dtype if _is_float(x) else "float32"
    targets = _soft_targets(y, num_classes, xp, tdtype)  # (B, K)
    if targets.shape[0] != B:
        raise ValueError(f"{B} images but {targets.shape[0]} targets")
    lam = float(rng.beta(alpha, alpha))
    cut_h, cut_w = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
    cy, cx = int(rng.integers(H)), int(rng.integers(W))  # the box's centre
    y0, y1 = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, H)
    x0, x1 = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, W)
    perm = xp.asarray(rng.permutation(B))  # (B,)
    x_mixed = x.copy()  # (B, H, W, C)
    x_mixed[:, y0:y1, x0:x1, :] = x[perm, y0:y1, x0:x1, :]
    a = xp.asarray(1.0 - (y1 - y0) * (x1 - x0) / (H * W), dtype=tdtype)  # the share of the original image
    y_mixed = a * targets + (1 - a) * targets[perm]  # (B, K)
    return x_mixed, y_mixed


# ---------------------------------------------------------------------------------------------------
# RandAugment (Cubuk et al. 2020): num_ops random operations per image at one global magnitude
# ---------------------------------------------------------------------------------------------------
# Each operation takes a batch v (b, H, W, C) of whole numbers 0..255 held as float32, the magnitude
# m in 0..10 (as a fraction m/10 of each op's largest strength) and the rng for per-image choices
# (a random sign, a position), and returns the same kind of batch: every op ends by rounding to whole
# levels and clipping to 0..255. Working on whole numbers keeps sums (image means) exact, so NumPy and
# CuPy agree bit for bit.

def _finish(v):
    xp = get_array_module(v)
    return xp.clip(xp.rint(v), 0, 255)


def _signs(rng, b, xp):
    """+1 or -1 per image, (b, 1, 1, 1) float32 on xp's device."""
    return xp.asarray((rng.integers(0, 2, size=(b, 1, 1, 1)) * 2 - 1).astype("float32"))


def _grey(v):
    """Luma (b, H, W, 1) by ITU-R 601 weights in integer arithmetic, as Pillow does: (299R+587G+114B)/1000."""
    xp = get_array_module(v)
    if v.shape[-1] == 1:
        return v
    q = v.astype(xp.int32)  # (b, H, W, 3) whole numbers
    return ((q[..., 0:1] * 299 + q[..., 1:2] * 587 + q[..., 2:3] * 114 + 500) // 1000).astype(v.dtype)


def _op_identity(v, m, rng):
    return v


def _op_brightness(v, m, rng):
    """v * (1 +- 0.9 m/10): brighter or darker."""
    xp = get_array_module(v)
    factor = 1 + _signs(rng, v.shape[0], xp) * xp.asarray(0.09 * m, dtype=v.dtype)  # (b, 1, 1, 1)
    return _finish(v * factor)


def _op_color(v, m, rng):
    """Blend with the grey image: grey + f * (v - grey), f = 1 +- 0.9 m/10 (saturation)."""
    xp = get_array_module(v)
    factor = 1 + _signs(rng, v.shape[0], xp) * xp.asarray(0.09 * m, dtype=v.dtype)  # (b, 1, 1, 1)
    grey = _grey(v)  # (b, H, W, 1)
    return _finish(grey + factor * (v - grey))


def _op_contrast(v, m, rng):
    """Blend with the image's mean grey level: mu + f * (v - mu), f = 1 +- 0.9 m/10."""
    xp = get_array_module(v)
    b, H, W, _ = v.shape
    factor = 1 + _signs(rng, b, xp) * xp.asarray(0.09 * m, dtype=v.dtype)  # (b, 1, 1, 1)
    grey_sum = _grey(v).astype(xp.int64).sum(axis=(1, 2, 3), keepdims=True)  # (b, 1, 1, 1) exact
    mu = xp.rint(grey_sum / (H * W)).astype(v.dtype)  # (b, 1, 1, 1) a whole level, as Pillow
    return _finish(mu + factor * (v - mu))


def _op_solarize(v, m, rng):
    """Invert the pixels at or above a threshold 256 - 256 m/10 (m = 0: nothing changes)."""
    xp = get_array_module(v)
    threshold = 256 - int(round(25.6 * m))
    return xp.where(v >= threshold, 255 - v, v)


def _op_posterize(v, m, rng):
    """Keep the top 8 - round(4 m/10) bits of each level."""
    xp = get_array_module(v)
    bits = 8 - int(round(0.4 * m))
    step = 2 ** (8 - bits)
    return xp.floor(v / step) * step


def _op_autocontrast(v, m, rng):
    """Stretch each channel of each image to 0..255 (channels that are flat stay as they are)."""
    xp = get_array_module(v)
    lo = v.min(axis=(1, 2), keepdims=True)  # (b, 1, 1, C)
    hi = v.max(axis=(1, 2), keepdims=True)  # (b, 1, 1, C)
    span = xp.where(hi > lo, hi - lo, 1)
    stretched = (v - lo) * (255 / span)  # (b, H, W, C)
    return _finish(xp.where(hi > lo, stretched, v))


def _shift_gather(v, rows, cols):
    """out[i, r, c] = v[i, rows[i, r, c], cols[i, r, c]], zero where the source lies outside the image.
    rows, cols: int (b, H, W) on v's device."""
    xp = get_array_module(v)
    b, H, W, _ = v.shape
    inside = (rows >= 0) & (rows < H) & (cols >= 0) & (cols < W)  # (b, H, W)
    batch = xp.arange(b)[:, None, None]  # (b, 1, 1)
    out = v[batch, xp.clip(rows, 0, H - 1), xp.clip(cols, 0, W - 1)]  # (b, H, W, C)
    return xp.where(inside[..., None], out, 0)


def _op_translate(v, m, rng, axis):
    """Shift by +- 0.3 m/10 of the image size along axis (1 rows = y, 2 columns = x), zeros come in."""
    xp = get_array_module(v)
    b, H, W, _ = v.shape
    size = H if axis == 1 else W
    shift = int(round(0.03 * m * size)) * (rng.integers(0, 2, size=b) * 2 - 1)  # (b,) host, whole pixels
    shift = xp.asarray(shift)[:, None, None]  # (b, 1, 1)
    rows = xp.broadcast_to(xp.arange(H)[None, :, None], (b, H, W))  # (b, H, W)
    cols = xp.broadcast_to(xp.arange(W)[None, None, :], (b, H, W))  # (b, H, W)
    if axis == 1:
        rows = rows - shift
    else:
        cols = cols - shift
    return _shift_gather(v, rows, cols)


def _op_shear(v, m, rng, axis):
    """Shear by +- 0.3 m/10 about the centre: x-shear moves row r sideways by s (r - H/2) pixels
    (nearest pixel), y-shear moves column c up or down likewise."""
    xp = get_array_module(v)
    b, H, W, _ = v.shape
    s = 0.03 * m * (rng.integers(0, 2, size=b) * 2 - 1)  # (b,) host
    s = xp.asarray(s, dtype=xp.float32)[:, None, None]  # (b, 1, 1)
    r = xp.arange(H)[None, :, None]  # (1, H, 1)
    c = xp.arange(W)[None, None, :]  # (1, 1, W)
    rows = xp.broadcast_to(r, (b, H, W))
    cols = xp.broadcast_to(c, (b, H, W))
    if axis == 2:  # x-shear
        offset = xp.rint(s * xp.asarray(r - (H - 1) / 2, dtype=xp.float32)).astype(xp.int64)  # (b, H, 1)
        cols = cols - offset
    else:  # y-shear
        offset = xp.rint(s * xp.asarray(c - (W - 1) / 2, dtype=xp.float32)).astype(xp.int64)  # (b, 1, W)
        rows = rows - offset
    return _shift_gather(v, rows, cols)


def _op_cutout(v, m, rng):
    """Fill a square of side 0.4 m/10 of the image, at a random centre, with grey 128."""
    xp = get_array_module(v)
    b, H, W, _ = v.shape
    side = int(round(0.04 * m * min(H, W)))
    cy = xp.asarray(rng.integers(0, H, size=b))[:, None]  # (b, 1)
    cx = xp.asarray(rng.integers(0, W, size=b))[:, None]  # (b, 1)
    in_rows = xp.abs(xp.arange(H)[None, :] - cy) * 2 < side  # (b, H)
    in_cols = xp.abs(xp.arange(W)[None, :] - cx) * 2 < side  # (b, W)
    mask = in_rows[:, :, None] & in_cols[:, None, :]  # (b, H, W)
    return xp.where(mask[..., None], xp.asarray(128, dtype=v.dtype), v)


RAND_AUGMENT_OPS = [  # (name, function(v, m, rng)); an image draws num_ops of these, with repetition
    ("identity", _op_identity),
    ("autocontrast", _op_autocontrast),
    ("brightness", _op_brightness),
    ("color", _op_color),
    ("contrast", _op_contrast),
    ("solarize", _op_solarize),
    ("posterize", _op_posterize),
    ("translate_x", lambda v, m, rng: _op_translate(v, m, rng, axis=2)),
    ("translate_y", lambda v, m, rng: _op_translate(v, m, rng, axis=1)),
    ("shear_x", lambda v, m, rng: _op_shear(v, m, rng, axis=2)),
    ("shear_y", lambda v, m, rng: _op_shear(v, m, rng, axis=1)),
    ("cutout", _op_cutout),
]


def rand_augment(x, rng, num_ops=2, magnitude=9):
    """RandAugment: each image gets num_ops operations drawn at random from RAND_AUGMENT_OPS, all at
    strength magnitude/10 of their maximum. Vectorised per operation: each op runs once per round, on
    the subset of images that drew it.

    x: (B, H, W, C) pixel levels 0..255, uint8 or float (a float input is rounded to whole levels).
    rng: numpy.random.Generator. num_ops: int >= 0. magnitude: 0..10.
    Returns an array of x's shape, dtype and module.
    """
    B, H, W, C = _check_batch(x)
    _check_rng(rng)
    if not isinstance(num_ops, int) or isinstance(num_ops, bool) or num_ops < 0:
        raise ValueError(f"num_ops must be an int >= 0, got {num_ops!r}")
    if isinstance(magnitude, bool) or not isinstance(magnitude, (int, float)) or not 0 <= magnitude <= 10:
        raise ValueError(f"magnitude must be a number in 0..10, got {magnitude!r}")
    if C not in (1, 3):
        raise ValueError(f"rand_augment needs 1 or 3 channels, got C={C}")
    xp = get_array_module(x)
    v = xp.clip(xp.rint(x.astype(xp.float32)), 0, 255)  # (B, H, W, C) whole levels as float32
    for _ in range(num_ops):
        choice = rng.integers(0, len(RAND_AUGMENT_OPS), size=B)  # (B,) host: the op of each image
        for k, (name, op) in enumerate(RAND_AUGMENT_OPS):
            idx = (choice == k).nonzero()[0]  # host indices of the images that drew op k
            if idx.size == 0 or name == "identity":
                continue
            idx = xp.asarray(idx)
            v[idx] = op(v[idx], magnitude, rng)  # (b, H, W, C)
    return v.astype(x.dtype)


# ---------------------------------------------------------------------------------------------------
# The training pipeline and the batch order
# ---------------------------------------------------------------------------------------------------

def augment_batch(x, rng, policy, mean, std, dtype="float32"):
    """uint8 batch -> (randaug: rand_augment) -> normalize -> (standard, randaug: random crop 4 px + flip).

    x: uint8 (B, H, W, C). rng: numpy.random.Generator. policy: "none" (normalise only), "standard"
    (crop with 4 px padding + horizontal flip), "randaug" (RandAugment 2 ops at magnitude 9, then as
    standard). mean, std: per-channel, [0, 1] units. Returns float (B, H, W, C) of dtype, on x's device.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown augmentation policy {policy!r}; choose one of {POLICIES}")
    _check_batch(x)
    if policy != "none":
        _check_rng(rng)
    if policy == "randaug":
        x = rand_augment(x, rng, num_ops=2, magnitude=9)  # (B, H, W, C) still 0..255
    out = normalize(x, mean, std, dtype)  # (B, H, W, C) float
    if policy in ("standard", "randaug"):
        out = random_crop_flip(out, rng, padding=4, flip=True)  # (B, H, W, C)
    return out


def iterate_batches(num_items, batch_size, rng=None, shuffle=True, drop_last=False):
    """Yield host index arrays int64 (batch_size,) covering range(num_items) once (an epoch).

    shuffle: a random order drawn from rng (a numpy.random.Generator; required then), else 0, 1, 2, ...
    drop_last: skip the last batch if it is smaller than batch_size.
    """
    import numpy  # host indices; imported here so that the top of this module stays backend-neutral

    for name, value in (("num_items", num_items), ("batch_size", batch_size)):
        if not isinstance(value, (int, numpy.integer)) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_items < 0 or batch_size < 1:
        raise ValueError(f"need num_items >= 0 and batch_size >= 1, got {num_items} and {batch_size}")
    if shuffle:
        _check_rng(rng)
        order = rng.permutation(num_items)  # (num_items,)
    else:
        order = numpy.arange(num_items)  # (num_items,)
    stop = num_items - num_items % batch_size if drop_last else num_items
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size]
