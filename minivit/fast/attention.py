"""The attention room of the fast paths: fused attention on both backends, the N x N weights never stored.

One orchestration for NumPy and CuPy: the matrix products by BLAS (NumPy's matmul) or cuBLAS
(cuda._gpu_matmul), in chunks of images, around a softmax row kernel that keeps only each row's
log-sum-exp (cpu._softmax_lse on the CPU, softmax_lse_fwd of cuda._ROW_SOURCE on the GPU); the backward
recomputes the weights. On the CPU the chunks are shared among Python threads. minivit/fast/kernels.py
offers the two passes as the twins attention_forward / attention_backward, and attention_weights
recomputes the weights from the cache, for a picture or a test. The long note below says why each choice.
"""

import contextvars
import math

from .. import _blas_env
from ..backend import get_array_module
from . import cpu, cuda


class AttentionCache(tuple):
    """What the fused attention forward keeps: (qkv (B, N, 3D), lse (B, nh, N), num_heads, mask (N, N) or
    None); the attention weights are recomputed from it (attention_weights, ops.attention_weights)."""
    __slots__ = ()

    def __new__(cls, qkv, lse, num_heads, mask=None):
        return super().__new__(cls, (qkv, lse, num_heads, mask))


# The reference computes the scores q k^T / sqrt(hs) of the whole batch, (B, nh, N, N), and keeps their
# softmax for the backward. Here the batch goes through in chunks of a few images, and only each row's
# log-sum-exp (lse, B x nh x N values) is kept. The backward recomputes
# the weights inside its softmax-backward kernel: one more q k^T product, and no (B, nh, N, N) array held
# between the passes (FlashAttention and PyTorch's scaled_dot_product_attention make the same trade). It
# recomputes them from the scores alone, max, exp and sum as the forward did, rather than as
# exp(scale s_ij - lse_i) as FlashAttention does: lse is rounded at the size of the scores, so at scores
# of 1e6 that difference is off by ~0.1 in the exponent (10% in the weights), at 1e35 by 1e27 (NaN).
#
# One orchestration for both backends: the products are xp.matmul (NumPy's, i.e. BLAS; or CuPy's, i.e.
# cuBLAS) on views of qkv, written into place with out=. Only the row kernel between them differs:
# cpu._softmax_lse / cpu._softmax_lse_bwd (Numba) on the CPU, softmax_lse_fwd / softmax_lse_bwd (CUDA,
# cuda._ROW_SOURCE) on the GPU, which compute the same numbers the same way, so the same chunk code follows.
#
# CPU: a chunk's (b, nh, N, N) scores stay in the CPU's cache between the products and the softmax.
# Threads: each head's products are small (N x hs times hs x N), too small for BLAS to share one among
# the cores (it tries, and mostly waits). So the chunks are shared instead: cpu.num_threads() Python threads
# each take whole chunks, with BLAS set to one thread meanwhile (threadpoolctl); NumPy's matmul and the
# Numba kernels (nogil) release the GIL, so the threads really run at once. This needs OpenBLAS's own
# idle threads to sleep rather than spin (minivit/_blas_env.py, which sees to it whatever the import
# order): otherwise they hold the cores and the threads gain nothing. Measured on 2 cores, CIFAR model,
# batch 64: a training step 395 -> 345 ms.
# Tried and dropped: the per-head products as Numba loops (2.2x slower than BLAS).
#
# GPU: the chunks only bound the memory the scores take (ViT-B/16 at batch 128: 238 MB, one chunk). The
# kernels queue one after the other on CuPy's stream: one worker, no Python threads. The products are
# cuBLAS's strided batched GEMM, called directly (cuda._gpu_matmul), not CuPy's matmul: that one copies
# every operand that is not C-contiguous (k^T, p^T, ds^T: two of them N x N) and writes a non-contiguous
# out= through a temporary (cupy/_core/_routines_linalg.pyx), and it multiplies in plain FP32 even with
# CUPY_TF32=1. So q, k, v (and dctx) are made contiguous once per pass, (3, B, nh, N, hs), a transposed
# operand is handed to cuBLAS as "transposed" (no copy), each product writes into a contiguous array,
# and the heads go back side by side in one copy at the end. TF32: when CUPY_TF32=1 (cuda.tf32_enabled()).

CHUNK_BYTES = 512 * 1024  # a chunk's (b, nh, N, N) scores on the CPU: at most about this many bytes (fits in L2)
GPU_CHUNK_BYTES = 256 << 20  # on the GPU, only to bound the scores' memory: at most about this many bytes
THREADED_ATTENTION = None  # None: when it helps (see above); True / False: always / never (for tests)

try:
    import threadpoolctl
except ImportError:  # then the chunks run one after the other, BLAS with its own threads
    threadpoolctl = None

_chunk_pool = None   # the worker threads, made on first use
_blas_control = None


def _attention_workers():
    """How many threads share attention's chunks: cpu.num_threads() when OpenBLAS's idle threads sleep (set up
    now if that was too late at import: minivit/_blas_env.py), else 1."""
    n = cpu.num_threads()
    if n == 1 or threadpoolctl is None:
        return 1
    threaded = THREADED_ATTENTION
    if threaded is None:
        threaded = _blas_env.idle_blas_threads_sleep()
    return n if threaded else 1


def _chunks(B, nh, N, itemsize, workers, chunk_bytes):
    """[(b0, b1), ...] covering range(B): each chunk's scores at most chunk_bytes (one image at least),
    and a multiple of `workers` chunks of about equal size, so the threads finish together."""
    most = max(1, chunk_bytes // (nh * N * N * itemsize))             # images per chunk, at most
    n = -(-B // most)
    n = min(B, -(-n // workers) * workers)                            # a multiple of the workers
    rows = -(-B // n)
    return [(b, min(b + rows, B)) for b in range(0, B, rows)]


def _run_chunks(work, B, nh, N, itemsize, gpu):
    """work(b0, b1) for every chunk: on the GPU one after the other (its kernels queue on one stream); on
    the CPU on this thread, or shared among _attention_workers() threads."""
    global _chunk_pool, _blas_control
    workers = 1 if gpu else _attention_workers()
    chunks = _chunks(B, nh, N, itemsize, workers, GPU_CHUNK_BYTES if gpu else CHUNK_BYTES)
    if workers == 1 or len(chunks) == 1:
        for b0, b1 in chunks:
            work(b0, b1)
        return
    if _chunk_pool is None or _chunk_pool._max_workers != workers:
        from concurrent.futures import ThreadPoolExecutor
        _chunk_pool = ThreadPoolExecutor(workers, thread_name_prefix="minivit-attention")
    if _blas_control is None:
        _blas_control = threadpoolctl.ThreadpoolController()
    # each chunk runs in a copy of this thread's context: NumPy keeps np.errstate there, and a caller that
    # silenced float16's overflow (train/tasks.py) must not hear of it from the workers
    with _blas_control.limit(limits=1, user_api="blas"):
        for f in [_chunk_pool.submit(contextvars.copy_context().run, work, b0, b1) for b0, b1 in chunks]:
            f.result()                                                # (re-raises a worker's error)


def _heads(a, num_heads):
    """(B, N, nh * hs) -> a (B, nh, N, hs) view."""
    B, N, D = a.shape
    return a.reshape(B, N, num_heads, D // num_heads).transpose(0, 2, 1, 3)


def _three_heads(a, num_heads):
    """(B, N, 3D) -> its three thirds as (B, nh, N, hs) views: q, k, v (or dq, dk, dv), no copy."""
    D = a.shape[-1] // 3
    return tuple(_heads(a[..., i * D:(i + 1) * D], num_heads) for i in range(3))


def _mask_in_score_units(mask, scale, xp):
    """The additive mask divided by the scale, (N, N) float32: added to the raw scores q.k before the row
    kernel multiplies them by the scale, it adds the mask to scale q.k (-inf stays -inf; the kernels'
    exp of -inf is ~1e-38 on the CPU, 0 on the GPU: a masked weight is 0 to float32 precision)."""
    return None if mask is None else (xp.asarray(mask, dtype="float32") / scale).astype("float32")


def _fused_attention_forward(qkv, num_heads, mask=None):
    gpu = cuda._is_cupy(qkv)
    xp = get_array_module(qkv)
    softmax_lse = cuda._gpu_softmax_lse if gpu else cpu._softmax_lse   # the row kernel: CUDA or Numba
    matmul = cuda._gpu_matmul if gpu else xp.matmul           # cuBLAS (see above) or BLAS
    B, N, D3 = qkv.shape
    D = D3 // 3
    q, k, v = _attention_operands(qkv, num_heads, gpu)           # (B, nh, N, hs) each
    scale = xp.float32(1.0 / math.sqrt(D // num_heads))
    out = xp.empty((B, N, D), qkv.dtype)                         # (B, N, D), heads side by side
    lse = xp.empty((B, num_heads, N), qkv.dtype)                 # (B, nh, N)
    ctx = xp.empty_like(q) if gpu else _heads(out, num_heads)    # (B, nh, N, hs): contiguous, or a view of out
    m = _mask_in_score_units(mask, scale, xp)                    # (N, N) or None

    def chunk(b0, b1):
        s = matmul(q[b0:b1], k[b0:b1].swapaxes(-1, -2))          # (b, nh, N, N)  q.k
        if m is not None:
            s += m                                               # -inf where masked
        softmax_lse(s.reshape(-1, N), scale, lse[b0:b1].reshape(-1))   # s -> attention weights p
        matmul(s, v[b0:b1], out=ctx[b0:b1])                      # (b, nh, N, hs)  p v, into place

    _run_chunks(chunk, B, num_heads, N, qkv.itemsize, gpu)
    if gpu:
        _heads(out, num_heads)[...] = ctx                        # the heads side by side: one copy
    return out, AttentionCache(qkv, lse, num_heads, mask)


def _fused_attention_backward(dout, cache):
    qkv, lse, num_heads, mask = cache
    gpu = cuda._is_cupy(qkv)
    xp = get_array_module(qkv)
    softmax_lse_bwd = cuda._gpu_softmax_lse_bwd if gpu else cpu._softmax_lse_bwd
    matmul = cuda._gpu_matmul if gpu else xp.matmul
    B, N, D3 = qkv.shape
    D = D3 // 3
    q, k, v = _attention_operands(qkv, num_heads, gpu)           # (B, nh, N, hs) each
    scale = xp.float32(1.0 / math.sqrt(D // num_heads))
    if gpu:                                                      # contiguous: dq, dk, dv; dctx copied once
        dheads = xp.empty((3,) + q.shape, qkv.dtype)             # (3, B, nh, N, hs)
        dq, dk, dv = dheads[0], dheads[1], dheads[2]
        dctx = xp.ascontiguousarray(_heads(dout, num_heads))     # (B, nh, N, hs)
    else:
        dqkv = xp.empty(qkv.shape, qkv.dtype)                    # (B, N, 3D), every value written
        dq, dk, dv = _three_heads(dqkv, num_heads)               # views into dqkv
        dctx = _heads(dout, num_heads)                           # (B, nh, N, hs) view
    m = _mask_in_score_units(mask, scale, xp)                    # (N, N) or None

    def chunk(b0, b1):
        c = slice(b0, b1)
        s = matmul(q[c], k[c].swapaxes(-1, -2))                  # (b, nh, N, N)  q.k, again
        if m is not None:
            s += m
        dp = matmul(dctx[c], v[c].swapaxes(-1, -2))              # (b, nh, N, N)  dL/dp = dctx v^T
        softmax_lse_bwd(s.reshape(-1, N), dp.reshape(-1, N), scale)  # s -> p, dp -> ds
        matmul(s.swapaxes(-1, -2), dctx[c], out=dv[c])           # dv = p^T dctx
        matmul(dp, k[c], out=dq[c])                              # dq = ds k
        matmul(dp.swapaxes(-1, -2), q[c], out=dk[c])             # dk = ds^T q

    _run_chunks(chunk, B, num_heads, N, qkv.itemsize, gpu)
    if gpu:                                                      # (3, B, nh, N, hs) -> (B, N, 3, nh, hs): one copy
        dqkv = xp.ascontiguousarray(dheads.transpose(1, 3, 0, 2, 4)).reshape(qkv.shape)
    return dqkv


def _attention_operands(qkv, num_heads, gpu):
    """q, k, v, each (B, nh, N, hs). CPU: views into qkv (NumPy's matmul takes strided operands). GPU: made
    contiguous, in one copy of all three: cuBLAS takes a batch of matrices at one stride only."""
    if not gpu:
        return _three_heads(qkv, num_heads)
    B, N, D3 = qkv.shape
    heads = qkv.reshape(B, N, 3, num_heads, D3 // (3 * num_heads)).transpose(2, 0, 3, 1, 4)  # (3, B, nh, N, hs)
    heads = cuda._cupy().ascontiguousarray(heads)
    return heads[0], heads[1], heads[2]


def attention_weights(cache):
    """The weights p = softmax(q k^T / sqrt(hs) + mask), (B, nh, N, N), that the fused forward used,
    recomputed from its AttentionCache as its row kernel makes them: from the raw scores q.k alone (max,
    exp, sum), not as exp(scale q.k - lse), which cancels at large scores (see the note above)."""
    qkv, lse, num_heads, mask = cache
    xp = get_array_module(qkv)
    q, k, _ = _three_heads(qkv, num_heads)                       # (B, nh, N, hs) each
    scale = xp.float32(1.0 / math.sqrt(q.shape[-1]))
    s = xp.matmul(q, k.swapaxes(-1, -2))                         # (B, nh, N, N)  raw scores q.k
    m = _mask_in_score_units(mask, scale, xp)                    # (N, N) or None
    if m is not None:
        s = s + m                                                # -inf where masked: weight 0
    p = xp.exp((s - s.max(-1, keepdims=True)) * scale)           # subtract, then scale: the max's term is 1
    return p / p.sum(-1, keepdims=True)                          # (B, nh, N, N)
