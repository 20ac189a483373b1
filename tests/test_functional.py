"""The forward math of each pair against a plain, independent computation."""

import math

import numpy as np
import pytest

import minivit
from minivit import functional as F


def test_im2patch_flattens_each_patch_in_PPC_order(rng):
    B, H, W, C, P = 2, 8, 12, 3, 4
    x = rng.standard_normal((B, H, W, C))
    patches = minivit.to_numpy(F.im2patch(minivit.asarray(x), P))
    assert patches.shape == (B, (H // P) * (W // P), P * P * C)
    # patch n covers grid row n // (W/P), column n % (W/P); its values are x[rows, cols, :] flattened
    gw = W // P
    for n in range(patches.shape[1]):
        r, c = divmod(n, gw)
        window = x[:, r * P:(r + 1) * P, c * P:(c + 1) * P, :]      # (B, P, P, C)
        np.testing.assert_array_equal(patches[:, n], window.reshape(B, -1))


def test_patch2im_inverts_im2patch(rng):
    x = minivit.asarray(rng.standard_normal((3, 16, 8, 2)))
    back = F.patch2im(F.im2patch(x, 4), 4, (16, 8))
    np.testing.assert_array_equal(minivit.to_numpy(back), minivit.to_numpy(x))


def test_paper_shape_trace_of_patches():
    x = minivit.asarray(np.zeros((1, 224, 224, 3)))
    assert F.im2patch(x, 16).shape == (1, 196, 768)     # 14 x 14 patches of 16*16*3 values


def test_softmax_is_stable_and_sums_to_one(rng):
    x = rng.standard_normal((4, 7)) * 10
    x[0, 0] = 1000.0                                     # exp(1000) overflows without the max shift
    s, _ = F.softmax_forward(minivit.asarray(x))
    s = minivit.to_numpy(s)
    assert np.isfinite(s).all()
    np.testing.assert_allclose(s.sum(-1), 1.0, rtol=1e-12)
    ref = np.exp(x[1:] - x[1:].max(-1, keepdims=True))
    np.testing.assert_allclose(s[1:], ref / ref.sum(-1, keepdims=True), rtol=1e-12)


def test_gelu_erf_is_exact_and_tanh_is_close():
    x = np.linspace(-6, 6, 1201)
    exact = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    erf_out, _ = F.gelu_forward(minivit.asarray(x), "erf")
    tanh_out, _ = F.gelu_forward(minivit.asarray(x), "tanh")
    np.testing.assert_allclose(minivit.to_numpy(erf_out), exact, rtol=0, atol=1e-14)
    gap = np.abs(minivit.to_numpy(tanh_out) - exact).max()
    assert 1e-4 < gap < 5e-4                             # the two GELUs differ by up to ~4.7e-4
    with pytest.raises(ValueError, match="'relu'"):
        F.gelu_forward(minivit.asarray(x), "relu")


def test_layernorm_normalises_each_token(rng):
    x = rng.standard_normal((2, 5, 16)) * 3 + 7
    out, _ = F.layernorm_forward(minivit.asarray(x), minivit.asarray(np.ones(16)), minivit.asarray(np.zeros(16)))
    out = minivit.to_numpy(out)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_attention_matches_a_per_head_loop(rng):
    B, N, D, nh = 2, 5, 12, 3
    hs = D // nh
    qkv = rng.standard_normal((B, N, 3 * D))
    out, _ = F.attention_forward(minivit.asarray(qkv), nh)
    out = minivit.to_numpy(out)
    q, k, v = qkv[..., :D], qkv[..., D:2 * D], qkv[..., 2 * D:]
    for h in range(nh):
        cols = slice(h * hs, (h + 1) * hs)
        scores = q[..., cols] @ k[..., cols].transpose(0, 2, 1) / math.sqrt(hs)   # (B, N, N)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[..., cols], w @ v[..., cols], rtol=1e-12, atol=1e-12)


def test_cross_entropy_value_and_gradient(rng):
    logits = rng.standard_normal((4, 5))
    labels = np.array([0, 3, 4, 1])
    loss, dlogits = minivit.cross_entropy(minivit.asarray(logits), minivit.asarray(labels))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert loss == pytest.approx(-logp[np.arange(4), labels].mean(), rel=1e-12)
    p = np.exp(logp)
    p[np.arange(4), labels] -= 1
    np.testing.assert_allclose(minivit.to_numpy(dlogits), p / 4, rtol=1e-12)


def test_label_smoothing_has_pytorchs_meaning(rng):
    logits = rng.standard_normal((3, 4))
    labels = np.array([2, 0, 1])
    eps = 0.1
    loss, _ = minivit.cross_entropy(minivit.asarray(logits), minivit.asarray(labels), label_smoothing=eps)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    # PyTorch: (1 - eps) * NLL + eps * mean over classes of -log p
    expected = (1 - eps) * -logp[np.arange(3), labels].mean() + eps * -logp.mean(-1).mean()
    assert loss == pytest.approx(expected, rel=1e-12)


def test_cross_entropy_stays_finite_for_huge_logits():
    logits = minivit.asarray(np.array([[1e4, -1e4, 0.0]]))
    loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(np.array([1])))
    assert loss == pytest.approx(2e4) and np.isfinite(minivit.to_numpy(dlogits)).all()


@pytest.mark.parametrize("labels, match", [
    (np.array([0, 5]), r"labels must be in \[0, 5\).*from 0 to 5"),
    (np.array([0, -1]), r"from -1 to 0"),
    (np.array([0, 1, 2]), "got 3 labels for 2 logits rows"),
    (np.array([0.0, 1.0]), "integer class indices"),
])
def test_cross_entropy_refuses_bad_labels(labels, match):
    logits = minivit.asarray(np.zeros((2, 5)))
    with pytest.raises((ValueError, TypeError), match=match):
        minivit.cross_entropy(logits, minivit.asarray(labels))


def test_cross_entropy_refuses_bad_logits():
    with pytest.raises(ValueError, match=r"\(B, K\)"):
        minivit.cross_entropy(minivit.asarray(np.zeros(5)), minivit.asarray(np.array([0])))
    with pytest.raises(ValueError, match="label_smoothing"):
        minivit.cross_entropy(minivit.asarray(np.zeros((1, 5))), minivit.asarray(np.array([0])), 1.5)
