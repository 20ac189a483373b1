"""Fast paths: the elementwise-heavy pairs of functional.py again, computing the same numbers faster.

functional.py is the definition; this module only changes *how* the numbers are computed, and only for
float32 arrays. Nothing here is called by a layer directly: minivit/ops.py chooses, per op, between a
pair of functional.py and its twin here, and takes the twin only after checking on a probe input, in
the running process, that it agrees with the pair as it stands (so a student's edit to functional.py
runs, and is announced). float64 always runs functional.py, so the float64 gradient and parity checks
test the math as written. tests/test_fast_paths.py checks every function here against the reference
to float32 tolerance. ``minivit.ops.set_fast_kernels(False)`` (or ``MINIVIT_FAST_KERNELS=0``) turns
them off, e.g. to step through the reference code in a debugger.

Why the reference is slow: a line such as ``rstd * (dxhat - dxhat.mean(-1) - xhat * (dxhat * xhat).mean(-1))``
is six passes over a (B, N, D) array, each allocating a new one and each on one core. On the GPU every
operation is a kernel launch (~10 us, more than the work itself in a small model). What this module
does instead is one pass per forward or backward ("fusion"):

- CPU: each kernel is a plain loop, one value or one row at a time, that Numba compiles to machine code
  on first use (~10 s for all of them, cached on disk in minivit/__pycache__, so later runs start at
  once). The inner loops run as SIMD vectors; for arrays of PARALLEL_MIN values or more ``prange``
  shares the outer loop among the cores (MINIVIT_NUM_THREADS, default: all of them). Most of these
  kernels are limited by memory bandwidth, not arithmetic, so one pass instead of six is the win. exp and erf are written out as polynomials (``_exp32``, ``_erf32``) because the C
  library's versions are called one value at a time, which stops the loop from being vectorised. Rows
  of a reduction that crosses rows (LayerNorm's dweight) are summed in fixed groups, then the groups in
  order, so every result is the same to the bit whatever the number of threads.
  Without Numba installed the CPU runs the reference lines (correct, several times slower).
- CuPy: one fused kernel per forward or backward: a ``cupy.ElementwiseKernel`` for GELU, a ``RawKernel``
  with one thread block per row for the row-wise LayerNorm and softmax. Compiled on first use.
- Attention, on both: its matrix products by NumPy (BLAS) or CuPy (cuBLAS), in chunks of images, around
  a softmax row kernel (Numba or CUDA) that keeps only each row's log-sum-exp, not the N x N weights;
  the backward recomputes them (see its section, after the CuPy one).

Only this module and backend.py touch CuPy, and this one only ever sees CuPy arrays that exist already
(it never imports CuPy for a NumPy array). Besides the twins it holds the optimizers' GPU updates (which
ops.py also checks against functional.py) and dropout's device mask (dropout_keep_mask, a random number
generator that layers.Dropout calls on the GPU: there is nothing to check it against).
"""

import math
import os
import threading
import types

import numpy

from . import _blas_env

try:
    import numba
except ImportError:  # the CPU fast paths are off (ops.py runs functional.py for NumPy arrays)
    numba = None

HAVE_NUMBA = numba is not None

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _is_cupy(x):
    return type(x).__module__.startswith("cupy")


class AttentionCache(tuple):
    """What the fused attention forward keeps: (qkv (B, N, 3D), lse (B, nh, N), num_heads, mask (N, N) or
    None); the attention weights are recomputed from it (ops.attention_weights)."""
    __slots__ = ()

    def __new__(cls, qkv, lse, num_heads, mask=None):
        return super().__new__(cls, (qkv, lse, num_heads, mask))


# ==================================================================================================
# CPU: Numba kernels
# ==================================================================================================

# Fast-math flags that let the compiler reorder sums (so they vectorise) and use FMA, but NOT assume
# "no NaN, no inf": a NaN must still come out as a NaN, so that training notices it and stops.
_FASTMATH = {"contract", "arcp", "reassoc", "afn", "nsz"}

if HAVE_NUMBA:
    # Numba's own thread pool ("workqueue"): its threads sleep between kernels. With the OpenMP layer
    # they spin-wait instead, and on a machine with few cores they fight OpenBLAS's threads (which also
    # spin): a training step measured 4x slower here. NUMBA_THREADING_LAYER still chooses, if set.
    # (The workqueue layer must not be entered from two Python threads at once: _kernel takes a lock.)
    if "NUMBA_THREADING_LAYER" not in os.environ:
        numba.config.THREADING_LAYER = "workqueue"
    prange = numba.prange
    _jit = dict(fastmath=_FASTMATH, error_model="numpy", cache=True)  # numpy: x / 0 is inf, no check
    _in_thread = numba.njit(nogil=True, **_jit)                               # one core, run by a Python
    #                                                                          thread of ours (GIL released)
    _inline = numba.njit(inline="always", **_jit)                             # a helper, pasted in place
else:  # plain Python stand-ins, so the module still imports (these are never called without Numba)
    prange = range
    _in_thread = _inline = lambda fn: fn

PARALLEL_MIN = 1 << 18  # values: below this a kernel runs on one core (waking the others costs ~0.1 ms)


class _kernel:
    """A loop compiled twice: with prange shared among the cores, and (a copy of the same function,
    prange then meaning range) on one core, for small arrays, where waking the other threads would take
    longer than the work. Called like the function; the size of its first argument chooses."""

    def __init__(self, fn):
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__
        if not HAVE_NUMBA:
            self.parallel = self.serial = fn
            return
        one_core = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_one_core")
        one_core.__qualname__ = fn.__qualname__ + "_one_core"   # its own entry in Numba's disk cache
        self.parallel = numba.njit(parallel=True, **_jit)(fn)
        self.serial = numba.njit(**_jit)(one_core)

    def __call__(self, *args):
        if args[0].size >= PARALLEL_MIN:
            with _parallel_lock:   # Numba's workqueue aborts the process if two threads enter it at once
                _use_threads()
                return self.parallel(*args)
        return self.serial(*args)


_parallel_lock = threading.Lock()


f32 = numpy.float32
_threads_set = None


def num_threads():
    """Threads for the CPU kernels: MINIVIT_NUM_THREADS, default all the cores Numba sees."""
    default = numba.config.NUMBA_NUM_THREADS if HAVE_NUMBA else 1
    value = os.environ.get("MINIVIT_NUM_THREADS", "")
    if value.strip() == "":
        return default
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"MINIVIT_NUM_THREADS must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"MINIVIT_NUM_THREADS must be a positive integer, got {value!r}")
    return min(n, default)


def _use_threads():
    """Apply num_threads() to Numba (cheap: only when it changed)."""
    global _threads_set
    n = num_threads()
    if n != _threads_set:
        numba.set_num_threads(n)
        _threads_set = n


def _rows(x):
    """x as a C-contiguous (rows, last axis) array: a view when x is contiguous, else a copy."""
    return numpy.ascontiguousarray(x).reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _flat(x):
    return numpy.ascontiguousarray(x).reshape(-1)


# ---- exp and erf in float32, as polynomials the compiler can vectorise ------------------------------
# exp(x) = 2^k exp(r), k = round(x / ln 2), r = x - k ln 2 in [-ln2/2, ln2/2] (ln 2 in two parts, so
# k ln 2 is exact); exp(r) by its degree-7 Taylor-like polynomial (Cephes' expf coefficients); 2^k
# made directly as the bits of a float32 (exponent field k + 127). Within 1 unit in the last place
# (measured 6e-8 relative) on [-87, 88]; below that it returns ~1e-38 instead of 0 (no denormals).
_LOG2E, _LN2_HI, _LN2_LO = f32(1.4426950408889634), f32(0.693359375), f32(-2.12194440e-4)
_EXP_C = tuple(f32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_E0, _E1, _E2, _E3, _E4, _E5 = _EXP_C


@_inline
def _exp32(x):
    x = f32(88.7) if x > f32(88.7) else (f32(-87.3) if x < f32(-87.3) else x)  # float32's range; NaN stays
    #   (written with comparisons: min() and max() stop the loop being vectorised outside prange)
    k = math.floor(x * _LOG2E + f32(0.5))                       # nearest integer to x / ln 2
    r = x - k * _LN2_HI - k * _LN2_LO                            # |r| <= ln2 / 2
    p = ((((_E0 * r + _E1) * r + _E2) * r + _E3) * r + _E4) * r + _E5
    p = p * r * r + r + f32(1.0)                                 # exp(r)
    return p * numpy.int32((numpy.int32(k) + 127) << 23).view(numpy.float32)  # * 2^k


# erf(z) ~ z P(z^2) / Q(z^2) on [-4, 4] (the rational approximation used by Eigen and XLA); beyond 4,
# erf = +-1 to float32 precision. Its own error is 6.5e-8; evaluated in float32 it is within 4.2e-7 of
# erf (measured), so GELU's Phi(x) is within 2.1e-7: far below the rounding of the float32 matrix
# product that feeds GELU.
_ERF_P = tuple(f32(c) for c in (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
                                -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
                                -1.60960333262415e-02))           # of (z^2)^6, ..., (z^2)^0
_ERF_Q = tuple(f32(c) for c in (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
                                -7.37332916720468e-03, -1.42647390514189e-02))  # of (z^2)^4 ... (z^2)^0
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = _ERF_P
_Q0, _Q1, _Q2, _Q3, _Q4 = _ERF_Q


@_inline
def _erf32(z):
    z = f32(4.0) if z > f32(4.0) else (f32(-4.0) if z < f32(-4.0) else z)
    z2 = z * z
    p = (((((_P0 * z2 + _P1) * z2 + _P2) * z2 + _P3) * z2 + _P4) * z2 + _P5) * z2 + _P6
    q = (((_Q0 * z2 + _Q1) * z2 + _Q2) * z2 + _Q3) * z2 + _Q4
    return z * p / q


# ---- GELU -----------------------------------------------------------------------------------------
# erf:  y = x Phi(x),   dx = dout (Phi(x) + x phi(x)),   Phi(x) = (1 + erf(x / sqrt 2)) / 2, phi = Phi'
# tanh: y = (x / 2) (1 + t), t = tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3), tanh(u) = 1 - 2 / (e^2u + 1)

_C_INV_SQRT_2, _C_INV_SQRT_2PI, _C_SQRT_2_OVER_PI = f32(_INV_SQRT_2), f32(_INV_SQRT_2PI), f32(_SQRT_2_OVER_PI)


@_kernel
def _gelu_erf_fwd(x, y):  # x, y: (n,)
    for i in prange(x.size):
        y[i] = x[i] * f32(0.5) * (f32(1.0) + _erf32(x[i] * _C_INV_SQRT_2))


@_kernel
def _gelu_erf_bwd(x, dout, dx):  # (n,) each
    for i in prange(x.size):
        v = x[i]
        cdf = f32(0.5) * (f32(1.0) + _erf32(v * _C_INV_SQRT_2))           # Phi(x)
        pdf = _C_INV_SQRT_2PI * _exp32(f32(-0.5) * v * v)                  # phi(x)
        dx[i] = dout[i] * (cdf + v * pdf)


@_inline
def _tanh32(u):
    return f32(1.0) - f32(2.0) / (_exp32(f32(2.0) * u) + f32(1.0))


@_kernel
def _gelu_tanh_fwd(x, y):
    for i in prange(x.size):
        v = x[i]
        t = _tanh32(_C_SQRT_2_OVER_PI * (v + f32(0.044715) * v * v * v))
        y[i] = f32(0.5) * v * (f32(1.0) + t)


@_kernel
def _gelu_tanh_bwd(x, dout, dx):
    for i in prange(x.size):
        v = x[i]
        t = _tanh32(_C_SQRT_2_OVER_PI * (v + f32(0.044715) * v * v * v))
        dt = (f32(1.0) - t * t) * _C_SQRT_2_OVER_PI * (f32(1.0) + f32(3 * 0.044715) * v * v)  # dt/dx
        dx[i] = dout[i] * (f32(0.5) * (f32(1.0) + t) + f32(0.5) * v * dt)


# quick (OpenAI CLIP's): y = x s, s = sigmoid(1.702 x) = 1 / (1 + e^(-1.702 x)),  dx = dout (s + 1.702 x s (1 - s))
# (_exp32 clamps its argument, so e^(-1.702 x) stays finite and s goes smoothly to 0 or 1)

_C_QUICK = f32(1.702)


@_kernel
def _gelu_quick_fwd(x, y):
    for i in prange(x.size):
        s = f32(1.0) / (f32(1.0) + _exp32(-_C_QUICK * x[i]))
        y[i] = x[i] * s


@_kernel
def _gelu_quick_bwd(x, dout, dx):
    for i in prange(x.size):
        v = x[i]
        s = f32(1.0) / (f32(1.0) + _exp32(-_C_QUICK * v))
        dx[i] = dout[i] * (s + _C_QUICK * v * s * (f32(1.0) - s))


def _gelu_cpu(x, dout, approximate):
    xf = _flat(x)
    out = numpy.empty_like(xf)
    if approximate == "erf":
        _gelu_erf_fwd(xf, out) if dout is None else _gelu_erf_bwd(xf, _flat(dout), out)
    elif approximate == "quick":
        _gelu_quick_fwd(xf, out) if dout is None else _gelu_quick_bwd(xf, _flat(dout), out)
    else:
        _gelu_tanh_fwd(xf, out) if dout is None else _gelu_tanh_bwd(xf, _flat(dout), out)
    return out.reshape(x.shape)


# ---- LayerNorm: one row (token) per loop step -------------------------------------------------------

@_kernel
def _layernorm_fwd(x, weight, bias, eps, y, xhat, rstd):  # x, y, xhat: (R, D); rstd: (R,)
    R, D = x.shape
    for r in prange(R):
        mean = f32(0.0)
        for d in range(D):
            mean += x[r, d]
        mean /= D
        var = f32(0.0)
        for d in range(D):
            var += (x[r, d] - mean) * (x[r, d] - mean)
        rs = f32(1.0) / math.sqrt(var / D + eps)                           # 1 / sqrt(var + eps)
        for d in range(D):
            h = (x[r, d] - mean) * rs                                      # xhat
            xhat[r, d] = h
            y[r, d] = h * weight[d] + bias[d]
        rstd[r] = rs


ROWS_PER_GROUP = 64  # LayerNorm backward sums dweight, dbias over groups of this many rows, then groups


@_kernel
def _layernorm_bwd(dout, xhat, rstd, weight, dx, dweight_parts, dbias_parts):
    R, D = dout.shape
    for g in prange(dweight_parts.shape[0]):                               # one group of rows per step
        for d in range(D):
            dweight_parts[g, d] = f32(0.0)
            dbias_parts[g, d] = f32(0.0)
        for r in range(g * ROWS_PER_GROUP, min(R, (g + 1) * ROWS_PER_GROUP)):
            mean_g = f32(0.0)                                              # mean(dxhat), dxhat = dout w
            mean_gx = f32(0.0)                                             # mean(dxhat * xhat)
            for d in range(D):
                dweight_parts[g, d] += dout[r, d] * xhat[r, d]
                dbias_parts[g, d] += dout[r, d]
                mean_g += dout[r, d] * weight[d]
                mean_gx += dout[r, d] * weight[d] * xhat[r, d]
            mean_g /= D
            mean_gx /= D
            for d in range(D):                                             # term 1 - term 2 - term 3
                dx[r, d] = rstd[r] * (dout[r, d] * weight[d] - mean_g - xhat[r, d] * mean_gx)


def _layernorm_forward_cpu(x, weight, bias, eps):
    x2 = _rows(x)                                              # (R, D), R = all leading axes
    R, D = x2.shape
    y, xhat = numpy.empty_like(x2), numpy.empty_like(x2)      # (R, D)
    rstd = numpy.empty((R,), x2.dtype)                         # (R,)
    _layernorm_fwd(x2, _flat(weight), _flat(bias), f32(eps), y, xhat, rstd)
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(x.shape[:-1] + (1,)), weight)


def _layernorm_backward_cpu(dout, cache):
    xhat, rstd, weight = cache
    xh2, d2 = _rows(xhat), _rows(dout)                         # (R, D) each
    R, D = d2.shape
    dx = numpy.empty_like(d2)                                  # (R, D)
    groups = -(-R // ROWS_PER_GROUP)
    dweight_parts = numpy.empty((groups, D), d2.dtype)         # one partial sum per group of rows
    dbias_parts = numpy.empty((groups, D), d2.dtype)
    _layernorm_bwd(d2, xh2, _flat(rstd), _flat(weight), dx, dweight_parts, dbias_parts)
    return dx.reshape(dout.shape), dweight_parts.sum(0), dbias_parts.sum(0)


# ---- softmax over the last axis: one row per loop step ----------------------------------------------

@_inline
def _row_max(x):
    """max of a 1-D array, with eight running maxima: one alone waits for each comparison to finish
    (~4 cycles) before the next; eight overlap. (A max is not vectorised unless NaN is ruled out.)"""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x[0]
    j = 0
    while j + 8 <= x.size:
        m0, m1, m2, m3 = max(m0, x[j]), max(m1, x[j + 1]), max(m2, x[j + 2]), max(m3, x[j + 3])
        m4, m5, m6, m7 = max(m4, x[j + 4]), max(m5, x[j + 5]), max(m6, x[j + 6]), max(m7, x[j + 7])
        j += 8
    while j < x.size:
        m0 = max(m0, x[j])
        j += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


# In the row kernels below each loop does one thing: a loop that both stores values and sums them is
# not vectorised by the compiler (measured 2x slower), so the sum is a loop of its own.

@_kernel
def _softmax_fwd(x, y):  # (R, n) each
    R, n = x.shape
    for r in prange(R):
        xr, yr = x[r], y[r]
        m = _row_max(xr)                                                   # the row's max: exp <= 1
        for j in range(n):
            yr[j] = _exp32(xr[j] - m)
        total = f32(0.0)
        for j in range(n):
            total += yr[j]
        inv = f32(1.0) / total
        for j in range(n):
            yr[j] *= inv


@_kernel
def _softmax_bwd(dout, s, dx):  # (R, n) each: dx = s (dout - sum_j dout_j s_j)
    R, n = dout.shape
    for r in prange(R):
        dr, sr, dxr = dout[r], s[r], dx[r]
        dot = f32(0.0)
        for j in range(n):
            dot += dr[j] * sr[j]
        for j in range(n):
            dxr[j] = sr[j] * (dr[j] - dot)


def _softmax_forward_cpu(x):
    x2 = _rows(x)
    y = numpy.empty_like(x2)
    if x2.size:
        _softmax_fwd(x2, y)
    y = y.reshape(x.shape)
    return y, y


def _softmax_backward_cpu(dout, s):
    d2 = _rows(dout)
    dx = numpy.empty_like(d2)
    _softmax_bwd(d2, _rows(s), dx)
    return dx.reshape(dout.shape)


# ---- attention's softmax, keeping only each row's log-sum-exp ---------------------------------------
# The row kernels of the fused attention on the CPU (the attention section, after the CuPy one, runs
# them between its matrix products; softmax_lse_fwd / softmax_lse_bwd in _ROW_SOURCE are the same two
# for the GPU). Each overwrites a chunk's raw scores q.k, one row of N per query and head, with p.

@_inline
def _scaled_softmax_row(sr, scale):  # sr: (N,) raw scores q_i.k_j, in place -> p_ij; returns (max, total)
    m_raw = _row_max(sr)                                                  # max_j q_i.k_j (scale > 0)
    for j in range(sr.size):
        sr[j] = _exp32((sr[j] - m_raw) * scale)                           # subtract, then scale: the max's
    total = f32(0.0)                                                      # own term is exp(0) = 1 at any size
    for j in range(sr.size):                                              # (scale q.k - scale max would let
        total += sr[j]                                                    #  an FMA leave a rounding error of
    inv = f32(1.0) / total                                                #  the size of q.k in the exponent)
    for j in range(sr.size):
        sr[j] *= inv                                                      # p_ij
    return m_raw, total


@_in_thread
def _softmax_lse(s, scale, lse):  # s: (R, N) raw scores q.k, in place -> p; lse: (R,)
    for r in range(s.shape[0]):
        m_raw, total = _scaled_softmax_row(s[r], scale)
        lse[r] = m_raw * scale + math.log(total)                          # log sum_j exp(scale q_i.k_j)


@_in_thread
def _softmax_lse_bwd(s, dp, scale):  # s: raw scores (R, N) -> p; dp: dL/dp (R, N) -> scale * dL/ds
    R, N = s.shape
    for r in range(R):
        sr, dpr = s[r], dp[r]
        # p_ij, recomputed as the forward made it, from the scores alone: exp(scale q.k - lse) would cancel
        # (at scores of 1e6, lse's rounding alone is 0.1 in the exponent)
        _scaled_softmax_row(sr, scale)
        delta = f32(0.0)
        for j in range(N):
            delta += sr[j] * dpr[j]                                       # sum_j p_ij dp_ij
        for j in range(N):
            dpr[j] = sr[j] * (dpr[j] - delta) * scale                     # ds_ij, times d(scale q.k)/d(q.k)


# ---- AdamW: one pass over each parameter, instead of ten ---------------------------------------------
# The same update as optim.AdamW's reference lines, in the same order, one value at a time:
#   p <- p (1 - lr wd);  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
#   p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

@_kernel
def _adamw(p, g, m, v, decay, b1, b2, one_minus_b1, one_minus_b2, step_size, inv_sqrt_bc2, eps):
    for i in prange(p.size):                                              # (n,) each, in place
        m[i] = b1 * m[i] + one_minus_b1 * g[i]
        v[i] = b2 * v[i] + one_minus_b2 * (g[i] * g[i])
        p[i] = p[i] * decay - step_size * (m[i] / (math.sqrt(v[i]) * inv_sqrt_bc2 + eps))


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
        _elementwise("minivit_adamw", _ADAMW_PARAMS, "T p, T m, T v", _ADAMW_BODY)(g, *constants, p, m, v)
        return
    _adamw(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), *constants)


# ---- SGD with momentum: one pass over each parameter on the GPU --------------------------------------
# The same update as functional.sgd_update, one value at a time (the CPU runs functional.sgd_update: its
# three lines cost little next to NumPy's per-call overhead, and a Numba twin would buy nothing there):
#   g_t = g + wd p;   b_t = mu b_{t-1} + g_t (b_0 = 0, so b_1 = g_1);   d_t = b_t, or g_t + mu b_t (nesterov)
#   p <- p - lr d_t

def supports_sgd(*arrays):
    """Whether sgd_update can take these arrays: float32 CuPy arrays (momentum_buffer may be None)."""
    return all(a is None or (_is_cupy(a) and a.dtype == numpy.float32) for a in arrays)


def sgd_update(p, g, momentum_buffer, lr, momentum, nesterov, weight_decay):
    """As functional.sgd_update, on the GPU: one ElementwiseKernel launch (two on the first step, which
    makes the buffer). Returns the momentum buffer (None when momentum is 0)."""
    cp = _cupy()
    T = p.dtype.type
    if momentum == 0:
        _elementwise("minivit_sgd", "T g, T lr, T wd", "T p", _SGD_BODY)(g, T(lr), T(weight_decay), p)
        return None
    if momentum_buffer is None:
        momentum_buffer = cp.zeros_like(p)                     # b_0 = 0: then b_1 = mu 0 + g_1 = g_1 exactly
    _elementwise("minivit_sgd_momentum", "T g, T lr, T mu, T wd, bool nesterov", "T p, T b", _SGD_MOMENTUM_BODY)(
        g, T(lr), T(momentum), T(weight_decay), numpy.bool_(nesterov), p, momentum_buffer)
    return momentum_buffer


# ---- Linear: the same products as functional.linear_*, two speed choices ----------------------------
# 1. dW = x^T dout is given to BLAS as the product whose first side is the longer of in and out (the
#    transpose of a product is free: a view). OpenBLAS's threads handle (short side, long inner)
#    products badly: 3-10x slower when the cores are shared.
# 2. matmul_dtype="float16", mixed precision (minivit/amp.py): x and W are rounded to float16 for the
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


# ==================================================================================================
# CuPy (GPU): fused kernels, compiled on first use
# ==================================================================================================

_compiled = {}   # every compiled CuPy kernel, by name (made on first use)


def _cupy():
    import cupy

    return cupy


def _elementwise(name, in_params, out_params, body):
    if name not in _compiled:
        _compiled[name] = _cupy().ElementwiseKernel(in_params, out_params, body, name)
    return _compiled[name]


_GELU_ERF_FWD = "y = x * ((T)0.5 * ((T)1 + erf(x * (T)0.70710678118654752)));"
_GELU_ERF_BWD = """
    T cdf = (T)0.5 * ((T)1 + erf(x * (T)0.70710678118654752));
    T pdf = exp((T)(-0.5) * x * x) * (T)0.39894228040143264;
    dx = dout * (cdf + x * pdf);"""
_GELU_QUICK_FWD = "y = x / ((T)1 + exp((T)(-1.702) * x));"
_GELU_QUICK_BWD = """
    T s = (T)1 / ((T)1 + exp((T)(-1.702) * x));
    dx = dout * (s + (T)1.702 * x * s * ((T)1 - s));"""
_GELU_TANH_FWD = """
    T t = tanh((T)0.79788456080286536 * (x + (T)0.044715 * x * x * x));
    y = (T)0.5 * x * ((T)1 + t);"""
_GELU_TANH_BWD = """
    T t = tanh((T)0.79788456080286536 * (x + (T)0.044715 * x * x * x));
    T dt = ((T)1 - t * t) * (T)0.79788456080286536 * ((T)1 + (T)0.134145 * x * x);
    dx = dout * ((T)0.5 * ((T)1 + t) + (T)0.5 * x * dt);"""

# The optimizers (their sections above, with the CPU's): each parameter's update in one launch, the
# arrays named as in functional.py; p, m, v (p, b) are written in place.
_ADAMW_PARAMS = "T g, T decay, T b1, T b2, T one_minus_b1, T one_minus_b2, T step_size, T inv_sqrt_bc2, T eps"
_ADAMW_BODY = """
    m = b1 * m + one_minus_b1 * g;                                // m_t = b1 m + (1 - b1) g
    v = b2 * v + one_minus_b2 * (g * g);                          // v_t = b2 v + (1 - b2) g^2
    p = p * decay - step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps));"""
_SGD_BODY = "p = p - lr * (g + wd * p);"
_SGD_MOMENTUM_BODY = """
    T gt = g + wd * p;                                            // g_t = g + wd p
    b = mu * b + gt;                                              // b_t = mu b_{t-1} + g_t
    T d = nesterov ? gt + mu * b : b;                             // d_t
    p = p - lr * d;"""

# Dropout's keep mask, drawn on the GPU: element i gets the splitmix64 hash of (seed, i), a counter-based
# generator (no state but the seed, so nothing lives on the device between calls), and is kept when the
# top 24 bits, uniform in [0, 2^24), are >= threshold = round(p 2^24): with probability 1 - p (to 2^-24).
_KEEP_MASK_BODY = """
    unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z = z ^ (z >> 31);
    keep = (z >> 40) >= threshold;"""

# Row-wise kernels: one thread block per row, a tree reduction in shared memory.
_ROW_SOURCE = r"""
typedef %(T)s T;

__device__ T block_sum(T v, T* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    T r = buf[0];
    __syncthreads();
    return r;
}

__device__ T block_max(T v, T* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] = max(buf[threadIdx.x], buf[threadIdx.x + s]);
        __syncthreads();
    }
    T r = buf[0];
    __syncthreads();
    return r;
}

extern "C" __global__ void layernorm_fwd(const T* x, const T* w, const T* b, T* y, T* xhat, T* rstd,
                                         int D, T eps) {
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * D;
    T s = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) s += x[base + i];
    T mean = block_sum(s, buf) / (T)D;
    T v = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) { T c = x[base + i] - mean; v += c * c; }
    T r = (T)1 / sqrt(block_sum(v, buf) / (T)D + eps);
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        T h = (x[base + i] - mean) * r;
        xhat[base + i] = h;
        y[base + i] = h * w[i] + b[i];
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

extern "C" __global__ void layernorm_bwd(const T* dout, const T* xhat, const T* rstd, const T* w, T* dx,
                                         int D) {
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * D;
    T a = 0, c = 0;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        T g = dout[base + i] * w[i];
        a += g;
        c += g * xhat[base + i];
    }
    T mean_g = block_sum(a, buf) / (T)D;
    T mean_gx = block_sum(c, buf) / (T)D;
    T r = rstd[blockIdx.x];
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        T g = dout[base + i] * w[i];
        dx[base + i] = r * (g - mean_g - xhat[base + i] * mean_gx);
    }
}

extern "C" __global__ void softmax_fwd(const T* x, T* y, int n) {
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * n;
    T m = x[base];
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = max(m, x[base + i]);
    m = block_max(m, buf);
    T s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { T e = exp(x[base + i] - m); y[base + i] = e; s += e; }
    T inv = (T)1 / block_sum(s, buf);
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[base + i] *= inv;
}

extern "C" __global__ void softmax_bwd(const T* dout, const T* s, T* dx, int n) {
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * n;
    T d = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) d += dout[base + i] * s[base + i];
    d = block_sum(d, buf);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dx[base + i] = s[base + i] * (dout[base + i] - d);
}

// Attention's softmax (the attention section below), the same as _softmax_lse and _softmax_lse_bwd:
// s holds a row of raw scores q.k per block, scale = 1 / sqrt(hs); only lse, one value a row, is kept.
extern "C" __global__ void softmax_lse_fwd(T* s, T* lse, int n, T scale) {   // s -> p in place
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * n;
    T m_raw = s[base];
    for (int i = threadIdx.x; i < n; i += blockDim.x) m_raw = max(m_raw, s[base + i]);
    m_raw = block_max(m_raw, buf);                                 // max_j q_i.k_j (scale > 0)
    T total = 0;                                                   // subtract, then scale: exp(0) = 1 for the max
    for (int i = threadIdx.x; i < n; i += blockDim.x) { T e = exp((s[base + i] - m_raw) * scale); s[base + i] = e; total += e; }
    total = block_sum(total, buf);
    T inv = (T)1 / total;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[base + i] *= inv;          // p_ij
    if (threadIdx.x == 0) lse[blockIdx.x] = m_raw * scale + log(total);  // log sum_j exp(scale q_i.k_j)
}

extern "C" __global__ void softmax_lse_bwd(T* s, T* dp, int n, T scale) {  // s -> p, dp -> ds
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * n;
    T m_raw = s[base];                                             // p_ij recomputed as the forward made it,
    for (int i = threadIdx.x; i < n; i += blockDim.x) m_raw = max(m_raw, s[base + i]);   // from the scores
    m_raw = block_max(m_raw, buf);                                 // alone (exp(scale q.k - lse) would cancel)
    T total = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) { T e = exp((s[base + i] - m_raw) * scale); s[base + i] = e; total += e; }
    T inv = (T)1 / block_sum(total, buf);
    T d = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T p = s[base + i] * inv;                                   // p_ij
        s[base + i] = p;
        d += p * dp[base + i];
    }
    d = block_sum(d, buf);                                         // sum_j p_ij dp_ij
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        dp[base + i] = s[base + i] * (dp[base + i] - d) * scale;   // ds_ij, times d(scale q.k)/d(q.k)
}
"""


def _row_kernel(name, dtype):
    """A compiled row kernel for float32 or float64 (one module per dtype, each function looked up once)."""
    T = {"float32": "float", "float64": "double"}[numpy.dtype(dtype).name]
    key = ("rows", T, name)
    if key not in _compiled:
        if ("rows", T) not in _compiled:
            _compiled[("rows", T)] = _cupy().RawModule(code=_ROW_SOURCE % {"T": T})
        _compiled[key] = _compiled[("rows", T)].get_function(name)
    return _compiled[key]


def _gpu_rows(x):
    """x as a C-contiguous (rows, last axis) CuPy array (rows counted, so an empty last axis works too)."""
    return _cupy().ascontiguousarray(x).reshape(math.prod(x.shape[:-1]), x.shape[-1])


def _launch_rows(name, n_rows, row_len, dtype, args):
    """One block per row; threads: a power of two from 32 to 256, about the row length."""
    threads = 32
    while threads < min(row_len, 256):
        threads *= 2
    if n_rows and row_len:                      # an empty row has nothing to compute (and no s[base] to read)
        _row_kernel(name, dtype)((n_rows,), (threads,), args, shared_mem=threads * numpy.dtype(dtype).itemsize)


def _gpu_layernorm_forward(x, weight, bias, eps):
    cp = _cupy()
    x2 = _gpu_rows(x)                                         # (R, D)
    R, D = x2.shape
    y, xhat = cp.empty_like(x2), cp.empty_like(x2)
    rstd = cp.empty((R,), x2.dtype)
    w, b = cp.ascontiguousarray(weight), cp.ascontiguousarray(bias)
    _launch_rows("layernorm_fwd", R, D, x2.dtype, (x2, w, b, y, xhat, rstd, numpy.int32(D), x2.dtype.type(eps)))
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(x.shape[:-1] + (1,)), weight)


def _gpu_layernorm_backward(dout, cache):
    cp = _cupy()
    xhat, rstd, weight = cache
    D = xhat.shape[-1]
    xh2, d2 = _gpu_rows(xhat), _gpu_rows(dout)                # (R, D) each
    R = d2.shape[0]
    dx = cp.empty_like(d2)
    _launch_rows("layernorm_bwd", R, D, d2.dtype,
                 (d2, xh2, cp.ascontiguousarray(rstd).reshape(-1), cp.ascontiguousarray(weight), dx, numpy.int32(D)))
    if "colsum_prod" not in _compiled:
        _compiled["colsum_prod"] = cp.ReductionKernel("T g, T h", "T y", "g * h", "a + b", "y = a", "0",
                                                      "minivit_colsum_prod")
    dweight = _compiled["colsum_prod"](d2, xh2, axis=0)       # (D,) sum of dout * xhat, one kernel
    dbias = d2.sum(0)                                         # (D,)
    return dx.reshape(dout.shape), dweight, dbias


def _gpu_softmax_forward(x):
    cp = _cupy()
    x2 = _gpu_rows(x)                                         # (R, n)
    y = cp.empty_like(x2)
    _launch_rows("softmax_fwd", x2.shape[0], x2.shape[1], x2.dtype, (x2, y, numpy.int32(x2.shape[1])))
    y = y.reshape(x.shape)
    return y, y


def _gpu_softmax_backward(dout, s):
    cp = _cupy()
    n = s.shape[-1]
    d2, s2 = _gpu_rows(dout), _gpu_rows(s)                    # (R, n) each
    dx = cp.empty_like(d2)
    _launch_rows("softmax_bwd", d2.shape[0], n, d2.dtype, (d2, s2, dx, numpy.int32(n)))
    return dx.reshape(dout.shape)


def _gpu_softmax_lse(s, scale, lse):
    """_softmax_lse on the GPU: s (R, N) raw scores q.k, contiguous, in place -> p; lse (R,) written."""
    R, N = s.shape
    _launch_rows("softmax_lse_fwd", R, N, s.dtype, (s, lse, numpy.int32(N), s.dtype.type(scale)))


def _gpu_softmax_lse_bwd(s, dp, scale):
    """_softmax_lse_bwd on the GPU: s (R, N) raw scores -> p; dp (R, N) dL/dp -> scale * dL/ds; contiguous."""
    R, N = s.shape
    _launch_rows("softmax_lse_bwd", R, N, s.dtype, (s, dp, numpy.int32(N), s.dtype.type(scale)))


# ==================================================================================================
# Attention on both backends: in chunks of images, the N x N weights never stored
# ==================================================================================================
# The reference computes the scores q k^T / sqrt(hs) of the whole batch, (B, nh, N, N), and keeps their
# softmax for the backward. Here the batch goes through in chunks of a few images, and only each row's
# log-sum-exp (lse, B x nh x N values, which ops.attention_weights reads) is kept. The backward recomputes
# the weights inside its softmax-backward kernel: one more q k^T product, and no (B, nh, N, N) array held
# between the passes (FlashAttention and PyTorch's scaled_dot_product_attention make the same trade). It
# recomputes them from the scores alone, max, exp and sum as the forward did, rather than as
# exp(scale s_ij - lse_i) as FlashAttention does: lse is rounded at the size of the scores, so at scores
# of 1e6 that difference is off by ~0.1 in the exponent (10% in the weights), at 1e35 by 1e27 (NaN).
#
# One orchestration for both backends: the products are xp.matmul (NumPy's, i.e. BLAS; or CuPy's, i.e.
# cuBLAS) on views of qkv, written into place with out=. Only the row kernel between them differs:
# _softmax_lse / _softmax_lse_bwd (Numba, above) on the CPU, softmax_lse_fwd / softmax_lse_bwd (CUDA,
# _ROW_SOURCE) on the GPU, which compute the same numbers the same way, so the same chunk code follows.
#
# CPU: a chunk's (b, nh, N, N) scores stay in the CPU's cache between the products and the softmax.
# Threads: each head's products are small (N x hs times hs x N), too small for BLAS to share one among
# the cores (it tries, and mostly waits). So the chunks are shared instead: num_threads() Python threads
# each take whole chunks, with BLAS set to one thread meanwhile (threadpoolctl); NumPy's matmul and the
# Numba kernels (nogil) release the GIL, so the threads really run at once. This needs OpenBLAS's own
# idle threads to sleep rather than spin (minivit/_blas_env.py, which sees to it whatever the import
# order): otherwise they hold the cores and the threads gain nothing. Measured on 2 cores, CIFAR model, batch 64: a training step 395 -> 345 ms.
# Tried and dropped: the per-head products as Numba loops (2.2x slower than BLAS).
#
# GPU: the chunks only bound the memory the scores take (ViT-B/16 at batch 128: 238 MB, one chunk). The
# kernels queue one after the other on CuPy's stream: one worker, no Python threads. The products are
# cuBLAS's strided batched GEMM, called directly (_gpu_matmul, below), not CuPy's matmul: that one copies
# every operand that is not C-contiguous (k^T, p^T, ds^T: two of them N x N) and writes a non-contiguous
# out= through a temporary (cupy/_core/_routines_linalg.pyx), and it multiplies in plain FP32 even with
# CUPY_TF32=1. So q, k, v (and dctx) are made contiguous once per pass, (3, B, nh, N, hs), a transposed
# operand is handed to cuBLAS as "transposed" (no copy), each product writes into a contiguous array,
# and the heads go back side by side in one copy at the end. TF32: when CUPY_TF32=1 (tf32_enabled()).

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
    """How many threads share attention's chunks: num_threads() when OpenBLAS's idle threads sleep (set up
    now if that was too late at import: minivit/_blas_env.py), else 1."""
    n = num_threads()
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
    with _blas_control.limit(limits=1, user_api="blas"):
        for f in [_chunk_pool.submit(work, b0, b1) for b0, b1 in chunks]:
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
    return None if mask is None else (xp.asarray(mask, dtype=numpy.float32) / scale).astype(numpy.float32)


def _fused_attention_forward(qkv, num_heads, mask=None):
    gpu = _is_cupy(qkv)
    xp = _cupy() if gpu else numpy
    softmax_lse = _gpu_softmax_lse if gpu else _softmax_lse      # the row kernel: CUDA or Numba
    matmul = _gpu_matmul if gpu else numpy.matmul                # cuBLAS (see above) or BLAS
    B, N, D3 = qkv.shape
    D = D3 // 3
    q, k, v = _attention_operands(qkv, num_heads, gpu)           # (B, nh, N, hs) each
    scale = f32(1.0 / math.sqrt(D // num_heads))
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
    gpu = _is_cupy(qkv)
    xp = _cupy() if gpu else numpy
    softmax_lse_bwd = _gpu_softmax_lse_bwd if gpu else _softmax_lse_bwd
    matmul = _gpu_matmul if gpu else numpy.matmul
    B, N, D3 = qkv.shape
    D = D3 // 3
    q, k, v = _attention_operands(qkv, num_heads, gpu)           # (B, nh, N, hs) each
    scale = f32(1.0 / math.sqrt(D // num_heads))
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
    heads = _cupy().ascontiguousarray(heads)
    return heads[0], heads[1], heads[2]


# ---- batched matrix products on the GPU, through cuBLAS (see the GPU note above) --------------------

def tf32_enabled():
    """Whether float32 products on the GPU may use TF32 (10-bit mantissa inputs, float32 sums): when
    CUPY_TF32 is 1, which is also what makes CuPy's own 2-D products use it."""
    try:
        return int(os.environ.get("CUPY_TF32", "0") or 0) > 0
    except ValueError:
        return False


def _batch_layout(a):
    """How cuBLAS can read the matrices of a (..., r, c) CuPy array: (count, batch stride, transposed,
    leading dimension), strides in elements; None when the leading axes are not one even stride or a
    matrix is neither C-contiguous nor the transpose of a C-contiguous one (then it is copied first).
    transposed=False: row-major (ld = row stride); True: the transpose of a row-major (ld = column stride)."""
    *lead, r, c = a.shape
    strides = [st // a.itemsize for st in a.strides]
    count, batch_stride = 1, 0
    for n, st in zip(reversed(lead), reversed(strides[:-2])):   # innermost leading axis first
        if n == 1:
            continue
        if count > 1 and st != batch_stride * count:
            return None
        batch_stride = st if count == 1 else batch_stride
        count *= n
    rs, cs = strides[-2:]
    if cs == 1 or c == 1:
        return count, batch_stride, False, rs if r > 1 else c
    if rs == 1 or r == 1:
        return count, batch_stride, True, cs if c > 1 else r
    return None


def _gpu_matmul(a, b, out=None):
    """out = a @ b for CuPy arrays (..., M, K) @ (..., K, N) with the same leading axes, by one strided
    batched GEMM. a, b: C-contiguous matrices or transposed views of them; out: C-contiguous (made if None).
    cuBLAS is column-major: a row-major C is a column-major C^T, so it computes C^T = b^T a^T."""
    cp = _cupy()
    M, K = a.shape[-2:]
    N = b.shape[-1]
    if out is None:
        out = cp.empty(a.shape[:-1] + (N,), a.dtype)
    la, lb, lc = _batch_layout(a), _batch_layout(b), _batch_layout(out)
    if la is None:
        a = cp.ascontiguousarray(a)
        la = _batch_layout(a)
    if lb is None:
        b = cp.ascontiguousarray(b)
        lb = _batch_layout(b)
    if lc is None or lc[2] or not (la[0] == lb[0] == lc[0]):
        raise ValueError(f"_gpu_matmul: out {out.shape} must be C-contiguous with the operands' batch")
    if out.size == 0:
        return out
    if K == 0:
        out.fill(0)
        return out
    from cupy.cuda import cublas, device, runtime

    if a.dtype == numpy.float64:
        data_type, compute = runtime.CUDA_R_64F, cublas.CUBLAS_COMPUTE_64F
    else:
        data_type = runtime.CUDA_R_32F
        compute = cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if tf32_enabled() else cublas.CUBLAS_COMPUTE_32F
    one, zero = numpy.ones(1, a.dtype), numpy.zeros(1, a.dtype)          # alpha, beta: read from the host
    op = {False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T}
    cublas.gemmStridedBatchedEx(
        device.get_cublas_handle(), op[lb[2]], op[la[2]], N, M, K, one.ctypes.data,
        b.data.ptr, data_type, lb[3], lb[1], a.data.ptr, data_type, la[3], la[1], zero.ctypes.data,
        out.data.ptr, data_type, lc[3], lc[1], lc[0], compute, cublas.CUBLAS_GEMM_DEFAULT)
    return out


# ==================================================================================================
# The entry points, chosen by ops.py for float32 arrays: functional.py's arguments, the same caches
# ==================================================================================================

def gelu_forward(x, approximate="erf"):
    """As functional.gelu_forward: (out, cache) with cache = (x, approximate)."""
    if _is_cupy(x):
        body = (_GELU_ERF_FWD if approximate == "erf" else _GELU_TANH_FWD if approximate == "tanh"
                else _GELU_QUICK_FWD)
        out = _elementwise(f"minivit_gelu_{approximate}_fwd", "T x", "T y", body)(x)
    else:
        out = _gelu_cpu(x, None, approximate)
    return out, (x, approximate)


def gelu_backward(dout, cache):
    """As functional.gelu_backward: dx."""
    x, approximate = cache
    if _is_cupy(x):
        body = (_GELU_ERF_BWD if approximate == "erf" else _GELU_TANH_BWD if approximate == "tanh"
                else _GELU_QUICK_BWD)
        return _elementwise(f"minivit_gelu_{approximate}_bwd", "T dout, T x", "T dx", body)(dout, x)
    return _gelu_cpu(x, dout, approximate)


def dropout_keep_mask(shape, p, seed):
    """A boolean CuPy array of the given shape, each value True with probability 1 - p, drawn on the GPU
    in one launch from seed (an integer in [0, 2^63)): the same seed gives the same mask. Not a twin of a
    pair: layers.Dropout calls it on the GPU (on the CPU it draws its mask on the host, value by value)."""
    keep = _cupy().empty(shape, dtype=numpy.bool_)
    threshold = numpy.uint64(round(p * (1 << 24)))
    _elementwise("minivit_keep_mask", "uint64 seed, uint64 threshold", "bool keep", _KEEP_MASK_BODY)(
        numpy.uint64(seed), threshold, keep)
    return keep


def layernorm_forward(x, weight, bias, eps=1e-6):
    """As functional.layernorm_forward: (out, (xhat, rstd, weight))."""
    if _is_cupy(x):
        return _gpu_layernorm_forward(x, weight, bias, eps)
    return _layernorm_forward_cpu(x, weight, bias, eps)


def layernorm_backward(dout, cache):
    """As functional.layernorm_backward: (dx, dweight, dbias)."""
    if _is_cupy(dout):
        return _gpu_layernorm_backward(dout, cache)
    return _layernorm_backward_cpu(dout, cache)


def softmax_forward(x):
    """As functional.softmax_forward: (out, out)."""
    return _gpu_softmax_forward(x) if _is_cupy(x) else _softmax_forward_cpu(x)


def attention_forward(qkv, num_heads, mask=None):
    """As functional.attention_forward, fused (NumPy with Numba, or CuPy): (out, AttentionCache)."""
    return _fused_attention_forward(qkv, num_heads, mask)


def attention_backward(dout, cache):
    """As functional.attention_backward, for an AttentionCache: dqkv."""
    return _fused_attention_backward(dout, cache)


def softmax_backward(dout, cache):
    """As functional.softmax_backward: dx."""
    return _gpu_softmax_backward(dout, cache) if _is_cupy(dout) else _softmax_backward_cpu(dout, cache)
