"""Parity of minivit's MAE with a PyTorch autograd MAE written here from the paper's equations (He et al.,
CVPR 2022, and its models_mae.py), in float64: the same weights and the same noise (so the same mask), then
the loss, the prediction, the images' gradient and EVERY parameter's gradient must agree to 1e-9 relative.
Skipped when torch is not installed (`make test-parity` installs it in a separate venv)."""

import math

import numpy as np
import pytest

from minivit.mae import MAE, MAEConfig

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.parity

CONFIGS = {
    "rgb_square": dict(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2,
                       decoder_embed_dim=12, decoder_depth=2, decoder_num_heads=3, mlp_ratio=2.0),
    "grey_wide_grid": dict(img_size=(8, 12), patch_size=4, in_chans=1, embed_dim=8, depth=1, num_heads=2,
                           decoder_embed_dim=8, decoder_depth=1, decoder_num_heads=1, mlp_ratio=3.0, mask_ratio=0.5),
}


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def sincos_2d(grid_h, grid_w, dim):
    """MAE's get_2d_sincos_pos_embed, from its equations: patch (r, c) gets [sin(c w), cos(c w), sin(r w),
    cos(r w)], w_k = 1 / 10000^(k / (dim/4)); patches in row-major order."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4))      # (dim/4,)
    r, c = torch.meshgrid(torch.arange(grid_h, dtype=torch.float64), torch.arange(grid_w, dtype=torch.float64),
                          indexing="ij")
    c, r = c.reshape(-1, 1) * omega, r.reshape(-1, 1) * omega                              # (N, dim/4)
    return torch.cat([torch.sin(c), torch.cos(c), torch.sin(r), torch.cos(r)], dim=1)       # (N, dim)


def patchify(imgs, P):
    B, H, W, C = imgs.shape
    x = imgs.reshape(B, H // P, P, W // P, P, C).permute(0, 1, 3, 2, 4, 5)                  # (B, gh, gw, P, P, C)
    return x.reshape(B, (H // P) * (W // P), P * P * C)


def layer_norm(x, w, b, eps):
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, eps)


def block(x, p, prefix, nh, eps):
    """z' = z + MSA(LN(z)); z_out = z' + MLP(LN(z')): the ViT's pre-norm block, weights stored (in, out)."""
    B, T, D = x.shape
    hs = D // nh
    h = layer_norm(x, p[prefix + "norm1.weight"], p[prefix + "norm1.bias"], eps)
    qkv = (h @ p[prefix + "attn.qkv.weight"] + p[prefix + "attn.qkv.bias"]).reshape(B, T, 3, nh, hs)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)                                                   # (B, nh, T, hs) each
    attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hs), dim=-1)
    o = (attn @ v).transpose(1, 2).reshape(B, T, D)
    x = x + o @ p[prefix + "attn.proj.weight"] + p[prefix + "attn.proj.bias"]
    h = layer_norm(x, p[prefix + "norm2.weight"], p[prefix + "norm2.bias"], eps)
    h = torch.nn.functional.gelu(h @ p[prefix + "mlp.fc1.weight"] + p[prefix + "mlp.fc1.bias"])
    return x + h @ p[prefix + "mlp.fc2.weight"] + p[prefix + "mlp.fc2.bias"]


def torch_mae(p, imgs, noise, c):
    """Loss and prediction of MAE (models_mae.py's forward_encoder, forward_decoder, forward_loss)."""
    B = imgs.shape[0]
    P, (gh, gw) = c.patch_size, c.grid_size
    N, L, D, Dd = c.num_patches, c.len_keep, c.embed_dim, c.decoder_embed_dim
    # the encoder: embed, add positions, keep the L patches of smallest noise, prepend x_class
    x = patchify(imgs, P) @ p["patch_embed.proj.weight"] + p["patch_embed.proj.bias"]     # (B, N, D)
    x = x + sincos_2d(gh, gw, D)
    ids_shuffle = torch.argsort(noise, dim=1)
    ids_restore = torch.argsort(ids_shuffle, dim=1)
    ids_keep = ids_shuffle[:, :L]
    x = torch.gather(x, 1, ids_keep[:, :, None].expand(-1, -1, D))                        # (B, L, D)
    mask = torch.ones(B, N, dtype=torch.float64)
    mask[:, :L] = 0
    mask = torch.gather(mask, 1, ids_restore)
    x = torch.cat([p["cls_token"].expand(B, -1, -1), x], dim=1)                           # (B, 1+L, D)
    for i in range(c.depth):
        x = block(x, p, f"blocks.{i}.", c.num_heads, c.norm_eps)
    x = layer_norm(x, p["norm.weight"], p["norm.bias"], c.norm_eps)
    # the decoder: embed, append mask tokens, unshuffle, add positions (0 for x_class)
    x = x @ p["decoder_embed.weight"] + p["decoder_embed.bias"]                           # (B, 1+L, Dd)
    mask_tokens = p["mask_token"].repeat(B, N + 1 - x.shape[1], 1)
    x_ = torch.cat([x[:, 1:], mask_tokens], dim=1)
    x_ = torch.gather(x_, 1, ids_restore[:, :, None].expand(-1, -1, Dd))                  # (B, N, Dd)
    x = torch.cat([x[:, :1], x_], dim=1)
    x = x + torch.cat([torch.zeros(1, Dd, dtype=torch.float64), sincos_2d(gh, gw, Dd)])[None]
    for i in range(c.decoder_depth):
        x = block(x, p, f"decoder_blocks.{i}.", c.decoder_num_heads, c.norm_eps)
    x = layer_norm(x, p["decoder_norm.weight"], p["decoder_norm.bias"], c.norm_eps)
    pred = (x @ p["decoder_pred.weight"] + p["decoder_pred.bias"])[:, 1:]                 # (B, N, P*P*C)
    # the loss on the removed patches
    target = patchify(imgs.detach(), P)       # the target is data (imgs' gradient is the encoder's path only)
    if c.norm_pix_loss:
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
    loss = ((pred - target) ** 2).mean(dim=-1)
    return (loss * mask).sum() / mask.sum(), pred, mask


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_loss_prediction_and_every_gradient_match_pytorch(name, norm_pix_loss):
    config = MAEConfig(**CONFIGS[name], norm_pix_loss=norm_pix_loss)
    model = MAE(config, seed=4, dtype="float64")
    rng = np.random.default_rng(0)
    for p in model.params.values():          # off the init (norms at 1, biases at 0), so every term counts
        p[...] += rng.standard_normal(p.shape) * 0.2
    H, W = config.img_size
    imgs = rng.standard_normal((3, H, W, config.in_chans))
    noise = rng.random((3, config.num_patches))

    pred = model.forward(imgs, noise)
    loss, dpred = model.forward_loss(imgs, pred)
    model.zero_grad()
    dimgs = model.backward(dpred)

    tp = {k: torch.tensor(v, requires_grad=True) for k, v in model.state_dict().items()}
    timgs = torch.tensor(imgs, requires_grad=True)
    tloss, tpred, tmask = torch_mae(tp, timgs, torch.tensor(noise), config)
    tloss.backward()

    assert np.array_equal(model.mask, tmask.numpy())
    assert rel(np.asarray(loss), tloss.detach().numpy()) < 1e-12
    assert rel(pred, tpred.detach().numpy()) < 1e-12
    assert rel(dimgs, timgs.grad.numpy()) < 1e-9
    assert set(tp) == set(model.grads)
    errors = {k: rel(model.grads[k], tp[k].grad.numpy()) for k in tp}
    assert max(errors.values()) < 1e-9, {k: e for k, e in errors.items() if e >= 1e-9}
    assert all(np.any(tp[k].grad.numpy() != 0) for k in tp)      # every parameter is reached
