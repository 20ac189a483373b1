"""Tests of minivit.augment: exact results on tiny hand-made arrays, shapes and dtypes kept, seeds.

With CuPy and a GPU present, the same seed must give bit-identical batches on both backends
(marked gpu; skipped otherwise).
"""

import numpy as np
import pytest

from minivit import backend
from minivit.augment import (
    POLICIES, RAND_AUGMENT_OPS, augment_batch, cutmix, iterate_batches, mixup, normalize, rand_augment,
    random_crop_flip, random_erasing,
)
from minivit.backend import host_rng

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _images(B=6, H=8, W=8, C=3, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(B, H, W, C), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------
# normalize
# ---------------------------------------------------------------------------------------------------

def test_normalize_values():
    x = np.array([[[[0, 255, 51]]]], dtype=np.uint8)  # (1, 1, 1, 3)
    out = normalize(x, MEAN, STD)
    assert out.dtype == np.float32 and out.shape == (1, 1, 1, 3)
    expected = [(0 - 0.5) / 0.2, (1 - 0.4) / 0.25, (0.2 - 0.3) / 0.3]
    np.testing.assert_allclose(out[0, 0, 0], expected, rtol=1e-6)
    assert normalize(x, MEAN, STD, dtype="float64").dtype == np.float64


def test_normalize_one_channel_and_scalar_stats():
    x = np.full((2, 3, 3, 1), 255, dtype=np.uint8)
    np.testing.assert_allclose(normalize(x, (0.2860,), (0.3530,)), (1 - 0.2860) / 0.3530, rtol=1e-6)
    np.testing.assert_allclose(normalize(x, 0.5, 0.5), 1.0)


def test_normalize_bad_arguments():
    x = _images()
    with pytest.raises(ValueError, match="mean and std"):
        normalize(x, (0.5, 0.5), STD)
    with pytest.raises(ValueError, match="std must be positive"):
        normalize(x, MEAN, (0.2, 0.0, 0.3))
    with pytest.raises(ValueError, match="float"):
        normalize(x, MEAN, STD, dtype="int32")
    with pytest.raises(TypeError, match="array"):
        normalize([1, 2, 3], MEAN, STD)


# ---------------------------------------------------------------------------------------------------
# random_crop_flip
# ---------------------------------------------------------------------------------------------------

class FixedRng:
    """A stand-in Generator whose integers() and random() return given arrays: known crops and flips."""

    def __init__(self, offsets, flip_draws):
        self.offsets, self.flip_draws = np.asarray(offsets), np.asarray(flip_draws, dtype=float)

    def integers(self, low, high, size):
        assert self.offsets.shape == size and self.offsets.min() >= low and self.offsets.max() < high
        return self.offsets

    def random(self, size):
        return self.flip_draws


def test_crop_with_known_offset_gives_known_window():
    x = np.arange(2 * 4 * 5 * 1, dtype=np.float32).reshape(2, 4, 5, 1)  # (B, H, W, C)
    padding = 2
    rng = FixedRng(offsets=[[0, 0], [3, 1]], flip_draws=[0.9, 0.9])  # 0.9 >= 0.5: no flip
    out = random_crop_flip(x, rng, padding=padding)
    padded = np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)))
    np.testing.assert_array_equal(out[0], padded[0, 0:4, 0:5])  # window at the top-left corner
    np.testing.assert_array_equal(out[1], padded[1, 3:7, 1:6])
    # image 1, window (3, 1): output row 0 is input row 1, output column 1 is input column 0
    assert out[1, 0, 1, 0] == x[1, 1, 0, 0]
    assert out[0, 0, 0, 0] == 0 and out[0, 2, 2, 0] == x[0, 0, 0, 0]


def test_centre_crop_is_identity_and_flip_reverses_columns():
    x = np.arange(3 * 4 * 6 * 2, dtype=np.int32).reshape(3, 4, 6, 2)
    rng = FixedRng(offsets=[[4, 4]] * 3, flip_draws=[0.1, 0.7, 0.2])  # < 0.5: flipped
    out = random_crop_flip(x, rng, padding=4)
    np.testing.assert_array_equal(out[1], x[1])  # offset = padding: the original image
    np.testing.assert_array_equal(out[0], x[0, :, ::-1])
    np.testing.assert_array_equal(out[2], x[2, :, ::-1])
    assert out.dtype == x.dtype


def test_crop_flip_keeps_shape_dtype_and_is_seeded():
    x = normalize(_images(B=16), MEAN, STD)
    a = random_crop_flip(x, host_rng(1))
    b = random_crop_flip(x, host_rng(1))
    assert a.shape == x.shape and a.dtype == x.dtype
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, random_crop_flip(x, host_rng(2)))


def test_images_in_a_batch_get_different_crops():
    x = np.broadcast_to(np.arange(64, dtype=np.float32).reshape(1, 8, 8, 1), (32, 8, 8, 1)).copy()
    out = random_crop_flip(x, host_rng(0), padding=2)  # 32 copies of one image
    distinct = {out[i].tobytes() for i in range(32)}
    assert len(distinct) > 10
    assert np.array_equal(random_crop_flip(x, host_rng(0), padding=0, flip=False), x)


def test_crop_flip_bad_arguments():
    with pytest.raises(ValueError, match="shape"):
        random_crop_flip(np.zeros((8, 8, 3)), host_rng(0))
    with pytest.raises(ValueError, match="padding"):
        random_crop_flip(np.zeros((1, 8, 8, 3)), host_rng(0), padding=-1)
    with pytest.raises(TypeError, match="rng"):
        random_crop_flip(np.zeros((1, 8, 8, 3)), 0)


# ---------------------------------------------------------------------------------------------------
# random_erasing
# ---------------------------------------------------------------------------------------------------

def test_random_erasing_fills_one_rectangle():
    x = np.ones((64, 16, 16, 3), dtype=np.float32)
    out = random_erasing(x, host_rng(0), p=1.0, value=0.0)
    assert out.shape == x.shape and out.dtype == x.dtype
    for i in range(64):
        erased = out[i, :, :, 0] == 0  # (H, W)
        assert (erased == (out[i] == 0).all(-1)).all()  # all channels together
        rows, cols = np.nonzero(erased)
        assert rows.size > 0
        box = erased[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        assert box.all(), "the erased pixels form one filled rectangle"
        area = box.size / (16 * 16)
        assert 0.02 * 0.5 <= area <= 0.33 * 1.6  # rounding and clipping stretch the bounds a little


def test_random_erasing_probability_and_seed():
    x = np.ones((200, 8, 8, 1), dtype=np.float32)
    assert np.array_equal(random_erasing(x, host_rng(0), p=0.0), x)
    out = random_erasing(x, host_rng(3), p=0.25, value=-1.0)
    erased_images = (out == -1).any(axis=(1, 2, 3)).mean()
    assert 0.15 < erased_images < 0.35
    np.testing.assert_array_equal(out, random_erasing(x, host_rng(3), p=0.25, value=-1.0))
    with pytest.raises(ValueError, match="p must"):
        random_erasing(x, host_rng(0), p=1.5)
    with pytest.raises(ValueError, match="scale"):
        random_erasing(x, host_rng(0), scale=(0.5, 0.1))


# ---------------------------------------------------------------------------------------------------
# mixup, cutmix
# ---------------------------------------------------------------------------------------------------

def test_mixup_is_a_convex_pairing():
    x = np.stack([np.full((4, 4, 1), float(i)) for i in range(8)]).astype(np.float32)  # image i is all i
    y = np.arange(8) % 4
    xm, ym = mixup(x, y, host_rng(0), alpha=0.4, num_classes=4)
    assert xm.shape == x.shape and xm.dtype == np.float32 and ym.shape == (8, 4) and ym.dtype == np.float32
    np.testing.assert_allclose(ym.sum(1), 1.0, rtol=1e-6)
    # recover lam and the partner of every image, and check both images and targets agree with them
    rng = host_rng(0)
    lam = rng.beta(0.4, 0.4)
    perm = rng.permutation(8)
    np.testing.assert_allclose(xm[:, 0, 0, 0], lam * np.arange(8) + (1 - lam) * perm, rtol=1e-5)
    onehot = np.eye(4)[y]
    np.testing.assert_allclose(ym, lam * onehot + (1 - lam) * onehot[perm], rtol=1e-5)


def test_mixup_soft_targets_and_errors():
    x = np.zeros((4, 2, 2, 3), dtype=np.float32)
    soft = np.full((4, 5), 0.2, dtype=np.float32)
    _, ym = mixup(x, soft, host_rng(0), alpha=1.0)
    np.testing.assert_allclose(ym, 0.2, rtol=1e-6)
    with pytest.raises(ValueError, match="num_classes"):
        mixup(x, np.zeros(4, dtype=np.int64), host_rng(0), alpha=1.0)
    with pytest.raises(TypeError, match="float"):
        mixup(x.astype(np.uint8), soft, host_rng(0), alpha=1.0)
    with pytest.raises(ValueError, match="alpha"):
        mixup(x, soft, host_rng(0), alpha=0)
    with pytest.raises(ValueError, match="4 images but 3 targets"):
        mixup(x, soft[:3], host_rng(0), alpha=1.0)


def test_cutmix_pastes_one_box_and_weights_targets_by_area():
    B, H, W = 8, 16, 16
    x = np.stack([np.full((H, W, 1), i, dtype=np.uint8) for i in range(B)])  # image i is all i
    y = np.arange(B)
    xm, ym = cutmix(x, y, host_rng(5), alpha=1.0, num_classes=B)
    assert xm.dtype == np.uint8 and xm.shape == x.shape and ym.shape == (B, B) and ym.dtype == np.float32
    for i in range(B):
        kept = (xm[i] == i).mean()  # share of image i that is still its own
        partner = [j for j in np.unique(xm[i]) if j != i]
        assert len(partner) <= 1
        assert ym[i, i] == pytest.approx(kept, abs=1e-6) or partner == []
        if partner:
            assert ym[i, partner[0]] == pytest.approx(1 - kept, abs=1e-6)
    np.testing.assert_allclose(ym.sum(1), 1.0, rtol=1e-6)
    xm2, ym2 = cutmix(x, y, host_rng(5), alpha=1.0, num_classes=B)
    np.testing.assert_array_equal(xm, xm2)
    np.testing.assert_array_equal(ym, ym2)


# ---------------------------------------------------------------------------------------------------
# rand_augment
# ---------------------------------------------------------------------------------------------------

def test_rand_augment_keeps_shape_dtype_and_is_seeded():
    x = _images(B=64, H=16, W=16)
    a = rand_augment(x, host_rng(0))
    assert a.shape == x.shape and a.dtype == np.uint8
    np.testing.assert_array_equal(a, rand_augment(x, host_rng(0)))
    assert not np.array_equal(a, rand_augment(x, host_rng(1)))
    assert not np.array_equal(a, x)
    xf = x.astype(np.float32)
    af = rand_augment(xf, host_rng(0))
    assert af.dtype == np.float32
    np.testing.assert_array_equal(af, a.astype(np.float32))  # float input of whole levels: same result


def test_rand_augment_zero_ops_or_zero_magnitude_change_nothing():
    x = _images(B=32)
    np.testing.assert_array_equal(rand_augment(x, host_rng(0), num_ops=0), x)
    out = rand_augment(x, host_rng(0), num_ops=3, magnitude=0)
    # at magnitude 0 every op is the identity except autocontrast (whose strength has no magnitude):
    # an image that changed has each channel stretched to exactly 0..255
    changed = np.nonzero((out != x).any(axis=(1, 2, 3)))[0]
    assert 0 < changed.size < 32
    for i in changed:
        assert out[i].min(axis=(0, 1)).tolist() == [0, 0, 0]
        assert out[i].max(axis=(0, 1)).tolist() == [255, 255, 255]


@pytest.mark.parametrize("name", [name for name, _ in RAND_AUGMENT_OPS])
def test_each_rand_augment_op_keeps_whole_levels(name):
    op = dict(RAND_AUGMENT_OPS)[name]
    v = _images(B=5, H=12, W=10).astype(np.float32)
    out = op(v.copy(), 9, host_rng(0))
    assert out.shape == v.shape
    assert out.min() >= 0 and out.max() <= 255
    np.testing.assert_array_equal(out, np.rint(out))
    grey = _images(B=5, H=12, W=10, C=1).astype(np.float32)
    assert op(grey.copy(), 9, host_rng(0)).shape == grey.shape


def test_rand_augment_known_ops():
    ops = dict(RAND_AUGMENT_OPS)
    v = np.array([0, 100, 200, 255], dtype=np.float32).reshape(1, 1, 4, 1)
    np.testing.assert_array_equal(ops["solarize"](v, 5, None).ravel(), [0, 100, 55, 0])  # threshold 128
    np.testing.assert_array_equal(ops["posterize"](v, 10, None).ravel(), [0, 96, 192, 240])  # 4 bits
    ramp = np.array([50, 100, 150], dtype=np.float32).reshape(1, 1, 3, 1)
    np.testing.assert_array_equal(ops["autocontrast"](ramp, 9, None).ravel(), [0, 128, 255])  # 127.5 -> 128
    img = np.arange(1, 17, dtype=np.float32).reshape(1, 4, 4, 1)
    shifted = ops["translate_x"](img, 10, host_rng(0))  # 0.3 * 4 px = 1 px, left or right
    assert shifted[0, :, :, 0].tolist() in ([[0, 1, 2, 3], [0, 5, 6, 7], [0, 9, 10, 11], [0, 13, 14, 15]],
                                            [[2, 3, 4, 0], [6, 7, 8, 0], [10, 11, 12, 0], [14, 15, 16, 0]])


def test_rand_augment_bad_arguments():
    x = _images()
    with pytest.raises(ValueError, match="magnitude"):
        rand_augment(x, host_rng(0), magnitude=11)
    with pytest.raises(ValueError, match="num_ops"):
        rand_augment(x, host_rng(0), num_ops=-1)
    with pytest.raises(ValueError, match="channels"):
        rand_augment(np.zeros((1, 4, 4, 2), np.uint8), host_rng(0))


# ---------------------------------------------------------------------------------------------------
# augment_batch, iterate_batches
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
def test_augment_batch_policies(policy):
    x = _images(B=8, H=16, W=16)
    out = augment_batch(x, host_rng(0), policy, MEAN, STD)
    assert out.shape == x.shape and out.dtype == np.float32
    np.testing.assert_array_equal(out, augment_batch(x, host_rng(0), policy, MEAN, STD))
    if policy == "none":
        np.testing.assert_array_equal(out, normalize(x, MEAN, STD))
    if policy == "standard":  # the same draws by hand
        np.testing.assert_array_equal(out, random_crop_flip(normalize(x, MEAN, STD), host_rng(0), padding=4))


def test_augment_batch_unknown_policy():
    with pytest.raises(ValueError, match="'autoaugment'.*none"):
        augment_batch(_images(), host_rng(0), "autoaugment", MEAN, STD)


def test_iterate_batches_covers_every_item_once_and_is_seeded():
    batches = list(iterate_batches(10, 4, host_rng(0)))
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(np.concatenate(batches).tolist()) == list(range(10))
    again = list(iterate_batches(10, 4, host_rng(0)))
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    assert [len(b) for b in iterate_batches(10, 4, host_rng(0), drop_last=True)] == [4, 4]
    ordered = list(iterate_batches(5, 2, shuffle=False))
    assert [b.tolist() for b in ordered] == [[0, 1], [2, 3], [4]]
    assert batches[0].dtype == np.int64


def test_iterate_batches_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        list(iterate_batches(10, 0, host_rng(0)))
    with pytest.raises(TypeError, match="rng"):
        list(iterate_batches(10, 2, None, shuffle=True))
    with pytest.raises(TypeError, match="num_items"):
        list(iterate_batches(10.0, 2, host_rng(0)))


# ---------------------------------------------------------------------------------------------------
# NumPy and CuPy: the same seed, the same bits
# ---------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a GPU")
def test_numpy_and_cupy_give_identical_batches():
    import cupy

    x = _images(B=64, H=32, W=32)
    xg = cupy.asarray(x)
    for policy in POLICIES:
        cpu = augment_batch(x, host_rng(7), policy, MEAN, STD)
        gpu = augment_batch(xg, host_rng(7), policy, MEAN, STD)
        assert isinstance(gpu, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(gpu), cpu)
    xf = normalize(x, MEAN, STD)
    np.testing.assert_array_equal(cupy.asnumpy(random_erasing(cupy.asarray(xf), host_rng(1), p=1.0)),
                                  random_erasing(xf, host_rng(1), p=1.0))
    for fn in (mixup, cutmix):
        a = fn(xf, np.arange(64) % 10, host_rng(2), 1.0, num_classes=10)
        b = fn(cupy.asarray(xf), cupy.asarray(np.arange(64) % 10), host_rng(2), 1.0, num_classes=10)
        for u, v in zip(a, b):
            np.testing.assert_array_equal(cupy.asnumpy(v), u)
