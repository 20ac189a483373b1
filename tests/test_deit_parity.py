"""Parity with timm's VisionTransformerDistilled (timm.models.deit) under PyTorch autograd, in float64: the same
weights (minivit.deit.to_timm_distilled), then both heads' logits, the distillation loss (hard, and soft by the
paper's formula written here in torch), the input gradient and every parameter gradient agree to 1e-9
relative; and a timm DeiT distilled state dict, saved to a file, loads through from_pretrained to timm's
logits. Skipped when torch or timm is not installed (`make test-parity` installs them in a separate venv)."""

import numpy as np
import pytest

import minivit
from minivit.weights import convert
from minivit.deit import DistilledViT, distillation_loss, from_pretrained, from_timm_distilled, to_timm_distilled

torch = pytest.importorskip("torch")
timm_deit = pytest.importorskip("timm.models.deit")

pytestmark = pytest.mark.parity

CONFIGS = {
    "square_rgb": dict(img_size=16, patch_size=4, in_chans=3, num_classes=7, embed_dim=24, depth=2, num_heads=4),
    "nonsquare_grey_no_qkv_bias": dict(img_size=(8, 16), patch_size=4, in_chans=1, num_classes=3, embed_dim=15,
                                       depth=3, num_heads=5, mlp_ratio=2.0, qkv_bias=False),
}


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def pair(config, seed=7):
    """A DistilledViT (norms and biases moved off their 1/0 init) and timm's with the same weights."""
    model = DistilledViT(config, seed=seed, dtype="float64")
    rng = np.random.default_rng(1)
    for k, p in model.params.items():
        if k.endswith(".bias") or "norm" in k or k.endswith("_token"):
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    ref = timm_deit.VisionTransformerDistilled(**convert.timm_kwargs(config)).double()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in
                         to_timm_distilled(model.state_dict(), config.patch_size, config.in_chans).items()})
    return model, ref


def torch_loss(kind, logits, logits_dist, labels, teacher, tau=3.0, alpha=0.1):
    tF = torch.nn.functional
    if kind == "hard":
        return 0.5 * tF.cross_entropy(logits, labels) + 0.5 * tF.cross_entropy(logits_dist, teacher.argmax(-1))
    kl = tF.kl_div(tF.log_softmax(logits_dist / tau, -1), tF.log_softmax(teacher / tau, -1), reduction="batchmean",
                   log_target=True)
    return (1 - alpha) * tF.cross_entropy(logits, labels) + alpha * tau * tau * kl


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_both_heads_the_loss_and_every_gradient_match_timm(name, kind):
    config = minivit.ViTConfig(**CONFIGS[name])
    model, ref = pair(config)
    model.distilled_training = True
    ref.set_distilled_training(True)
    ref.train()                                                  # no dropout configured
    rng = np.random.default_rng(2)
    H, W = config.img_size
    x = rng.standard_normal((3, H, W, config.in_chans))
    labels = rng.integers(0, config.num_classes, size=3)
    teacher = rng.standard_normal((3, config.num_classes)) * 2

    logits, logits_dist = model.forward(x)
    loss, dcls, ddist = distillation_loss(logits, logits_dist, labels, teacher, kind, tau=3.0, alpha=0.1)
    model.zero_grad()
    dx = model.backward((dcls, ddist))
    grads = to_timm_distilled(dict(model.grads), config.patch_size, config.in_chans)

    tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_(True)
    tlogits, tlogits_dist = ref(tx)
    tloss = torch_loss(kind, tlogits, tlogits_dist, torch.from_numpy(labels), torch.from_numpy(teacher))
    tloss.backward()

    tgrads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
    assert set(tgrads) == set(grads) and {"dist_token", "head_dist.weight"} <= set(grads)
    errors = {"logits": rel(logits, tlogits.detach().numpy()),
              "logits_dist": rel(logits_dist, tlogits_dist.detach().numpy()),
              "loss": abs(loss - tloss.item()) / abs(tloss.item()),
              "dx": rel(dx, tx.grad.permute(0, 2, 3, 1).numpy())}
    worst = max((rel(grads[k], tgrads[k]), k) for k in tgrads)
    print(f"\n{name} {kind}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f", worst parameter gradient {worst[0]:.1e} ({worst[1]})")
    for what, err in errors.items():
        assert err < 1e-9, (what, err)
    assert worst[0] < 1e-9, worst


def test_inference_is_the_mean_of_the_heads_as_timms():
    config = minivit.ViTConfig(**CONFIGS["square_rgb"])
    model, ref = pair(config, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 16, 16, 3))
    expected = ref.eval()(torch.from_numpy(x).permute(0, 3, 1, 2)).detach().numpy()      # (B, K): the mean
    assert rel(model.eval().forward(x), expected) < 1e-12


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_a_timm_deit_distilled_file_loads_through_from_pretrained(tmp_path, suffix):
    """A randomly initialised timm DeiT (deit_tiny_distilled's shape, small), saved as timm saves, loads into a
    DistilledViT (num_heads read from the width 192) that gives timm's logits."""
    torch.manual_seed(0)
    ref = timm_deit.VisionTransformerDistilled(img_size=32, patch_size=8, embed_dim=192, depth=1, num_heads=3,
                                               num_classes=10).eval()
    sd = ref.state_dict()
    path = tmp_path / f"deit{suffix}"
    if suffix == ".pth":
        torch.save(sd, path)
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    model = from_pretrained(path, verbose=False)
    assert isinstance(model, DistilledViT) and model.config.num_heads == 3 and model.config.img_size == (32, 32)
    same = DistilledViT.from_pretrained(path, verbose=False)
    x = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype("float32")
    expected = ref(torch.from_numpy(x).permute(0, 3, 1, 2)).detach().numpy()
    assert rel(model.eval().forward(x), expected) < 1e-5
    np.testing.assert_array_equal(same.eval().forward(x), model.forward(x))
    top = minivit.from_pretrained(path, verbose=False)                  # the one loader hands it over
    assert isinstance(top, DistilledViT)
    np.testing.assert_array_equal(top.eval().forward(x), model.forward(x))
    zeroed = minivit.from_pretrained(path, new_head=True, verbose=False)
    assert not zeroed.params["head.weight"].any() and not zeroed.params["head_dist.weight"].any()
    with pytest.raises(ValueError, match="a DeiT distilled model: loading it at another resolution"):
        minivit.from_pretrained(path, img_size=64, verbose=False)
    fresh = from_pretrained(path, num_classes=4, verbose=False)          # fine-tuning: two new zero heads
    assert fresh.config.num_classes == 4 and not fresh.params["head_dist.weight"].any()
    config, state = from_timm_distilled(sd, verbose=False)
    assert state["head_dist.weight"].shape == (192, 10) and state["pos_embed"].shape == (1, 16 + 2, 192)


def test_a_plain_vit_state_dict_is_not_taken_for_a_distilled_one():
    ref = timm_deit.VisionTransformer(img_size=16, patch_size=8, embed_dim=192, depth=1, num_heads=3, num_classes=3)
    with pytest.raises(ValueError, match=r"lacks \['dist_token', 'head_dist.weight', 'head_dist.bias'\]"):
        from_timm_distilled(ref.state_dict())
