"""The fast twins (minivit/fast/kernels.py) against the pairs of functional.py.

For float32 arrays minivit/fast/ops.py may run LayerNorm, GELU, softmax, attention, the Linear products and
AdamW from minivit.kernels: Numba loops on the CPU, fused kernels on the GPU; attention, on both, in
chunks of images, keeping only each row's log-sum-exp. They must compute the same function as the
reference, so each twin is called here directly and compared with the functional pair evaluated in
float64 (the exact math), to float32 tolerance, on random inputs of awkward shapes (rows that do not
fill a block, rows longer than a block, huge values). (tests/test_ops.py tests the choosing.)
The GPU tests are skipped without CuPy and a GPU (`pytest tests/test_fast_paths.py` on a GPU machine).
"""

import os

import numpy as np
import pytest
import scipy.special

import minivit
from minivit import backend
from minivit.fast import attention, cpu, cuda, kernels, ops
from minivit import functional as F


@pytest.fixture
def reference():
    """Run the body with the fast twins off, then switch them back on."""
    ops.set_fast_kernels(False)
    yield
    ops.set_fast_kernels(True)


def rel(a, b):
    """Largest error relative to the largest reference value."""
    a, b = minivit.to_numpy(a).astype(np.float64), minivit.to_numpy(b).astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def ref64(fn, *arrays):
    """fn (a functional pair) on float64 copies of the arrays: the exact math."""
    return fn(*[np.asarray(minivit.to_numpy(a), dtype=np.float64) for a in arrays])


# ---- the polynomial exp and erf inside the CPU kernels ------------------------------------------------

needs_numba = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="the CPU fast paths need Numba")


def _vectorised(helper):
    """A float32 array function from one of kernels' scalar helpers (compiled the same way)."""
    import numba

    @numba.njit
    def apply(x, out):
        for i in range(x.size):
            out[i] = helper(x[i])

    def call(x):
        x = np.ascontiguousarray(x, np.float32)
        out = np.empty_like(x)
        apply(x.reshape(-1), out.reshape(-1))
        return out

    return call


@needs_numba
def test_exp32_is_within_two_ulp_of_exp_over_the_float32_range(rng):
    exp32 = _vectorised(cpu._exp32)
    x = np.concatenate([np.linspace(-87, 88, 2_000_001), rng.standard_normal(100_000) * 10,
                        [0.0, -0.0, 1e-30, -1e-8, 0.5 * np.log(2)]]).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    assert np.abs(exp32(x) / exact - 1).max() < 2.5e-7          # float32's ulp is 1.2e-7 relative
    out = exp32(np.float32([np.nan, np.inf, -np.inf, -200.0, 200.0]))
    assert np.isnan(out[0]) and out[1] == np.inf and 0 <= out[2] < 2e-38 and 0 <= out[3] < 2e-38
    assert out[4] == np.inf


@needs_numba
def test_erf32_is_within_5e7_of_erf():
    erf32 = _vectorised(cpu._erf32)
    x = np.concatenate([np.linspace(-7, 7, 1_400_001), [0.0, 1e-30, -1e-8, 3.9, 4.0, 4.1, 1e30, -1e30]])
    x = x.astype(np.float32)
    assert np.abs(erf32(x) - scipy.special.erf(x.astype(np.float64))).max() < 5e-7   # measured 4.2e-7
    tiny = np.float32([1e-3, -1e-5, 1e-20])                       # erf(x) ~ 2x / sqrt(pi): relative too
    np.testing.assert_allclose(erf32(tiny), scipy.special.erf(tiny.astype(np.float64)), rtol=5e-7)
    out = erf32(np.float32([np.nan, np.inf, -np.inf]))
    assert np.isnan(out[0]) and out[1] == 1.0 and out[2] == -1.0


def test_backend_erf_is_scipys_on_the_cpu():
    x = np.linspace(-3, 3, 1001)
    np.testing.assert_array_equal(backend.erf(x), scipy.special.erf(x))
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(backend.erf(x32), scipy.special.erf(x32))


def test_without_numba_the_cpu_runs_the_reference(monkeypatch, rng):
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    monkeypatch.setattr(kernels, "gelu_forward", None)                       # would fail if called
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    assert not ops.uses_twin("gelu", x, ("erf",))
    out, cache = ops.gelu_forward(x)                               # the reference lines, in float32
    assert out.dtype == np.float32 and cache[0] is x


# ---- the pairs on the CPU ----------------------------------------------------------------------------

SHAPES = [(3, 5, 8), (2, 37, 50), (64, 65, 192), (7, 3000)]   # partial blocks, rows longer than a block


@needs_numba
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["erf", "tanh"])
def test_gelu_fast_path_matches_the_reference(rng, shape, approximate):
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)
    out, cache = kernels.gelu_forward(x, approximate)
    dx = kernels.gelu_backward(dout, cache)
    out64, cache64 = ref64(lambda a: F.gelu_forward(a, approximate), x)
    dx64 = ref64(lambda d: F.gelu_backward(d, cache64), dout)
    assert out.dtype == dx.dtype == np.float32 and out.shape == dx.shape == x.shape
    assert rel(out, out64) < 1e-6 and rel(dx, dx64) < 2e-6
    assert cache[0] is x and cache[1] == approximate     # the same cache as the reference: x alone


@needs_numba
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_fast_path_matches_the_reference(rng, shape):
    D = shape[-1]
    x = (rng.standard_normal(shape) * 3 + 5).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)
    out, cache = kernels.layernorm_forward(x, w, b)
    dx, dw, db = kernels.layernorm_backward(dout, cache)
    out64, cache64 = ref64(lambda *a: F.layernorm_forward(*a), x, w, b)
    dx64, dw64, db64 = ref64(lambda d: F.layernorm_backward(d, cache64), dout)
    assert {a.dtype for a in (out, dx, dw, db, cache[0], cache[1])} == {np.dtype(np.float32)}
    assert cache[0].shape == shape and cache[1].shape == shape[:-1] + (1,) and cache[2] is w
    assert rel(out, out64) < 2e-6 and rel(cache[0], cache64[0]) < 2e-6 and rel(cache[1], cache64[1]) < 2e-6
    assert rel(dx, dx64) < 5e-6 and rel(dw, dw64) < 5e-6 and rel(db, db64) < 5e-6


@needs_numba
@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (4, 3, 65, 65), (3, 20000), (6, 1)])
def test_softmax_fast_path_matches_the_reference(rng, shape):
    x = (rng.standard_normal(shape) * 5).astype(np.float32)
    x.reshape(-1, shape[-1])[0, 0] = 1000.0              # exp would overflow without the max shift
    dout = rng.standard_normal(shape).astype(np.float32)
    s, cache = kernels.softmax_forward(x)
    dx = kernels.softmax_backward(dout, cache)
    s64, _ = ref64(F.softmax_forward, x)
    dx64 = ref64(F.softmax_backward, dout, s64)
    assert s.dtype == dx.dtype == np.float32 and np.isfinite(s).all()
    np.testing.assert_allclose(s.sum(-1), 1.0, rtol=1e-5)
    assert rel(s, s64) < 1e-6 and rel(dx, dx64) < 2e-6


ATTENTION_SHAPES = [(2, 5, 12, 3), (3, 17, 32, 2), (64, 65, 192, 3), (2, 197, 96, 12), (5, 1, 8, 2), (1, 3, 4, 1)]


@needs_numba
@pytest.mark.parametrize("B, N, D, nh", ATTENTION_SHAPES)
def test_fused_attention_matches_the_reference(rng, B, N, D, nh):
    qkv = (rng.standard_normal((B, N, 3 * D)) * 2).astype(np.float32)
    dout = rng.standard_normal((B, N, D)).astype(np.float32)
    out, cache = kernels.attention_forward(qkv, nh)
    dqkv = kernels.attention_backward(dout, cache)
    out64, cache64 = ref64(lambda a: F.attention_forward(a, nh), qkv)
    dqkv64 = ref64(lambda d: F.attention_backward(d, cache64), dout)
    assert isinstance(cache, kernels.AttentionCache) and out.dtype == dqkv.dtype == np.float32
    assert out.shape == (B, N, D) and dqkv.shape == qkv.shape
    assert rel(out, out64) < 2e-6 and rel(dqkv, dqkv64) < 5e-6          # float32 sums over N terms
    weights = ops.attention_weights(cache)                                   # recomputed from lse
    assert weights.shape == (B, nh, N, N) and rel(weights, cache64[3]) < 1e-5   # exp(s - lse): lse's rounding


@needs_numba
@pytest.mark.parametrize("size", [1e3, 1e8, 1e15])
def test_fused_attention_matches_the_reference_at_huge_scores(rng, size):
    # scores of size^2 (a diverging run): the row kernel subtracts the row's max before it scales, so
    # the max's own term is exp(0) = 1 exactly; scaling first let an FMA leave a rounding error of the
    # scores' size in the exponent: exp(+-1e27) gave NaN rows where the pair gave the right weights
    B, N, D, nh = 4, 17, 16, 2
    qkv = (rng.standard_normal((B, N, 3 * D)) * size).astype(np.float32)
    qkv[..., 2 * D:] /= size                                                  # v of size 1
    dout = rng.standard_normal((B, N, D)).astype(np.float32)
    out, cache = kernels.attention_forward(qkv, nh)
    dqkv = kernels.attention_backward(dout, cache)
    out64, cache64 = ref64(lambda a: F.attention_forward(a, nh), qkv)
    dqkv64 = ref64(lambda d: F.attention_backward(d, cache64), dout)
    assert np.isfinite(out).all() and np.isfinite(dqkv).all()
    assert rel(out, out64) < 1e-5
    dv, dv64 = dqkv[..., 2 * D:], dqkv64[..., 2 * D:]                        # dq, dk: ds times size: see below
    assert rel(dv, dv64) < 1e-5
    if size <= 1e3:                                                           # not saturated: every gradient
        assert rel(dqkv, dqkv64) < 1e-4


@needs_numba
def test_fused_attention_keeps_no_n_by_n_array(rng):
    """What the fused forward keeps: qkv itself (the qkv layer's output, not a copy) and one float per
    query row and head; the reference keeps the (B, nh, N, N) weights besides."""
    B, N, D, nh = 4, 50, 24, 3
    qkv = rng.standard_normal((B, N, 3 * D)).astype(np.float32)
    _, cache = kernels.attention_forward(qkv, nh)
    kept, lse, heads, mask = cache
    assert kept is qkv and heads == nh and lse.shape == (B, nh, N) and mask is None


@needs_numba
def test_fused_attention_takes_a_strided_qkv_and_chunks_of_any_size(rng, monkeypatch):
    B, N, D, nh = 7, 9, 16, 2
    wide = rng.standard_normal((B, N, 3 * D + 5)).astype(np.float32)
    qkv = wide[..., 2:2 + 3 * D]                                           # not contiguous
    dout = rng.standard_normal((B, N, D)).astype(np.float32)
    out64, cache64 = ref64(lambda a: F.attention_forward(a, nh), qkv)
    dqkv64 = ref64(lambda d: F.attention_backward(d, cache64), dout)
    results = []
    for threaded in (False, True):                                         # one thread, or the chunks shared
        monkeypatch.setattr(attention, "THREADED_ATTENTION", threaded)
        monkeypatch.setenv("MINIVIT_NUM_THREADS", "2")
        for chunk_images in (1, 3, 7, 100):                                # chunks that do and do not divide B
            monkeypatch.setattr(attention, "CHUNK_BYTES", chunk_images * nh * N * N * 4)
            out, cache = kernels.attention_forward(qkv, nh)
            dqkv = kernels.attention_backward(dout, cache)
            assert rel(out, out64) < 2e-6 and rel(dqkv, dqkv64) < 2e-6
            results.append((out, cache[1], dqkv))
    for r in results[1:]:                                                  # and the same bits every way
        for a, b in zip(results[0], r):
            np.testing.assert_array_equal(a, b)


@needs_numba
def test_attention_threads_follow_the_callers_errstate(rng, monkeypatch):
    """The trainer silences NumPy's floating-point warnings where float16 overflows by design
    (np.errstate, train/tasks.py); attention's worker threads must keep that setting (NumPy keeps it per
    thread): CI printed "invalid value encountered in matmul" from them."""
    import warnings

    B, N, D, nh = 8, 9, 16, 2
    qkv = rng.standard_normal((B, N, 3 * D)).astype(np.float32)
    dout = rng.standard_normal((B, N, D)).astype(np.float32)
    dout[0, 0, 0] = np.inf                                                 # an overflowed gradient
    monkeypatch.setattr(attention, "THREADED_ATTENTION", True)
    monkeypatch.setenv("MINIVIT_NUM_THREADS", "2")
    monkeypatch.setattr(attention, "CHUNK_BYTES", nh * N * N * 4)          # one image a chunk: 8 chunks
    if attention._attention_workers() < 2:
        pytest.skip("attention runs on one thread here (threadpoolctl missing)")
    _, cache = kernels.attention_forward(qkv, nh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                     # any warning fails the test
        with np.errstate(over="ignore", invalid="ignore"):
            dqkv = kernels.attention_backward(dout, cache)
    assert not np.isfinite(dqkv).all()                                     # the inf did spread: there was
    with pytest.warns(RuntimeWarning, match="invalid value"):             # something to silence, and
        kernels.attention_backward(dout, cache)                           # without errstate it is said


def test_attention_chunks_cover_the_batch_in_equal_shares():
    for B, nh, N, workers in [(64, 3, 65, 2), (7, 2, 9, 2), (1, 12, 197, 2), (5, 1, 4, 3), (64, 3, 65, 1)]:
        chunks = attention._chunks(B, nh, N, 4, workers, attention.CHUNK_BYTES)
        assert chunks[0][0] == 0 and chunks[-1][1] == B
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))      # contiguous, no overlap
        sizes = [b - a for a, b in chunks]
        assert max(sizes) * nh * N * N * 4 <= max(attention.CHUNK_BYTES, nh * N * N * 4)
        if workers > 1 and B >= workers:
            assert len(chunks) % workers == 0 or len(chunks) == B
    # the GPU's budget: ViT-B/16 at batch 128 (12 heads, 197 tokens) in one chunk, one worker
    assert attention._chunks(128, 12, 197, 4, 1, attention.GPU_CHUNK_BYTES) == [(0, 128)]
    assert len(attention._chunks(512, 12, 197, 4, 1, attention.GPU_CHUNK_BYTES)) == 4


def test_threaded_attention_is_chosen_only_when_blas_threads_sleep(monkeypatch):
    from minivit import _blas_env

    monkeypatch.setenv("MINIVIT_NUM_THREADS", "2")
    monkeypatch.setattr(attention, "THREADED_ATTENTION", None)
    monkeypatch.setattr(_blas_env, "idle_blas_threads_sleep", lambda: False)
    assert attention._attention_workers() == 1
    monkeypatch.setattr(_blas_env, "idle_blas_threads_sleep", lambda: True)
    assert attention._attention_workers() == (min(2, kernels.num_threads()) if attention.threadpoolctl else 1)
    monkeypatch.setattr(attention, "THREADED_ATTENTION", False)
    assert attention._attention_workers() == 1


@needs_numba
def test_fused_attention_on_numpy_never_asks_for_cupy(rng, monkeypatch):
    """The orchestration is shared with the GPU; for NumPy arrays it must not import CuPy (not installed
    on CPU machines) nor launch a CUDA kernel."""
    def no_cupy(*args):
        raise AssertionError("CuPy was asked for with NumPy arrays")

    for name in ("_cupy", "_launch_rows"):
        monkeypatch.setattr(cuda, name, no_cupy)
    qkv = rng.standard_normal((2, 9, 3 * 8)).astype(np.float32)
    out, cache = kernels.attention_forward(qkv, 2)
    dqkv = kernels.attention_backward(np.ones_like(out), cache)
    assert isinstance(cache, kernels.AttentionCache) and dqkv.shape == qkv.shape


def test_attention_layer_shows_its_weights_from_either_cache(rng, reference):
    """Attention.attn, for plots: the weights, whichever forward ran (fast paths off here, then on)."""
    from minivit import layers as L

    att = L.Attention(8, num_heads=2, rng=np.random.default_rng(0))         # on the current backend,
    x = minivit.asarray(rng.standard_normal((2, 5, 8)).astype(np.float32))  # and so is its input
    att.forward(x)
    ref_weights = att.attn.copy()
    ops.set_fast_kernels(True)
    att.forward(x)
    assert isinstance(att.cache, kernels.AttentionCache)
    assert rel(att.attn, ref_weights) < 2e-6 and att.attn.shape == (2, 2, 5, 5)
    att.eval()
    att.forward(x)
    assert att.attn is None


@needs_numba
@pytest.mark.parametrize("masked", [False, True])
def test_attention_weights_of_the_fused_cache_hold_at_large_scores(masked):
    """ops.attention_weights recomputes the fused forward's weights from the scores alone (max, exp, sum), as
    the fused kernels do, not as exp(scale q.k - lse): lse is rounded at the size of the scores, so at scaled
    scores of 1e6 (float32's spacing there: 0.0625) that route is off by up to 3% and its rows do not sum
    to 1. Integer q and k, and hs = 4 (scale 1/2), make every score exact in float32, so the float64
    reference is the answer."""
    B, N, hs = 2, 6, 4
    rng = np.random.default_rng(3)
    q, k = (np.concatenate([np.full((B, N, 2), 1000.0), rng.integers(-3, 4, (B, N, 2))], -1) for _ in range(2))
    v = rng.standard_normal((B, N, hs))
    qkv = np.concatenate([q, k, v], -1).astype(np.float32)                 # q.k = 2e6 + small integers
    mask = F.causal_mask(qkv) if masked else None
    _, cache = ops.attention_forward(qkv, 1, mask)
    assert isinstance(cache, kernels.AttentionCache)
    _, cache64 = F.attention_forward(qkv.astype(np.float64), 1, mask)
    weights, expected = ops.attention_weights(cache), F.attention_weights(cache64)   # (B, 1, N, N) each
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    np.testing.assert_allclose(weights, expected, atol=1e-5)


@needs_numba
def test_empty_arrays_pass_through_the_kernels():
    for shape in [(0, 5), (3, 0), (2, 0, 4)]:
        x = np.zeros(shape, np.float32)
        assert kernels.gelu_forward(x)[0].shape == shape and kernels.softmax_forward(x)[0].shape == shape
        assert kernels.gelu_backward(x, (x, "erf")).shape == shape
        if shape[-1]:
            out, cache = kernels.layernorm_forward(x, np.ones(shape[-1], np.float32), np.zeros(shape[-1], np.float32))
            dx, dw, db = kernels.layernorm_backward(x, cache)
            assert out.shape == dx.shape == shape and dw.shape == db.shape == (shape[-1],) and not dw.any()


@needs_numba
def test_fast_and_reference_caches_are_interchangeable(rng):
    """A cache made by one path works in the other's backward (same layout, same meaning)."""
    x = rng.standard_normal((4, 9, 16)).astype(np.float32)
    w, b = np.ones(16, np.float32), np.zeros(16, np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    _, ref_cache = F.layernorm_forward(x, w, b)                # the pair's forward
    ref_dx = F.layernorm_backward(dout, ref_cache)[0]
    fast_dx = kernels.layernorm_backward(dout, ref_cache)[0]   # the twin's backward on the pair's cache
    _, fast_cache = kernels.layernorm_forward(x, w, b)         # and the other way round
    assert rel(fast_dx, ref_dx) < 1e-5 and rel(F.layernorm_backward(dout, fast_cache)[0], ref_dx) < 1e-5


@needs_numba
def test_threads_give_the_same_numbers(rng, monkeypatch):
    """MINIVIT_NUM_THREADS sets how many cores share each kernel's loop; every result is the same to
    the bit (LayerNorm's dweight is summed per group of rows, then the groups in order)."""
    x = rng.standard_normal((8, 65, 192)).astype(np.float32)
    dout = rng.standard_normal(x.shape).astype(np.float32)
    w, b = rng.standard_normal(192).astype(np.float32), rng.standard_normal(192).astype(np.float32)

    def run():
        out, cache = kernels.layernorm_forward(x, w, b)
        g, gcache = kernels.gelu_forward(x)
        s, _ = kernels.softmax_forward(x)
        qkv = np.concatenate([x, x[:, ::-1], x * 0.5], -1)                   # (8, 65, 576)
        a, acache = kernels.attention_forward(qkv, 3)
        return (out, *kernels.layernorm_backward(dout, cache), g, kernels.gelu_backward(dout, gcache), s,
                kernels.softmax_backward(dout, s), a, acache[1], kernels.attention_backward(dout, acache))

    monkeypatch.setattr(cpu, "PARALLEL_MIN", 1 << 40)                  # every kernel on one core
    one = run()
    monkeypatch.setattr(cpu, "PARALLEL_MIN", 0)                        # every kernel's prange version,
    monkeypatch.setenv("MINIVIT_NUM_THREADS", "1")                         # on one thread
    assert all(np.array_equal(a, b_) for a, b_ in zip(one, run()))
    monkeypatch.setenv("MINIVIT_NUM_THREADS", "2")                         # and on two
    monkeypatch.setattr(attention, "THREADED_ATTENTION", True)               # attention's chunks on 2 threads
    import numba

    assert kernels.num_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
    for a, b_ in zip(one, run()):
        np.testing.assert_array_equal(a, b_)
    monkeypatch.setenv("MINIVIT_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="MINIVIT_NUM_THREADS"):
        kernels.num_threads()


def test_float64_never_takes_a_fast_path(rng, monkeypatch):
    calls = []
    for name in ("gelu_forward", "layernorm_forward", "softmax_forward", "attention_forward", "linear_forward",
                 "adamw_update"):
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, **k: calls.append(_n))
    x = rng.standard_normal((2, 3, 4))
    ops.gelu_forward(x)
    ops.layernorm_forward(x, np.ones(4), np.zeros(4))
    ops.softmax_forward(x)
    ops.attention_forward(rng.standard_normal((2, 3, 12)), 2)
    ops.linear_forward(x, np.ones((4, 2)))
    ops.adamw_update(np.ones(3), np.ones(3), np.zeros(3), np.zeros(3), 0.1, 0.9, 0.999, 1e-8, 0.0, 1)
    backend.erf(x)
    assert calls == []


def test_set_fast_kernels_checks_its_argument():
    with pytest.raises(TypeError, match="True or False"):
        ops.set_fast_kernels("yes")
    assert ops.fast_kernels_enabled()


def test_float32_model_stays_float32_and_matches_the_reference(reference):
    """The whole model in float32, reference and fast: the same logits and gradients; and nothing in
    the fast model's step (caches, gradients, dx) is silently float64."""
    config = minivit.ViTConfig(img_size=16, patch_size=4, num_classes=5, embed_dim=24, depth=2, num_heads=3)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16, 16, 3)).astype(np.float32)
    labels = rng.integers(0, 5, 4)
    results = []
    for fast in (False, True):
        ops.set_fast_kernels(fast)
        ops.reset()
        minivit.set_backend("numpy")
        model = minivit.ViT(config, seed=1)
        logits = model.forward(x)
        loss, dlogits = minivit.cross_entropy(logits, labels)
        model.zero_grad()
        dx = model.backward(dlogits)
        results.append((logits, dx, {k: g.copy() for k, g in model.grads.items()}))
        if fast:
            assert logits.dtype == dx.dtype == np.float32
            assert all(g.dtype == np.float32 for g in model.grads.values())
            assert ops.report().from_kernels() == ["attention", "gelu", "layernorm", "linear"]
            for layer in model.sublayers():
                cache = layer.cache if isinstance(layer.cache, tuple) else (layer.cache,)
                for a in cache:
                    if isinstance(a, np.ndarray):
                        assert a.dtype == np.float32, (type(layer).__name__, a.dtype)
    (l0, dx0, g0), (l1, dx1, g1) = results
    assert rel(l1, l0) < 1e-5 and rel(dx1, dx0) < 1e-4
    for k in g0:
        assert rel(g1[k], g0[k]) < 1e-4, k


# ---- the fused CuPy kernels (skipped without a GPU) ------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 5, 8), (64, 65, 192), (2, 7, 300), (4, 1000), (5, 1)])
def test_gpu_fused_kernels_match_the_reference(rng, shape):
    cp = backend.backend_module("cupy")
    D = shape[-1]
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    x.reshape(-1, D)[0, 0] = 80.0                       # softmax stability
    w = (1 + 0.5 * rng.standard_normal(D)).astype(np.float32)
    b = rng.standard_normal(D).astype(np.float32)
    dout = rng.standard_normal(shape).astype(np.float32)
    gx, gw, gb, gd = (cp.asarray(a) for a in (x, w, b, dout))

    for approximate in ("erf", "tanh"):
        out, cache = kernels.gelu_forward(gx, approximate)
        dx = kernels.gelu_backward(gd, cache)
        out64, cache64 = ref64(lambda a: F.gelu_forward(a, approximate), x)
        assert isinstance(out, cp.ndarray) and out.dtype == dx.dtype == np.float32
        assert rel(out, out64) < 1e-6 and rel(dx, ref64(lambda d: F.gelu_backward(d, cache64), dout)) < 2e-6

    out, cache = kernels.layernorm_forward(gx, gw, gb)
    dx, dw, db = kernels.layernorm_backward(gd, cache)
    out64, cache64 = ref64(lambda *a: F.layernorm_forward(*a), x, w, b)
    dx64, dw64, db64 = ref64(lambda d: F.layernorm_backward(d, cache64), dout)
    assert cache[1].shape == shape[:-1] + (1,)
    assert rel(out, out64) < 2e-6 and rel(cache[0], cache64[0]) < 2e-6 and rel(cache[1], cache64[1]) < 2e-6
    assert rel(dx, dx64) < 5e-6 and rel(dw, dw64) < 5e-6 and rel(db, db64) < 5e-6

    s, cache = kernels.softmax_forward(gx)
    ds = kernels.softmax_backward(gd, cache)
    s64, _ = ref64(F.softmax_forward, x)
    assert bool(cp.isfinite(s).all())
    assert rel(s, s64) < 1e-6 and rel(ds, ref64(F.softmax_backward, dout, s64)) < 2e-6


@pytest.mark.gpu
def test_gpu_model_fast_and_reference_agree():
    config = minivit.ViTConfig(img_size=32, patch_size=4, num_classes=10, embed_dim=64, depth=2, num_heads=4)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32, 32, 3)).astype(np.float32)
    labels = rng.integers(0, 10, 8)
    out = []
    for fast in (False, True):
        ops.set_fast_kernels(fast)
        minivit.set_backend("cupy")
        model = minivit.ViT(config, seed=0)
        logits = model.forward(minivit.asarray(x))
        _, dlogits = minivit.cross_entropy(logits, minivit.asarray(labels))
        model.zero_grad()
        model.backward(dlogits)
        out.append((minivit.to_numpy(logits), {k: minivit.to_numpy(g) for k, g in model.grads.items()}))
    ops.set_fast_kernels(True)
    minivit.set_backend("numpy")
    assert rel(out[1][0], out[0][0]) < 1e-5
    for k in out[0][1]:
        assert rel(out[1][1][k], out[0][1][k]) < 1e-4, k


GPU_ATTENTION_SHAPES = [(2, 5, 12, 3), (3, 17, 32, 2), (4, 197, 768, 12), (5, 1, 8, 2), (16, 65, 192, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("B, N, D, nh", GPU_ATTENTION_SHAPES)
def test_gpu_fused_attention_matches_the_reference(rng, B, N, D, nh):
    """CuPy float32 takes the same fused attention as the CPU (cuBLAS products, CUDA softmax_lse row
    kernels): out, dqkv and the recomputed weights against the float64 reference."""
    cp = backend.backend_module("cupy")
    qkv = (rng.standard_normal((B, N, 3 * D)) * 2).astype(np.float32)
    dout = rng.standard_normal((B, N, D)).astype(np.float32)
    out, cache = kernels.attention_forward(cp.asarray(qkv), nh)
    dqkv = kernels.attention_backward(cp.asarray(dout), cache)
    out64, cache64 = ref64(lambda a: F.attention_forward(a, nh), qkv)
    dqkv64 = ref64(lambda d: F.attention_backward(d, cache64), dout)
    assert isinstance(cache, kernels.AttentionCache) and isinstance(out, cp.ndarray) and isinstance(dqkv, cp.ndarray)
    assert out.dtype == dqkv.dtype == np.float32 and out.shape == (B, N, D) and dqkv.shape == qkv.shape
    assert rel(out, out64) < 5e-6 and rel(dqkv, dqkv64) < 1e-5           # float32 sums over N terms
    weights = ops.attention_weights(cache)                                   # recomputed from lse, on the GPU
    assert isinstance(weights, cp.ndarray) and weights.shape == (B, nh, N, N)
    assert rel(weights, cache64[3]) < 1e-5


@pytest.mark.gpu
def test_gpu_fused_attention_keeps_no_n_by_n_array(rng):
    """The GPU's backward cache is what PyTorch's scaled_dot_product_attention keeps: qkv itself and lse,
    (B, nh, N). Measured in CuPy's memory pool: the forward leaves out and lse allocated, nothing of the
    (B, nh, N, N) scores (the reference forward leaves its weights)."""
    cp = backend.backend_module("cupy")
    pool = cp.get_default_memory_pool()
    B, N, D, nh = 8, 197, 768, 12
    qkv = cp.asarray(rng.standard_normal((B, N, 3 * D)).astype(np.float32))
    n_by_n = B * nh * N * N * 4
    kernels.attention_forward(qkv, nh)                                           # compile, warm cuBLAS
    before = pool.used_bytes()
    out, cache = kernels.attention_forward(qkv, nh)
    kept_fused = pool.used_bytes() - before
    kept, lse, heads, mask = cache
    assert kept is qkv and heads == nh and lse.shape == (B, nh, N) and mask is None and isinstance(lse, cp.ndarray)
    assert kept_fused < out.nbytes + lse.nbytes + (1 << 20) < n_by_n
    del out, cache, kept, lse
    before = pool.used_bytes()
    out, cache = F.attention_forward(qkv, nh)                              # the reference: keeps the weights
    assert pool.used_bytes() - before >= n_by_n and cache[3].shape == (B, nh, N, N)


@pytest.mark.gpu
def test_gpu_fused_attention_takes_a_strided_qkv_and_chunks_of_any_size(rng, monkeypatch):
    cp = backend.backend_module("cupy")
    B, N, D, nh = 7, 9, 16, 2
    wide = rng.standard_normal((B, N, 3 * D + 5)).astype(np.float32)
    dout = rng.standard_normal((B, N, D)).astype(np.float32)
    out64, cache64 = ref64(lambda a: F.attention_forward(a, nh), wide[..., 2:2 + 3 * D])
    dqkv64 = ref64(lambda d: F.attention_backward(d, cache64), dout)
    qkv = cp.asarray(wide)[..., 2:2 + 3 * D]                               # not contiguous
    for chunk_images in (1, 3, 7, 100):                                    # chunks that do and do not divide B
        monkeypatch.setattr(attention, "GPU_CHUNK_BYTES", chunk_images * nh * N * N * 4)
        out, cache = kernels.attention_forward(qkv, nh)
        dqkv = kernels.attention_backward(cp.asarray(dout), cache)
        assert rel(out, out64) < 5e-6 and rel(dqkv, dqkv64) < 1e-5, chunk_images


# ---- AdamW in one pass ---------------------------------------------------------------------------------

@needs_numba
def test_adamw_fast_path_matches_the_reference_over_many_steps(rng):
    """float32 parameters take kernels.adamw_update; 30 steps with weight decay on some parameters and
    changing gradients end within float32 rounding of the reference lines (run in float64)."""
    from minivit.optim import AdamW

    class Toy:
        def __init__(self, dtype):
            self.params = {"w": (rng_w * 1.0).astype(dtype), "b": np.zeros(7, dtype), "s": np.ones((), dtype)}
            self.grads = {k: np.zeros_like(p) for k, p in self.params.items()}

    rng_w = rng.standard_normal((5, 7))
    grads = [{"w": rng.standard_normal((5, 7)), "b": rng.standard_normal(7) * 1e-3, "s": rng.standard_normal(())}
             for _ in range(30)]
    fast, ref = Toy(np.float32), Toy(np.float64)
    opts = [AdamW(m, lr=3e-3, weight_decay=0.1, no_decay={"b"}) for m in (fast, ref)]
    for gs in grads:
        for m, opt in zip((fast, ref), opts):
            for k, g in gs.items():
                m.grads[k][...] = g
            opt.step()
    for k in fast.params:
        assert fast.params[k].dtype == np.float32
        np.testing.assert_allclose(fast.params[k], ref.params[k], rtol=1e-5, atol=1e-6)  # |p| ~ 1
        np.testing.assert_allclose(opts[0].buffers["exp_avg_sq"][k], opts[1].buffers["exp_avg_sq"][k], rtol=1e-5)


@needs_numba
def test_adamw_fast_path_is_taken_only_for_contiguous_float32(monkeypatch):
    calls = []
    real = kernels.adamw_update
    monkeypatch.setattr(kernels, "adamw_update", lambda *a: (calls.append(a[0]), real(*a)))
    from minivit.optim import AdamW

    class Toy:
        params = {"a": np.ones(4, np.float32), "b": np.ones(4), "c": np.ones((4, 4), np.float32)[:, 1]}
        grads = {"a": np.ones(4, np.float32), "b": np.ones(4), "c": np.ones(4, np.float32)}

    toy = Toy()
    AdamW(toy, lr=1e-3).step()
    through_twin = [name for name, p in toy.params.items() if any(c is p for c in calls)]
    assert through_twin == ["a"]                       # "b" is float64, "c" is a strided view


@pytest.mark.parametrize("first, env, expected", [
    ("import minivit", None, "10 True True"),                # minivit first: it sets the variable in time
    ("import numpy, minivit", None, "None False True"),      # NumPy first: too late at import, set up at use
    ("import minivit", "20", "20 False False"),              # the caller's value is kept (and is long)
    ("import numpy, minivit", "20", "20 False False"),
    ("import minivit", "4", "4 True True"),
])
def test_openblas_idle_threads_sleep_whatever_the_import_order(first, env, expected):
    """_blas_env: set in the environment when minivit comes first; when NumPy came first, set when attention
    first needs it: OpenBLAS re-reads its environment and restarts its threads (its own timeout then 10),
    and its products still give the same numbers on as many threads as before."""
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS")}
    if env is not None:
        environ["OPENBLAS_THREAD_TIMEOUT"] = env
    code = (f"{first}; import os, ctypes, numpy, threadpoolctl; from minivit import _blas_env\n"
            "a = numpy.random.default_rng(0).standard_normal((300, 300)); before = a @ a\n"
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), _blas_env.IDLE_BLAS_THREADS_SLEEP, "
            "_blas_env.idle_blas_threads_sleep())\n"
            "info = [i for i in threadpoolctl.threadpool_info() if i['internal_api'] == 'openblas'][0]\n"
            "lib = ctypes.CDLL(info['filepath'])\n"
            "assert lib.openblas_thread_timeout() == int(os.environ['OPENBLAS_THREAD_TIMEOUT'])\n"
            "assert (a @ a == before).all() and threadpoolctl.threadpool_info()[0]['num_threads'] "
            "== info['num_threads']")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


@needs_numba
def test_kernels_can_be_called_from_several_python_threads_at_once(rng, monkeypatch):
    """Numba's workqueue layer aborts the whole process when two threads launch a parallel kernel at the
    same time; the kernels serialise their parallel launches, so threaded callers get the right numbers."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(cpu, "PARALLEL_MIN", 0)                         # every call the parallel one
    xs = [rng.standard_normal((16, 65, 96)).astype(np.float32) for _ in range(8)]
    expected = [kernels.gelu_forward(x)[0] for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: kernels.gelu_forward(x)[0], xs * 4))
    for g, e in zip(got, expected * 4):
        np.testing.assert_array_equal(g, e)
