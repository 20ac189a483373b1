"""The GPU room of the fast paths: CUDA source compiled by CuPy on first use, and cuBLAS called directly.

What is here: the ElementwiseKernel bodies (GELU, the AdamW and SGD updates, dropout's keep mask), the
RawModule of row kernels (``_ROW_SOURCE``: LayerNorm, softmax, and attention's softmax that keeps only each
row's log-sum-exp), their launches, and ``_gpu_matmul``, a batched matrix product through cuBLAS's strided
batched GEMM that minivit/fast/attention.py uses. Nothing here is called by a layer: minivit/fast/ops.py
chooses a twin, and minivit/fast/kernels.py sends CuPy arrays here.

How: one fused kernel per forward or backward, a ``cupy.ElementwiseKernel`` for an elementwise op, a
``RawKernel`` with one thread block per row for the row-wise ones. On the GPU every operation of the
reference is a kernel launch (~10 us, more than the work itself in a small model): one launch instead of
six is the win. Only this module and backend.py touch CuPy, and this one only ever sees CuPy arrays that
exist already (it never imports CuPy for a NumPy array). tests/test_cuda_source.py compiles the source
here with NVRTC, without a GPU; tests/fake_cupy.py runs the launches on the CPU.
"""

import math
import os

import numpy


def _is_cupy(x):
    return type(x).__module__.startswith("cupy")


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

# The optimizers (their entry points in minivit/fast/kernels.py): each parameter's update in one launch, the
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

// Attention's softmax (minivit/fast/attention.py), the same as cpu._softmax_lse and _softmax_lse_bwd:
// s holds a row of raw scores q.k per block, scale = 1 / sqrt(hs); only lse, one value a row, is kept.
extern "C" __global__ void softmax_lse_fwd(T* s, T* lse, int n, T scale) {   // s -> p in place
    extern __shared__ unsigned char smem[];
    T* buf = (T*)smem;
    long long base = (long long)blockIdx.x * n;
    T m_raw = s[base];
    for (int i = threadIdx.x; i < n; i += blockDim.x) m_raw = max(m_raw, s[base + i]);
    m_raw = block_max(m_raw, buf);                                 // max_j q_i.k_j (scale > 0)
    T total = 0;                                                   // subtract, then scale: exp(0) = 1 for the max
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T e = exp((s[base + i] - m_raw) * scale); s[base + i] = e; total += e;
    }
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
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        T e = exp((s[base + i] - m_raw) * scale); s[base + i] = e; total += e;
    }
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
    """cpu._softmax_lse on the GPU: s (R, N) raw scores q.k, contiguous, in place -> p; lse (R,) written."""
    R, N = s.shape
    _launch_rows("softmax_lse_fwd", R, N, s.dtype, (s, lse, numpy.int32(N), s.dtype.type(scale)))


def _gpu_softmax_lse_bwd(s, dp, scale):
    """cpu._softmax_lse_bwd on the GPU: s (R, N) raw scores -> p; dp (R, N) dL/dp -> scale * dL/ds; contiguous."""
    R, N = s.shape
    _launch_rows("softmax_lse_bwd", R, N, s.dtype, (s, dp, numpy.int32(N), s.dtype.type(scale)))



# ---- batched matrix products on the GPU, through cuBLAS (see the GPU note in attention.py) ----------

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

# ---- the GPU halves of the elementwise twins (minivit/fast/kernels.py sends CuPy arrays here) ------

def _gpu_gelu_forward(x, approximate):
    body = (_GELU_ERF_FWD if approximate == "erf" else _GELU_TANH_FWD if approximate == "tanh"
            else _GELU_QUICK_FWD)
    return _elementwise(f"minivit_gelu_{approximate}_fwd", "T x", "T y", body)(x)


def _gpu_gelu_backward(dout, x, approximate):
    body = (_GELU_ERF_BWD if approximate == "erf" else _GELU_TANH_BWD if approximate == "tanh"
            else _GELU_QUICK_BWD)
    return _elementwise(f"minivit_gelu_{approximate}_bwd", "T dout, T x", "T dx", body)(dout, x)


def _gpu_adamw(p, g, m, v, constants):
    """kernels.adamw_update on the GPU: one launch; constants as it rounds them (decay, b1, b2, ... eps)."""
    _elementwise("minivit_adamw", _ADAMW_PARAMS, "T p, T m, T v", _ADAMW_BODY)(g, *constants, p, m, v)


# ---- SGD with momentum: one pass over each parameter on the GPU (the twin itself: GPU only) ---------
# The same update as functional.sgd_update, one value at a time (the CPU runs functional.sgd_update: its
# three lines cost little next to NumPy's per-call overhead, and a Numba twin would buy nothing there):
#   g_t = g + wd p;   b_t = mu b_{t-1} + g_t (b_0 = 0, so b_1 = g_1);   d_t = b_t, or g_t + mu b_t (nesterov)
#   p <- p - lr d_t

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


def dropout_keep_mask(shape, p, seed):
    """A boolean CuPy array of the given shape, each value True with probability 1 - p, drawn on the GPU
    in one launch from seed (an integer in [0, 2^63)): the same seed gives the same mask. Not a twin of a
    pair: layers.Dropout calls it on the GPU (on the CPU it draws its mask on the host, value by value)."""
    keep = _cupy().empty(shape, dtype=numpy.bool_)
    threshold = numpy.uint64(round(p * (1 << 24)))
    _elementwise("minivit_keep_mask", "uint64 seed, uint64 threshold", "bool keep", _KEEP_MASK_BODY)(
        numpy.uint64(seed), threshold, keep)
    return keep
