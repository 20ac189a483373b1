"""Parity of minivit's CLIP with open_clip's under PyTorch autograd, in float64, and of the ViT's CLIP
options (pre_norm, no patch bias, LayerNorm eps 1e-5, QuickGELU) with timm's.

A small random open_clip.CLIP is built offline (no weights downloaded), its state dict loaded into
minivit (CLIP.from_open_clip); then image and text features, logits, open_clip's ClipLoss, the image
gradient and every parameter gradient (logit_scale's included) must agree to 1e-9 relative. The other
direction too: a minivit CLIP's weights written into open_clip (to_open_clip). Skipped without torch or
open_clip (`make test-parity` installs both in .venv-parity).
"""

import functools

import numpy as np
import pytest

import minivit
from minivit import clip
from minivit.weights import convert

torch = pytest.importorskip("torch")
open_clip = pytest.importorskip("open_clip")
timm_vit = pytest.importorskip("timm.models.vision_transformer")

pytestmark = pytest.mark.parity

VISION = dict(image_size=32, patch_size=8, width=64, layers=2, head_width=16)      # 4 heads
TEXT = dict(context_length=16, vocab_size=100, width=64, heads=4, layers=2)


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def reference(quick_gelu, seed=0):
    torch.manual_seed(seed)
    ref = open_clip.CLIP(embed_dim=32, vision_cfg=dict(VISION), text_cfg=dict(TEXT), quick_gelu=quick_gelu).double()
    with torch.no_grad():                      # norms and biases off their 1 / 0 start: every term counts
        for name, p in ref.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        ref.logit_scale.fill_(2.3)
    return ref.train()                         # no dropout in CLIP: train and eval compute the same


def batch(B=4, seed=1):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((B, 32, 32, 3))                                  # NHWC
    tokens = np.zeros((B, 16), dtype=np.int64)
    for b in range(B):                                                            # <start>, words, <end>=99
        n = int(rng.integers(1, 13))
        tokens[b, :n + 2] = [1] + list(rng.integers(2, 98, size=n)) + [99]
    return images, tokens


def compare(model, ref, images, tokens):
    """Every number of one training step, minivit against open_clip; returns {what: relative error}."""
    x, t = minivit.asarray(images), minivit.asarray(tokens)
    img_feat = minivit.to_numpy(model.eval().encode_image(x))
    txt_feat = minivit.to_numpy(model.encode_text(t))
    model.train()
    logits = model.forward(x, t)
    loss, dlogits = clip.contrastive_loss(logits)
    model.zero_grad()
    dx = minivit.to_numpy(model.backward(dlogits))
    grads = clip.to_open_clip({k: minivit.to_numpy(g) for k, g in model.grads.items()})

    tx = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().requires_grad_(True)
    tt = torch.from_numpy(tokens)
    r_img = ref.encode_image(tx)
    r_txt = ref.encode_text(tt)
    image_n, text_n, scale = ref(tx, tt)                       # normalised features, exp(logit_scale)
    r_logits = scale * image_n @ text_n.T
    r_loss = open_clip.ClipLoss()(image_n, text_n, scale)
    r_loss.backward()
    r_grads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    assert set(grads) == set(r_grads), (set(grads) ^ set(r_grads))

    errors = {"image features": rel(img_feat, r_img.detach().numpy()),
              "text features": rel(txt_feat, r_txt.detach().numpy()),
              "logits": rel(minivit.to_numpy(logits), r_logits.detach().numpy()),
              "loss": abs(loss - r_loss.item()) / abs(r_loss.item()),
              "d images": rel(dx, tx.grad.permute(0, 2, 3, 1).numpy()),
              "d logit_scale": rel(grads["logit_scale"], r_grads["logit_scale"])}
    worst = max((rel(grads[k], r_grads[k]), k) for k in r_grads)
    print("\n" + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f", worst parameter gradient {worst[0]:.1e} ({worst[1]})")
    errors[f"worst gradient ({worst[1]})"] = worst[0]
    return errors


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_open_clip_weights_in_minivit_give_every_number_of_open_clip(quick_gelu):
    ref = reference(quick_gelu)
    state = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    model = clip.CLIP.from_open_clip(state, vision_heads=4, text_heads=4, dtype="float64", quick_gelu=quick_gelu)
    assert model.config.embed_dim == 32 and model.config.context_length == 16 and model.config.vocab_size == 100
    assert model.config.gelu == ("quick" if quick_gelu else "erf")
    images, tokens = batch()
    for what, err in compare(model, ref, images, tokens).items():
        assert err < 1e-9, (what, err)


def test_minivit_weights_in_open_clip_give_every_number_of_minivit():
    config = clip.CLIPConfig(embed_dim=32, img_size=32, patch_size=8, vision_width=64, vision_layers=2,
                             vision_heads=4, context_length=16, vocab_size=100, text_width=64, text_layers=2,
                             text_heads=4)
    model = clip.CLIP(config, seed=5, dtype="float64")
    rng = np.random.default_rng(2)
    for k, p in model.params.items():
        if k.endswith(".bias") or "norm" in k:
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    ref = open_clip.CLIP(embed_dim=32, vision_cfg=dict(VISION), text_cfg=dict(TEXT)).double().train()
    missing, unexpected = ref.load_state_dict({k: torch.from_numpy(v) for k, v in
                                               clip.to_open_clip(model.state_dict()).items()}, strict=True)
    assert not missing and not unexpected
    images, tokens = batch(B=5, seed=3)
    for what, err in compare(model, ref, images, tokens).items():
        assert err < 1e-9, (what, err)


def test_vit_with_clips_options_matches_timm():
    """pre_norm, no patch bias, LayerNorm eps 1e-5 and QuickGELU as timm has them (convert.timm_kwargs)."""
    config = minivit.ViTConfig(img_size=16, patch_size=4, num_classes=6, embed_dim=24, depth=2, num_heads=4,
                               pre_norm=True, patch_bias=False, norm_eps=1e-5, gelu="quick")
    model = minivit.ViT(config, seed=3, dtype="float64")
    rng = np.random.default_rng(4)
    for k, p in model.params.items():
        if k.endswith(".bias") or "norm" in k:
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    kwargs = convert.timm_kwargs(config)
    assert kwargs["pre_norm"] and kwargs["act_layer"] == "quick_gelu"
    assert isinstance(kwargs["norm_layer"], functools.partial) and kwargs["norm_layer"].keywords == {"eps": 1e-5}
    ref = timm_vit.VisionTransformer(**kwargs).double().train()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in
                         convert.to_timm(model.state_dict(), config.patch_size, config.in_chans).items()})
    x = rng.standard_normal((3, 16, 16, 3))
    labels = rng.integers(0, 6, size=3)
    logits = model.forward(minivit.asarray(x))
    loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(labels))
    model.zero_grad()
    dx = minivit.to_numpy(model.backward(dlogits))
    grads = convert.to_timm({k: minivit.to_numpy(g) for k, g in model.grads.items()}, 4, 3)
    tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_(True)
    tlogits = ref(tx)
    torch.nn.functional.cross_entropy(tlogits, torch.from_numpy(labels)).backward()
    assert rel(minivit.to_numpy(logits), tlogits.detach().numpy()) < 1e-9
    assert rel(dx, tx.grad.permute(0, 2, 3, 1).numpy()) < 1e-9
    tgrads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    assert set(tgrads) == set(grads) and "norm_pre.weight" in grads and "patch_embed.proj.bias" not in grads
    worst = max((rel(grads[k], tgrads[k]), k) for k in tgrads)
    assert worst[0] < 1e-9, worst
