"""MAE (minivit/mae): the masking's gather and scatter, the decoder's unshuffle and mask token, the masked
loss (with and without the per-patch normalised target), the decoder and the whole model, each backward
against float64 central differences; and what the masking must be (the 25% of smallest noise, the mask in
the original order, ids_restore the inverse permutation). PyTorch parity is tests/test_mae_parity.py."""

import numpy as np
import pytest

import minivit
from minivit import check
from minivit.gradcheck import PairLayer
from minivit.optim import AdamW
from minivit.mae import (MAE, MAEConfig, create_mae, finetune_vit, masked_mse_backward, masked_mse_forward,
                         random_masking_backward, random_masking_forward, unshuffle_backward, unshuffle_forward)

TOL = 1e-7
TINY = dict(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2, decoder_embed_dim=8,
            decoder_depth=1, decoder_num_heads=2, mlp_ratio=2.0)


def tiny(dtype="float64", **kw):
    """A small MAE, its tokens drawn at std 1 (at MAE's 0.02 the class token is nearly constant, and its
    LayerNorm, dividing by a tiny spread, makes central differences lose digits)."""
    model = create_mae(dtype=dtype, seed=3, **{**TINY, **kw})
    rng = np.random.default_rng(5)
    for name in ("cls_token", "mask_token"):
        model.params[name][...] = minivit.asarray(rng.standard_normal(model.params[name].shape), dtype=dtype)
    return model


def noise_for(B, N, seed=1):
    return minivit.asarray(np.random.default_rng(seed).random((B, N)))


def grad_ok(layer, x, **kw):
    report = minivit.gradcheck(layer, x, tol=TOL, **kw)
    report.assert_ok()
    return report


# ---- the masking -----------------------------------------------------------------------------------

def test_masking_keeps_the_smallest_noise_in_order_and_ids_restore_inverts_the_shuffle(arr):
    x = arr(2, 8, 3)
    noise = minivit.asarray(np.array([[.9, .1, .5, .3, .8, .05, .7, .6], [.2, .4, .6, .8, .1, .3, .5, .7]]))
    x_masked, mask, ids_restore, _ = random_masking_forward(x, noise, 2)
    x, x_masked, mask, ids_restore = map(minivit.to_numpy, (x, x_masked, mask, ids_restore))
    np.testing.assert_array_equal(x_masked[0], x[0, [5, 1]])      # the two smallest noises, smallest first
    np.testing.assert_array_equal(x_masked[1], x[1, [4, 0]])
    np.testing.assert_array_equal(mask[0], [1, 0, 1, 1, 1, 0, 1, 1])   # 0 = kept, in the original order
    np.testing.assert_array_equal(mask[1], [0, 1, 1, 1, 0, 1, 1, 1])
    shuffle = np.argsort(minivit.to_numpy(noise), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(shuffle, ids_restore, 1), np.tile(np.arange(8), (2, 1)))


def test_masking_gather_backward_scatters_into_zeros(arr):
    noise = noise_for(3, 10)
    layer = PairLayer(lambda x: (lambda r: (r[0], r[3]))(random_masking_forward(x, noise, 3)),
                      random_masking_backward)
    grad_ok(layer, arr(3, 10, 4))
    dx = minivit.to_numpy(layer.backward(arr(3, 3, 4)))
    mask = minivit.to_numpy(random_masking_forward(arr(3, 10, 4), noise, 3)[1])
    assert np.all(dx[mask == 1] == 0) and np.all(dx[mask == 0] != 0)   # removed patches get exactly nothing


def test_unshuffle_and_the_mask_token(arr):
    B, N, L, Dd = 3, 10, 3, 4
    ids_restore = random_masking_forward(arr(B, N, 1), noise_for(B, N), L)[2]
    layer = PairLayer(lambda x, mask_token: unshuffle_forward(x, mask_token, ids_restore), unshuffle_backward,
                      {"mask_token": arr(1, 1, Dd)})
    report = grad_ok(layer, arr(B, 1 + L, Dd))
    assert set(report.errors()) >= {"mask_token"}


def test_unshuffle_puts_each_kept_token_back_where_it_was(arr):
    x = arr(2, 8, 3)
    noise = noise_for(2, 8)
    x_masked, mask, ids_restore, _ = random_masking_forward(x, noise, 2)
    z = minivit.asarray(np.concatenate([np.zeros((2, 1, 3)), minivit.to_numpy(x_masked)], 1))
    token = minivit.asarray(np.full((1, 1, 3), 7.0))
    out, _ = unshuffle_forward(z, token, ids_restore)
    out, x, mask = minivit.to_numpy(out), minivit.to_numpy(x), minivit.to_numpy(mask)
    np.testing.assert_array_equal(out[:, 1:][mask == 0], x[mask == 0])
    assert np.all(out[:, 1:][mask == 1] == 7.0)


# ---- the loss --------------------------------------------------------------------------------------

@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_masked_loss_gradient(arr, norm_pix_loss):
    target, mask = arr(2, 6, 12), minivit.asarray(np.array([[1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0.]]))
    layer = PairLayer(lambda pred: masked_mse_forward(pred, target, mask, norm_pix_loss),
                      lambda dloss, cache: dloss * masked_mse_backward(cache))
    grad_ok(layer, arr(2, 6, 12))


def test_masked_loss_counts_only_the_removed_patches(arr):
    pred, target = arr(1, 4, 5), arr(1, 4, 5)
    mask = minivit.asarray(np.array([[1.0, 0, 0, 1]]))
    p, t = minivit.to_numpy(pred), minivit.to_numpy(target)
    expected = (((p[0, 0] - t[0, 0]) ** 2).mean() + ((p[0, 3] - t[0, 3]) ** 2).mean()) / 2
    loss, cache = masked_mse_forward(pred, target, mask)
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert np.all(minivit.to_numpy(masked_mse_backward(cache))[0, 1:3] == 0)
    normed, _ = masked_mse_forward(pred, target, mask, norm_pix_loss=True)   # a per-patch normalised target
    tn = (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, ddof=1, keepdims=True) + 1e-6)
    expected = (((p[0, 0] - tn[0, 0]) ** 2).mean() + ((p[0, 3] - tn[0, 3]) ** 2).mean()) / 2
    assert float(normed) == pytest.approx(expected, rel=1e-12)


# ---- the decoder and the whole model -------------------------------------------------------------

class _Decoder:
    """The decoder alone, on a fixed mask: latent (B, 1+L, D) -> pred (B, N, P*P*C)."""

    def __init__(self, model):
        self.model, self.params, self.grads = model, model.params, model.grads

    def forward(self, latent):
        return self.model.forward_decoder(latent)

    def backward(self, dpred):
        return self.model.backward_decoder(dpred)

    def zero_grad(self):
        self.model.zero_grad()


def test_decoder_gradients(arr):
    model = tiny()
    model.forward(arr(3, 8, 8, 3), noise_for(3, 16))                 # sets the mask the decoder reads
    decoder_names = [k for k in model.params if k == "mask_token" or k.startswith("decoder_")]
    grad_ok(_Decoder(model), arr(3, 1 + 4, 16), names=decoder_names, max_checks=30)


class _Fixed:
    """The model with its noise held fixed, as gradcheck wants a function of the images alone."""

    def __init__(self, model, noise):
        self.model, self.noise, self.params, self.grads = model, noise, model.params, model.grads

    def forward(self, x):
        return self.model.forward(x, self.noise)

    def backward(self, dout):
        return self.model.backward(dout)

    def zero_grad(self):
        self.model.zero_grad()


def test_whole_model_gradients(arr):
    model = tiny()
    rng = np.random.default_rng(2)
    for p in model.params.values():      # off the 0.02-scale init, where the encoder's gradients are tiny
        p[...] += minivit.asarray(rng.standard_normal(p.shape) * 0.2)
    grad_ok(_Fixed(model, noise_for(2, 16)), arr(2, 8, 8, 3), max_checks=12)


def test_model_walk_checks_every_layer_with_the_noise_held_fixed():
    report = check.run_model(tiny(norm_pix_loss=True))
    assert report.ok, str(report)
    assert any(r.op == "masking" for r in report.rows) and any(r.op == "model" for r in report.rows)


def test_check_command_takes_an_mae(tmp_path):
    path = tmp_path / "my_mae.py"
    path.write_text("from minivit.mae import create_mae\n"
                    f"def build(dtype='float32'):\n    return create_mae(dtype=dtype, **{TINY!r})\n")
    assert check.main(["--model", f"{path}:build"]) in (0, None)


# ---- the model's shapes, names and bookkeeping -----------------------------------------------------

def test_encoder_sees_only_the_visible_tokens(arr):
    model = tiny()
    model.forward_encoder(arr(2, 8, 8, 3), noise_for(2, 16))
    assert model.blocks[0].norm1.cache is not None
    latent = model.norm.forward(arr(2, 5, 16))
    assert latent.shape == (2, 5, 16)
    pred = model.forward(arr(2, 8, 8, 3))
    assert pred.shape == (2, 16, 12) and minivit.to_numpy(model.mask).sum(1).tolist() == [12, 12]
    assert model.blocks[0].attn.cache is not None
    assert model.blocks[0].attn.cache[0].shape[2] == 1 + 4          # q: (B, nh, 1+L, hs): L = 16/4 visible


def test_names_are_maes_and_the_bookkeeping_works():
    model = tiny(dtype="float32")
    names = set(model.params)
    assert {"cls_token", "mask_token", "patch_embed.proj.weight", "blocks.1.attn.qkv.weight", "norm.weight",
            "decoder_embed.weight", "decoder_blocks.0.mlp.fc2.bias", "decoder_norm.weight",
            "decoder_pred.weight"} <= names
    assert not any("pos_embed" in k for k in names)                  # MAE's tables are fixed sin-cos
    assert model.num_params() == sum(v.size for v in model.state_dict().values())
    other = tiny(dtype="float32")
    other.params["cls_token"][...] = 5
    other.load_state_dict(model.state_dict())
    assert np.array_equal(minivit.to_numpy(other.params["cls_token"]), minivit.to_numpy(model.params["cls_token"]))
    opt = AdamW(model, lr=1e-2)
    x = minivit.asarray(np.random.default_rng(0).random((4, 8, 8, 3)), dtype="float32")
    before = minivit.to_numpy(model.params["mask_token"]).copy()
    pred = model.forward(x)
    loss, dpred = model.forward_loss(x, pred)
    model.zero_grad()
    model.backward(dpred)
    opt.step()
    assert not np.array_equal(before, minivit.to_numpy(model.params["mask_token"]))


def test_learns_to_fill_in_the_removed_patches_of_one_batch():
    model = tiny(dtype="float64")
    opt = AdamW(model, lr=3e-3, weight_decay=0.0)
    colours = np.random.default_rng(0).random((4, 1, 1, 3))
    x = minivit.asarray(np.broadcast_to(colours, (4, 8, 8, 3)).copy())    # one colour each: the removed
    noise = noise_for(4, 16)                                             # patches follow from the kept ones
    losses = []
    for _ in range(150):
        pred = model.forward(x, noise)
        loss, dpred = model.forward_loss(x, pred)
        model.zero_grad()
        model.backward(dpred)
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.1 * losses[0], losses[::30]


def test_encoder_becomes_a_vit_with_the_same_weights():
    model = tiny()
    vit = finetune_vit(model.config, model.state_dict(), num_classes=5, dtype="float64")
    assert isinstance(vit, minivit.ViT) and vit.config.pos_embed == "sincos2d"
    for k, v in model.encoder_state_dict().items():
        np.testing.assert_array_equal(minivit.to_numpy(vit.params[k]), v)
    assert not np.any(minivit.to_numpy(vit.params["head.weight"]))


def test_bad_config_and_input_are_refused():
    with pytest.raises(ValueError, match="mask_ratio"):
        MAEConfig(**{**TINY, "mask_ratio": 1.0})
    with pytest.raises(ValueError, match="decoder_embed_dim"):
        MAEConfig(**{**TINY, "decoder_embed_dim": 6, "decoder_num_heads": 2})
    with pytest.raises(ValueError, match="noise must be"):
        tiny().forward(minivit.asarray(np.zeros((2, 8, 8, 3))), noise_for(2, 15))
    with pytest.raises(TypeError, match="MAEConfig"):
        MAE(minivit.ViTConfig())
