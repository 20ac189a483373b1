"""The CPU room of the fast paths: Numba kernels, each a plain loop compiled to machine code.

What is here: the loops for GELU (erf, tanh, quick), LayerNorm, softmax, attention's softmax that keeps only
each row's log-sum-exp (minivit/fast/attention.py runs it between its matrix products) and AdamW, plus the
CPU halves of the twins that minivit/fast/kernels.py offers (``_gelu_cpu``, ``_layernorm_forward_cpu``...).
Nothing here is called by a layer: minivit/fast/ops.py chooses a twin, and kernels.py sends NumPy arrays here.

How: each kernel is a loop, one value or one row at a time, that Numba compiles on first use (~10 s for all
of them, cached on disk in minivit/fast/__pycache__, so later runs start at once). The inner loops run as
SIMD vectors; for arrays of PARALLEL_MIN values or more ``prange`` shares the outer loop among the cores
(MINIVIT_NUM_THREADS, default: all of them). Most of these kernels are limited by memory bandwidth, not
arithmetic, so one pass instead of six is the win. exp and erf are written out as polynomials (``_exp32``,
``_erf32``) because the C library's versions are called one value at a time, which stops the loop from
being vectorised. Rows of a reduction that crosses rows (LayerNorm's dweight) are summed in fixed groups,
then the groups in order, so every result is the same to the bit whatever the number of threads.
Without Numba installed this module still imports (HAVE_NUMBA is False) and ops.py runs functional.py.
"""

import math
import os
import threading
import types

import numpy

try:
    import numba
except ImportError:  # the CPU fast paths are off (ops.py runs functional.py for NumPy arrays)
    numba = None

HAVE_NUMBA = numba is not None

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


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
# The row kernels of the fused attention on the CPU (minivit/fast/attention.py runs them between its
# matrix products; softmax_lse_fwd / softmax_lse_bwd in cuda._ROW_SOURCE are the same two for the GPU).
# Each overwrites a chunk's raw scores q.k, one row of N per query and head, with p.

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