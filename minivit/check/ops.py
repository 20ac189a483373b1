"""The ops of minivit.check: one check per op (a layer, a functional pair, an optimizer), each returning its
rows; OPS, the table of them that `python -m minivit.check --help` prints; and run(), which checks them."""

import math
import time

import numpy as np

from .. import conv
from .. import embeddings as E
from .. import functional as F
from ..fast import kernels
from .. import layers as L
from ..conv import ConvStem
from ..backend import asarray, backend_of, get_array_module, host_rng, to_numpy
from ..gradcheck import PairLayer
from ..model import ViT, ViTConfig
from ..optim import SGD, AdamW
from .compare import (TOKENS, _attention, _block, _first_wrong_in_backward, _forward_row, _gradient_rows, _kernel_rows,
                      _layernorm, _linear, _mlp, _pos_embed, _raised, _random, _randomise, _Stages, _sub,
                      _textbook_differs, _vit)
from .report import TOL_KERNEL, TOL_SAME, Report, Row
from .walk import _walk_hint, walk_rows

# --------------------------------------------------------------------------------------------------
# The ops: each returns its rows. Small shapes (B = 3 samples, so 1/B is not 0.5) keep the default set fast.
# --------------------------------------------------------------------------------------------------

B, N = 3, 5


def check_patch_embed(rng, use_kernels):
    layer = _randomise(E.PatchEmbed((8, 12), 4, 3, 6, dtype="float64"), rng)
    x = _random(rng, (B, 8, 12, 3))                                             # (B, H, W, C)
    rows = [_forward_row("patch_embed", "forward: embeddings.PatchEmbed vs functional", layer.forward(x),
                         _linear(_sub(layer.params, "proj."), F.im2patch(x, 4)))]
    return rows + _gradient_rows("patch_embed", layer, x, factors={"B": B},
                                 axes={"dx": ("B", "H", "W", "C"), "dproj.weight": ("P*P*C", "D"),
                                       "dproj.bias": ("D",)})


def check_linear(rng, use_kernels):
    layer = _randomise(L.Linear(6, 6, dtype="float64"), rng)                   # square: a transposed dW shows
    x = _random(rng, (B, N, 6))
    rows = [_forward_row("linear", "forward: layers.Linear vs functional", layer.forward(x), _linear(layer.params, x))]
    if use_kernels:
        w, b = layer.params["weight"], layer.params["bias"]
        rows += _kernel_rows("linear", "linear", [x, w, b], lambda m, x, w, b: m.linear_forward(x, w, b),
                             lambda m, d, c: dict(zip(("dx", "dweight", "dbias"), m.linear_backward(d, c))),
                             axes={"forward": ("B", "N", "out"), "dx": ("B", "N", "in"), "dweight": ("in", "out")},
                             numba=False)
    return rows + _gradient_rows("linear", layer, x, factors={"B": B, "B*N": B * N},
                                 axes={"dx": ("B", "N", "in"), "dweight": ("in", "out"), "dbias": ("out",)})


def check_layernorm(rng, use_kernels):
    D = 8
    layer = L.LayerNorm(D, dtype="float64")
    layer.params["weight"][...] = _random(rng, D)                               # gamma far from 1
    layer.params["bias"][...] = _random(rng, D)
    x = _random(rng, (B, N, D), scale=2.0, shift=1.0)
    w, b = layer.params["weight"], layer.params["bias"]
    rows = [_forward_row("layernorm", "forward: layers.LayerNorm vs functional", layer.forward(x),
                         _layernorm(layer.params, x))]
    if use_kernels:
        rows += _kernel_rows("layernorm", "layernorm", [x, w, b],
                             lambda m, x, w, b: m.layernorm_forward(x, w, b, 1e-6),
                             lambda m, d, c: dict(zip(("dx", "dweight", "dbias"), m.layernorm_backward(d, c))),
                             axes={"forward": TOKENS, "dx": TOKENS})
    xhat = (x - x.mean(-1, keepdims=True)) / (x.var(-1, keepdims=True) + 1e-6) ** 0.5    # for the diagnosis
    return rows + _gradient_rows("layernorm", layer, x, factors={"D": D, "B": B},
                                 axes={"dx": TOKENS, "dweight": ("D",), "dbias": ("D",)},
                                 refs={"dx": {"xhat": xhat}})


def _check_gelu(approximate, rng, use_kernels, op=None):
    op = op or f"gelu_{approximate}"
    layer = L.GELU(approximate)
    x = _random(rng, (B, N, 8), scale=2.0)
    rows = [_forward_row(op, "forward: layers.GELU vs functional", layer.forward(x),
                         F.gelu_forward(x, approximate)[0])]
    if use_kernels:
        rows += _kernel_rows(op, "gelu", [x], lambda m, x: m.gelu_forward(x, approximate),
                             lambda m, d, c: {"dx": m.gelu_backward(d, c)})
    return rows + _gradient_rows(op, layer, x, axes={"dx": TOKENS})


def check_gelu_erf(rng, use_kernels):
    return _check_gelu("erf", rng, use_kernels)


def check_gelu_tanh(rng, use_kernels):
    return _check_gelu("tanh", rng, use_kernels)


def check_quick_gelu(rng, use_kernels):
    """OpenAI CLIP's x sigmoid(1.702 x). Its kernel is not compared: the gelu rows above do that for the kernel."""
    return _check_gelu("quick", rng, False, op="quick_gelu")


def check_softmax(rng, use_kernels):
    x = _random(rng, (B, 4, 7), scale=2.0)
    rows = []
    if use_kernels:
        rows += _kernel_rows("softmax", "softmax", [x], lambda m, x: m.softmax_forward(x),
                             lambda m, d, c: {"dx": m.softmax_backward(d, c)})
    pair = PairLayer(lambda x: F.softmax_forward(x), lambda dout, cache: F.softmax_backward(dout, cache))
    s = F.softmax_forward(x)[0]
    return rows + _gradient_rows("softmax", pair, x, axes={"dx": ("B", "row", "j")}, refs={"dx": {"s": s}})


NH, HS = 2, 16                                                                  # sqrt(hs) = 4: not 2 or 3
ATTENTION_FACTORS = {"sqrt(hs)": math.sqrt(HS), "B": B, "N": N}


def check_attention(rng, use_kernels):
    """The core softmax(q k^T / sqrt(hs)) v of functional.py, its input gradient shown as dq, dk, dv."""
    nh, hs = NH, HS
    D = nh * hs
    factors = ATTENTION_FACTORS
    qkv = _random(rng, (B, N, 3 * D))                                           # (B, N, 3D)
    heads = ("B", "N", "head", "hs")

    def split(dqkv):                                                            # (B, N, 3D) -> dq, dk, dv
        parts = to_numpy(dqkv).reshape(B, N, 3, nh, hs)
        return {"dq": parts[:, :, 0], "dk": parts[:, :, 1], "dv": parts[:, :, 2]}

    rows = []
    if use_kernels:
        rows += _kernel_rows("attention", "attention", [qkv, nh], lambda m, qkv, nh: m.attention_forward(qkv, nh),
                             lambda m, d, c: split(m.attention_backward(d, c)), factors=factors,
                             axes={"forward": ("B", "N", "D"), "dq": heads, "dk": heads, "dv": heads})
    core = PairLayer(lambda qkv: F.attention_forward(qkv, nh), lambda dout, cache: F.attention_backward(dout, cache))

    def alternatives(dout):                                                     # dv without P's transpose
        q, k, _ = (to_numpy(qkv).reshape(B, N, 3, nh, hs)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        scores = q @ k.swapaxes(-1, -2) / math.sqrt(hs)                         # (B, nh, N, N)
        P = np.exp(scores - scores.max(-1, keepdims=True))
        P /= P.sum(-1, keepdims=True)
        dctx = to_numpy(dout).reshape(B, N, nh, hs).transpose(0, 2, 1, 3)      # (B, nh, N, hs)
        return {"dv": [((P @ dctx).transpose(0, 2, 1, 3),
                        "dv = P @ dout: the transpose of P is missing. ctx = P v, so dv = P^T @ dout (row j of v "
                        "is read by every query i, weighted by P[i, j]), not P @ dout")]}

    return rows + _gradient_rows("attention", core, qkv, split_input=split, factors=factors,
                                 axes={"dq": heads, "dk": heads, "dv": heads}, alternatives=alternatives)


def check_masked_attention(rng, use_kernels):
    """The core with an additive causal mask (CLIP's text tower): softmax(q k^T / sqrt(hs) + mask) v, by hand
    in NumPy, and its dq, dk, dv by central differences with the mask held fixed."""
    nh, hs = NH, HS
    D = nh * hs
    qkv = _random(rng, (B, N, 3 * D))                                           # (B, N, 3D)
    mask = F.causal_mask(qkv)                                                   # (N, N): -inf above the diagonal
    heads = ("B", "N", "head", "hs")
    q, k, v = (to_numpy(qkv).reshape(B, N, 3, nh, hs)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.swapaxes(-1, -2) / math.sqrt(hs) + to_numpy(mask)           # (B, nh, N, N)
    P = np.exp(scores - scores.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    expected = (P @ v).transpose(0, 2, 1, 3).reshape(B, N, D)                   # (B, N, D)

    def split(dqkv):                                                            # (B, N, 3D) -> dq, dk, dv
        parts = to_numpy(dqkv).reshape(B, N, 3, nh, hs)
        return {"dq": parts[:, :, 0], "dk": parts[:, :, 1], "dv": parts[:, :, 2]}

    rows = [_forward_row("masked_attention", "forward: functional.attention_forward(mask) vs softmax(+ mask) by hand",
                         F.attention_forward(qkv, nh, mask)[0], expected, axes=("B", "N", "D"),
                         why="differs: is the mask added to the scores before the softmax?")]
    core = PairLayer(lambda qkv: F.attention_forward(qkv, nh, mask),
                     lambda dout, cache: F.attention_backward(dout, cache))
    return rows + _gradient_rows("masked_attention", core, qkv, split_input=split, factors=ATTENTION_FACTORS,
                                 axes={"dq": heads, "dk": heads, "dv": heads})


def check_attention_layer(rng, use_kernels):
    """layers.Attention: the packed qkv projection, the core, the output projection."""
    layer = _randomise(L.Attention(NH * HS, NH, dtype="float64"), rng, 0.2)
    x = _random(rng, (B, N, NH * HS))
    rows = [_forward_row("attention_layer", "forward: layers.Attention vs functional", layer.forward(x),
                         _attention(layer.params, x, NH))]
    return rows + _gradient_rows("attention_layer", layer, x, max_checks=40, factors=ATTENTION_FACTORS,
                                 axes={"dx": TOKENS, "dproj.weight": ("D", "D")})


def check_mlp(rng, use_kernels):
    layer = _randomise(L.MLP(8, 16, dtype="float64"), rng)
    x = _random(rng, (B, N, 8))
    rows = [_forward_row("mlp", "forward: layers.MLP vs functional", layer.forward(x), _mlp(layer.params, x, "erf"))]
    return rows + _gradient_rows("mlp", layer, x, max_checks=60, axes={"dx": TOKENS}, factors={"B": B})


def check_block(rng, use_kernels):
    layer = _randomise(L.Block(16, 2, mlp_ratio=2.0, dtype="float64"), rng, 0.3)
    x = _random(rng, (B, N, 16))
    rows = [_forward_row("block", "forward: layers.Block vs functional", layer.forward(x),
                         _block(layer.params, x, 2, "erf"))]
    return rows + _gradient_rows("block", layer, x, max_checks=30, axes={"dx": TOKENS}, factors={"B": B})


def check_pos_embed(rng, use_kernels):
    layer = _randomise(E.PosEmbed(6, 8, class_token=True, dtype="float64"), rng)
    x = _random(rng, (B, 6, 8))
    rows = [_forward_row("pos_embed", "forward: embeddings.PosEmbed vs functional", layer.forward(x),
                         _pos_embed(layer.params, x))]
    return rows + _gradient_rows("pos_embed", layer, x, factors={"B": B},
                                 axes={"dx": TOKENS, "dcls_token": ("1", "1", "D"), "dpos_embed": ("1", "N+1", "D")})


def check_grid_pos_embed(rng, use_kernels):
    """embeddings.GridPosEmbed, "learned2d" (a row table and a column table) and "sincos2d" (fixed), with a
    class token: x + pos, then [x_class; x]."""
    (gh, gw), D = (2, 4), 8                                                     # gw is not B: 1/gw is told apart
    x = _random(rng, (B, gh * gw, D))                                           # (B, N, D)
    rows = []
    for kind in ("learned2d", "sincos2d"):
        layer = _randomise(E.GridPosEmbed((gh, gw), D, kind, class_token=True, dtype="float64"), rng)
        p, xp = layer.params, get_array_module(x)
        if kind == "learned2d":                                                 # patch (r, c) gets [row_r | col_c]
            pos = xp.concatenate([xp.repeat(p["pos_embed_row"][0], gw, axis=0),
                                  xp.tile(p["pos_embed_col"][0], (gh, 1))], axis=-1)[None]     # (1, N, D)
        else:
            pos = E.sincos2d_table((gh, gw), D, dtype="float64")                 # (1, N, D)
        expected = xp.concatenate([xp.broadcast_to(p["cls_token"], (B, 1, D)), x + pos], axis=1)  # (B, N+1, D)
        rows.append(_forward_row("grid_pos_embed", f"{kind}: forward vs x + pos, the class token first",
                                 layer.forward(x), expected))
        for r in _gradient_rows("grid_pos_embed", layer, x, factors={"B": B, "gh": gh, "gw": gw},
                                axes={"dx": TOKENS, "dcls_token": ("1", "1", "D")}):
            r.what = f"{kind}: {r.what}"
            rows.append(r)
    return rows


class _TokenIds:
    """embeddings.Embedding seen as a layer of a float input that it ignores: its input, token ids, is held
    fixed (integers have no gradient), and only its weight's gradient is checked."""

    def __init__(self, layer, ids):
        self.layer, self.ids = layer, ids
        self.params, self.grads = layer.params, layer.grads

    def forward(self, x):
        return self.layer.forward(self.ids)

    def backward(self, dout):
        return self.layer.backward(dout)

    def train(self, mode=True):
        self.layer.train(mode)
        return self

    def zero_grad(self):
        self.layer.zero_grad()


def check_embedding(rng, use_kernels):
    """embeddings.Embedding: ids (B, N) -> rows of weight (V, D). Some ids repeat, so their rows' gradient
    is a sum (dweight[ids] += dout would keep only one of them)."""
    V, D = 7, 4
    layer = _randomise(E.Embedding(V, D, dtype="float64"), rng)
    ids = asarray(np.array([[1, 3, 3, 0, 6], [2, 2, 2, 5, 1], [6, 0, 4, 3, 3]]))   # (B, N) with repeats
    onehot = np.eye(V)[to_numpy(ids)]                                           # (B, N, V)
    rows = [_forward_row("embedding", "forward: embeddings.Embedding vs onehot(ids) @ weight", layer.forward(ids),
                         onehot @ to_numpy(layer.params["weight"]))]
    probe = asarray(np.zeros(1), dtype="float64")                                # a placeholder: ids are fixed
    return rows + _gradient_rows("embedding", _TokenIds(layer, ids), probe, check_input=False,
                                 axes={"dweight": ("V", "D")})


def check_pool(rng, use_kernels):
    x = _random(rng, (B, N, 8))
    rows = []
    for mode, expected in (("cls", x[:, 0]), ("gap", x.mean(1))):
        layer = L.Pool(mode)
        rows.append(_forward_row("pool", f"{mode}: forward vs x[:, 0]" if mode == "cls" else "gap: forward vs mean",
                                 layer.forward(x), expected))
        for r in _gradient_rows("pool", layer, x, axes={"dx": TOKENS}, factors={"N": N, "B": B}):
            r.what = f"{mode}: {r.what}"
            rows.append(r)
    return rows


class _FixedMask:
    """A Dropout layer whose generator is reset before every forward, so that every forward draws the same
    mask: deterministic, so central differences can check its backward. (Not a Layer: gradcheck refuses a
    random layer inside a Layer, and this one is random no more.)"""

    def __init__(self, layer, seed):
        self.layer, self.seed = layer, seed
        self.params, self.grads = layer.params, layer.grads

    def forward(self, x):
        self.layer.rng = host_rng(self.seed)
        return self.layer.forward(x)

    def backward(self, dout):
        return self.layer.backward(dout)

    def train(self, mode=True):
        self.layer.train(mode)
        return self


def _check_dropout(per_sample, rng, use_kernels):
    """layers.Dropout(p) in training mode, as it stands: out = x * keep / (1 - p), keep drawn from the layer's
    generator, one number per value (dropout) or per sample (drop-path, keep (B, 1, 1)). The mask is random,
    so the forward is checked by what any right mask gives (each unit 0 or x / (1 - p), a share p of them 0),
    and the backward by central differences with the generator reset before each forward (the same mask)."""
    op, unit = ("drop_path", "sample") if per_sample else ("dropout", "value")
    p, seed = 0.25, 2                        # 1/(1-p) = 4/3, not 2; seed 2 keeps 5 of the 8 samples, drops 3
    factors = {"1 - p": 1 - p}
    layer = L.Dropout(p, per_sample=per_sample)
    fixed = _FixedMask(layer, seed)
    x = _random(rng, (8, N, 4))                                                  # (B, N, D), no zero in it
    out, again = to_numpy(fixed.forward(x)), to_numpy(fixed.forward(x))         # (B, N, D) twice
    same = _forward_row(op, "forward: the same generator state, the same mask", again, out)
    if not same.ok:
        same.note = ("two forwards from the same state of self.rng differ: draw the mask from self.rng (the "
                     "layer's generator, which checkpoints save), not from np.random")
    rows = [same]
    xs = to_numpy(x) / (1 - p)                                                   # a kept unit's value
    units = out.reshape(8, -1) if per_sample else out.reshape(-1, 1)            # one row per unit
    dropped = (np.abs(units).sum(1) < np.abs(units - xs.reshape(units.shape)).sum(1))[:, None]
    expected = np.where(dropped, 0.0, xs.reshape(units.shape)).reshape(out.shape)
    row = _forward_row(op, f"forward: each {unit} is 0 or x / (1 - p)", out, expected, factors=factors)
    zeros = (out == 0).reshape(8, -1).mean(1)                                    # (B,) share of zeros per sample
    mixed = ((zeros > 0) & (zeros < 1)).any()
    if per_sample and mixed:
        row.note = ("zeros inside a sample: a mask drawn per value is dropout's; drop-path drops a whole sample's "
                    "branch, one number per sample: keep of shape (B, 1, 1)")
    elif not per_sample and zeros.any() and not mixed:
        row.error, row.note = 1.0, ("only whole samples are dropped: that is drop-path's mask (B, 1, 1); dropout "
                                    "draws one number per value, keep of x's shape")
    rows.append(row)
    many = asarray(np.ones((2000, 2, 2) if per_sample else (20, 10, 10)), dtype="float64")   # 2000 units
    out_many = to_numpy(layer.forward(many))
    share = float((out_many == 0).reshape(2000, -1).mean(1).mean() if per_sample else (out_many == 0).mean())
    row = Row(op, f"forward: the share of {unit}s dropped, of 2000 (p = {p})", abs(share - p) / p, 0.2,
              got=np.array([share]), expected=np.array([p]))             # 0.2 p: 5 std of the share (0.0097)
    if not row.ok:
        row.note = f"{share:.2f} of the {unit}s dropped, where p = {p}" + (
            ": kept with probability p instead of dropped (keep = u >= p, for u uniform in [0, 1))"
            if abs(share - (1 - p)) < 0.05 else "")
    rows.append(row)
    layer.eval()
    rows.append(_forward_row(op, "eval mode: out = x", layer.forward(x), x, factors=factors,
                             why="in eval mode dropout is the identity: the whole network, nothing dropped and "
                                 "nothing rescaled (the 1/(1-p) in training is what makes that right)"))
    layer.train()

    def alternatives(dout):
        return {"dx": [(dout, "dx = dout: the backward must apply the forward's mask and its 1/(1-p) too (out = x "
                              "* keep / (1 - p), so dx = dout * keep / (1 - p))"),
                       (dout / (1 - p), f"dx = dout / (1 - p) everywhere: the mask is missing (a dropped {unit} "
                                        f"passes no gradient)")]}

    grads = _gradient_rows(op, fixed, x, axes={"dx": TOKENS}, factors=factors, alternatives=alternatives)
    for r in grads if not same.ok else []:
        r.note = ("the mask changes from one forward to the next, so central differences see another layer each "
                  "time: fix the row 'the same mask' first")
    return rows + grads


def check_dropout(rng, use_kernels):
    return _check_dropout(False, rng, use_kernels)


def check_drop_path(rng, use_kernels):
    return _check_dropout(True, rng, use_kernels)


def _conv_stem(layer, x):
    """ConvStem's forward composed from conv.py's pairs: conv, GroupNorm, ReLU per stage, flatten, proj."""
    for stage in layer.stages:
        c, g = stage.conv, stage.norm
        x = conv.conv2d_forward(x, c.params["weight"], c.params.get("bias"), c.stride, c.padding)[0]
        x = conv.relu_forward(conv.groupnorm_forward(x, g.params["weight"], g.params["bias"], g.num_groups,
                                                     g.eps)[0])[0]                # (B, h, w, c)
    Bx, h, w, c = x.shape
    return _linear(_sub(layer.params, "proj."), x.reshape(Bx, h * w, c))        # (B, N, D)


def check_conv_stem(rng, use_kernels):
    """conv.ConvStem, the hybrid's patch embedding (paper 3.1): 3x3 conv stages, GroupNorm, ReLU, 1x1 patches."""
    layer = _randomise(ConvStem(3, (4, 6), 8, dtype="float64"), rng, 0.3)
    x = _random(rng, (B, 8, 8, 3))                                              # (B, H, W, C)
    rows = [_forward_row("conv_stem", "forward: conv.ConvStem vs conv.py's pairs", layer.forward(x),
                         _conv_stem(layer, x))]
    return rows + _gradient_rows("conv_stem", layer, x, max_checks=30, axes={"dx": ("B", "H", "W", "C")},
                                 factors={"B": B})


def check_head(rng, use_kernels):
    """The stages after the blocks: the final LayerNorm, the class token, the tanh layer, the linear head."""
    D, R, K = 8, 6, 4
    norm, pool = L.LayerNorm(D, dtype="float64"), L.Pool("cls")
    pre_logits, head = L.PreLogits(D, R, dtype="float64"), L.Linear(R, K, dtype="float64")
    layer = _randomise(_Stages([("norm", norm), ("pool", pool), ("pre_logits", pre_logits), ("head", head)]), rng)
    x = _random(rng, (B, N, D))
    normed = _layernorm(_sub(layer.params, "norm."), x)[:, 0]                         # (B, D)
    y = F.tanh_forward(_linear(_sub(layer.params, "pre_logits.fc."), normed))[0]
    rows = [_forward_row("head", "forward: norm, pool, pre_logits, head vs functional", layer.forward(x),
                         _linear(_sub(layer.params, "head."), y))]
    return rows + _gradient_rows("head", layer, x, axes={"dx": TOKENS}, factors={"B": B})


def check_cross_entropy(rng, use_kernels):
    Bc, K, smoothing = 5, 4, 0.1
    logits = _random(rng, (Bc, K), scale=2.0)
    labels = asarray(np.array([1, 0, 3, 3, 2]))
    xp = get_array_module(logits)
    q = (1 - smoothing) * xp.eye(K)[labels] + smoothing / K                     # (B, K) the smoothed target
    shifted = logits - logits.max(-1, keepdims=True)
    expected = -(q * (shifted - xp.log(xp.exp(shifted).sum(-1, keepdims=True)))).sum() / Bc
    rows = [_forward_row("cross_entropy", "forward: loss vs -mean(sum q log softmax)",
                         F.cross_entropy_forward(logits, labels, smoothing)[0], expected, factors={"B": Bc})]
    pair = PairLayer(lambda z: _loss_as_vector(F.cross_entropy_forward(z, labels, smoothing)),
                     lambda dout, cache: F.cross_entropy_backward(cache) * dout[0])
    for r in _gradient_rows("cross_entropy", pair, logits, axes={"dx": ("B", "K")}, factors={"B": Bc, "K": K}):
        r.what = "dlogits" if r.what == "dx" else r.what
        rows.append(r)
    return rows


def _loss_as_vector(loss_and_cache):
    loss, cache = loss_and_cache
    return loss.reshape(1), cache                                                # (1,): gradcheck takes arrays


def check_model(rng, use_kernels):
    config = ViTConfig(img_size=8, patch_size=2, in_chans=3, num_classes=5, embed_dim=16, depth=2, num_heads=2,
                       mlp_ratio=2.0)
    model = _randomise(ViT(config, seed=0, dtype="float64"), rng, 0.1)
    x = _random(rng, (B, 8, 8, 3))
    rows = [_forward_row("model", "forward: ViT vs functional", model.forward(x), _vit(model, x))]
    rows = _Rows(rows + _gradient_rows("model", model, x, max_checks=16, axes={"dx": ("B", "H", "W", "C")},
                                       factors={"B": B}))
    if not rows[-1].ok or any(not r.ok for r in rows[1:]):          # which layer: its own check says
        rows.first_wrong_layer = walk_rows(model, x)[1]
    return rows


class _Rows(list):
    """An op's rows, and for the model the first layer (by path) whose own check fails."""
    first_wrong_layer = None


def check_adamw(rng, use_kernels):
    """functional.adamw_update against what its formula implies, against kernels.adamw_update, and inside
    optim.AdamW.step. m and v are zero before the first step."""
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-8, 0.05
    factors = {"1 - b1": 1 - b1, "1/sqrt(1 - b2)": 1 / math.sqrt(1 - b2),
               "(1 - b1) / sqrt(1 - b2)": (1 - b1) / math.sqrt(1 - b2), "lr": lr}
    shape = (4, 6)
    p0, grads = _random(rng, shape), [_random(rng, shape) for _ in range(3)]
    xp = get_array_module(p0)
    p, m, v = p0.copy(), xp.zeros(shape), xp.zeros(shape)         # step 1 with eps = wd = 0: m_hat = g and
    F.adamw_update(p, grads[0], m, v, lr, b1, b2, 0.0, 0.0, 1)    # sqrt(v_hat) = |g|, so p moves by lr
    rows = [_forward_row("adamw", "step 1: m = (1 - b1) g", m, (1 - b1) * grads[0], factors=factors),
            _forward_row("adamw", "step 1: v = (1 - b2) g^2", v, (1 - b2) * grads[0] ** 2, factors=factors),
            _forward_row("adamw", "step 1 (eps = wd = 0): p moves by -lr sign(g)", p - p0, -lr * xp.sign(grads[0]),
                         factors=factors)]
    for row, name, before, after in zip(rows, ("m", "v", "p"), (xp.zeros(shape), xp.zeros(shape), p0), (m, v, p)):
        _rebound(row, name, before, after, "adamw_update")
    p = p0.copy()                                                 # g = 0: only the decoupled decay moves p
    F.adamw_update(p, xp.zeros(shape), xp.zeros(shape), xp.zeros(shape), lr, b1, b2, eps, wd, 1)
    rows.append(_forward_row("adamw", "g = 0: p <- p (1 - lr wd)", p, p0 * (1 - lr * wd),
                             why="with a zero gradient only the decay moves p: is it decoupled, p *= 1 - lr wd "
                                 "before the Adam step, and not added to the gradient (that is Adam with L2)?"))
    if use_kernels and not (kernels.HAVE_NUMBA and backend_of(p0) == "numpy"):
        rows.append(Row("adamw", "kernels.adamw_update", math.nan, TOL_KERNEL,
                        "the CPU kernel needs Numba and NumPy arrays", skipped=True))
    elif use_kernels:
        p64, m64, v64 = p0.copy(), xp.zeros(shape), xp.zeros(shape)
        p32, m32, v32 = p64.astype("float32"), m64.astype("float32"), v64.astype("float32")
        for t, g in enumerate(grads, start=1):
            F.adamw_update(p64, g, m64, v64, lr, b1, b2, eps, wd, t)
            kernels.adamw_update(p32, g.astype("float32"), m32, v32, lr, b1, b2, eps, wd, t)
        for name, a64, a32 in (("p", p64, p32), ("m", m64, m32), ("v", v64, v32)):
            rows.append(_forward_row("adamw", f"3 steps: {name} vs kernels.adamw_update, float32", a64,
                                     a32.astype("float64"), factors=factors, tol=TOL_KERNEL,
                                     why="differs after 3 steps (the step count t in the bias corrections?)"))

    def by_hand(p, g, state, t, decay):                           # state: (m, v), updated in place
        F.adamw_update(p, g, *state, lr, b1, b2, eps, decay, t)
        return state

    make = lambda layer: AdamW(layer, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, no_decay=("bias",))
    return rows + _optimizer_rows("adamw", make, by_hand, lambda p: (p * 0, p * 0), wd, rng)


def check_sgd(rng, use_kernels):
    """functional.sgd_update against torch.optim.SGD's rule written out, and inside optim.SGD.step."""
    lr, mu, wd = 0.1, 0.9, 0.05
    p0, grads = _random(rng, (4, 6)), [_random(rng, (4, 6)) for _ in range(3)]
    rows = []
    for nesterov in (False, True):
        p, buf, expected, b = p0.copy(), None, p0.copy(), None
        for g in grads:
            buf = F.sgd_update(p, g, buf, lr, mu, nesterov, wd)
            g_t = g + wd * expected                               # the rule, as torch.optim.SGD documents it
            b = g_t if b is None else mu * b + g_t
            expected = expected - lr * (g_t + mu * b if nesterov else b)
        kind = "nesterov" if nesterov else "momentum"
        rows += [_forward_row("sgd", f"{kind}, 3 steps: p vs the rule written out", p, expected, factors={"lr": lr}),
                 _forward_row("sgd", f"{kind}, 3 steps: the momentum buffer", buf, b, factors={"mu": mu})]
    p = p0.copy()
    F.sgd_update(p, grads[0], None, lr, 0.0, False, 0.0)
    rows.append(_forward_row("sgd", "no momentum: p <- p - lr g", p, p0 - lr * grads[0], factors={"lr": lr}))
    _rebound(rows[-1], "p", p0, p, "sgd_update")

    def by_hand(p, g, buf, t, decay):                             # the momentum buffer: None before step 1
        return F.sgd_update(p, g, buf, lr, mu, False, decay)

    make = lambda layer: SGD(layer, lr=lr, momentum=mu, weight_decay=wd, no_decay=("bias",))
    return rows + _optimizer_rows("sgd", make, by_hand, lambda p: None, wd, rng)


def _optimizer_rows(op, make, by_hand, new_state, wd, rng):
    """optim's class (as it stands) for 3 steps on a Linear layer, against the update rule called by hand,
    bias exempt from weight decay: do the class's step count, buffers and no_decay fit the rule?
    by_hand(p, g, state, t, weight_decay) -> state."""
    layer = L.Linear(4, 6, dtype="float64")
    layer.params["bias"][...] = _random(rng, 6)
    opt = make(layer)
    hand = {name: [p.copy(), new_state(p)] for name, p in layer.params.items()}
    arrays = dict(layer.params.items())                           # the arrays the model holds, by identity
    for t in range(1, 4):
        for name, g in layer.grads.items():
            g[...] = _random(rng, g.shape)
            p, state = hand[name]
            hand[name][1] = by_hand(p, g, state, t, 0.0 if name == "bias" else wd)
        opt.step()
    rows = []
    for name in layer.params:
        what = f"optim.{type(opt).__name__}.step, 3 steps: {name} vs functional.{op}_update by hand"
        if layer.params[name] is not arrays[name]:
            rows.append(Row(op, what, math.inf, TOL_SAME,
                            f"the parameter array was replaced (a new array put into params) instead of updated in "
                            f"place: whatever holds the old array (data parallel's flat buffers, a caller's "
                            f"reference) no longer sees the model's {name}; "
                            f"update it in place (p -= ..., p[...] = ...)"))
        else:
            rows.append(_forward_row(op, what, layer.params[name], hand[name][0]))
    return rows


def _rebound(row, name, before, after, fn):
    """A WRONG row whose array did not change at all: the update rebound its name to a new array."""
    if not row.ok and get_array_module(after).array_equal(after, before):
        row.note = ("the parameter array was rebound, not updated in place: the model's array did not change "
                    if name == "p" else f"{name} was rebound, not updated in place: the optimizer's {name} did "
                    f"not change ") + (f"(`{name} = {name} - ...` in {fn} makes a new array, lost on return; write "
                                       f"`{name} -= ...` or `{name}[...] = ...`)")


# name -> (check, what it covers); `python -m minivit.check --help` prints this table
OPS = {
    "patch_embed": (check_patch_embed,
                    "embeddings.PatchEmbed: functional.im2patch / patch2im, the linear projection E"),
    "linear": (check_linear, "layers.Linear: functional.linear_forward / linear_backward"),
    "layernorm": (check_layernorm, "layers.LayerNorm: functional.layernorm_* (and kernels.layernorm_*)"),
    "gelu_erf": (check_gelu_erf, "layers.GELU('erf'): functional.gelu_* (and kernels.gelu_*)"),
    "gelu_tanh": (check_gelu_tanh, "layers.GELU('tanh'): functional.gelu_* (and kernels.gelu_*)"),
    "quick_gelu": (check_quick_gelu, "layers.GELU('quick'), CLIP's x sigmoid(1.702 x): functional.gelu_*"),
    "softmax": (check_softmax, "functional.softmax_* (and kernels.softmax_*)"),
    "attention": (check_attention, "functional.attention_*: softmax(q k^T / sqrt(hs)) v, its dq, dk, dv "
                                   "(and kernels.attention_*)"),
    "masked_attention": (check_masked_attention, "functional.attention_* with a causal mask (CLIP's text tower)"),
    "attention_layer": (check_attention_layer, "layers.Attention: qkv projection, the core, proj"),
    "mlp": (check_mlp, "layers.MLP: fc1, GELU, fc2"),
    "block": (check_block, "layers.Block: the pre-norm residual block, Eqs. 2-3"),
    "pos_embed": (check_pos_embed, "embeddings.PosEmbed: the class token and the position embeddings"),
    "grid_pos_embed": (check_grid_pos_embed, "embeddings.GridPosEmbed: 'learned2d' and 'sincos2d', the class token"),
    "embedding": (check_embedding, "embeddings.Embedding: token ids -> rows of the table (repeated ids add)"),
    "conv_stem": (check_conv_stem, "conv.ConvStem: the hybrid's conv stages, GroupNorm, ReLU, 1x1 patches"),
    "pool": (check_pool, "layers.Pool: 'cls' and 'gap'"),
    "dropout": (check_dropout, "layers.Dropout(p): a mask per value, 1/(1-p), the identity in eval mode"),
    "drop_path": (check_drop_path, "layers.Dropout(p, per_sample=True), stochastic depth: a mask per sample, "
                                   "1/(1-p)"),
    "head": (check_head, "the last stages: norm, pool, pre_logits (functional.tanh_*), head"),
    "cross_entropy": (check_cross_entropy, "functional.cross_entropy_*, with label smoothing 0.1"),
    "model": (check_model, "the whole ViT (2 blocks), every parameter"),
    "adamw": (check_adamw, "functional.adamw_update (and kernels.adamw_update), optim.AdamW"),
    "sgd": (check_sgd, "functional.sgd_update, optim.SGD"),
}
COMPOSITE = ("conv_stem", "attention_layer", "mlp", "block", "head", "model")


def select(names=None):
    """The op names to check: all (None or empty), or those named; a name also selects every op it begins
    with before an underscore ("gelu": gelu_erf and gelu_tanh). Unknown names raise a ValueError listing
    the valid ones."""
    if not names:
        return list(OPS)
    if isinstance(names, str):
        names = [names]
    chosen, unknown = [], []
    for name in names:
        found = [op for op in OPS if op == name or op.startswith(name + "_")]
        if not found:
            unknown.append(name)
        chosen += [op for op in found if op not in chosen]
    if unknown:
        raise ValueError(f"unknown op name(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(OPS)}")
    return chosen


def run(names=None, use_kernels=True, seed=0):
    """Check the named ops (default: all of OPS) and return a Report: ``print`` it, read ``.ok``, ``.wrong()``.
    use_kernels=False leaves out the comparisons with kernels.py (for math changed on purpose)."""
    start = time.perf_counter()
    rows, hints = [], {}
    for op in select(names):
        check, _ = OPS[op]
        try:
            op_rows = check(host_rng(seed), use_kernels)
        except Exception as err:                    # a student's edit that raises: say where, and go on
            op_rows = [_textbook_differs(op, err) or _raised(op, err)]
        _point_kernel_rows_at_gradient_rows(op_rows)
        rows += op_rows
        if op in COMPOSITE and any(not r.ok for r in op_rows):
            hint = _first_wrong_in_backward(op_rows)
            walk = getattr(op_rows, "first_wrong_layer", None)     # the model: by a walk of its layers
            if walk is not None:
                hint = _walk_hint(walk, hint)
            if hint:
                hints[op] = hint
    return Report(rows, hints, time.perf_counter() - start)


def _point_kernel_rows_at_gradient_rows(rows):
    """A kernel row of a gradient that its own gradient row already calls WRONG says so, and no more: the
    diagnosis is the gradient row's (told once)."""
    wrong = {r.what for r in rows if r.tensor is not None and not r.ok}
    for r in rows:
        name = getattr(r, "kernel_of", None)
        if name in wrong and not r.ok:
            r.note = f"the gradient row {name} is WRONG too: fix that first (this row follows from it)"
