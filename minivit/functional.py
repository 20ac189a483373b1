"""The math of the Vision Transformer, as pure forward/backward pairs.

Each ``*_forward`` returns its output and a ``cache``: exactly what the matching ``*_backward`` needs.
Each ``*_backward(dout, cache)`` returns the gradient of the loss with respect to every input, given
``dout``, the gradient with respect to the output. There is no autograd anywhere: the chain rule is
written out by hand, one line per term, next to the forward line it differentiates.

Letters used in every shape comment (the paper's and timm's names):
    B   batch size                      H, W, C   image height, width, channels
    P   patch size (P x P pixels)       N         tokens (patches, plus 1 for the class token)
    D   embedding dim (embed_dim)       M         MLP hidden dim (mlp_ratio * D)
    nh  attention heads (num_heads)     hs        head size, D // nh
    K   classes (num_classes)       nr        register tokens (num_registers), after the class token

No numpy import here: ``xp = get_array_module(x)`` is numpy or cupy, whichever x lives in.

This file is the definition: the math, and nothing that is there only for speed, except a few small
tricks for speed or memory (one 2-D product over all rows, an in-place update), each with its reason in a
comment. Some pairs have a fast twin in minivit/fast/kernels.py (the same math fused into one pass, for
float32). minivit/fast/ops.py, the one place that chooses between the two, uses a twin only after checking,
in the running process, that it agrees with the pair written here. So an edit you make here is what
runs (in float32 too, slower), and ops tells you once which op it then took from this file.
"""

import math

from .backend import erf, get_array_module

# --------------------------------------------------------------------------------------------------
# Patches (paper Eq. 1: x in R^{H x W x C} -> x_p in R^{N x (P^2 C)})
# --------------------------------------------------------------------------------------------------


def im2patch(x, patch_size):
    """Cut images into non-overlapping P x P patches, each flattened in (P, P, C) order.

    x: (B, H, W, C) with H and W multiples of P. Returns (B, N, P*P*C) with N = (H/P)(W/P), patches
    in row-major order over the grid (left to right, then top to bottom), as in the paper.
    """
    B, H, W, C = x.shape
    P = patch_size
    gh, gw = H // P, W // P                                   # the patch grid
    x = x.reshape(B, gh, P, gw, P, C)                         # (B, gh, P, gw, P, C)
    x = x.transpose(0, 1, 3, 2, 4, 5)                         # (B, gh, gw, P, P, C)
    return x.reshape(B, gh * gw, P * P * C)                   # (B, N, P*P*C)


def patch2im(patches, patch_size, img_size):
    """The inverse of im2patch: (B, N, P*P*C) -> (B, H, W, C). It is also im2patch's backward, since
    im2patch only moves values around (a permutation), and the gradient of a permutation is its inverse."""
    B, N, PPC = patches.shape
    H, W = img_size
    P = patch_size
    gh, gw = H // P, W // P
    C = PPC // (P * P)
    x = patches.reshape(B, gh, gw, P, P, C)                   # (B, gh, gw, P, P, C)
    x = x.transpose(0, 1, 3, 2, 4, 5)                         # (B, gh, P, gw, P, C)
    return x.reshape(B, H, W, C)                              # (B, H, W, C)


# --------------------------------------------------------------------------------------------------
# Linear: y = x W + b
# --------------------------------------------------------------------------------------------------


def linear_forward(x, weight, bias=None):
    """y = x @ W + b.  x: (..., in), weight: (in, out), bias: (out,) or None. Returns y (..., out) and the
    cache (x as rows, W). The leading axes are folded into one, so the product is a single 2-D matrix
    multiply: NumPy would run a stacked (B, N, in) @ (in, out) as B small products, 10x slower or more."""
    d_in, d_out = weight.shape
    x2 = x.reshape(-1, d_in)                                  # (rows, in), rows = all leading axes
    y = x2 @ weight                                           # (rows, out)
    if bias is not None:
        y += bias                                             # (rows, out), in place: no second array
    return y.reshape(*x.shape[:-1], d_out), (x2, weight)      # (..., out)


def linear_backward(dout, cache):
    """dx = dout W^T, dW = x^T dout (summed over every row: all leading axes), db = sum of dout over rows."""
    x2, weight = cache
    d_in, d_out = weight.shape
    dout2 = dout.reshape(-1, d_out)                           # (rows, out)
    dx = dout2 @ weight.T                                     # (rows, in)
    dweight = x2.T @ dout2                                    # (in, out)
    dbias = dout2.sum(0)                                      # (out,)
    return dx.reshape(*dout.shape[:-1], d_in), dweight, dbias  # (..., in)


# --------------------------------------------------------------------------------------------------
# LayerNorm: over the last axis, eps = 1e-6 as in ViT
# --------------------------------------------------------------------------------------------------


def layernorm_forward(x, weight, bias, eps=1e-6):
    """out = (x - mean) / sqrt(var + eps) * weight + bias, over the last axis.
    x: (..., D); weight, bias: (D,). Returns out (..., D) and the cache for backward."""
    xp = get_array_module(x)
    mean = x.mean(-1, keepdims=True)                          # (..., 1)
    xc = x - mean                                             # (..., D)
    var = (xc * xc).mean(-1, keepdims=True)                   # (..., 1)  biased variance, as PyTorch
    rstd = 1.0 / xp.sqrt(var + eps)                           # (..., 1)
    xhat = xc * rstd                                          # (..., D)
    return xhat * weight + bias, (xhat, rstd, weight)


def layernorm_backward(dout, cache):
    """dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), with dxhat = dout * weight."""
    xhat, rstd, weight = cache
    D = xhat.shape[-1]
    dweight = (dout * xhat).reshape(-1, D).sum(0)             # (D,)
    dbias = dout.reshape(-1, D).sum(0)                        # (D,)
    dxhat = dout * weight                                     # (..., D)
    dx = rstd * (dxhat                                        # term 1: the direct path
                 - dxhat.mean(-1, keepdims=True)              # term 2: through the mean
                 - xhat * (dxhat * xhat).mean(-1, keepdims=True))  # term 3: through the variance
    return dx, dweight, dbias


# --------------------------------------------------------------------------------------------------
# GELU: x * Phi(x), Phi the standard normal CDF. "erf" is exact (timm, PyTorch's default);
# "tanh" is the approximation used by the original JAX/Flax ViT checkpoints; "quick" is OpenAI CLIP's
# x * sigmoid(1.702 x) (sigmoid(1.702 x) is within 0.01 of Phi(x) everywhere).
# --------------------------------------------------------------------------------------------------

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_KINDS = ("erf", "tanh", "quick")
_QUICK = 1.702


def sigmoid(x):
    """1 / (1 + exp(-x)), written so that exp never overflows: exp(-|x|) <= 1 on both sides of 0."""
    xp = get_array_module(x)
    e = xp.exp(-xp.abs(x))                                    # in (0, 1]
    return xp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def check_gelu(approximate):
    """The GELU rule, one of GELU_KINDS: for gelu_forward, layers.GELU and ViTConfig.gelu alike."""
    if approximate not in GELU_KINDS:
        raise ValueError(f"gelu must be one of {GELU_KINDS}, got {approximate!r}")


def gelu_forward(x, approximate="erf"):
    """erf:   gelu(x) = x * 0.5 * (1 + erf(x / sqrt 2))
    tanh:  gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    quick: gelu(x) = x sigmoid(1.702 x)
    x: any shape. Returns (out, cache) with out of x's shape. The cache is x alone: backward computes
    Phi(x) (or t) again rather than keeping a second array of x's size, as PyTorch does."""
    check_gelu(approximate)
    xp = get_array_module(x)
    if approximate == "erf":
        cdf = 0.5 * (1.0 + erf(x / _SQRT_2))                  # Phi(x)
        return x * cdf, (x, approximate)
    if approximate == "quick":
        return x * sigmoid(_QUICK * x), (x, approximate)
    t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
    return 0.5 * x * (1.0 + t), (x, approximate)


def gelu_backward(dout, cache):
    """erf:   d gelu / dx = Phi(x) + x phi(x), phi(x) = exp(-x^2/2) / sqrt(2 pi)
    tanh:  d gelu / dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    quick: d gelu / dx = s + 1.702 x s (1 - s), s = sigmoid(1.702 x)   (sigmoid' = s (1 - s))"""
    x, approximate = cache
    xp = get_array_module(x)
    if approximate == "erf":
        cdf = 0.5 * (1.0 + erf(x / _SQRT_2))                  # Phi(x), again
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * x * x)            # phi(x)
        return dout * (cdf + x * pdf)
    if approximate == "quick":
        s = sigmoid(_QUICK * x)                               # again
        return dout * (s + _QUICK * x * s * (1.0 - s))
    t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))   # t, again
    dt = (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + t) + 0.5 * x * dt)


# --------------------------------------------------------------------------------------------------
# Softmax over the last axis, numerically stable
# --------------------------------------------------------------------------------------------------


def softmax_forward(x):
    """softmax(x)_j = exp(x_j - max x) / sum_k exp(x_k - max x), over the last axis.
    Subtracting the max changes nothing mathematically and keeps exp from overflowing."""
    xp = get_array_module(x)
    e = xp.exp(x - x.max(-1, keepdims=True))                  # (..., n)
    out = e / e.sum(-1, keepdims=True)                        # (..., n)
    return out, out


def softmax_backward(dout, cache):
    """The Jacobian of softmax is diag(s) - s s^T, so dx = s * (dout - sum_j dout_j s_j)."""
    s = cache
    return s * (dout - (dout * s).sum(-1, keepdims=True))     # (..., n)


# --------------------------------------------------------------------------------------------------
# Multi-head self-attention (timm's layout: one packed qkv projection, columns [q | k | v], and
# within each, head h in columns h*hs ... h*hs + hs - 1)
# --------------------------------------------------------------------------------------------------


def split_heads(qkv, num_heads):
    """(B, N, 3D) -> q, k, v, each (B, nh, N, hs)."""
    B, N, D3 = qkv.shape
    hs = D3 // (3 * num_heads)
    qkv = qkv.reshape(B, N, 3, num_heads, hs)                 # (B, N, 3, nh, hs)
    qkv = qkv.transpose(2, 0, 3, 1, 4)                        # (3, B, nh, N, hs)
    return qkv[0], qkv[1], qkv[2]


def merge_heads(dq, dk, dv):
    """The inverse of split_heads: three (B, nh, N, hs) -> (B, N, 3D). Each is copied once, straight
    into its place (stacking first and then transposing would copy everything twice)."""
    xp = get_array_module(dq)
    B, nh, N, hs = dq.shape
    dqkv = xp.empty((B, N, 3, nh, hs), dtype=dq.dtype)       # (B, N, 3, nh, hs)
    for i, d in enumerate((dq, dk, dv)):
        dqkv[:, :, i] = d.transpose(0, 2, 1, 3)               # (B, N, nh, hs) into the q, k or v third
    return dqkv.reshape(B, N, 3 * nh * hs)                    # (B, N, 3D)


def attention_forward(qkv, num_heads, mask=None):
    """Scaled dot-product attention of every head: softmax(q k^T / sqrt(hs) + mask) v, heads concatenated.
    qkv: (B, N, 3D) from the packed projection. mask: None, or an additive (N, N) array (PyTorch's float
    attn_mask): 0 where query i may read key j, -inf where it may not (causal_mask), the same for every
    image and head; no row may be all -inf. Returns out (B, N, D) and the cache. The backward needs no
    mask: a masked weight is 0, and the softmax's backward gives it a zero gradient."""
    B, N, D3 = qkv.shape
    D = D3 // 3
    q, k, v = split_heads(qkv, num_heads)                     # each (B, nh, N, hs)
    scale = 1.0 / math.sqrt(D // num_heads)                   # 1 / sqrt(hs)
    scores = (q * scale) @ k.swapaxes(-1, -2)                 # (B, nh, N, N)
    if mask is not None:
        scores = scores + mask                                # (B, nh, N, N), -inf where masked
    attn, _ = softmax_forward(scores)                         # (B, nh, N, N), rows sum to 1
    ctx = attn @ v                                            # (B, nh, N, hs)
    out = ctx.transpose(0, 2, 1, 3).reshape(B, N, D)          # (B, N, D), heads side by side
    return out, (q, k, v, attn, scale)


def attention_backward(dout, cache):
    """Backward of attention_forward: dout (B, N, D) -> dqkv (B, N, 3D)."""
    q, k, v, attn, scale = cache
    B, nh, N, hs = q.shape
    dctx = dout.reshape(B, N, nh, hs).transpose(0, 2, 1, 3)   # (B, nh, N, hs)
    dattn = dctx @ v.swapaxes(-1, -2)                         # (B, nh, N, N)   ctx = attn v
    dv = attn.swapaxes(-1, -2) @ dctx                         # (B, nh, N, hs)
    dscores = softmax_backward(dattn, attn)                   # (B, nh, N, N)
    dq = dscores @ k                                          # (B, nh, N, hs)  scores = q k^T scale
    dq *= scale                                               #   (in place: no second array)
    dk = dscores.swapaxes(-1, -2) @ q                         # (B, nh, N, hs)
    dk *= scale
    return merge_heads(dq, dk, dv)                            # (B, N, 3D)


def attention_weights(cache):
    """The attention weights softmax(q k^T / sqrt(hs)), (B, nh, N, N), kept in attention_forward's cache.
    (ops.attention_weights also reads the cache of the fused kernel, which recomputes them.)"""
    return cache[3]                                           # the cache is (q, k, v, attn, scale)


def causal_mask(x):
    """The additive causal mask for the N tokens of x (B, N, D): (N, N), 0 where j <= i and -inf where
    j > i, so that token i attends to tokens 0 ... i only (a GPT-style, or CLIP's text, Transformer)."""
    xp = get_array_module(x)
    N = x.shape[1]
    future = xp.triu(xp.ones((N, N), dtype=bool), 1)         # (N, N) True above the diagonal
    return xp.where(future, -xp.inf, 0.0).astype(x.dtype)    # (N, N)


# --------------------------------------------------------------------------------------------------
# Embedding: a lookup table, row ids[b, n] of weight (the token embedding of a text Transformer)
# --------------------------------------------------------------------------------------------------


def embedding_forward(ids, weight):
    """out[b, n] = weight[ids[b, n]]. ids: int (B, N) in [0, V); weight: (V, D). Returns out (B, N, D)
    and the cache. The same as onehot(ids) @ weight, without building the (B, N, V) one-hot array."""
    return weight[ids], (ids, weight.shape)


def embedding_backward(dout, cache):
    """dweight[v] = sum of dout[b, n] over every (b, n) with ids[b, n] = v (the one-hot product's
    transpose); ids get no gradient. add.at adds repeated ids each time (plain dweight[ids] += dout
    would keep only one of them)."""
    ids, shape = cache
    xp = get_array_module(dout)
    dweight = xp.zeros(shape, dtype=dout.dtype)               # (V, D)
    xp.add.at(dweight, ids.reshape(-1), dout.reshape(-1, shape[1]))
    return dweight


# --------------------------------------------------------------------------------------------------
# Dropout and stochastic depth (drop-path). The random mask is drawn by the layer and passed in,
# so each pair here is deterministic and can be gradient-checked.
# --------------------------------------------------------------------------------------------------


def dropout_forward(x, keep_mask, p):
    """out = x * mask / (1 - p): each value kept with probability 1 - p and scaled so E[out] = x.
    x: any shape; keep_mask: boolean, broadcastable to x (per value for dropout, (B, 1, 1) for
    drop-path, where a whole residual branch of one sample is dropped)."""
    scale = keep_mask * (1.0 / (1.0 - p))                     # 0 or 1/(1-p), x's shape or broadcastable
    scale = scale.astype(x.dtype)
    return x * scale, scale


def dropout_backward(dout, cache):
    """The same mask and scale: dx = dout * mask / (1 - p)."""
    scale = cache
    return dout * scale


# --------------------------------------------------------------------------------------------------
# Softmax cross-entropy, mean over the batch, with PyTorch's label smoothing
# --------------------------------------------------------------------------------------------------


def cross_entropy_forward(logits, targets, label_smoothing=0.0):
    """loss = mean_b sum_k -q_bk log softmax(logits_b)_k, where the target distribution q is
    (1 - eps) onehot(label) + eps / K (PyTorch's label smoothing), or given directly as soft targets.
    logits: (B, K); targets: int labels (B,) or soft targets (B, K) whose rows sum to 1.
    Returns (loss as a 0-d array, cache)."""
    xp = get_array_module(logits)
    B, K = logits.shape
    shifted = logits - logits.max(-1, keepdims=True)          # (B, K), stable log-sum-exp
    logsumexp = xp.log(xp.exp(shifted).sum(-1, keepdims=True))  # (B, 1)
    logp = shifted - logsumexp                                # (B, K)  log softmax
    if targets.ndim == 1:
        q = xp.zeros_like(logits)                             # (B, K)
        q[xp.arange(B), targets] = 1.0
    else:
        q = targets.astype(logits.dtype, copy=False)
    if label_smoothing:
        q = (1.0 - label_smoothing) * q + label_smoothing / K
    loss = -(q * logp).sum() / B
    return loss, (logp, q)


def cross_entropy_backward(cache):
    """d loss / d logits = (softmax(logits) - q) / B."""
    logp, q = cache
    xp = get_array_module(logp)
    B = logp.shape[0]
    return (xp.exp(logp) - q) / B                             # (B, K)


def cross_entropy(logits, labels, label_smoothing=0.0):
    """Softmax cross-entropy, averaged over the batch: returns (loss as a float, dlogits (B, K)).

    logits: float (B, K). labels: integer class indices (B,) in [0, K), or soft targets (B, K)
    (mixup/cutmix) whose rows sum to 1. label_smoothing in [0, 1): PyTorch's semantics, the target
    becomes (1 - eps) onehot + eps / K. Checked before any work, with errors that name the value.
    """
    xp = get_array_module(logits)
    if not hasattr(logits, "ndim") or logits.ndim != 2:
        raise ValueError(f"logits must be a (B, K) array, got shape {getattr(logits, 'shape', type(logits))}")
    if logits.dtype.kind != "f":
        raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    B, K = logits.shape
    if B == 0:
        raise ValueError(f"got an empty batch: logits of shape {logits.shape} (the mean over 0 rows is undefined)")
    if get_array_module(labels) is not xp:
        raise TypeError(f"labels are a {type(labels).__module__} array but logits a {xp.__name__} one: "
                        "put both on the same device (minivit.asarray)")
    if labels.ndim == 1:
        if labels.dtype.kind not in "iu":
            raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}")
        if labels.shape[0] != B:
            raise ValueError(f"got {labels.shape[0]} labels for {B} logits rows")
        lo, hi = int(labels.min()), int(labels.max())
        if lo < 0 or hi >= K:
            raise ValueError(f"labels must be in [0, {K}) for {K} classes, got values from {lo} to {hi}")
    elif labels.shape != logits.shape:
        raise ValueError(f"soft targets must have the logits' shape {logits.shape}, got {labels.shape}")
    elif float(labels.min()) < 0 or float(abs(labels.sum(-1) - 1).max()) > 1e-3:
        raise ValueError(f"soft targets must be probabilities: rows >= 0 that sum to 1, got values from "
                         f"{float(labels.min()):.3g} and row sums from {float(labels.sum(-1).min()):.4g} "
                         f"to {float(labels.sum(-1).max()):.4g}")
    loss, cache = cross_entropy_forward(logits, labels, label_smoothing)
    return float(loss), cross_entropy_backward(cache)


# --------------------------------------------------------------------------------------------------
# Tanh: the activation of the representation layer ("pre_logits") of some pre-trained checkpoints
# --------------------------------------------------------------------------------------------------


def tanh_forward(x):
    """out = tanh(x), elementwise. x: any shape. Returns (out, cache); the cache is out itself."""
    xp = get_array_module(x)
    out = xp.tanh(x)                                          # same shape as x
    return out, out


def tanh_backward(dout, cache):
    """d tanh(x) / dx = 1 - tanh(x)^2, read from the forward's output."""
    out = cache
    return dout * (1.0 - out * out)


# --------------------------------------------------------------------------------------------------
# The optimizers' update rules, one parameter at a time, in place (minivit/optim.py keeps their state:
# the step count, the buffers, the hyperparameters). Glossary: p a parameter, g its gradient, lr the
# learning rate, wd the weight decay, t the step number (1 for the first step).
# --------------------------------------------------------------------------------------------------


def sgd_update(p, g, momentum_buffer, lr, momentum, nesterov, weight_decay):
    """SGD with momentum, as torch.optim.SGD (dampening 0), in place on p:
        g_t = g + wd p;   b_t = g_t (first step), else mu b_{t-1} + g_t;   d_t = b_t, or g_t + mu b_t (nesterov)
        p  <- p - lr d_t                          (d_t = g_t when mu = 0: no buffer)
    p, g: any shape; momentum_buffer: p's shape, or None before the first step.
    Returns the momentum buffer (updated in place, or new on the first step; None when mu = 0)."""
    if weight_decay != 0:
        g = g + weight_decay * p                              # g_t: a new array, the gradient stays as it was
    if momentum != 0:
        if momentum_buffer is None:
            momentum_buffer = g.copy()                        # b_1 = g_1
        else:
            momentum_buffer *= momentum
            momentum_buffer += g                              # b_t = mu b_{t-1} + g_t
        g = g + momentum * momentum_buffer if nesterov else momentum_buffer   # d_t
    p -= lr * g                                               # p <- p - lr d_t
    return momentum_buffer


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """Adam with decoupled weight decay, as torch.optim.AdamW, in place on p, m and v:
        p   <- p (1 - lr wd)                      (decay first, not through the gradient)
        m_t  = b1 m_{t-1} + (1 - b1) g            (m_0 = v_0 = 0)
        v_t  = b2 v_{t-1} + (1 - b2) g^2
        p   <- p - lr / (1 - b1^t) * m_t / (sqrt(v_t) / sqrt(1 - b2^t) + eps)
    p, g, m, v: the same shape; step: t, the number of this step (1 for the first)."""
    xp = get_array_module(p)
    bias_c1 = 1 - beta1 ** step                               # 1 - b1^t: m_t averages fewer than 1/(1-b1) steps yet
    bias_c2 = 1 - beta2 ** step                               # 1 - b2^t
    if weight_decay != 0:
        p *= 1 - lr * weight_decay                            # p <- p (1 - lr wd)
    m *= beta1
    m += (1 - beta1) * g                                      # m_t = b1 m + (1 - b1) g
    v *= beta2
    v += (1 - beta2) * (g * g)                                # v_t = b2 v + (1 - b2) g^2
    denom = xp.sqrt(v) / math.sqrt(bias_c2) + eps             # sqrt(v_t / (1 - b2^t)) + eps
    p -= (lr / bias_c1) * (m / denom)                         # p <- p - lr m_hat / denom
