"""ops.report(model): what each layer runs, recorded while the model runs, not inferred from its classes.

A student swaps layers (an RMSNorm for a LayerNorm, an Attention subclass): the report must then say that
the layer is their code, and that the kernel minivit's layer would have run dropped out there. Where the
change keeps the kernel's math (a temperature folded into q: minivit/layer_examples.py), the kernel stays.
"""


import numpy as np
import pytest

import minivit
from minivit import functional as F
from minivit import kernels, ops, train
from minivit.layer_examples import PlainTempAttention, TempAttention
from minivit.layers import Attention, Layer, ones
from minivit.optim import AdamW

needs_numba = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="the CPU fast twins need Numba")

CONFIG = minivit.ViTConfig(img_size=16, patch_size=4, num_classes=5, embed_dim=24, depth=3, num_heads=3)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    ops.reset()
    ops.set_fast_kernels(True)
    yield
    ops.reset()
    ops.set_fast_kernels(True)


class RMSNorm(Layer):
    """out = x / sqrt(mean(x^2) + eps) * weight: a student's norm, calling no ops."""

    def __init__(self, dim, eps=1e-6, dtype="float32"):
        super().__init__()
        self.eps = eps
        self.params["weight"] = ones((dim,), dtype)

    def forward(self, x):
        rms = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps)       # (..., 1)
        self.cache = (x, rms) if self.training else None
        return x * rms * self.params["weight"]

    def backward(self, dout):
        x, rms = self._need_cache()
        xhat = x * rms
        self.grads["weight"] += (dout * xhat).reshape(-1, x.shape[-1]).sum(0)
        dxhat = dout * self.params["weight"]
        return rms * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))


def model(dtype="float32"):
    return minivit.ViT(CONFIG, dtype=dtype)


@needs_numba
def test_default_model_reports_the_kernels_that_ops_chose():
    r = ops.report(model(), training=True)
    assert r.ops_from("kernels") == ["attention", "gelu", "layernorm", "linear"]
    assert r.ops_from("functional") == []
    assert r.ops_from("kernels") == ops.report().from_kernels()     # what ops' own verdicts chose
    assert r.uses_kernel("blocks.0-2.attn", "attention") and r.uses_kernel("blocks.0-2.norm1", "layernorm")
    assert r.uses_kernel("blocks.0-2.mlp.act", "gelu") and r.uses_kernel("head", "linear")
    assert "blocks.0-2.attn: attention (kernels.attention_forward/backward)" in str(r)
    assert r.summary_lines() == ["ops from kernels.py (each checked against functional.py on a probe): "
                                 "attention, gelu, layernorm, linear"]


def test_float64_reports_functional():
    r = ops.report(model("float64"))
    assert r.ops_from("kernels") == [] and r.ops_from("functional") == ["attention", "gelu", "layernorm", "linear"]
    assert "functional.attention_forward" in str(r) and "float64: always the math as written" in str(r)


@needs_numba
def test_rmsnorm_is_your_code_and_the_layernorm_kernel_is_not_claimed_there():
    m = model()
    m.blocks[0].norm1 = RMSNorm(CONFIG.embed_dim)
    r = ops.report(m, training=True)
    assert not r.uses_kernel("blocks.0.norm1", "layernorm")
    assert r.uses_kernel("blocks.1-2.norm1", "layernorm") and r.uses_kernel("blocks.0-2.norm2", "layernorm")
    assert "  blocks.0.norm1: your code (no fast path): RMSNorm" in str(r)
    lines = r.summary_lines()
    assert ("kernel dropped out: blocks.0.norm1 is RMSNorm (in the place of minivit's LayerNorm), which does not "
            "call ops.layernorm_forward: the LayerNorm kernel is not used there (your code runs instead)") in lines
    assert len(lines) == 2                                 # the kernels line and that one


@needs_numba
def test_an_attention_that_computes_attention_itself_says_the_kernel_dropped_out():
    m = model()
    for blk in m.blocks:
        blk.attn = PlainTempAttention(CONFIG.embed_dim, CONFIG.num_heads)
    r = ops.report(m)
    assert "attention" not in r.ops_from("kernels") and "attention" not in r.ops_from("functional")
    assert r.uses_kernel("blocks.0-2.attn.qkv", "linear")  # its sublayers still run theirs
    assert ("kernel dropped out: blocks.0-2.attn is PlainTempAttention (a subclass of Attention), which does not "
            "call ops.attention_forward: the fused attention kernel is not used there (your code runs instead)"
            in r.summary_lines())


@needs_numba
def test_the_folded_temperature_keeps_the_kernel():
    m = model()
    for blk in m.blocks:
        blk.attn = TempAttention.from_attention(blk.attn)
    r = ops.report(m, training=True)
    assert r.uses_kernel("blocks.0-2.attn", "attention")
    assert "blocks.0-2.attn: attention (kernels.attention_forward/backward)" in str(r)
    assert ("kernel kept: blocks.0-2.attn is TempAttention (a subclass of Attention), which calls "
            "ops.attention_forward: the fused attention kernel stays in use") in r.summary_lines()


def test_report_is_recorded_not_inferred():
    """The same classes, one layer's forward patched to skip ops: the report follows what ran."""
    m = model("float64")
    act = m.blocks[1].mlp.act
    act.forward = lambda x: F.gelu_forward(x)[0]           # an instance attribute, as a student might patch
    r = ops.report(m)
    rows = {path: calls for path, _, calls, _ in r.rows}
    assert "gelu" not in rows["blocks.1.mlp.act"] and "gelu" in rows["blocks.0,2.mlp.act"]
    assert any("blocks.1.mlp.act is GELU (minivit's own, its forward replaced), which does not call "
               "ops.gelu_forward" in line for line in r.summary_lines())
    assert act.forward.__name__ == "<lambda>"              # the patch is left as it was
    del act.forward
    assert "blocks.0-2.mlp.act" in {path for path, *_ in ops.report(m).rows}


def test_recording_leaves_the_model_as_it_was():
    m = model("float64")
    m.blocks[0].drop_path1.p = 0.5
    for g in m.grads.values():
        g[...] = 0.25
    state = m.blocks[0].drop_path1.rng.bit_generator.state
    ops.report(m, training=True)
    assert all(float(abs(g - 0.25).max()) == 0 for g in m.grads.values())
    assert m.blocks[0].drop_path1.rng.bit_generator.state == state and m.training
    assert all("forward" not in layer.__dict__ for layer in m.sublayers())
    assert ops._recorder is None


def test_temperature_attention_gradcheck_float64():
    rng = np.random.default_rng(0)
    layer = TempAttention(12, 3, dtype="float64", rng=np.random.default_rng(1))
    layer.params["tau"][...] = np.array([0.5, 1.0, 2.0])
    x = rng.standard_normal((2, 5, 12))
    report = minivit.gradcheck(layer, x, tol=1e-6)
    assert "tau" in report.errors()
    report.assert_ok()


def test_temperature_attention_equals_the_plain_one():
    rng = np.random.default_rng(0)
    folded = TempAttention(12, 3, dtype="float64", rng=np.random.default_rng(1))
    plain = PlainTempAttention(12, 3, dtype="float64")
    for name in ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias"):
        plain.params[name][...] = folded.params[name] + 0.01 * rng.standard_normal(folded.params[name].shape)
        folded.params[name][...] = plain.params[name]
    folded.params["tau"][...] = plain.params["tau"][...] = np.array([0.3, 1.0, 4.0])
    x = rng.standard_normal((2, 5, 12))
    np.testing.assert_allclose(folded.forward(x), plain.forward(x), rtol=1e-12, atol=1e-12)
    folded.params["tau"][...] = 1.0                        # tau = 1: minivit's Attention exactly
    base = Attention(12, 3, dtype="float64")
    base.qkv, base.proj = folded.qkv, folded.proj
    np.testing.assert_allclose(folded.forward(x), base.forward(x), rtol=1e-12, atol=1e-12)


@needs_numba
def test_trainer_announces_the_dropped_kernel():
    m = model()
    m.blocks[2].attn = PlainTempAttention(CONFIG.embed_dim, CONFIG.num_heads)
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3)).astype(np.uint8)
    lines = train.announce_ops(m, AdamW(m, lr=1e-3), images, 0.5, 0.25, "float32")
    assert lines[0] == ("ops from kernels.py (each checked against functional.py on a probe, "
                        f"{ops.report().probe_seconds * 1e3:.0f} ms in all): adamw, attention, gelu, layernorm, linear")
    assert lines[1].startswith("kernel dropped out: blocks.2.attn is PlainTempAttention") and len(lines) == 2


def test_plain_temperature_attention_gradcheck_float64():
    layer = PlainTempAttention(12, 3, dtype="float64")
    layer.params["tau"][...] = np.array([0.5, 1.0, 2.0])
    report = minivit.gradcheck(layer, np.random.default_rng(0).standard_normal((2, 5, 12)), tol=1e-6)
    assert "tau" in report.errors()
    report.assert_ok()
