"""Parity with the reference: timm's VisionTransformer under PyTorch autograd, in float64.

The same weights are copied into timm (minivit.weights.convert.to_timm); then logits, the loss, the input
gradient and every parameter gradient must agree to 1e-9 relative. Skipped when torch or timm is
not installed (`make test-parity` installs them in a separate venv).
"""

import numpy as np
import pytest

import minivit
from minivit.weights import convert

torch = pytest.importorskip("torch")
timm_vit = pytest.importorskip("timm.models.vision_transformer")

pytestmark = pytest.mark.parity

CONFIGS = {
    "cls_square_rgb": dict(img_size=16, patch_size=4, in_chans=3, num_classes=7, embed_dim=24, depth=2,
                           num_heads=4),
    "gap_nonsquare_grey": dict(img_size=(12, 20), patch_size=4, in_chans=1, num_classes=5, embed_dim=18,
                               depth=2, num_heads=3, pool="gap"),
    "odd_heads_no_qkv_bias": dict(img_size=(8, 16), patch_size=4, in_chans=3, num_classes=3, embed_dim=15,
                                  depth=3, num_heads=5, mlp_ratio=2.0, qkv_bias=False),
    "cls_patch8_wide_mlp": dict(img_size=32, patch_size=8, in_chans=3, num_classes=10, embed_dim=32, depth=1,
                                num_heads=2, mlp_ratio=3.0),
}


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_logits_loss_and_every_gradient_match_timm(name, label_smoothing):
    config = minivit.ViTConfig(**CONFIGS[name])
    model = minivit.ViT(config, seed=7, dtype="float64")
    # perturb norms and biases away from their 1/0 init so their gradients are exercised in full
    rng = np.random.default_rng(1)
    for k, p in model.params.items():
        if k.endswith(".bias") or "norm" in k:
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))

    ref = timm_vit.VisionTransformer(**convert.timm_kwargs(config)).double()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in
                         convert.to_timm(model.state_dict(), config.patch_size, config.in_chans).items()})
    ref.train()  # no dropout configured, so train and eval compute the same

    H, W = config.img_size
    x = rng.standard_normal((3, H, W, config.in_chans))
    labels = rng.integers(0, config.num_classes, size=3)

    # minivit
    logits = model.forward(minivit.asarray(x))
    loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(labels), label_smoothing=label_smoothing)
    model.zero_grad()
    dx = minivit.to_numpy(model.backward(dlogits))
    grads = convert.to_timm({k: minivit.to_numpy(g) for k, g in model.grads.items()},
                            config.patch_size, config.in_chans)

    # timm, under autograd (NCHW)
    tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_(True)
    tlogits = ref(tx)
    tloss = torch.nn.functional.cross_entropy(tlogits, torch.from_numpy(labels), label_smoothing=label_smoothing)
    tloss.backward()

    tgrads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    assert set(tgrads) == set(grads)
    errors = {"logits": rel(minivit.to_numpy(logits), tlogits.detach().numpy()),
              "loss": abs(loss - tloss.item()) / abs(tloss.item()),
              "dx": rel(dx, tx.grad.permute(0, 2, 3, 1).numpy())}
    worst = max((rel(grads[k], tgrads[k]), k) for k in tgrads)
    print(f"\n{name} smoothing={label_smoothing}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f", worst parameter gradient {worst[0]:.1e} ({worst[1]})")
    for what, err in errors.items():
        assert err < 1e-9, (what, err)
    assert worst[0] < 1e-9, worst


def test_convert_round_trip_and_conv_layout():
    config = minivit.ViTConfig(**CONFIGS["cls_square_rgb"])
    sd = minivit.ViT(config, seed=3).state_dict()
    timm_sd = convert.to_timm(sd, config.patch_size, config.in_chans)
    assert timm_sd["patch_embed.proj.weight"].shape == (24, 3, 4, 4)
    assert timm_sd["blocks.0.attn.qkv.weight"].shape == (72, 24)
    back = convert.from_timm({k: torch.from_numpy(v) for k, v in timm_sd.items()})
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k])


# --------------------------------------------------------------------------------------------------
# Register tokens (Darcet et al., ICLR 2024): timm's VisionTransformer(reg_tokens=nr), same weights
# --------------------------------------------------------------------------------------------------

REGISTER_CONFIGS = {
    "reg4_cls": dict(img_size=16, patch_size=4, in_chans=3, num_classes=7, embed_dim=24, depth=2, num_heads=4,
                     num_registers=4),
    "reg3_gap_nonsquare": dict(img_size=(12, 20), patch_size=4, in_chans=1, num_classes=5, embed_dim=18, depth=2,
                               num_heads=3, pool="gap", num_registers=3),
    "reg1_cls_no_qkv_bias": dict(img_size=(8, 16), patch_size=4, in_chans=3, num_classes=3, embed_dim=15, depth=1,
                                 num_heads=5, mlp_ratio=2.0, qkv_bias=False, num_registers=1),
}


@pytest.mark.parametrize("name", sorted(REGISTER_CONFIGS))
def test_registers_logits_and_every_gradient_match_timm(name):
    config = minivit.ViTConfig(**REGISTER_CONFIGS[name])
    model = minivit.ViT(config, seed=7, dtype="float64")
    rng = np.random.default_rng(1)
    for k, p in model.params.items():   # off the init: registers and class token of weight 1, norms and biases
        if k.endswith(("_token", ".bias")) or "norm" in k:
            p += minivit.asarray((1.0 if k.endswith("_token") else 0.1) * rng.standard_normal(p.shape))
        if k.endswith("attn.qkv.weight"):
            p *= 10                     # sharper attention than at init, so the registers weigh on every token

    kwargs = convert.timm_kwargs(config)
    assert kwargs["reg_tokens"] == config.num_registers
    ref = timm_vit.VisionTransformer(**kwargs).double()
    assert ref.num_prefix_tokens == config.num_prefix_tokens and not ref.no_embed_class
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in
                         convert.to_timm(model.state_dict(), config.patch_size, config.in_chans).items()})
    ref.train()

    H, W = config.img_size
    x = rng.standard_normal((3, H, W, config.in_chans))
    labels = rng.integers(0, config.num_classes, size=3)
    logits = model.forward(minivit.asarray(x))
    loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(labels))
    model.zero_grad()
    dx = minivit.to_numpy(model.backward(dlogits))
    grads = convert.to_timm({k: minivit.to_numpy(g) for k, g in model.grads.items()},
                            config.patch_size, config.in_chans)

    tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_(True)
    tlogits = ref(tx)
    tloss = torch.nn.functional.cross_entropy(tlogits, torch.from_numpy(labels))
    tloss.backward()

    tgrads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    assert set(tgrads) == set(grads) and "reg_token" in grads
    assert np.abs(tgrads["reg_token"]).max() > 1e-6 * np.abs(tgrads["head.weight"]).max()   # trained, through attention
    pairs = {"logits": (minivit.to_numpy(logits), tlogits.detach().numpy()),
             "dx": (dx, tx.grad.permute(0, 2, 3, 1).numpy())}
    pairs.update({k: (grads[k], tgrads[k]) for k in tgrads})
    absdiff = {k: float(np.abs(a - b).max()) for k, (a, b) in pairs.items()}
    relerr = {k: rel(a, b) for k, (a, b) in pairs.items()}
    worst = max((v, k) for k, v in relerr.items() if k not in ("logits", "dx"))
    print(f"\n{name}: logits max|diff| {absdiff['logits']:.1e} (rel {relerr['logits']:.1e}), dx {absdiff['dx']:.1e}, "
          f"reg_token grad {absdiff['reg_token']:.1e} (of max {np.abs(tgrads['reg_token']).max():.1e}), "
          f"pos_embed grad {absdiff['pos_embed']:.1e}, "
          f"worst parameter gradient max|diff| {max(v for k, v in absdiff.items() if k not in ('logits', 'dx')):.1e}, "
          f"worst rel {worst[0]:.1e} ({worst[1]}); loss rel {abs(loss - tloss.item()) / abs(tloss.item()):.1e}")
    assert abs(loss - tloss.item()) / abs(tloss.item()) < 1e-9
    for k, err in relerr.items():
        assert err < 1e-9, (k, err)


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_a_timm_state_dict_with_registers_loads_to_timms_logits(pool):
    config = minivit.ViTConfig(img_size=16, patch_size=4, in_chans=3, num_classes=7, embed_dim=24, depth=2,
                               num_heads=4, pool=pool, num_registers=4)
    torch.manual_seed(0)
    ref = timm_vit.VisionTransformer(**convert.timm_kwargs(config)).double().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    loaded_config, state = convert.from_timm_checkpoint(ref.state_dict(), num_heads=4, verbose=False)
    assert loaded_config == config and state["reg_token"].shape == (1, 4, 24)
    model = minivit.ViT(loaded_config, dtype="float64").load_state_dict(state).eval()
    x = np.random.default_rng(2).standard_normal((2, 16, 16, 3))
    with torch.no_grad():
        expected = ref(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()).numpy()
    assert rel(minivit.to_numpy(model.forward(minivit.asarray(x))), expected) < 1e-12
    back = convert.to_timm(model.state_dict(), 4, 3)
    for k, v in ref.state_dict().items():                        # and back to timm's names and layouts
        np.testing.assert_array_equal(back[k], v.numpy())


def test_a_timm_state_dict_with_registers_outside_pos_embed_is_refused():
    # DINOv2-style: no_embed_class=True, pos_embed over the patches only; minivit's covers every token
    ref = timm_vit.VisionTransformer(img_size=16, patch_size=4, embed_dim=24, depth=1, num_heads=4, num_classes=3,
                                     reg_tokens=4, no_embed_class=True)
    with pytest.raises(ValueError, match="no_embed_class=True"):
        convert.from_timm_checkpoint(ref.state_dict(), num_heads=4, verbose=False)
