"""Layer behaviour beyond gradients: patch embedding is a strided convolution, the class token, pooling."""

import numpy as np

import minivit
from minivit import embeddings as E
from minivit import layers as L


def naive_conv(x, kernel, bias, stride):
    """A plain loop convolution, channels last. x (B, H, W, C), kernel (P, P, C, D) -> (B, H/s, W/s, D)."""
    B, H, W, C = x.shape
    P, _, _, D = kernel.shape
    out = np.zeros((B, (H - P) // stride + 1, (W - P) // stride + 1, D))
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            window = x[:, i * stride:i * stride + P, j * stride:j * stride + P, :]   # (B, P, P, C)
            out[:, i, j] = np.tensordot(window, kernel, axes=([1, 2, 3], [0, 1, 2])) + bias
    return out


def test_patch_embedding_equals_a_convolution_with_kernel_equal_stride(rng):
    B, H, W, C, P, D = 2, 8, 12, 3, 4, 5
    layer = E.PatchEmbed((H, W), P, C, D, dtype="float64")
    layer.params["proj.bias"][...] = minivit.asarray(rng.standard_normal(D))
    x = rng.standard_normal((B, H, W, C))
    out = minivit.to_numpy(layer.forward(minivit.asarray(x)))                        # (B, N, D)
    kernel = minivit.to_numpy(layer.params["proj.weight"]).reshape(P, P, C, D)       # rows in (P, P, C) order
    conv = naive_conv(x, kernel, minivit.to_numpy(layer.params["proj.bias"]), stride=P)  # (B, H/P, W/P, D)
    np.testing.assert_allclose(out, conv.reshape(B, -1, D), rtol=1e-12, atol=1e-12)


def test_class_token_is_prepended_and_position_embeddings_added(rng):
    layer = E.PosEmbed(4, 6, dtype="float64")
    x = rng.standard_normal((2, 4, 6))
    out = minivit.to_numpy(layer.forward(minivit.asarray(x)))
    cls = minivit.to_numpy(layer.params["cls_token"])[0, 0]
    pos = minivit.to_numpy(layer.params["pos_embed"])[0]
    assert out.shape == (2, 5, 6)
    np.testing.assert_allclose(out[:, 0], np.broadcast_to(cls + pos[0], (2, 6)))
    np.testing.assert_allclose(out[:, 1:], x + pos[1:])


def test_pool_modes(rng):
    x = rng.standard_normal((2, 5, 3))
    np.testing.assert_array_equal(minivit.to_numpy(L.Pool("cls").forward(minivit.asarray(x))), x[:, 0])
    np.testing.assert_allclose(minivit.to_numpy(L.Pool("gap").forward(minivit.asarray(x))), x.mean(1))


def test_registers_follow_the_class_token_and_get_their_own_position_rows(rng):
    # timm's layout: [x_class; reg_1 .. reg_nr; patches], pos_embed (1, 1+nr+N, D) added to all of them
    layer = E.PosEmbed(4, 6, num_registers=3, dtype="float64")
    assert layer.params["reg_token"].shape == (1, 3, 6) and layer.params["pos_embed"].shape == (1, 8, 6)
    layer.params["reg_token"][...] = minivit.asarray(rng.standard_normal((1, 3, 6)))
    x = rng.standard_normal((2, 4, 6))
    out = minivit.to_numpy(layer.forward(minivit.asarray(x)))                   # (B, 1+3+4, D)
    cls, reg = minivit.to_numpy(layer.params["cls_token"])[0], minivit.to_numpy(layer.params["reg_token"])[0]
    pos = minivit.to_numpy(layer.params["pos_embed"])[0]
    assert out.shape == (2, 8, 6)
    np.testing.assert_allclose(out[:, 0], np.broadcast_to(cls[0] + pos[0], (2, 6)))
    np.testing.assert_allclose(out[:, 1:4], np.broadcast_to(reg + pos[1:4], (2, 3, 6)))
    np.testing.assert_allclose(out[:, 4:], x + pos[4:])
    gap = E.PosEmbed(4, 6, class_token=False, num_registers=2, dtype="float64")  # GAP: the registers come first
    assert "cls_token" not in gap.params and gap.params["pos_embed"].shape == (1, 6, 6)
    assert minivit.to_numpy(gap.forward(minivit.asarray(x))).shape == (2, 6, 6)


def test_grid_kinds_put_registers_before_the_patches_without_a_position(rng):
    layer = E.GridPosEmbed((2, 2), 8, "sincos2d", class_token=True, num_registers=2, dtype="float64")
    layer.params["reg_token"][...] = minivit.asarray(rng.standard_normal((1, 2, 8)))
    x = rng.standard_normal((3, 4, 8))
    out = minivit.to_numpy(layer.forward(minivit.asarray(x)))                   # (B, 1+2+4, D)
    np.testing.assert_array_equal(out[:, 1:3],
                                  np.broadcast_to(minivit.to_numpy(layer.params["reg_token"])[0], (3, 2, 8)))
    np.testing.assert_allclose(out[:, 3:], x + minivit.to_numpy(layer.table))


def test_pool_drops_the_prefix_tokens(rng):
    # 1 class token + 2 registers, then 5 patches: "cls" reads token 0, "gap" the mean of the 5 patches only
    x = rng.standard_normal((2, 8, 3))
    cls, gap = L.Pool("cls", num_prefix_tokens=3), L.Pool("gap", num_prefix_tokens=3)
    np.testing.assert_array_equal(minivit.to_numpy(cls.forward(minivit.asarray(x))), x[:, 0])
    np.testing.assert_allclose(minivit.to_numpy(gap.forward(minivit.asarray(x))), x[:, 3:].mean(1))
    dx = minivit.to_numpy(gap.backward(minivit.asarray(np.ones((2, 3)))))          # (B, 8, D)
    assert (dx[:, :3] == 0).all() and np.allclose(dx[:, 3:], 1 / 5)                # the registers get nothing
    dx = minivit.to_numpy(cls.backward(minivit.asarray(np.ones((2, 3)))))
    assert (dx[:, 1:] == 0).all() and (dx[:, 0] == 1).all()


def test_linear_reads_as_the_math(rng):
    layer = L.Linear(3, 2, dtype="float64")
    assert layer.params["weight"].shape == (3, 2)      # (in, out): y = x W + b
    x = rng.standard_normal((4, 3))
    np.testing.assert_allclose(minivit.to_numpy(layer.forward(minivit.asarray(x))),
                               x @ minivit.to_numpy(layer.params["weight"]))


def test_dropout_keeps_expectation_and_is_identity_in_eval(rng):
    layer = L.Dropout(0.25, seed=1)
    x = minivit.asarray(np.ones((200, 100)))
    out = minivit.to_numpy(layer.forward(x))
    assert set(np.unique(out)) <= {0.0, 1 / 0.75}
    assert abs(out.mean() - 1.0) < 0.02 and abs((out == 0).mean() - 0.25) < 0.01
    layer.eval()
    assert layer.forward(x) is x


def test_drop_path_drops_whole_samples():
    layer = L.Dropout(0.5, per_sample=True, seed=0)
    out = minivit.to_numpy(layer.forward(minivit.asarray(np.ones((64, 3, 4)))))
    per_sample = out.reshape(64, -1)
    assert ((per_sample == 0).all(1) | (per_sample == 2).all(1)).all()   # each sample all kept or all dropped
    assert 10 < (per_sample[:, 0] == 0).sum() < 54
