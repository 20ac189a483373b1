"""DeiT (minivit/deit/): the distillation token, the two heads and the two distillation losses, each backward
against float64 central differences; the model with the ViT's machinery (params, state_dict, optimizers,
minivit.check); the errors a student meets. Parity with timm is tests/test_deit_parity.py."""

import numpy as np
import pytest

import minivit
from minivit import functional as F
from minivit.check import run_model
from minivit.deit import (DistilledViT, DistTokenEmbed, distillation_loss, hard_distillation_backward,
                          hard_distillation_forward, kl_distillation_backward, kl_distillation_forward,
                          soft_distillation_backward, soft_distillation_forward)
from minivit.embeddings import prepend_tokens_forward
from minivit.optim import AdamW

CONFIG = minivit.ViTConfig(img_size=8, patch_size=4, in_chans=3, num_classes=5, embed_dim=12, depth=2, num_heads=2)


def images(B=3, seed=0):
    return np.random.default_rng(seed).standard_normal((B, 8, 8, 3))


class PairOutput:
    """The model in distilled training seen as one output: forward gives [logits | logits_dist] (B, 2K), and
    backward splits its gradient into the pair the model's backward takes."""

    def __init__(self, model):
        self.model, self.params, self.grads = model, model.params, model.grads
        model.distilled_training = True

    def forward(self, x):
        return np.concatenate(self.model.forward(x), axis=1)             # (B, 2K)

    def backward(self, dout):
        K = dout.shape[1] // 2
        return self.model.backward((dout[:, :K], dout[:, K:]))

    def sublayers(self):
        return self.model.sublayers()

    def train(self, mode=True):
        self.model.train(mode)
        return self

    def zero_grad(self):
        self.model.zero_grad()


class LossOf:
    """A distillation loss pair as a layer of z = stack(logits, logits_dist) (2, B, K) -> loss (1,), so that
    gradcheck compares its backward with central differences (labels and teacher held fixed)."""

    def __init__(self, forward, backward, labels, teacher, **kwargs):
        self.f, self.b, self.labels, self.teacher, self.kwargs = forward, backward, labels, teacher, kwargs

    def forward(self, z):
        loss, self.cache = self.f(z[0], z[1], self.labels, self.teacher, **self.kwargs)
        return np.reshape(loss, (1,))

    def backward(self, dout):
        return dout[0] * np.stack(self.b(self.cache))                    # (2, B, K)


def logits_pair(B=4, K=6, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, B, K)) * 2, rng.integers(0, K, B), rng.standard_normal((B, K)) * 3


# --------------------------------------------------------------------------------------------------
# Every new backward against central differences
# --------------------------------------------------------------------------------------------------


def test_dist_token_embed_backward_matches_central_differences():
    layer = DistTokenEmbed(num_patches=4, embed_dim=6, rng=np.random.default_rng(0), dtype="float64")
    x = np.random.default_rng(1).standard_normal((3, 4, 6))
    report = minivit.gradcheck(layer, x, max_checks=None)
    report.assert_ok()
    assert set(report.errors()) == {"input", "cls_token", "dist_token", "pos_embed"}


def test_the_distilled_model_and_both_heads_match_central_differences():
    """Distilled training: each head's own upstream gradient reaches its head, its token and everything below."""
    model = DistilledViT(CONFIG, seed=3, dtype="float64")
    report = minivit.gradcheck(PairOutput(model), images(), max_checks=40)
    report.assert_ok()
    assert {"dist_token", "cls_token", "pos_embed", "head.weight", "head_dist.weight", "head_dist.bias"} <= \
        set(report.errors())


def test_the_inference_mean_matches_central_differences():
    model = DistilledViT(CONFIG, seed=4, dtype="float64")
    minivit.gradcheck(model, images(), max_checks=40).assert_ok()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_hard_distillation_loss_backward(smoothing):
    z, labels, teacher = logits_pair()
    loss = LossOf(hard_distillation_forward, hard_distillation_backward, labels, teacher, label_smoothing=smoothing)
    minivit.gradcheck(loss, z, max_checks=None, check_input=True).assert_ok()


@pytest.mark.parametrize("tau, alpha", [(1.0, 0.5), (3.0, 0.1), (0.5, 0.9)])
def test_soft_distillation_loss_backward(tau, alpha):
    z, labels, teacher = logits_pair(seed=2)
    loss = LossOf(soft_distillation_forward, soft_distillation_backward, labels, teacher, tau=tau, alpha=alpha)
    minivit.gradcheck(loss, z, max_checks=None).assert_ok()


def test_kl_pair_backward():
    rng = np.random.default_rng(5)
    teacher = rng.standard_normal((3, 4))

    class KL:
        def forward(self, z):
            loss, self.cache = kl_distillation_forward(z, teacher, 2.0)
            return np.reshape(loss, (1,))

        def backward(self, dout):
            return dout[0] * kl_distillation_backward(self.cache)

    minivit.gradcheck(KL(), rng.standard_normal((3, 4)), max_checks=None).assert_ok()


# --------------------------------------------------------------------------------------------------
# The losses' values, by their formulas
# --------------------------------------------------------------------------------------------------


def test_hard_loss_is_half_ce_on_labels_and_half_on_the_teachers_argmax():
    z, labels, teacher = logits_pair()
    loss, dcls, ddist = distillation_loss(z[0], z[1], labels, teacher)
    ce = lambda logits, y: F.cross_entropy(logits, y)[0]                  # noqa: E731
    assert loss == pytest.approx(0.5 * ce(z[0], labels) + 0.5 * ce(z[1], teacher.argmax(-1)), rel=1e-12)
    # only the teacher's argmax counts: a teacher with the same argmax and other values gives the same loss
    same_argmax = teacher + 10 * (teacher == teacher.max(-1, keepdims=True))
    assert distillation_loss(z[0], z[1], labels, same_argmax)[0] == pytest.approx(loss, rel=1e-12)
    np.testing.assert_allclose(dcls, 0.5 * F.cross_entropy(z[0], labels)[1], rtol=1e-12)


def test_soft_loss_by_its_formula_and_its_limits():
    z, labels, teacher = logits_pair(seed=3)
    tau, alpha = 3.0, 0.1

    def softmax(a):
        e = np.exp(a - a.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p_t, p_d = softmax(teacher / tau), softmax(z[1] / tau)
    kl = (p_t * np.log(p_t / p_d)).sum(-1).mean()
    expected = (1 - alpha) * F.cross_entropy(z[0], labels)[0] + alpha * tau ** 2 * kl
    assert distillation_loss(z[0], z[1], labels, teacher, "soft", tau, alpha)[0] == pytest.approx(expected, rel=1e-12)
    # alpha = 0: the labels alone, and the distillation head learns nothing
    loss, dcls, ddist = distillation_loss(z[0], z[1], labels, teacher, "soft", tau, 0.0)
    assert loss == pytest.approx(F.cross_entropy(z[0], labels)[0], rel=1e-12) and not ddist.any()
    # a student that already answers as the teacher does: the KL term and its gradient vanish
    loss, _, ddist = distillation_loss(z[0], teacher, labels, teacher, "soft", tau, 1.0)
    assert abs(loss) < 1e-12 and np.abs(ddist).max() < 1e-12


def test_distillation_loss_refuses_what_it_cannot_use():
    z, labels, teacher = logits_pair()
    with pytest.raises(ValueError, match="kind must be 'hard' or 'soft', got 'medium'"):
        distillation_loss(z[0], z[1], labels, teacher, kind="medium")
    with pytest.raises(ValueError, match=r"teacher_logits must have .* \(4, 6\), got \(4, 5\)"):
        distillation_loss(z[0], z[1], labels, teacher[:, :5])
    with pytest.raises(ValueError, match="tau must be a positive"):
        distillation_loss(z[0], z[1], labels, teacher, "soft", tau=0.0)
    with pytest.raises(ValueError, match=r"alpha .* must be in \[0, 1\], got 1.5"):
        distillation_loss(z[0], z[1], labels, teacher, "soft", alpha=1.5)


# --------------------------------------------------------------------------------------------------
# The model: its forward, and the ViT's machinery
# --------------------------------------------------------------------------------------------------


def test_forward_reads_token_0_and_token_1_and_averages_at_inference():
    model = DistilledViT(CONFIG, seed=0, dtype="float64").eval()
    x = images()
    z = x
    for _, layer in model.stages():
        z = layer.forward(z)                                              # (B, 2+N, D)
    assert z.shape == (3, 2 + 4, 12)
    head, head_dist = model.head.forward(z[:, 0]), model.head_dist.forward(z[:, 1])
    np.testing.assert_allclose(model.forward(x), (head + head_dist) / 2, rtol=1e-12)
    model.distilled_training = True                                       # eval mode: still the mean
    np.testing.assert_allclose(model.forward(x), (head + head_dist) / 2, rtol=1e-12)
    logits, logits_dist = model.train().forward(x)
    np.testing.assert_allclose(logits, head, rtol=1e-12)
    np.testing.assert_allclose(logits_dist, head_dist, rtol=1e-12)


def test_the_sequence_is_class_then_dist_then_patches():
    layer = DistTokenEmbed(num_patches=3, embed_dim=4, rng=np.random.default_rng(0), dtype="float64")
    x = np.random.default_rng(1).standard_normal((2, 3, 4))
    p = layer.params
    p["pos_embed"][...] = 0                                               # the order alone
    z = layer.forward(x)
    np.testing.assert_array_equal(z[:, 0], np.broadcast_to(p["cls_token"][0], (2, 4)))
    np.testing.assert_array_equal(z[:, 1], np.broadcast_to(p["dist_token"][0], (2, 4)))
    np.testing.assert_array_equal(z[:, 2:], x)
    assert prepend_tokens_forward(x, p["cls_token"], p["dist_token"])[0].shape == (2, 5, 4)


def test_params_state_dict_and_an_optimizer_step():
    model = DistilledViT(CONFIG, seed=0)
    names = list(model.params)
    assert {"cls_token", "dist_token", "pos_embed", "head.weight", "head_dist.weight"} <= set(names)
    assert "reg_token" not in names and model.params["pos_embed"].shape == (1, CONFIG.num_patches + 2, 12)
    vit = minivit.ViT(CONFIG, seed=0)
    extra = 12 + 12 + 12 * 5 + 5                 # dist_token, its pos_embed row, head_dist
    assert model.num_params() == vit.num_params() + extra
    other = DistilledViT(CONFIG, seed=9).load_state_dict(model.state_dict())
    x = images().astype("float32")
    np.testing.assert_array_equal(other.eval().forward(x), model.eval().forward(x))
    model.train().distilled_training = True
    opt = AdamW(model, lr=1e-2)
    before = model.state_dict()
    logits, logits_dist = model.forward(x)
    labels, teacher = np.array([0, 1, 2]), np.random.default_rng(0).standard_normal((3, 5))
    _, dcls, ddist = distillation_loss(logits, logits_dist, labels, teacher)
    model.zero_grad()
    model.backward((dcls, ddist))
    opt.step()
    after = model.state_dict()
    assert all(not np.array_equal(before[k], after[k]) for k in ("dist_token", "head_dist.weight", "cls_token"))


def test_minivit_check_walks_the_distilled_model():
    report = run_model(DistilledViT(CONFIG, seed=1, dtype="float64"))
    assert report.ok, report
    text = str(report)
    assert "ddist_token" in text and "head_dist" in text


class ForgetfulDistTokenEmbed(DistTokenEmbed):
    """A planted bug: the distillation token's gradient taken from image 0 only, not summed over the batch."""

    def backward(self, dout):
        dx = super().backward(dout)
        self.grads["dist_token"] -= dout[1:, 1:2].sum(0, keepdims=True)
        return dx


def test_the_check_names_a_planted_bug_in_the_dist_token():
    model = DistilledViT(CONFIG, seed=1, dtype="float64")
    model.pos_embed = ForgetfulDistTokenEmbed(CONFIG.num_patches, CONFIG.embed_dim, dtype="float64")
    report = run_model(model)
    assert not report.ok
    wrong = [r.label for r in report.wrong()]
    assert "dist_token" in wrong, wrong
    assert "pos_embed" in report.verdict()


def test_bad_configs_and_bad_gradients_are_refused():
    import dataclasses
    for field, value, match in (("pool", "gap", "pool='cls'"), ("pos_embed", "sincos2d", "pos_embed='learned'"),
                                ("num_registers", 2, "num_registers=0"), ("representation_size", 8, "None")):
        with pytest.raises(ValueError, match=match):
            DistilledViT(dataclasses.replace(CONFIG, **{field: value}))
    with pytest.raises(TypeError, match="config must be a ViTConfig"):
        DistilledViT({"img_size": 8})
    model = DistilledViT(CONFIG, dtype="float64")
    model.forward(images())
    with pytest.raises(ValueError, match=r"dlogits \(3, 5\) or the pair .* got \(3, 4\)"):
        model.backward(np.zeros((3, 4)))
    with pytest.raises(ValueError, match=r"got \(\(3, 5\), \(2, 5\)\)"):
        model.backward((np.zeros((3, 5)), np.zeros((2, 5))))
    with pytest.raises(NotImplementedError, match="two"):
        model.resize_pos_embed(16)
