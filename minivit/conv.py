"""Convolutions for the paper's hybrid model (§3.1) and for the ResNet it is compared with.

The same two halves as the rest of minivit: pure forward/backward pairs first (convolution via im2col,
GroupNorm, ReLU, global average pooling), then thin layers over them (Conv2d, GroupNorm, ReLU,
ConvNormAct), then two blocks built from them:

    ConvStem     a small CNN of total stride P whose feature map is cut into 1x1 patches and projected
                 to D: the "hybrid" patch embedding of §3.1. (B, H, W, C) -> (B, N, D), N = HW / P^2.
    BasicBlock   ResNet's two 3x3 convolutions and a shortcut, with GroupNorm: the ResNet baseline
                 (minivit/resnet.py, a model like the ViT) is a stack of them.

Everything is channels-last (NHWC) like the rest of minivit, and a kernel is (kh, kw, C_in, C_out), the
layout of the JAX release (PyTorch's is (C_out, C_in, kh, kw)). The layer contract is layers.py's:
backward ADDS into ``grads``.

Letters in the shape comments (besides functional.py's B, H, W, C, D, N, K):
    Ho, Wo   output height and width        kh, kw   kernel height and width
    Co       output channels                G        GroupNorm groups
"""

import math

from .backend import asarray, get_array_module, host_rng
from .layers import Layer, LayerList, Linear, ones, zeros

# --------------------------------------------------------------------------------------------------
# Convolution as one matrix multiply: im2col gathers every window into a row
# --------------------------------------------------------------------------------------------------


def conv_output_size(size, kernel_size, stride, padding):
    """Ho = (H + 2 pad - kh) // stride + 1."""
    return (size + 2 * padding - kernel_size) // stride + 1


def im2col(x, kh, kw, stride=1, padding=0):
    """Every kh x kw window of x, flattened in (kh, kw, C) order, the kernel's own order.
    x: (B, H, W, C), zero-padded by `padding` on each side. Returns cols (B, Ho, Wo, kh*kw*C)."""
    xp = get_array_module(x)
    B, H, W, C = x.shape
    Ho, Wo = conv_output_size(H, kh, stride, padding), conv_output_size(W, kw, stride, padding)
    xpad = xp.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))   # (B, H+2p, W+2p, C)
    cols = xp.empty((B, Ho, Wo, kh, kw, C), dtype=x.dtype)                        # (B, Ho, Wo, kh, kw, C)
    for i in range(kh):          # one strided slice per kernel offset: kh*kw copies, no loop over pixels
        for j in range(kw):
            cols[:, :, :, i, j, :] = xpad[:, i:i + stride * Ho:stride, j:j + stride * Wo:stride, :]  # (B, Ho, Wo, C)
    return cols.reshape(B, Ho, Wo, kh * kw * C)                                   # (B, Ho, Wo, kh*kw*C)


def col2im(dcols, x_shape, kh, kw, stride=1, padding=0):
    """im2col's backward: each window's gradient is added back onto the pixels it was read from.
    Windows overlap when stride < kernel, so a pixel collects from up to kh*kw of them.
    dcols: (B, Ho, Wo, kh*kw*C); x_shape: (B, H, W, C). Returns dx (B, H, W, C)."""
    xp = get_array_module(dcols)
    B, H, W, C = x_shape
    _, Ho, Wo, _ = dcols.shape
    dcols = dcols.reshape(B, Ho, Wo, kh, kw, C)                                   # (B, Ho, Wo, kh, kw, C)
    dxpad = xp.zeros((B, H + 2 * padding, W + 2 * padding, C), dtype=dcols.dtype)  # (B, H+2p, W+2p, C)
    for i in range(kh):
        for j in range(kw):
            dxpad[:, i:i + stride * Ho:stride, j:j + stride * Wo:stride, :] += dcols[:, :, :, i, j, :]
    return dxpad[:, padding:padding + H, padding:padding + W, :]                  # (B, H, W, C)


def conv2d_forward(x, weight, bias=None, stride=1, padding=0):
    """out[b, i, j] = sum over the window at (i, j) of x * weight, + bias; computed as im2col(x) @ W.
    x: (B, H, W, C); weight: (kh, kw, C, Co); bias: (Co,) or None. Returns out (B, Ho, Wo, Co)."""
    kh, kw, C, Co = weight.shape
    if x.shape[-1] != C:
        raise ValueError(f"conv2d: the input has {x.shape[-1]} channels but the kernel {tuple(weight.shape)} "
                         f"expects {C}")
    cols = im2col(x, kh, kw, stride, padding)                 # (B, Ho, Wo, kh*kw*C)
    B, Ho, Wo, KC = cols.shape
    cols2 = cols.reshape(-1, KC)                              # (B*Ho*Wo, kh*kw*C): one row per output pixel
    out = cols2 @ weight.reshape(KC, Co)                      # (B*Ho*Wo, Co)
    if bias is not None:
        out += bias
    return out.reshape(B, Ho, Wo, Co), (cols2, weight, tuple(x.shape), stride, padding)


def conv2d_backward(dout, cache):
    """The linear layer's three lines on the im2col rows, then col2im folds the rows back into the image:
    dW = cols^T dout, db = sum of dout, dx = col2im(dout W^T)."""
    cols2, weight, x_shape, stride, padding = cache
    kh, kw, C, Co = weight.shape
    B, Ho, Wo, _ = dout.shape
    dout2 = dout.reshape(-1, Co)                              # (B*Ho*Wo, Co)
    dweight = (cols2.T @ dout2).reshape(weight.shape)         # (kh, kw, C, Co)
    dbias = dout2.sum(0)                                      # (Co,)
    dcols = dout2 @ weight.reshape(-1, Co).T                  # (B*Ho*Wo, kh*kw*C)
    dx = col2im(dcols.reshape(B, Ho, Wo, -1), x_shape, kh, kw, stride, padding)  # (B, H, W, C)
    return dx, dweight, dbias


# --------------------------------------------------------------------------------------------------
# GroupNorm (Wu & He 2018): LayerNorm over groups of channels and all positions, per image
# --------------------------------------------------------------------------------------------------


def _group_mean(v):
    """The mean of v (B, HW, G, C/G) over each group: axes 1 and 3, kept as (B, 1, G, 1). Summed one axis
    at a time: NumPy reduces two non-adjacent axes at once about 6x more slowly."""
    return v.sum(1, keepdims=True).sum(3, keepdims=True) / (v.shape[1] * v.shape[3])


def groupnorm_forward(x, weight, bias, num_groups, eps=1e-5):
    """out = (x - mean_g) / sqrt(var_g + eps) * weight + bias, with mean_g and var_g taken per image over
    the H*W positions and the C/G channels of each group (channels c*G/C ... grouped in order, as PyTorch).
    x: (B, H, W, C); weight, bias: (C,). Returns out (B, H, W, C) and the cache."""
    xp = get_array_module(x)
    B, H, W, C = x.shape
    G = num_groups
    xg = x.reshape(B, H * W, G, C // G)                       # (B, HW, G, C/G)
    mean = _group_mean(xg)                                    # (B, 1, G, 1)
    xc = xg - mean                                            # (B, HW, G, C/G)
    var = _group_mean(xc * xc)                                # (B, 1, G, 1)  biased, as PyTorch
    rstd = 1.0 / xp.sqrt(var + eps)                           # (B, 1, G, 1)
    xhat = (xc * rstd).reshape(B, H, W, C)                    # (B, H, W, C)
    return xhat * weight + bias, (xhat, rstd, weight, G)


def groupnorm_backward(dout, cache):
    """LayerNorm's backward, with "the last axis" replaced by "the group" (positions and its channels):
    dx = rstd * (dxhat - mean_g(dxhat) - xhat * mean_g(dxhat * xhat)), dxhat = dout * weight."""
    xhat, rstd, weight, G = cache
    B, H, W, C = xhat.shape
    dweight = (dout * xhat).reshape(-1, C).sum(0)             # (C,)
    dbias = dout.reshape(-1, C).sum(0)                        # (C,)
    dxhat = (dout * weight).reshape(B, H * W, G, C // G)      # (B, HW, G, C/G)
    xhat_g = xhat.reshape(B, H * W, G, C // G)                # (B, HW, G, C/G)
    dx = rstd * (dxhat                                        # term 1: the direct path
                 - _group_mean(dxhat)                         # term 2: through the group mean
                 - xhat_g * _group_mean(dxhat * xhat_g))      # term 3: through the variance
    return dx.reshape(B, H, W, C), dweight, dbias


# --------------------------------------------------------------------------------------------------
# ReLU and global average pooling
# --------------------------------------------------------------------------------------------------


def relu_forward(x):
    """out = max(x, 0). Returns out and the mask of where x > 0."""
    xp = get_array_module(x)
    mask = x > 0                                              # same shape as x
    return xp.maximum(x, 0), mask


def relu_backward(dout, cache):
    """The gradient passes where the input was positive, and is zero elsewhere."""
    return dout * cache


def gap_forward(x):
    """Global average pooling: the mean over all positions. x: (B, H, W, C) -> (B, C)."""
    return x.mean((1, 2)), tuple(x.shape)


def gap_backward(dout, cache):
    """Each of the H*W positions receives 1/(H*W) of the gradient. dout: (B, C) -> (B, H, W, C)."""
    xp = get_array_module(dout)
    B, H, W, C = cache
    return xp.broadcast_to(dout[:, None, None, :] / (H * W), (B, H, W, C)).copy()


# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


def he_normal(rng, shape, fan_in, dtype):
    """N(0, 2 / fan_in): He et al.'s initialisation for layers followed by a ReLU (PyTorch's
    kaiming_normal_ with mode='fan_in'). Drawn on the host with rng, like layers.trunc_normal."""
    return asarray(rng.standard_normal(shape) * math.sqrt(2.0 / fan_in), dtype=dtype)


class Conv2d(Layer):
    """A 2-D convolution, channels last: weight (kh, kw, C_in, C_out), square kernel, zero padding."""

    def __init__(self, in_chans, out_chans, kernel_size=3, stride=1, padding=None, bias=True, rng=None,
                 dtype="float32"):
        super().__init__()
        rng = host_rng(0) if rng is None else rng
        k = kernel_size
        self.in_chans, self.out_chans, self.kernel_size, self.stride = in_chans, out_chans, k, stride
        self.padding = k // 2 if padding is None else padding     # "same" size at stride 1 for odd k
        self.params["weight"] = he_normal(rng, (k, k, in_chans, out_chans), k * k * in_chans, dtype)  # (kh, kw, C, Co)
        self.grads["weight"] = zeros((k, k, in_chans, out_chans), dtype)
        if bias:
            self.params["bias"] = zeros((out_chans,), dtype)                                        # (Co,)
            self.grads["bias"] = zeros((out_chans,), dtype)

    def forward(self, x):  # (B, H, W, C) -> (B, Ho, Wo, Co)
        out, cache = conv2d_forward(x, self.params["weight"], self.params.get("bias"), self.stride, self.padding)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):  # (B, Ho, Wo, Co) -> (B, H, W, C)
        dx, dweight, dbias = conv2d_backward(dout, self._need_cache())
        self.grads["weight"] += dweight
        if "bias" in self.grads:
            self.grads["bias"] += dbias
        return dx

    def extra_repr(self):
        return (f"{self.in_chans} -> {self.out_chans}, kernel={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}, bias={'bias' in self.params}")


class GroupNorm(Layer):
    """Normalise each image over groups of C/G channels (and all positions), then scale and shift.
    Unlike BatchNorm it does not look across the batch, so train and eval compute the same."""

    def __init__(self, num_groups, num_chans, eps=1e-5, dtype="float32"):
        super().__init__()
        if num_chans % num_groups:
            raise ValueError(f"GroupNorm: {num_chans} channels cannot be split into {num_groups} equal groups")
        self.num_groups, self.num_chans, self.eps = num_groups, num_chans, eps
        self.params["weight"] = ones((num_chans,), dtype)   # (C,)  gamma
        self.params["bias"] = zeros((num_chans,), dtype)    # (C,)  beta
        self.grads["weight"] = zeros((num_chans,), dtype)
        self.grads["bias"] = zeros((num_chans,), dtype)

    def forward(self, x):  # (B, H, W, C) -> (B, H, W, C)
        out, cache = groupnorm_forward(x, self.params["weight"], self.params["bias"], self.num_groups, self.eps)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):
        dx, dweight, dbias = groupnorm_backward(dout, self._need_cache())
        self.grads["weight"] += dweight
        self.grads["bias"] += dbias
        return dx

    def extra_repr(self):
        return f"groups={self.num_groups}, channels={self.num_chans}, eps={self.eps}"


class ReLU(Layer):
    """out = max(x, 0), elementwise; no parameters."""

    def forward(self, x):
        out, cache = relu_forward(x)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):
        return relu_backward(dout, self._need_cache())


class GlobalAvgPool(Layer):
    """(B, H, W, C) -> (B, C): the mean over positions (the ResNet's pooling before its head)."""

    def forward(self, x):
        out, cache = gap_forward(x)
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):
        return gap_backward(dout, self._need_cache())


def groups_for(num_chans, max_groups=8):
    """The GroupNorm groups used by ConvStem and ResNet: 8 (or fewer, the largest number <= 8 that
    divides the channels, so that small test models work too)."""
    return max(g for g in range(1, max_groups + 1) if num_chans % g == 0)


class ConvNormAct(Layer):
    """conv (no bias: the norm's shift replaces it) -> GroupNorm -> ReLU (the ReLU only if act=True)."""

    def __init__(self, in_chans, out_chans, kernel_size=3, stride=1, act=True, rng=None, dtype="float32"):
        super().__init__()
        self.conv = Conv2d(in_chans, out_chans, kernel_size, stride, bias=False, rng=rng, dtype=dtype)
        self.norm = GroupNorm(groups_for(out_chans), out_chans, dtype=dtype)
        self.act = ReLU() if act else None

    def forward(self, x):                                   # (B, H, W, C)
        h = self.norm.forward(self.conv.forward(x))         # (B, Ho, Wo, Co)
        return self.act.forward(h) if self.act else h

    def backward(self, dout):                               # (B, Ho, Wo, Co)
        dh = self.act.backward(dout) if self.act else dout
        return self.conv.backward(self.norm.backward(dh))   # (B, H, W, C)

    def extra_repr(self):
        c = self.conv
        return (f"{c.in_chans} -> {c.out_chans}, kernel={c.kernel_size}, stride={c.stride}, "
                f"GroupNorm({self.norm.num_groups})" + (", ReLU" if self.act else ""))


# --------------------------------------------------------------------------------------------------
# The hybrid's stem (paper §3.1): CNN feature map -> 1x1 patches -> D
# --------------------------------------------------------------------------------------------------


class ConvStem(Layer):
    """The hybrid patch embedding: "the input sequence can be formed from feature maps of a CNN ...
    the patches can have spatial size 1x1" (§3.1).

        stages.0            3x3 conv, stride 1, C -> channels[0], GroupNorm, ReLU
        stages.1 ... k      3x3 conv, stride 2, channels[i-1] -> channels[i], GroupNorm, ReLU
        flatten             each of the (H/2^k) x (W/2^k) feature-map positions is one token
        proj                linear, channels[-1] -> D (a 1x1 "patch" projection)

    With k = log2(P) stride-2 stages the token grid is the patch stem's, (H/P) x (W/P), so a hybrid
    and a plain ViT with the same patch_size have the same sequence length.
    (B, H, W, C) -> (B, N, D).
    """

    def __init__(self, in_chans, channels, embed_dim, rng=None, dtype="float32"):
        super().__init__()
        self.channels = tuple(channels)
        self.stages = LayerList(self, "stages")
        c_in = in_chans
        for i, c_out in enumerate(self.channels):
            self.stages.append(ConvNormAct(c_in, c_out, 3, stride=1 if i == 0 else 2, rng=rng, dtype=dtype))
            c_in = c_out
        self.proj = Linear(c_in, embed_dim, rng=rng, dtype=dtype)

    def features(self, x):
        """The CNN's feature map (B, H/P, W/P, channels[-1]), before it is cut into tokens."""
        for stage in self.stages:
            x = stage.forward(x)                            # (B, H/2^i, W/2^i, channels[i])
        return x

    def forward(self, x):                                   # (B, H, W, C)
        fmap = self.features(x)                             # (B, gh, gw, c)
        B, gh, gw, c = fmap.shape
        self.cache = fmap.shape if self.training else None
        tokens = fmap.reshape(B, gh * gw, c)                # (B, N, c): 1x1 patches, row-major over the grid
        return self.proj.forward(tokens)                    # (B, N, D)

    def backward(self, dout):                               # (B, N, D)
        fmap_shape = self._need_cache()
        dfmap = self.proj.backward(dout).reshape(fmap_shape)  # (B, gh, gw, c)
        for stage in reversed(self.stages):
            dfmap = stage.backward(dfmap)                   # back up through each stage
        return dfmap                                        # (B, H, W, C)

    def extra_repr(self):
        return f"channels={self.channels}"


# --------------------------------------------------------------------------------------------------
# The ResNet's block (He et al. 2016), with GroupNorm; the network itself is in minivit/resnet.py
# --------------------------------------------------------------------------------------------------


class BasicBlock(Layer):
    """ResNet's basic block (two 3x3 convs) with GroupNorm:
        h   = relu(norm1(conv1(x)))           conv1 has the block's stride
        out = relu(norm2(conv2(h)) + s(x))    s: identity, or a strided 1x1 conv + norm when the shape changes
    """

    def __init__(self, in_chans, out_chans, stride=1, rng=None, dtype="float32"):
        super().__init__()
        self.conv1 = Conv2d(in_chans, out_chans, 3, stride, bias=False, rng=rng, dtype=dtype)
        self.norm1 = GroupNorm(groups_for(out_chans), out_chans, dtype=dtype)
        self.act1 = ReLU()
        self.conv2 = Conv2d(out_chans, out_chans, 3, 1, bias=False, rng=rng, dtype=dtype)
        self.norm2 = GroupNorm(groups_for(out_chans), out_chans, dtype=dtype)
        self.shortcut = None
        if stride != 1 or in_chans != out_chans:
            self.shortcut = ConvNormAct(in_chans, out_chans, 1, stride, act=False, rng=rng, dtype=dtype)
        self.act2 = ReLU()

    def forward(self, x):                                                   # (B, H, W, C)
        h = self.act1.forward(self.norm1.forward(self.conv1.forward(x)))    # (B, Ho, Wo, Co)
        h = self.norm2.forward(self.conv2.forward(h))                       # (B, Ho, Wo, Co)
        s = x if self.shortcut is None else self.shortcut.forward(x)        # (B, Ho, Wo, Co)
        return self.act2.forward(h + s)                                     # (B, Ho, Wo, Co)

    def backward(self, dout):                                               # (B, Ho, Wo, Co)
        dsum = self.act2.backward(dout)                                     # through the last ReLU
        # the branch: norm2(conv2(relu(norm1(conv1(x)))))
        dh = self.conv2.backward(self.norm2.backward(dsum))                 # (B, Ho, Wo, Co)
        dx = self.conv1.backward(self.norm1.backward(self.act1.backward(dh)))  # (B, H, W, C)
        # the shortcut: the sum passes dsum to it unchanged
        return dx + (dsum if self.shortcut is None else self.shortcut.backward(dsum))
