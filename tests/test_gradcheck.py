"""One gradient check per forward/backward pair: float64, central differences, random upstream gradient.

If you change a layer's backward, run this file: a row marked WRONG names the array whose gradient
disagrees with the finite differences.
"""

import numpy as np
import pytest

import minivit
from minivit import embeddings as E
from minivit import functional as F
from minivit import layers as L
from minivit.gradcheck import PairLayer

TOL = 1e-7  # right backwards give ~1e-9 or less here; wrong ones give 1e-2 and up


Pair = PairLayer   # a pure pair (forward(x) -> out, cache; backward(dout, cache) -> dx) as a layer


def check(layer, x, **kw):
    report = minivit.gradcheck(layer, x, tol=TOL, **kw)
    report.assert_ok()
    return report


def test_linear(arr):
    check(L.Linear(6, 4, dtype="float64"), arr(2, 3, 6))


def test_linear_without_bias(arr):
    layer = L.Linear(6, 4, bias=False, dtype="float64")
    assert "bias" not in layer.params
    check(layer, arr(5, 6))


def test_layernorm(arr):
    layer = L.LayerNorm(8, dtype="float64")
    layer.params["weight"][...] = minivit.asarray(np.linspace(0.5, 2, 8))   # not all ones, so dweight counts
    check(layer, arr(2, 3, 8) * 3 + 1)


@pytest.mark.parametrize("approximate", ["erf", "tanh"])
def test_gelu(arr, approximate):
    check(L.GELU(approximate), arr(3, 10) * 2)


def test_softmax_pair(arr):
    check(Pair(F.softmax_forward, F.softmax_backward), arr(2, 3, 7))


def test_attention_core_pair(arr):
    check(Pair(lambda qkv: F.attention_forward(qkv, 2), F.attention_backward), arr(2, 5, 3 * 8))


def test_attention_layer(arr):
    check(L.Attention(12, 3, dtype="float64"), arr(2, 5, 12))


def test_attention_odd_heads_no_qkv_bias(arr):
    check(L.Attention(10, 5, qkv_bias=False, dtype="float64"), arr(2, 4, 10))


def test_mlp(arr):
    check(L.MLP(8, 20, dtype="float64"), arr(2, 3, 8))


def test_patch_embed(arr):
    check(E.PatchEmbed((8, 12), 4, 3, 10, dtype="float64"), arr(2, 8, 12, 3))


@pytest.mark.parametrize("class_token", [True, False])
def test_pos_embed(arr, class_token):
    check(E.PosEmbed(6, 8, class_token=class_token, dtype="float64"), arr(2, 6, 8))


# register tokens (Darcet et al., ICLR 2024): [x_class; reg_1 .. reg_nr; patches], E_pos over them all
@pytest.mark.parametrize("class_token", [True, False])
def test_pos_embed_with_registers(arr, class_token):
    layer = E.PosEmbed(6, 8, class_token=class_token, num_registers=3, dtype="float64")
    report = check(layer, arr(2, 6, 8))
    assert "reg_token" in report.errors() and ("cls_token" in report.errors()) == class_token


@pytest.mark.parametrize("kind", ["learned2d", "sincos2d", "none"])
@pytest.mark.parametrize("class_token", [True, False])
def test_grid_pos_embed_with_registers(arr, kind, class_token):
    layer = E.GridPosEmbed((2, 3), 8, kind, class_token=class_token, num_registers=2, dtype="float64")
    assert "reg_token" in check(layer, arr(2, 6, 8)).errors()


def test_prepend_tokens_pair(arr):
    cls_token, reg_token = arr(1, 1, 8), arr(1, 3, 8)
    check(Pair(lambda x: E.prepend_tokens_forward(x, cls_token, reg_token),
               lambda dz, cache: E.prepend_tokens_backward(dz, cache)[0]), arr(2, 5, 8))


def test_block(arr):
    check(L.Block(12, 3, mlp_ratio=2.0, dtype="float64"), arr(2, 5, 12))


@pytest.mark.parametrize("mode", ["cls", "gap"])
def test_pool(arr, mode):
    check(L.Pool(mode), arr(3, 5, 8))


@pytest.mark.parametrize("mode", ["cls", "gap"])
def test_pool_after_prefix_tokens(arr, mode):     # the class token and/or registers first, then 5 patches
    check(L.Pool(mode, num_prefix_tokens=3), arr(3, 8, 8))


def test_dropout_pair_with_a_fixed_mask(arr, rng):
    mask = minivit.asarray(rng.random((4, 6)) > 0.3)
    check(Pair(lambda x: F.dropout_forward(x, mask, 0.3), F.dropout_backward), arr(4, 6))


def test_drop_path_pair_drops_whole_samples(arr):
    keep = minivit.asarray(np.array([True, False, True]).reshape(3, 1, 1))
    x = arr(3, 4, 5)
    out, _ = F.dropout_forward(x, keep, 0.5)
    out = minivit.to_numpy(out)
    assert (out[1] == 0).all() and np.allclose(out[0], 2 * minivit.to_numpy(x)[0])
    check(Pair(lambda x: F.dropout_forward(x, keep, 0.5), F.dropout_backward), x)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_backward(arr, smoothing):
    labels = minivit.asarray(np.array([1, 0, 3]))

    def forward(logits):
        loss, cache = F.cross_entropy_forward(logits, labels, smoothing)
        return loss.reshape(1), cache

    check(Pair(forward, lambda dout, cache: F.cross_entropy_backward(cache) * dout[0]), arr(3, 4),
          dout=minivit.asarray(np.array([1.0])))


def test_cross_entropy_soft_targets_backward(arr, rng):
    q = rng.random((3, 4))
    q = minivit.asarray(q / q.sum(1, keepdims=True))

    def forward(logits):
        loss, cache = F.cross_entropy_forward(logits, q)
        return loss.reshape(1), cache

    check(Pair(forward, lambda dout, cache: F.cross_entropy_backward(cache) * dout[0]), arr(3, 4),
          dout=minivit.asarray(np.array([1.0])))


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_whole_model(arr, pool):
    config = minivit.ViTConfig(img_size=(8, 12), patch_size=4, in_chans=3, num_classes=5, embed_dim=12,
                               depth=2, num_heads=3, mlp_ratio=2.0, pool=pool)
    model = minivit.ViT(config, seed=1, dtype="float64")
    report = check(model, arr(2, 8, 12, 3), max_checks=60)
    assert {"input", "patch_embed.proj.weight", "blocks.1.mlp.fc2.weight", "head.bias"} <= set(report.errors())
    assert ("cls_token" in report.errors()) == (pool == "cls")


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_whole_model_with_registers(arr, pool):
    config = minivit.ViTConfig(img_size=(8, 12), patch_size=4, in_chans=3, num_classes=5, embed_dim=12,
                               depth=2, num_heads=3, mlp_ratio=2.0, pool=pool, num_registers=2)
    model = minivit.ViT(config, seed=1, dtype="float64")
    model.params["reg_token"][...] = arr(1, 2, 12)   # off their 1e-6 init, so they move the attention
    report = check(model, arr(2, 8, 12, 3), max_checks=60)
    assert {"input", "reg_token", "pos_embed"} <= set(report.errors())


def test_model_with_tanh_gelu(arr):
    config = minivit.ViTConfig(img_size=8, patch_size=4, num_classes=3, embed_dim=8, depth=1, num_heads=2,
                               gelu="tanh")
    check(minivit.ViT(config, dtype="float64"), arr(2, 8, 8, 3), max_checks=40)


# ---- the checker itself must catch wrong backwards -------------------------------------------------


class LayerNormWithoutMeanTerm(L.LayerNorm):
    """A planted bug: LayerNorm's backward forgetting the path through the mean (term 2)."""

    def backward(self, dout):
        xhat, rstd, weight = self.cache
        dxhat = dout * weight
        self.grads["weight"] += (dout * xhat).reshape(-1, self.dim).sum(0)
        self.grads["bias"] += dout.reshape(-1, self.dim).sum(0)
        return rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))


def test_planted_bug_is_caught(arr):
    report = minivit.gradcheck(LayerNormWithoutMeanTerm(8, dtype="float64"), arr(2, 3, 8), tol=TOL)
    errors = report.errors()
    assert errors["input"] > 1e-2            # the input gradient is wrong ...
    assert errors["weight"] < TOL            # ... while the parameter gradients are still right
    assert not report.ok and "WRONG" in str(report)
    with pytest.raises(AssertionError, match="input"):
        report.assert_ok()


class LinearWithTransposedBiasBug(L.Linear):
    """A planted bug: the bias gradient summed over the wrong axis count (only the first row)."""

    def backward(self, dout):
        dx = super().backward(dout)
        self.grads["bias"] -= dout.reshape(-1, self.out_features)[1:].sum(0)
        return dx


def test_planted_parameter_bug_is_caught(arr):
    report = minivit.gradcheck(LinearWithTransposedBiasBug(4, 3, dtype="float64"), arr(5, 4), tol=TOL)
    assert report.errors()["bias"] > 1e-2 and report.errors()["weight"] < TOL


def test_gradcheck_refuses_float32(arr):
    with pytest.raises(TypeError, match="float64"):
        minivit.gradcheck(L.Linear(3, 2), arr(2, 3, dtype="float32"))


def test_gradcheck_refuses_random_forward(arr):
    with pytest.raises(ValueError, match="deterministic"):
        minivit.gradcheck(L.MLP(4, 8, drop=0.5, dtype="float64"), arr(2, 4))
