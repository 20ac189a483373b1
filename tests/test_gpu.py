"""CuPy against NumPy: the same model, weights and batch give the same results to float32 tolerance.
Skipped without CuPy and a GPU (as on CI); run on a GPU machine with `pytest tests/test_gpu.py`."""

import numpy as np
import pytest

import minivit

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_cupy_matches_numpy_forward_and_backward(pool):
    config = minivit.ViTConfig(img_size=32, patch_size=4, num_classes=10, embed_dim=64, depth=2, num_heads=4,
                               pool=pool)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32, 32, 3)).astype("float32")
    labels = rng.integers(0, 10, 4)
    results = {}
    for name in ("numpy", "cupy"):
        minivit.set_backend(name)
        model = minivit.ViT(config, seed=0)             # same seed -> same weights on both backends
        logits = model.forward(minivit.asarray(x))
        loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(labels))
        model.zero_grad()
        dx = model.backward(dlogits)
        results[name] = (minivit.to_numpy(logits), loss, minivit.to_numpy(dx),
                         {k: minivit.to_numpy(g) for k, g in model.grads.items()})
    minivit.set_backend("numpy")
    (l0, loss0, dx0, g0), (l1, loss1, dx1, g1) = results["numpy"], results["cupy"]
    np.testing.assert_allclose(l1, l0, rtol=1e-4, atol=1e-5)
    assert abs(loss1 - loss0) < 1e-4
    np.testing.assert_allclose(dx1, dx0, rtol=1e-3, atol=1e-6)
    for k in g0:
        scale = np.abs(g0[k]).max() + 1e-12
        assert np.abs(g1[k] - g0[k]).max() / scale < 1e-3, k


def test_model_to_cupy_and_back_keeps_weights():
    minivit.set_backend("numpy")
    model = minivit.ViT(minivit.ViTConfig(img_size=16, patch_size=4, num_classes=3, embed_dim=16, depth=1,
                                          num_heads=2))
    before = model.state_dict()
    model.to("cupy")
    assert model.backend == "cupy"
    model.forward(minivit.asarray(np.zeros((1, 16, 16, 3), "float32"), backend="cupy"))
    model.to("numpy")
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
