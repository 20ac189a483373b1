"""Mixed precision (minivit/fast/amp.py): float16 Linear products, float32 master weights, dynamic loss scaling.

The float16 path cannot be checked by central differences on itself (each forward rounds to 1e-3), so its
gradients are compared with the float64 model's, which tests/test_gradcheck.py checks by differences:
they must agree to float16's precision, no better (the float16 path really ran) and no worse (its
backward is right)."""

import functools
import json
import os
import signal
import warnings

import numpy as np
import pytest

import minivit
import minivit.functional as F
from minivit import amp, kernels
from minivit import train as T
from minivit.train import TrainConfig, TrainingDiverged, train

CONFIG = dict(img_size=16, patch_size=4, num_classes=5, embed_dim=32, depth=2, num_heads=4)


@pytest.fixture(autouse=True)
def _quiet():
    """set_matmul_dtype warns on NumPy that float16 is slow there; these tests mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="float16 matrix products on NumPy", category=RuntimeWarning)
        yield


def mixed(model):
    return model.set_matmul_dtype("float16")


def batch(rng, n=8, num_classes=5):
    x = rng.standard_normal((n, 16, 16, 3))
    return x, rng.integers(0, num_classes, n)


def grads_of(model, x, y, scaler=None):
    logits = model.forward(minivit.asarray(x, dtype=model.dtype))
    _, dlogits = minivit.cross_entropy(logits, minivit.asarray(y))
    model.zero_grad()
    model.backward(dlogits if scaler is None else scaler.scale(dlogits))
    if scaler is not None:
        assert scaler.unscale(model)
    return minivit.to_numpy(logits).astype("float64"), {k: minivit.to_numpy(g).astype("float64")
                                                         for k, g in model.grads.items()}


def worst_relative_error(a, b):
    """max over arrays of max|a - b| / max|b|."""
    return max(np.abs(a[k] - b[k]).max() / (np.abs(b[k]).max() + 1e-30) for k in b)


# ---- the Linear pair ---------------------------------------------------------------------------------

def test_linear_in_float16_rounds_the_product_inputs_and_keeps_float16_in_its_cache(rng):
    x = rng.standard_normal((4, 7, 24))
    w, b, dout = rng.standard_normal((24, 12)) * 0.2, rng.standard_normal(12), rng.standard_normal((4, 7, 12))
    xs, ws, bs, ds = (minivit.asarray(a, dtype="float32") for a in (x, w, b, dout))
    y, cache = kernels.linear_forward(xs, ws, bs, matmul_dtype="float16")   # the mixed twin
    assert y.dtype == np.float32 and y.shape == (4, 7, 12)
    assert cache[0].dtype == np.float16 and cache[1].dtype == np.float16      # half the bytes of float32
    assert cache[0].nbytes == xs.nbytes // 2
    dx, dweight, dbias = kernels.linear_backward(ds, cache)
    assert dx.dtype == dweight.dtype == dbias.dtype == np.float32
    # the exact answer for the float16-rounded inputs, computed in float64
    x16, w16 = x.astype(np.float16).astype(np.float64), w.astype(np.float16).astype(np.float64)
    d16 = dout.astype(np.float16).astype(np.float64)
    expected = [(x16 @ w16 + b.astype(np.float32), minivit.to_numpy(y)),
                (d16 @ w16.T, minivit.to_numpy(dx)),
                (x16.reshape(-1, 24).T @ d16.reshape(-1, 12), minivit.to_numpy(dweight))]
    for want, got in expected:            # only the output's rounding to float16 differs: 2^-11 relative
        assert np.abs(got - want).max() <= 2.0 ** -10 * np.abs(want).max()
    np.testing.assert_allclose(minivit.to_numpy(dbias), dout.reshape(-1, 12).sum(0), rtol=1e-5)  # float32 sum
    y32, _ = F.linear_forward(xs, ws, bs)                                     # and it really was rounded:
    assert np.abs(minivit.to_numpy(y) - minivit.to_numpy(y32)).max() > 1e-5


# ---- the whole model -----------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_mixed_precision_gradients_agree_with_float64_to_float16_precision(rng, pool):
    config = minivit.ViTConfig(**CONFIG, pool=pool)
    x, y = batch(rng)
    ref_logits, ref = grads_of(minivit.ViT(config, seed=0, dtype="float64"), x, y)
    logits32, g32 = grads_of(minivit.ViT(config, seed=0), x, y)
    logits16, g16 = grads_of(mixed(minivit.ViT(config, seed=0)), x, y, amp.LossScaler())
    assert worst_relative_error(g32, ref) < 1e-5                       # float32: the control
    err16 = worst_relative_error(g16, ref)
    assert 1e-5 < err16 < 1e-2, err16                                  # float16: ran, and is right
    assert np.abs(logits16 - ref_logits).max() < 1e-2 * np.abs(ref_logits).max()
    assert set(g16) == set(ref)


def test_small_gradients_vanish_in_float16_unless_the_loss_is_scaled(rng):
    """Why LossScaler exists: dL/dlogits of 1e-7 underflows float16 (smallest value 6e-8) in the backward
    products; scaled by 2^16 first, the same gradients come out right."""
    config = minivit.ViTConfig(**CONFIG)
    x, y = batch(rng)
    x = minivit.asarray(x, dtype="float32")

    dlogits = minivit.asarray(rng.standard_normal((8, 5)) * 1e-7, dtype="float32")

    def grads(model, scale):
        model.zero_grad()
        model.forward(x)
        model.backward(dlogits * scale)
        return {k: minivit.to_numpy(g).astype("float64") / scale for k, g in model.grads.items()}

    exact = grads(minivit.ViT(config, seed=0), 1.0)                    # float32 all the way
    unscaled = grads(mixed(minivit.ViT(config, seed=0)), 1.0)
    scaled = grads(mixed(minivit.ViT(config, seed=0)), 2.0 ** 16)
    first = "patch_embed.proj.weight"                                  # the gradient that crossed every layer
    assert np.count_nonzero(unscaled[first]) < 0.5 * unscaled[first].size     # mostly rounded to zero
    assert worst_relative_error({first: unscaled[first]}, {first: exact[first]}) > 0.1
    assert worst_relative_error(scaled, exact) < 1e-2                  # scaled: as float32, to float16 precision


def test_set_matmul_dtype_reaches_every_linear_and_undoes(rng):
    model = minivit.ViT(minivit.ViTConfig(**CONFIG))
    linears = [layer for layer in model.sublayers() if isinstance(layer, minivit.layers.Linear)]
    assert len(linears) == 2 + 4 * CONFIG["depth"]                     # patch_embed.proj, head, 4 per block
    assert model.matmul_dtype is None
    mixed(model)
    assert model.matmul_dtype == "float16" and all(layer.matmul_dtype == "float16" for layer in linears)
    assert "matmul float16" in repr(model.head)
    model.set_matmul_dtype("float32")
    assert all(layer.matmul_dtype is None for layer in linears)
    x, _ = batch(rng)
    model.eval()                                                       # eval mode works in float16 too
    assert mixed(model).forward(minivit.asarray(x, dtype="float32")).dtype == np.float32


@pytest.mark.parametrize("value, match", [("bfloat16", "has a bfloat16 dtype"), ("int8", "'int8'"), (16, "16")])
def test_set_matmul_dtype_refuses_what_it_cannot_do(value, match):
    with pytest.raises(ValueError, match=match):
        minivit.ViT(minivit.ViTConfig(**CONFIG)).set_matmul_dtype(value)


def test_mixed_precision_needs_a_float32_model():
    with pytest.raises(ValueError, match="float32 model"):
        minivit.ViT(minivit.ViTConfig(**CONFIG), dtype="float64").set_matmul_dtype("float16")


def test_numpy_float16_warns_that_it_is_slow():
    if minivit.get_backend() != "numpy":
        pytest.skip("the warning is NumPy's")
    with pytest.warns(RuntimeWarning, match="without BLAS"):
        warnings.filterwarnings("default", category=RuntimeWarning)
        minivit.ViT(minivit.ViTConfig(**CONFIG)).set_matmul_dtype("float16")


# ---- LossScaler -----------------------------------------------------------------------------------------

class _Grads:
    def __init__(self, *arrays):
        self.grads = {f"g{i}": minivit.asarray(a, dtype="float32") for i, a in enumerate(arrays)}


def test_scale_and_unscale_by_a_power_of_two_are_exact(rng):
    g = rng.standard_normal(100).astype(np.float32)
    scaler = amp.LossScaler(init_scale=2.0 ** 12)
    model = _Grads(scaler.scale(minivit.asarray(g)))
    assert scaler.unscale(model)
    np.testing.assert_array_equal(minivit.to_numpy(model.grads["g0"]), g)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_an_overflow_skips_halves_and_counts(bad):
    scaler = amp.LossScaler(init_scale=1024.0, growth_interval=3)
    model = _Grads(np.ones(4), np.array([1.0, bad]))
    assert not scaler.unscale(model)
    np.testing.assert_array_equal(minivit.to_numpy(model.grads["g0"]), 1.0)   # left alone: the step is skipped
    assert scaler.update(False) == 512.0 and scaler.skipped_steps == 1 and scaler.good_steps == 0


def test_the_scale_doubles_after_growth_interval_finite_steps_in_a_row():
    scaler = amp.LossScaler(init_scale=8.0, growth_interval=3)
    assert [scaler.update(f) for f in (True, True, False, True, True, True, True)] == \
        [8.0, 8.0, 4.0, 4.0, 4.0, 8.0, 8.0]            # the overflow restarts the count


def test_the_scaler_gives_up_on_gradients_that_are_never_finite():
    scaler = amp.LossScaler(init_scale=1.0, min_scale=0.25)
    scaler.update(False)
    scaler.update(False)                                # 0.25: still allowed
    with pytest.raises(FloatingPointError, match="diverged"):
        scaler.update(False)


def test_state_dict_round_trips_through_json():
    a = amp.LossScaler(init_scale=64.0, growth_interval=5)
    for f in (True, False, True, True):
        a.update(f)
    b = amp.LossScaler()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.scale_value, b.good_steps, b.skipped_steps, b.growth_interval) == (32.0, 2, 1, 5)
    with pytest.raises(ValueError, match="good_steps"):
        b.load_state_dict({"scale": 2.0})


@pytest.mark.parametrize("kwargs, name", [(dict(init_scale=0), "init_scale"), (dict(init_scale=np.inf), "init_scale"),
                                          (dict(growth_factor=1.0), "growth_factor"),
                                          (dict(backoff_factor=1.5), "backoff_factor"),
                                          (dict(growth_interval=0), "growth_interval"),
                                          (dict(growth_interval=2.5), "growth_interval"),
                                          (dict(min_scale=-1), "min_scale")])
def test_bad_scaler_settings_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        amp.LossScaler(**kwargs)


# ---- the trainer ----------------------------------------------------------------------------------------

TINY = dict(dataset="shapes", embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0, batch_size=32,
            train_subset=256, epochs=2, progress=False, verbose=False, eval_batch_size=1000)


def test_training_in_float16_follows_float32(tmp_path):
    runs = {p: train(TrainConfig(**TINY, precision=p, eval_every=4, out=str(tmp_path / p)))
            for p in ("float32", "float16")}
    a, b = ([r["train_loss"] for r in runs[p].history] for p in ("float32", "float16"))
    np.testing.assert_allclose(b, a, rtol=2e-2)                       # the same run, to float16's precision
    assert a != b
    s = runs["float16"].summary
    assert s["loss_scale"] == 2.0 ** 16 and s["skipped_steps"] == 0
    assert runs["float16"].model.matmul_dtype == "float16"
    assert "loss_scale" not in runs["float32"].summary


def test_resume_restores_the_loss_scale_bit_for_bit(tmp_path, monkeypatch):
    # a scale that starts too high (overflows, halves) and grows every 2 steps: it changes all run long
    monkeypatch.setattr(T.loop, "LossScaler",
                        functools.partial(amp.LossScaler, init_scale=2.0 ** 24, growth_interval=2))
    cfg = dict(TINY, precision="float16", eval_every=3)
    full = train(TrainConfig(**cfg, out=str(tmp_path / "a")))
    assert 0 < full.summary["skipped_steps"] < 16                     # 2^24 overflowed at first

    def press_ctrl_c(record):                                          # a real SIGINT, mid-run
        if record["step"] == 6:
            os.kill(os.getpid(), signal.SIGINT)

    first = train(TrainConfig(**cfg, out=str(tmp_path / "b")), callback=press_ctrl_c)
    assert first.summary["interrupted"] and first.summary["steps"] == 6
    resumed = train(TrainConfig(out=str(tmp_path / "b"), resume=True, progress=False, verbose=False))
    assert resumed.summary["steps"] == full.summary["steps"] == 16
    assert resumed.summary["loss_scale"] == full.summary["loss_scale"]
    assert resumed.summary["skipped_steps"] == full.summary["skipped_steps"]
    for k, v in full.model.params.items():
        np.testing.assert_array_equal(minivit.to_numpy(resumed.model.params[k]), minivit.to_numpy(v), err_msg=k)


def test_an_overflowing_step_changes_no_parameter(rng):
    model = mixed(minivit.ViT(minivit.ViTConfig(**CONFIG)))
    opt = minivit.optim.AdamW(model, lr=1e-3)
    before = {k: minivit.to_numpy(v).copy() for k, v in model.params.items()}
    scaler = amp.LossScaler(init_scale=2.0 ** 100)                     # float16 overflows for sure
    x, y = batch(rng)
    cfg = T.resolve(TrainConfig(**TINY))
    loss, _, grad_norm = T.train_step(model, opt, minivit.asarray(x, dtype="float32"), minivit.asarray(y), cfg, scaler)
    assert np.isfinite(loss) and grad_norm == np.inf
    assert scaler.scale_value == 2.0 ** 99 and scaler.skipped_steps == 1
    for k, v in model.params.items():
        np.testing.assert_array_equal(minivit.to_numpy(v), before[k], err_msg=k)


def test_precision_is_checked_with_the_value_named():
    with pytest.raises(ValueError, match="'bfloat16'"):
        T.resolve(TrainConfig(**TINY, precision="bfloat16"))
    with pytest.raises(ValueError, match="float32 master weights"):
        T.resolve(TrainConfig(**TINY, precision="float16", dtype="float64"))


def test_a_scaler_that_gives_up_is_reported_as_divergence(tmp_path, monkeypatch):
    monkeypatch.setattr(T.loop, "LossScaler",
                        functools.partial(amp.LossScaler, init_scale=2.0 ** 100, min_scale=2.0 ** 99))
    with pytest.raises(TrainingDiverged, match="loss scale"):
        train(TrainConfig(**TINY, precision="float16", out=None))
