"""The Python that drives the GPU, run on the CPU under a strict CuPy stand-in (tests/fake_cupy.py).

What these tests prove: the glue. Device arrays are never mixed with host arrays, the kernels are launched
with arguments of the right kinds, the fused paths compute the same numbers as functional.py, and the
counts of launches and host syncs that make a GPU step fast or slow are what we claim, pinned here:
- an AdamW or SGD step: one launch per parameter (issue 18: it was 13 per parameter, 1,066 a step of the
  `fast` recipe's model); the first SGD step two (it makes the buffers);
- clipping and the loss scaler's finiteness check: no host sync;
- attention: no copy of an N x N array, products through cuBLAS, TF32 exactly when CUPY_TF32=1.
What they do not prove: anything about GPU numbers or speed (the stand-in computes with NumPy). Those are
tests/test_gpu.py and scripts/gpu_check.sh, on a GPU.
"""

import collections
import os
import re
import sys

import numpy as np
import pytest

import minivit
from minivit import functional as F
from minivit.fast import cuda, kernels, ops
from minivit.amp import LossScaler
from minivit.optim import SGD, AdamW, clip_grad_norm

sys.path.insert(0, os.path.dirname(__file__))
import fake_cupy  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def gpu():
    """The stand-in installed as CuPy and chosen as the backend; yields its counters (on a GPU machine the
    real CuPy is put back afterwards)."""
    with fake_cupy.installed() as counts:
        minivit.set_backend("cupy")
        try:
            yield counts
        finally:
            minivit.set_backend("numpy")


def small_model(**kw):
    config = dict(img_size=16, patch_size=4, num_classes=5, embed_dim=24, depth=2, num_heads=3)
    config.update(kw)
    return minivit.ViT(minivit.ViTConfig(**config), seed=0)


def fill_grads(model, seed=1):
    rng = np.random.default_rng(seed)
    for g in model.grads.values():
        g[...] = minivit.asarray(rng.standard_normal(g.shape).astype("float32"))


# ---- the stand-in is strict: what it catches ---------------------------------------------------------

def test_the_stand_in_refuses_host_arrays_and_implicit_conversion(gpu):
    """The mistake of issue 18, item 4 (a NumPy x into a layer on the GPU backend) fails here as on a GPU."""
    layer = minivit.layers.Attention(8, num_heads=2, rng=np.random.default_rng(0))
    x = np.zeros((2, 5, 8), np.float32)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        layer.forward(x)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(minivit.asarray(x))
    before = len(gpu.syncs)
    assert float(minivit.asarray(np.float32(2.0)).sum()) == 2.0          # a read: counted
    assert len(gpu.syncs) == before + 1


def test_a_raw_kernel_launch_with_a_wrong_argument_kind_is_refused(gpu):
    cp = sys.modules["cupy"]
    x = cp.asarray(np.ones((2, 4), np.float32))
    y = cp.empty_like(x)
    cuda._launch_rows("softmax_fwd", 2, 4, x.dtype, (x, y, np.int32(4)))       # right
    with pytest.raises(TypeError, match="numpy.int32"):
        cuda._launch_rows("softmax_fwd", 2, 4, x.dtype, (x, y, 4))             # a Python int: wrong
    with pytest.raises(TypeError, match="float32"):
        cuda._launch_rows("softmax_fwd", 2, 4, x.dtype, (x, cp.empty((2, 4), np.float64), np.int32(4)))


# ---- the optimizers: one launch per parameter ----------------------------------------------------------

def test_an_adamw_step_is_one_launch_per_parameter_and_the_functional_rule(gpu):
    model = minivit.create_model("vit_cifar_tiny", num_classes=10)               # the `fast` recipe's model
    opt = AdamW(model, lr=1e-3, weight_decay=0.05, no_decay={"head.bias"})
    fill_grads(model)
    opt.step()                                       # the first step also makes m and v (2 launches each)
    fill_grads(model, seed=2)
    gpu.reset()
    opt.step()
    assert collections.Counter(gpu.launches) == {"ElementwiseKernel:minivit_adamw": len(model.params)} == {
        "ElementwiseKernel:minivit_adamw": 80}
    assert gpu.syncs == []
    assert ops.report().from_kernels() == ["adamw"]     # the probe found it agrees with functional.py


@pytest.mark.parametrize("nesterov, momentum", [(False, 0.9), (True, 0.9), (False, 0.0)])
def test_an_sgd_step_is_one_launch_per_parameter_and_the_functional_rule(gpu, nesterov, momentum):
    model = small_model()
    reference = {k: minivit.to_numpy(p).astype(np.float64) for k, p in model.params.items()}
    opt = SGD(model, lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=0.01, no_decay={"head.bias"})
    buffers = {}
    kernel = "ElementwiseKernel:minivit_sgd" + ("_momentum" if momentum else "")
    for t in range(3):
        fill_grads(model, seed=t)
        gpu.reset()
        opt.step()
        if t > 0:                                       # (the first step also probes the twin, once)
            assert collections.Counter(gpu.launches) == {kernel: len(model.params)} and gpu.syncs == []
        for k, g in model.grads.items():                # the rule of functional.py, in float64
            wd = 0.0 if k == "head.bias" else 0.01
            buffers[k] = F.sgd_update(reference[k], minivit.to_numpy(g).astype(np.float64), buffers.get(k),
                                      0.1, momentum, nesterov, wd)
    for k, p in model.params.items():
        np.testing.assert_allclose(minivit.to_numpy(p), reference[k], rtol=2e-6, atol=1e-7, err_msg=k)
    gpu.reset()
    SGD(model, lr=0.1, momentum=momentum, nesterov=nesterov).step()   # a first step, probe done: makes buffers
    assert len(gpu.launches) == (2 if momentum else 1) * len(model.params) and gpu.syncs == []


def test_a_disagreeing_optimizer_twin_is_not_used(gpu, monkeypatch):
    """The GPU update is probed against functional.py like every twin: a wrong one runs the rule instead."""
    monkeypatch.setattr(cuda, "_ADAMW_BODY", cuda._ADAMW_BODY.replace("(1 - b1)", "(1 - b2)")
                        .replace("one_minus_b1 * g", "one_minus_b2 * g"))
    cuda._compiled.pop("minivit_adamw", None)
    model = small_model()
    fill_grads(model)
    with pytest.warns(ops.FastPathDisagrees, match="adamw"):
        AdamW(model, lr=1e-3).step()
    assert "adamw" in ops.report().from_functional()


# ---- no host sync in clipping and loss scaling -----------------------------------------------------------

def test_clipping_and_unscaling_never_wait_for_the_device(gpu):
    model = small_model()
    fill_grads(model)
    expected = np.sqrt(sum(float((minivit.to_numpy(g).astype(np.float64) ** 2).sum()) for g in model.grads.values()))
    before = {k: minivit.to_numpy(g) for k, g in model.grads.items()}
    gpu.reset()
    scaler = LossScaler(init_scale=4.0)
    finite = scaler.unscale(model)
    total = clip_grad_norm(model, max_norm=0.5)
    assert gpu.syncs == []                               # decided on the device
    assert bool(finite) and abs(float(total) * 4 - expected) < 1e-4 * expected
    scale = 0.5 / (float(total) + 1e-6)
    for k, g in model.grads.items():
        np.testing.assert_allclose(minivit.to_numpy(g), before[k] / 4 * scale, rtol=1e-5, atol=1e-9)
    model.grads["head.bias"][0] = np.inf
    kept = {k: minivit.to_numpy(g) for k, g in model.grads.items()}
    assert not bool(scaler.unscale(model))               # not finite: nothing divided
    for k, g in model.grads.items():
        np.testing.assert_array_equal(minivit.to_numpy(g), kept[k])


# ---- attention: cuBLAS, no N x N copy, TF32 when asked ----------------------------------------------------

@pytest.mark.parametrize("tf32", ["0", "1"])
def test_gpu_attention_through_cublas_matches_the_reference(gpu, monkeypatch, tf32):
    monkeypatch.setenv("CUPY_TF32", tf32)
    cp = sys.modules["cupy"]
    rng = np.random.default_rng(0)
    for B, N, D, nh in [(2, 5, 12, 3), (3, 17, 32, 2), (5, 1, 8, 2), (7, 9, 16, 2)]:
        wide = (rng.standard_normal((B, N, 3 * D + 5)) * 2).astype(np.float32)
        qkv = wide[..., 2:2 + 3 * D]                                     # strided, as a slice can be
        dout = rng.standard_normal((B, N, D)).astype(np.float32)
        gpu.reset()
        out, cache = kernels.attention_forward(cp.asarray(wide)[..., 2:2 + 3 * D], nh)
        dqkv = kernels.attention_backward(cp.asarray(dout), cache)
        out64, c64 = F.attention_forward(qkv.astype(np.float64), nh)
        dqkv64 = F.attention_backward(dout.astype(np.float64), c64)
        assert np.abs(out.get() - out64).max() < 1e-5 * np.abs(out64).max()
        assert np.abs(dqkv.get() - dqkv64).max() < 1e-5 * np.abs(dqkv64).max()
        launches = collections.Counter(gpu.launches)
        assert launches["cublas:gemmStridedBatchedEx"] == 2 + 5              # 2 products forward, 5 backward
        copies = sum(n for name, n in launches.items() if "copy" in name or name == "setitem")
        assert copies <= 5                                                    # none of them N x N: see below
        want = fake_cupy.cublas.CUBLAS_COMPUTE_32F_FAST_TF32 if tf32 == "1" else fake_cupy.cublas.CUBLAS_COMPUTE_32F
        assert set(gpu.compute_types) == {want}


def test_gpu_attention_copies_nothing_of_n_by_n(gpu, monkeypatch):
    """Every copy attention makes is of a (B, N, D)-sized array: the scores go straight to cuBLAS, transposed
    operands as 'transposed'."""
    cp = sys.modules["cupy"]
    sizes = []
    real = fake_cupy.ascontiguousarray
    monkeypatch.setattr(fake_cupy, "ascontiguousarray", lambda a, dtype=None: (sizes.append(a.size), real(a, dtype))[1])
    B, N, D, nh = 2, 33, 16, 2
    qkv = cp.asarray(np.random.default_rng(0).standard_normal((B, N, 3 * D)).astype(np.float32))
    out, cache = kernels.attention_forward(qkv, nh)
    kernels.attention_backward(cp.ones_like(out), cache)
    assert sizes and max(sizes) <= B * N * 3 * D < B * nh * N * N


# ---- dropout on the device -----------------------------------------------------------------------------

def test_dropout_draws_its_mask_on_the_device_reproducibly(gpu):
    cp = sys.modules["cupy"]
    x = cp.asarray(np.ones((8, 65, 64), np.float32))
    a, b = minivit.layers.Dropout(0.25, seed=3), minivit.layers.Dropout(0.25, seed=3)
    gpu.reset()
    out_a = a.forward(x)
    assert gpu.h2d == 0 and "ElementwiseKernel:minivit_keep_mask" in gpu.launches   # no mask from the host
    kept = out_a.get() != 0
    assert abs(kept.mean() - 0.75) < 0.01 and np.allclose(out_a.get()[kept], 1 / 0.75)
    np.testing.assert_array_equal(b.forward(x).get(), out_a.get())                   # same seed, same mask
    state = a.rng.bit_generator.state                                                # what checkpoints save
    second = a.forward(x).get()
    assert (second != out_a.get()).any()                                             # a new mask each call
    a.rng.bit_generator.state = state
    np.testing.assert_array_equal(a.forward(x).get(), second)                        # restored: the same again
    np.testing.assert_array_equal(a.backward(cp.ones_like(x)).get(), second)


def test_dropout_on_the_cpu_is_unchanged():
    """The CPU draws every value of its mask from the host generator, as before (the resume tests rely on it)."""
    x = np.ones((4, 5, 6), np.float32)
    layer = minivit.layers.Dropout(0.3, seed=7)
    expected = (np.random.default_rng(7).random(x.shape) >= 0.3) / np.float32(0.7)
    np.testing.assert_array_equal(layer.forward(x), expected.astype(np.float32))


# ---- small items of issue 18 ----------------------------------------------------------------------------

def test_row_kernels_are_looked_up_once_and_an_empty_last_axis_works(gpu):
    cp = sys.modules["cupy"]
    for _ in range(3):
        kernels.softmax_forward(cp.asarray(np.ones((2, 3), np.float32)))
    module = cuda._compiled[("rows", "float")]
    assert module.get_function_calls == 1
    empty = cp.asarray(np.zeros((2, 3, 0), np.float32))
    out, cache = kernels.softmax_forward(empty)
    assert out.shape == (2, 3, 0) and kernels.softmax_backward(empty, cache).shape == (2, 3, 0)


def test_a_model_step_on_the_stand_in_agrees_with_numpy(gpu):
    """Forward, loss, backward and an AdamW step of a small ViT under the stand-in (the fused GPU paths,
    chosen by ops) against the same on NumPy."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16, 16, 3)).astype(np.float32)
    y = rng.integers(0, 5, 4)
    results = []
    for name in ("numpy", "cupy"):
        minivit.set_backend(name)
        model = small_model()
        logits = model.forward(minivit.asarray(x))
        loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(y))
        model.zero_grad()
        model.backward(dlogits)
        results.append({k: minivit.to_numpy(g) for k, g in model.grads.items()})
        results[-1]["logits"] = minivit.to_numpy(logits)
        AdamW(model, lr=1e-2).step()
    assert set(ops.report().from_kernels()) >= {"adamw", "attention", "gelu", "layernorm", "linear"}
    for k in results[0]:
        assert np.abs(results[1][k] - results[0][k]).max() <= 1e-4 * np.abs(results[0][k]).max(), k


# ---- scripts/gpu_check.sh fits the device's budget -------------------------------------------------------

def test_gpu_check_fits_its_budget_by_construction():
    """The device machine runs one command for at most 600 s: the steps' timeouts must add up to less than
    540 s; each step stops with SIGINT (pytest still prints its summary) and Python's output is unbuffered."""
    text = open(os.path.join(REPO, "scripts", "gpu_check.sh")).read()
    steps = re.findall(r"^step (\w+) (\d+) ", text, flags=re.M)
    names = [name for name, _ in steps]
    assert {"probe", "gpu_tests", "suite_on_cupy", "bench_fp32", "bench_tf32", "bench_fp16", "train"} <= set(names)
    assert sum(int(limit) for _, limit in steps) < 540
    assert 'timeout -s INT' in text and "export PYTHONUNBUFFERED=1" in text
    assert "not slow" in text and "tar -czf" in text and text.rstrip().endswith('exit "$failed"')


# ---- the trainer: one host sync per step ----------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, dict(clip_grad=1.0, grad_accum=2, precision="float16")])
def test_a_training_step_waits_for_the_device_once(gpu, kw):
    """train_step reads the loss, the accuracy, the scaler's finiteness and the gradient norm in one transfer
    (issue 18: it made 4 reads per micro-batch, more with clipping and loss scaling)."""
    import warnings

    from minivit import train as T

    cfg = T.resolve(T.TrainConfig(dataset="shapes", recipe="demo", max_steps=10, batch_size=8, out=None, **kw))
    model = small_model()
    scaler = None
    if "precision" in kw:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.set_matmul_dtype("float16")
        scaler = LossScaler()
    opt = T.build_optimizer(cfg, model)
    rng = np.random.default_rng(0)
    x = minivit.asarray(rng.standard_normal((8, 16, 16, 3)).astype("float32"))
    y = minivit.asarray(rng.integers(0, 5, 8))
    T.train_step(model, opt, x, y, cfg, scaler)               # the first step also probes the twins
    for _ in range(2):
        gpu.reset()
        loss, correct, grad_norm = T.train_step(model, opt, x, y, cfg, scaler)
        assert gpu.syncs == ["get()"]
        assert isinstance(loss, float) and isinstance(correct, int) and 0 <= correct <= 8
        assert (grad_norm is None) == ("clip_grad" not in kw)


def test_a_whole_training_run_on_the_stand_in(gpu):
    """minivit.train.train on the "GPU": it runs, learns, and waits for the device about once a step."""
    from minivit import train as T
    from minivit.data import Dataset

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 96)
    x = np.where(y[:, None, None, None] == 1, 200, 40) + rng.integers(0, 30, (96, 16, 16, 3))
    data = Dataset("shapes", x[:64].astype(np.uint8), y[:64], x[64:].astype(np.uint8), y[64:], ["dark", "bright"],
                   (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    cfg = T.TrainConfig(embed_dim=24, depth=1, num_heads=2, batch_size=16, max_steps=12, num_evals=1, lr=3e-3,
                        warmup_epochs=0, backend="cupy", out=None, progress=False, verbose=False)
    import dataclasses

    T.train(dataclasses.replace(cfg, max_steps=2), data=data)    # the twins' probes (once per process)
    gpu.reset()
    result = T.train(cfg, data=data)
    assert result.summary["backend"] == "cupy" and result.summary["steps"] == 12
    assert result.history[-1]["val_acc"] == 1.0
    reads = collections.Counter(gpu.syncs)
    # a read per step; 4 in the one evaluation (the labels' range, the loss, the correct count) and one for
    # "is every parameter finite?" before the checkpoint is kept (issue 13), however many parameters there are
    assert reads["get()"] == 12 + 1 and sum(reads.values()) == 12 + 4 + 1, reads
    with pytest.raises(ValueError, match=r"y_train must be in \[0, 2\)"):
        T.train(cfg, data=Dataset("shapes", data.x_train, data.y_train + 1, data.x_test, data.y_test,
                                  data.classes, data.mean, data.std))
