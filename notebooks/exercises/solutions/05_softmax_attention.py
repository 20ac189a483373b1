"""Solutions to notebooks/exercises/05_softmax_attention.ipynb. Try the exercises first: the check cells say
what is wrong with your version, which teaches more than reading these lines."""

import numpy as np  # noqa: F401  (the notebook's names, so that this file runs on its own)

from minivit import functional as F


def softmax_backward(dout, cache):
    s = cache                                                 # (..., n) the softmax's output
    return s * (dout - (dout * s).sum(-1, keepdims=True))     # (J^T dout), J = diag(s) - s s^T


def attention_backward(dout, cache):
    q, k, v, attn, scale = cache
    B, nh, N, hs = q.shape
    dctx = dout.reshape(B, N, nh, hs).transpose(0, 2, 1, 3)   # (B, nh, N, hs)
    dattn = dctx @ v.swapaxes(-1, -2)                         # (B, nh, N, N)   ctx = attn v
    dv = attn.swapaxes(-1, -2) @ dctx                         # (B, nh, N, hs)
    dscores = F.softmax_backward(dattn, attn)                 # (B, nh, N, N)   attn = softmax(scores)
    dq = dscores @ k * scale                                  # (B, nh, N, hs)  scores = q k^T scale
    dk = dscores.swapaxes(-1, -2) @ q * scale                 # (B, nh, N, hs)
    return F.merge_heads(dq, dk, dv)                          # (B, N, 3D)
