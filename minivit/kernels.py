"""Fast paths: the elementwise-heavy pairs of functional.py again, computing the same numbers faster.

functional.py is the definition; this module only changes *how* the numbers are computed, and only for
float32 arrays (float64 always runs the reference lines, so the float64 gradient and parity checks test
the math as written). tests/test_fast_paths.py checks every function here against the reference to
float32 tolerance. ``minivit.backend.set_fast_kernels(False)`` (or ``MINIVIT_FAST_KERNELS=0``) turns
the fast paths off, e.g. to step through the reference code in a debugger.

Why the reference is slow: a line such as ``rstd * (dxhat - dxhat.mean(-1) - xhat * (dxhat * xhat).mean(-1))``
is six passes over a (B, N, D) array, each allocating a new one. On the CPU every pass reads and writes
main memory; on the GPU every operation is a kernel launch (~10 us, more than the work itself in a small
model). What this module does instead:

- NumPy: the rows are processed in blocks of about 64K values (256 KB, so a block and its temporaries
  stay in the CPU's L2 cache), written into preallocated outputs with ``out=``: the same operations, on
  cached data, with no big temporaries (the best of 16K...256K on this machine's 2 MB L2). GELU's erf
  is a rational approximation (scipy's erf costs ~10 ns a value, several times the matrix product that
  feeds GELU). ``MINIVIT_NUM_THREADS`` > 1 shares the
  blocks among that many threads (NumPy releases the GIL inside each operation). Off by default: on this
  2-core machine, busy with other work, it gained at best 1.3x on GELU and lost as often (each block is
  ~20 short operations, and every one hands the GIL over).
- CuPy: one fused kernel per forward or backward: a ``cupy.ElementwiseKernel`` for GELU, a ``RawKernel``
  with one thread block per row for the row-wise LayerNorm and softmax. Compiled on first use.

Only this module and backend.py touch CuPy, and this one only ever sees CuPy arrays that exist already
(it never imports CuPy for a NumPy array).
"""

import math
import os
import threading

import numpy

_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _is_cupy(x):
    return type(x).__module__.startswith("cupy")


# ==================================================================================================
# NumPy (CPU)
# ==================================================================================================

BLOCK_VALUES = 65536  # values per block: 256 KB of float32; a block and its temporaries fit in L2 (2 MB)
_pool = None
_local = threading.local()  # per-thread scratch blocks


def num_threads():
    """Threads for the CPU kernels: MINIVIT_NUM_THREADS, default 1 (BLAS has threads of its own)."""
    value = os.environ.get("MINIVIT_NUM_THREADS", "1")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"MINIVIT_NUM_THREADS must be a positive integer, got {value!r}") from None
    if n < 1:
        raise ValueError(f"MINIVIT_NUM_THREADS must be a positive integer, got {value!r}")
    return n


def _scratch(name, n, dtype):
    """A scratch array of n values, reused by this thread (one per name and dtype)."""
    key = (name, numpy.dtype(dtype).char)
    buf = getattr(_local, "bufs", None)
    if buf is None:
        buf = _local.bufs = {}
    a = buf.get(key)
    if a is None or a.size < n:
        a = buf[key] = numpy.empty(max(n, BLOCK_VALUES), dtype)
    return a[:n]


def _for_blocks(n_rows, row_len, task):
    """Call task(i, start, stop) for consecutive ranges of rows covering [0, n_rows), block i holding
    about BLOCK_VALUES values; on this thread in order, or shared among num_threads() threads (each
    takes a contiguous run of blocks). Returns the number of blocks."""
    global _pool
    rows = max(1, BLOCK_VALUES // max(row_len, 1))
    n_blocks = -(-n_rows // rows)
    threads = min(num_threads(), n_blocks)

    def run(first, last):
        for i in range(first, last):
            task(i, i * rows, min((i + 1) * rows, n_rows))

    if threads <= 1:
        run(0, n_blocks)
        return n_blocks
    if _pool is None or _pool._max_workers < threads:
        from concurrent.futures import ThreadPoolExecutor
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="minivit-kernels")
    per = -(-n_blocks // threads)
    futures = [_pool.submit(run, f, min(f + per, n_blocks)) for f in range(0, n_blocks, per)]
    for f in futures:
        f.result()
    return n_blocks


def _rows(x):
    """x as a C-contiguous (rows, last axis) array: a view when x is contiguous, else a copy."""
    return numpy.ascontiguousarray(x).reshape(-1, x.shape[-1])


# ---- erf ------------------------------------------------------------------------------------------
# erf(z) ~ z P(z^2) / Q(z^2) on [-4, 4] (the rational approximation used by Eigen and XLA); beyond 4,
# erf = +-1 to float32 precision. The approximation's own error is 6.5e-8. Evaluated in float32, the
# rounding of the Horner steps adds up to 4e-7 more, so erf() evaluates each block in float64 and rounds
# once at the end: within 1e-7 of the exact erf, and ~4x faster than scipy's erf (which also works in
# float64, one value at a time). GELU evaluates it in float32 instead, twice as fast again: there its
# error, 2e-7 in Phi(x), is far below the rounding of the float32 matrix product that feeds it.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)  # of (z^2)^6, ..., (z^2)^0
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)                                                 # of (z^2)^4, ..., (z^2)^0


def _erf_rational(z, out, z2, q):
    """out = erf(z) for a block z (clipped in place), in z's dtype; z2, q: scratch blocks like z."""
    numpy.clip(z, -4.0, 4.0, out=z)
    numpy.multiply(z, z, out=z2)                             # z^2
    numpy.multiply(z2, _ERF_P[0], out=out)
    for c in _ERF_P[1:-1]:
        out += c
        out *= z2
    out += _ERF_P[-1]                                        # P(z^2), by Horner's rule
    out *= z                                                 # z P(z^2)
    numpy.multiply(z2, _ERF_Q[0], out=q)
    for c in _ERF_Q[1:-1]:
        q += c
        q *= z2
    q += _ERF_Q[-1]                                          # Q(z^2)
    out /= q
    return out


def erf(x):
    """erf(x) for a float32 NumPy array, within 1e-7 of the exact value."""
    if x.dtype != numpy.float32:
        raise TypeError(f"kernels.erf is for float32 arrays, got {x.dtype} (use scipy.special.erf)")
    flat = numpy.ascontiguousarray(x).reshape(-1)
    out = numpy.empty_like(flat)

    def task(i, s, e):
        z, p, z2, q = (_scratch(k, e - s, numpy.float64) for k in "zpwq")
        numpy.copyto(z, flat[s:e])                           # float32 -> float64
        _erf_rational(z, p, z2, q)
        numpy.copyto(out[s:e], p, casting="same_kind")      # rounded to float32 once

    _for_blocks(flat.size, 1, task)
    return out.reshape(x.shape)


# ---- GELU -----------------------------------------------------------------------------------------

def _gelu_erf_block(x, dout, out, need_grad):
    """Forward: out = x Phi(x). Backward (need_grad): out = dout (Phi(x) + x phi(x)).
    Phi(x) = (1 + erf(x / sqrt 2)) / 2, phi(x) = exp(-x^2 / 2) / sqrt(2 pi). All float32."""
    n = x.size
    z, cdf, z2, q = (_scratch(k, n, numpy.float32) for k in "zpwq")
    numpy.multiply(x, _INV_SQRT_2, out=z)                    # z = x / sqrt 2
    if need_grad:
        pdf = _scratch("e", n, numpy.float32)
        numpy.multiply(z, z, out=pdf)
        numpy.negative(pdf, out=pdf)
        numpy.exp(pdf, out=pdf)                                # exp(-x^2 / 2), before z is clipped
    _erf_rational(z, cdf, z2, q)
    cdf += 1.0
    cdf *= 0.5                                                 # Phi(x)
    if not need_grad:
        numpy.multiply(cdf, x, out=out)                        # x Phi(x)
        return
    pdf *= _INV_SQRT_2PI                                       # phi(x)
    pdf *= x
    cdf += pdf                                                 # Phi(x) + x phi(x)
    numpy.multiply(cdf, dout, out=out)


def _gelu_tanh_block(x, dout, out, need_grad):
    """The tanh approximation, in float32: t = tanh(sqrt(2/pi) (x + 0.044715 x^3))."""
    n = x.size
    t, u = _scratch("t", n, numpy.float32), _scratch("u", n, numpy.float32)
    numpy.multiply(x, x, out=u)                                # x^2
    numpy.multiply(u, 0.044715, out=t)
    t += 1.0
    t *= x
    t *= _SQRT_2_OVER_PI
    numpy.tanh(t, out=t)                                       # t
    if not need_grad:
        t += 1.0
        t *= x
        numpy.multiply(t, 0.5, out=out)                        # 0.5 x (1 + t)
        return
    u *= 3 * 0.044715
    u += 1.0
    u *= _SQRT_2_OVER_PI                                       # sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    numpy.multiply(t, t, out=out)
    numpy.subtract(1.0, out, out=out)                          # 1 - t^2
    out *= u
    out *= x                                                   # x dt/dx
    out += t
    out += 1.0
    out *= 0.5                                                 # 0.5 (1 + t) + 0.5 x dt/dx
    out *= dout


def _gelu_cpu(x, dout, approximate):
    block = _gelu_erf_block if approximate == "erf" else _gelu_tanh_block
    xf = numpy.ascontiguousarray(x).reshape(-1)
    df = None if dout is None else numpy.ascontiguousarray(dout).reshape(-1)
    out = numpy.empty_like(xf)

    def task(i, s, e):
        block(xf[s:e], None if df is None else df[s:e], out[s:e], df is not None)

    _for_blocks(xf.size, 1, task)
    return out.reshape(x.shape)


# ---- LayerNorm ------------------------------------------------------------------------------------

def _layernorm_forward_cpu(x, weight, bias, eps):
    x2 = _rows(x)                                              # (R, D), R = all leading axes
    R, D = x2.shape
    out, xhat = numpy.empty_like(x2), numpy.empty_like(x2)    # (R, D)
    rstd = numpy.empty((R, 1), x2.dtype)                       # (R, 1)

    def task(i, s, e):
        xs, xh, rs = x2[s:e], xhat[s:e], rstd[s:e, 0]
        mean = _scratch("m", e - s, x2.dtype)
        numpy.einsum("rd->r", xs, out=mean)                     # row sums (einsum: no temporary)
        mean *= 1.0 / D
        numpy.subtract(xs, mean[:, None], out=xh)              # x - mean
        numpy.einsum("rd,rd->r", xh, xh, out=rs)
        rs *= 1.0 / D
        rs += eps
        numpy.sqrt(rs, out=rs)
        numpy.reciprocal(rs, out=rs)                           # 1 / sqrt(var + eps)
        xh *= rs[:, None]                                      # xhat
        numpy.multiply(xh, weight, out=out[s:e])
        out[s:e] += bias

    _for_blocks(R, D, task)
    shape = x.shape[:-1]
    return out.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(shape + (1,)), weight)


def _layernorm_backward_cpu(dout, cache):
    xhat, rstd, weight = cache
    D = xhat.shape[-1]
    xh2, d2, rs2 = _rows(xhat), _rows(dout), rstd.reshape(-1)  # (R, D), (R, D), (R,)
    R = xh2.shape[0]
    dx = numpy.empty_like(d2)                                  # (R, D)
    rows = max(1, BLOCK_VALUES // D)
    n_blocks = -(-R // rows)
    dweight_parts = numpy.empty((n_blocks, D), d2.dtype)       # one partial sum per block, added in order
    dbias_parts = numpy.empty((n_blocks, D), d2.dtype)

    def task(i, s, e):
        xh, d, o = xh2[s:e], d2[s:e], dx[s:e]
        tmp = _scratch("t", (e - s) * D, d2.dtype).reshape(e - s, D)
        numpy.einsum("rd,rd->d", d, xh, out=dweight_parts[i])  # sum of dout * xhat
        numpy.einsum("rd->d", d, out=dbias_parts[i])
        numpy.multiply(d, weight, out=o)                       # dxhat
        m1 = _scratch("m", e - s, d2.dtype)
        m2 = _scratch("n", e - s, d2.dtype)
        numpy.einsum("rd->r", o, out=m1)
        m1 *= 1.0 / D                                          # mean(dxhat)
        numpy.einsum("rd,rd->r", o, xh, out=m2)
        m2 *= 1.0 / D                                          # mean(dxhat * xhat)
        o -= m1[:, None]
        numpy.multiply(xh, m2[:, None], out=tmp)
        o -= tmp
        o *= rs2[s:e, None]                                    # rstd (dxhat - mean - xhat mean)

    _for_blocks(R, D, task)
    return dx.reshape(dout.shape), dweight_parts.sum(0), dbias_parts.sum(0)


# ---- softmax over the last axis ---------------------------------------------------------------------

def _softmax_forward_cpu(x):
    x2 = _rows(x)
    out = numpy.empty_like(x2)
    n = x2.shape[1]

    def task(i, s, e):
        xs, o = x2[s:e], out[s:e]
        m = _scratch("m", e - s, x2.dtype)
        numpy.max(xs, axis=-1, out=m)
        numpy.subtract(xs, m[:, None], out=o)
        numpy.exp(o, out=o)
        numpy.einsum("rn->r", o, out=m)
        numpy.reciprocal(m, out=m)
        o *= m[:, None]

    _for_blocks(x2.shape[0], n, task)
    out = out.reshape(x.shape)
    return out, out


def _softmax_backward_cpu(dout, s):
    d2, s2 = _rows(dout), _rows(s)
    dx = numpy.empty_like(d2)

    def task(i, a, e):
        dot = _scratch("m", e - a, d2.dtype)
        numpy.einsum("rn,rn->r", d2[a:e], s2[a:e], out=dot)   # sum_j dout_j s_j
        numpy.subtract(d2[a:e], dot[:, None], out=dx[a:e])
        dx[a:e] *= s2[a:e]

    _for_blocks(d2.shape[0], d2.shape[1], task)
    return dx.reshape(dout.shape)


# ==================================================================================================
# CuPy (GPU): fused kernels, compiled on first use
# ==================================================================================================

_compiled = {}


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
_GELU_TANH_FWD = """
    T t = tanh((T)0.79788456080286536 * (x + (T)0.044715 * x * x * x));
    y = (T)0.5 * x * ((T)1 + t);"""
_GELU_TANH_BWD = """
    T t = tanh((T)0.79788456080286536 * (x + (T)0.044715 * x * x * x));
    T dt = ((T)1 - t * t) * (T)0.79788456080286536 * ((T)1 + (T)0.134145 * x * x);
    dx = dout * ((T)0.5 * ((T)1 + t) + (T)0.5 * x * dt);"""

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
"""


def _row_kernel(name, dtype):
    """A compiled row kernel for float32 or float64 (one module per dtype)."""
    cp = _cupy()
    T = {"float32": "float", "float64": "double"}[numpy.dtype(dtype).name]
    key = ("rows", T)
    if key not in _compiled:
        _compiled[key] = cp.RawModule(code=_ROW_SOURCE % {"T": T})
    return _compiled[key].get_function(name)


def _launch_rows(name, n_rows, row_len, dtype, args):
    """One block per row; threads: a power of two from 32 to 256, about the row length."""
    threads = 32
    while threads < min(row_len, 256):
        threads *= 2
    if n_rows:
        _row_kernel(name, dtype)((n_rows,), (threads,), args, shared_mem=threads * numpy.dtype(dtype).itemsize)


_colsum_prod = None


def _gpu_layernorm_forward(x, weight, bias, eps):
    cp = _cupy()
    x2 = cp.ascontiguousarray(x).reshape(-1, x.shape[-1])     # (R, D)
    R, D = x2.shape
    y, xhat = cp.empty_like(x2), cp.empty_like(x2)
    rstd = cp.empty((R,), x2.dtype)
    w, b = cp.ascontiguousarray(weight), cp.ascontiguousarray(bias)
    _launch_rows("layernorm_fwd", R, D, x2.dtype, (x2, w, b, y, xhat, rstd, numpy.int32(D), x2.dtype.type(eps)))
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(x.shape[:-1] + (1,)), weight)


def _gpu_layernorm_backward(dout, cache):
    global _colsum_prod
    cp = _cupy()
    xhat, rstd, weight = cache
    D = xhat.shape[-1]
    xh2 = cp.ascontiguousarray(xhat).reshape(-1, D)
    d2 = cp.ascontiguousarray(dout).reshape(-1, D)
    R = d2.shape[0]
    dx = cp.empty_like(d2)
    _launch_rows("layernorm_bwd", R, D, d2.dtype,
                 (d2, xh2, cp.ascontiguousarray(rstd).reshape(-1), cp.ascontiguousarray(weight), dx, numpy.int32(D)))
    if _colsum_prod is None:
        _colsum_prod = cp.ReductionKernel("T g, T h", "T y", "g * h", "a + b", "y = a", "0", "minivit_colsum_prod")
    dweight = _colsum_prod(d2, xh2, axis=0)                   # (D,) sum of dout * xhat, one kernel
    dbias = d2.sum(0)                                         # (D,)
    return dx.reshape(dout.shape), dweight, dbias


def _gpu_softmax_forward(x):
    cp = _cupy()
    x2 = cp.ascontiguousarray(x).reshape(-1, x.shape[-1])
    y = cp.empty_like(x2)
    _launch_rows("softmax_fwd", x2.shape[0], x2.shape[1], x2.dtype, (x2, y, numpy.int32(x2.shape[1])))
    y = y.reshape(x.shape)
    return y, y


def _gpu_softmax_backward(dout, s):
    cp = _cupy()
    n = s.shape[-1]
    d2 = cp.ascontiguousarray(dout).reshape(-1, n)
    s2 = cp.ascontiguousarray(s).reshape(-1, n)
    dx = cp.empty_like(d2)
    _launch_rows("softmax_bwd", d2.shape[0], n, d2.dtype, (d2, s2, dx, numpy.int32(n)))
    return dx.reshape(dout.shape)


# ==================================================================================================
# The entry points, called by functional.py for float32 arrays: same arguments, same caches
# ==================================================================================================

def gelu_forward(x, approximate="erf"):
    """As functional.gelu_forward: (out, cache) with cache = (x, approximate)."""
    if _is_cupy(x):
        body = _GELU_ERF_FWD if approximate == "erf" else _GELU_TANH_FWD
        out = _elementwise(f"minivit_gelu_{approximate}_fwd", "T x", "T y", body)(x)
    else:
        out = _gelu_cpu(x, None, approximate)
    return out, (x, approximate)


def gelu_backward(dout, cache):
    """As functional.gelu_backward: dx."""
    x, approximate = cache
    if _is_cupy(x):
        body = _GELU_ERF_BWD if approximate == "erf" else _GELU_TANH_BWD
        return _elementwise(f"minivit_gelu_{approximate}_bwd", "T dout, T x", "T dx", body)(dout, x)
    return _gelu_cpu(x, dout, approximate)


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


def softmax_backward(dout, cache):
    """As functional.softmax_backward: dx."""
    return _gpu_softmax_backward(dout, cache) if _is_cupy(dout) else _softmax_backward_cpu(dout, cache)
