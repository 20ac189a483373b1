"""The twins: functional.py's pairs again, computing the same numbers faster, for float32 arrays.

functional.py is the definition; this module only changes *how* the numbers are computed. Each function
here is named like the pair it replaces, takes the pair's arguments and returns the same cache, and sends
NumPy arrays to the CPU room (minivit/fast/cpu.py, Numba), CuPy arrays to the GPU room
(minivit/fast/cuda.py), attention to minivit/fast/attention.py (both). Nothing here is called by a layer
directly: minivit/fast/ops.py chooses, per op, between a pair of functional.py and its twin here, and takes
the twin only after checking on a probe input, in the running process, that it agrees with the pair as it
stands (so a student's edit to functional.py runs, and is announced). float64 always runs functional.py, so
the float64 gradient and parity checks test the math as written. tests/test_fast_paths.py checks every
function here against the reference to float32 tolerance. ``minivit.ops.set_fast_kernels(False)`` (or
``MINIVIT_FAST_KERNELS=0``) turns them off, e.g. to step through the reference code in a debugger.

Why the reference is slow: a line such as ``rstd * (dxhat - dxhat.mean(-1) - xhat * (dxhat * xhat).mean(-1))``
is six passes over a (B, N, D) array, each allocating a new one and each on one core. On the GPU every
operation is a kernel launch (~10 us, more than the work itself in a small model). The twins make one
pass per forward or backward ("fusion"); the rooms' docstrings say how.

Besides the twins this module holds the optimizers' updates (which ops.py also checks against
functional.py) and dropout's device mask (dropout_keep_mask, a random number generator that ops.py hands
layers.Dropout on the GPU: there is nothing to check it against).

This was minivit/kernels.py, one file, until issue 30 split it into the rooms above; ``minivit.kernels``
is still this module, and every name the old file had is found here (a name that moved to a room is
looked up there, see __getattr__ at the end). A setting such as CHUNK_BYTES or PARALLEL_MIN is read in
its room, so set it there: ``minivit.fast.attention.CHUNK_BYTES = ...``.
"""

import math

import numpy

from . import attention, cpu, cuda
from .attention import AttentionCache, attention_weights  # noqa: F401  (ops.py asks for these here)
from .cpu import HAVE_NUMBA, f32, num_threads  # noqa: F401
from .cuda import _is_cupy, dropout_keep_mask, sgd_update, tf32_enabled  # noqa: F401

# ---- AdamW: one pass over each parameter, instead of ten (the update: cpu._adamw) --------------------

def supports_adamw(*arrays):
    """Whether adamw_update can take these arrays: float32 CuPy arrays (one ElementwiseKernel), or float32
    C-contiguous NumPy arrays with Numba (one loop)."""
    if all(_is_cupy(a) and a.dtype == numpy.float32 for a in arrays):
        return True
    return HAVE_NUMBA and all(isinstance(a, numpy.ndarray) and a.dtype == numpy.float32 and a.flags.c_contiguous
                              for a in arrays)


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """As functional.adamw_update: one AdamW step of one parameter, in place (p, m, v): one pass (Numba on
    the CPU, one ElementwiseKernel launch on the GPU). Every constant is worked out in float64 and rounded
    once (1 - b2 from a rounded b2 would be 1.3e-5 off)."""
    bias_c1, bias_c2 = 1 - beta1 ** step, 1 - beta2 ** step
    constants = (f32(1.0 - lr * weight_decay), f32(beta1), f32(beta2), f32(1.0 - beta1), f32(1.0 - beta2),
                 f32(lr / bias_c1), f32(1.0 / math.sqrt(bias_c2)), f32(eps))
    if _is_cupy(p):
        cuda._gpu_adamw(p, g, m, v, constants)
        return
    cpu._adamw(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), *constants)


# ---- SGD with momentum: one launch per parameter on the GPU (cuda.sgd_update; the CPU runs the pair) ----

def supports_sgd(*arrays):
    """Whether sgd_update can take these arrays: float32 CuPy arrays (momentum_buffer may be None)."""
    return all(a is None or (_is_cupy(a) and a.dtype == numpy.float32) for a in arrays)


# ---- Linear: the same products as functional.linear_*, two speed choices ----------------------------
# 1. dW = x^T dout is given to BLAS as the product whose first side is the longer of in and out (the
#    transpose of a product is free: a view). OpenBLAS's threads handle (short side, long inner)
#    products badly: 3-10x slower when the cores are shared.
# 2. matmul_dtype="float16", mixed precision (minivit/fast/amp.py): x and W are rounded to float16 for the
#    product (sums kept in float32 by cuBLAS and by NumPy), y comes back in x's dtype, and the cache
#    holds the float16 copies: half the bytes. The backward's two products run in float16 too.

def linear_forward(x, weight, bias=None, matmul_dtype=None):
    """As functional.linear_forward: (y, (x2, weight)); with matmul_dtype the cache holds float16 copies."""
    d_in, d_out = weight.shape
    x2 = x.reshape(-1, d_in)                                  # (rows, in)
    if matmul_dtype is None:
        y = x2 @ weight                                       # (rows, out)
    else:
        x2, weight = x2.astype(matmul_dtype), weight.astype(matmul_dtype)  # rounded once, kept for backward
        y = (x2 @ weight).astype(x.dtype)                     # (rows, out), float16 product -> float32
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], d_out), (x2, weight)      # (..., out)


def linear_backward(dout, cache):
    """As functional.linear_backward: (dx, dweight, dbias), in dout's dtype."""
    x2, weight = cache
    d_in, d_out = weight.shape
    dout2 = dout.reshape(-1, d_out)                           # (rows, out)
    dbias = dout2.sum(0)                                      # (out,) in dout's dtype, before any rounding
    mixed = x2.dtype != dout.dtype
    if mixed:
        dout2 = dout2.astype(x2.dtype)                        # (rows, out) float16: why the loss is scaled
    dx = dout2 @ weight.T                                     # (rows, in)
    if d_in >= d_out:
        dweight = x2.T @ dout2                                # (in, out)
    else:
        dweight = (dout2.T @ x2).T                            # (in, out), computed as (dout^T x)^T
    if mixed:
        dx, dweight = dx.astype(dout.dtype), dweight.astype(dout.dtype)
    return dx.reshape(*dout.shape[:-1], d_in), dweight, dbias  # (..., in)


# ---- the pairs' twins, chosen by ops.py for float32 arrays: functional.py's arguments, the same caches ----

def gelu_forward(x, approximate="erf"):
    """As functional.gelu_forward: (out, cache) with cache = (x, approximate)."""
    if _is_cupy(x):
        out = cuda._gpu_gelu_forward(x, approximate)
    else:
        out = cpu._gelu_cpu(x, None, approximate)
    return out, (x, approximate)


def gelu_backward(dout, cache):
    """As functional.gelu_backward: dx."""
    x, approximate = cache
    if _is_cupy(x):
        return cuda._gpu_gelu_backward(dout, x, approximate)
    return cpu._gelu_cpu(x, dout, approximate)


def layernorm_forward(x, weight, bias, eps=1e-6):
    """As functional.layernorm_forward: (out, (xhat, rstd, weight))."""
    if _is_cupy(x):
        return cuda._gpu_layernorm_forward(x, weight, bias, eps)
    return cpu._layernorm_forward_cpu(x, weight, bias, eps)


def layernorm_backward(dout, cache):
    """As functional.layernorm_backward: (dx, dweight, dbias)."""
    if _is_cupy(dout):
        return cuda._gpu_layernorm_backward(dout, cache)
    return cpu._layernorm_backward_cpu(dout, cache)


def softmax_forward(x):
    """As functional.softmax_forward: (out, out)."""
    return cuda._gpu_softmax_forward(x) if _is_cupy(x) else cpu._softmax_forward_cpu(x)


def attention_forward(qkv, num_heads, mask=None):
    """As functional.attention_forward, fused (NumPy with Numba, or CuPy): (out, AttentionCache)."""
    return attention._fused_attention_forward(qkv, num_heads, mask)


def attention_backward(dout, cache):
    """As functional.attention_backward, for an AttentionCache: dqkv."""
    return attention._fused_attention_backward(dout, cache)


def softmax_backward(dout, cache):
    """As functional.softmax_backward: dx."""
    return cuda._gpu_softmax_backward(dout, cache) if _is_cupy(dout) else cpu._softmax_backward_cpu(dout, cache)


def __getattr__(name):
    """A name the old minivit/kernels.py had that now lives in one of the rooms (``kernels._exp32``,
    ``kernels._ROW_SOURCE``, ``kernels.CHUNK_BYTES``...): read from there."""
    for room in (cpu, cuda, attention):
        if name in vars(room):
            return vars(room)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
