"""Layers a student might write, worked through: changing a layer without losing its fast kernel.

TempAttention: attention with a learned temperature per head, scores = q k^T * scale / tau. The fused
kernel computes softmax(q k^T * scale) v and knows nothing of tau, but dividing the scores by tau is the
same as dividing q by tau first (q' = q / tau per head), so the layer rescales q inside qkv and still
calls ops.attention_forward/backward: the kernel stays in use (``minivit.ops.report(model)`` shows it).
An attention that computes its scores itself runs its own code instead, slower (README, "Speed").

    from minivit.layer_examples import TempAttention
    for blk in model.blocks:
        blk.attn = TempAttention.from_attention(blk.attn)   # keeps qkv, proj; adds "tau" (nh,) = 1
"""

import math

from . import functional as F
from .fast import ops
from .layers import Attention, ones


class TempAttention(Attention):
    """Attention with a learned per-head temperature tau (nh,): softmax(q k^T * scale / tau) v.
    Folded into q (q' = q / tau), so the fused kernel runs it. Backward: from dq' (what the kernel
    returns for q'), dq = dq' / tau and dtau_h = -sum(dq' * q') / tau_h over B, N and hs."""

    def __init__(self, dim, num_heads, qkv_bias=True, drop=0.0, rng=None, dtype="float32", seed=0):
        super().__init__(dim, num_heads, qkv_bias, drop, rng=rng, dtype=dtype, seed=seed)
        self.params["tau"] = ones((num_heads,), dtype)             # (nh,), its gradient made zeroed

    @classmethod
    def from_attention(cls, attn):
        """A TempAttention with attn's qkv, proj and dropout (the same arrays), tau = 1: same output."""
        new = cls.__new__(cls)
        Attention.__init__(new, attn.qkv.in_features, attn.num_heads, rng=None,
                           dtype=str(attn.qkv.params["weight"].dtype))
        new.qkv, new.proj, new.drop = attn.qkv, attn.proj, attn.drop
        new.params["tau"] = ones((attn.num_heads,), str(attn.qkv.params["weight"].dtype))
        return new

    def forward(self, x, mask=None):                                 # (B, N, D)
        B, N, D = x.shape
        nh, tau = self.num_heads, self.params["tau"]
        qkv = self.qkv.forward(x).reshape(B, N, 3, nh, D // nh)      # (B, N, 3, nh, hs)
        # q' = q / tau, in place: qkv is a new array that nothing else keeps (Linear's cache holds x), and
        # dividing it where it lies saves a copy of all of qkv (a speed trick, not part of the idea)
        qkv[:, :, 0] /= tau[:, None]
        q_scaled = qkv[:, :, 0]                                      # (B, N, nh, hs), a view
        ctx, cache = ops.attention_forward(qkv.reshape(B, N, 3 * D), nh, mask)  # (B, N, D), the kernel when checked
        self.cache = (cache, q_scaled) if self.training else None
        return self.drop.forward(self.proj.forward(ctx))             # (B, N, D)

    def backward(self, dout):                                        # (B, N, D)
        cache, q_scaled = self._need_cache()
        B, N, nh, hs = q_scaled.shape
        tau = self.params["tau"]
        dctx = self.proj.backward(self.drop.backward(dout))          # (B, N, D)
        dqkv = ops.attention_backward(dctx, cache).reshape(B, N, 3, nh, hs)  # d(qkv'): (B, N, 3, nh, hs)
        dq_scaled = dqkv[:, :, 0]                                    # (B, N, nh, hs)
        self.grads["tau"] += -(dq_scaled * q_scaled).sum(axis=(0, 1, 3)) / tau   # dq'/dtau = -q / tau^2 = -q' / tau
        dqkv[:, :, 0] /= tau[:, None]                                # dq = dq' / tau (in place, as above)
        return self.qkv.backward(dqkv.reshape(B, N, 3 * nh * hs))    # (B, N, D)

    @property
    def attn(self):
        return None if self.cache is None else ops.attention_weights(self.cache[0])

    def extra_repr(self):
        return f"heads={self.num_heads}, learned temperature"


class PlainTempAttention(Attention):
    """The same temperature written the direct way: the scores computed here from functional.py's pieces.
    Right, but it calls no ops.attention_*, so the fused kernel drops out (ops.report says so) and the
    N x N weights are kept for backward: slower (README, "Speed")."""

    def __init__(self, dim, num_heads, dtype="float32"):
        super().__init__(dim, num_heads, dtype=dtype)
        self.params["tau"] = ones((num_heads,), dtype)

    def forward(self, x, mask=None):
        B, N, D = x.shape
        q, k, v = F.split_heads(self.qkv.forward(x), self.num_heads)          # each (B, nh, N, hs)
        scale = 1.0 / math.sqrt(D // self.num_heads)                         # a Python float: stays float32
        tau = self.params["tau"][:, None, None]                               # (nh, 1, 1)
        attn, _ = F.softmax_forward((q @ k.swapaxes(-1, -2)) * scale / tau)   # (B, nh, N, N)
        ctx = (attn @ v).transpose(0, 2, 1, 3).reshape(B, N, D)
        self.cache = (q, k, v, attn, scale) if self.training else None
        return self.proj.forward(ctx)

    def backward(self, dout):
        q, k, v, attn, scale = self._need_cache()
        B, nh, N, hs = q.shape
        tau = self.params["tau"][:, None, None]                               # (nh, 1, 1)
        dctx = self.proj.backward(dout).reshape(B, N, nh, hs).transpose(0, 2, 1, 3)   # (B, nh, N, hs)
        dattn = dctx @ v.swapaxes(-1, -2)                                     # (B, nh, N, N)
        dv = attn.swapaxes(-1, -2) @ dctx
        dscores = F.softmax_backward(dattn, attn)                             # d(q k^T scale / tau)
        scores = (q @ k.swapaxes(-1, -2)) * scale / tau
        self.grads["tau"] += -(dscores * scores).sum(axis=(0, 2, 3)) / tau[:, 0, 0]
        dq = dscores @ k * scale / tau
        dk = dscores.swapaxes(-1, -2) @ q * scale / tau
        return self.qkv.backward(F.merge_heads(dq, dk, dv))
