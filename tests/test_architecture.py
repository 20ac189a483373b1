"""Changing the architecture of a built model: the live layer contract (minivit/layers.py).

Every change a student makes by assignment (a parameter a layer owns, a sublayer swapped in after the model
was built, an element of model.blocks replaced or added, a new layer class) must be in model.params and
model.grads at once, and so trained, saved, loaded, counted, moved and zeroed with no other call. Each test
below fails if the change were left out of the views (as the old one-time ``gather()`` left it out).
"""

import copy

import numpy as np
import pytest

import minivit
from minivit.weights import checkpoint
from minivit import layers as L
from minivit.functional import cross_entropy
from minivit.model import ViT, ViTConfig
from minivit.optim import SGD, AdamW

CONFIG = ViTConfig(img_size=8, patch_size=4, in_chans=3, num_classes=3, embed_dim=8, depth=2, num_heads=2,
                   mlp_ratio=2.0)


def tiny(dtype="float64"):
    return ViT(CONFIG, seed=0, dtype=dtype)


def batch(seed=0, B=4):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, 8, 8, 3)), rng.integers(0, 3, size=B)


class LayerScale(L.Layer):
    """y = gamma * x with a learned per-channel gamma (CaiT): a leaf with a parameter of its own."""

    def __init__(self, dim, init=0.5, dtype="float64"):
        super().__init__()
        self.params["gamma"] = init * L.ones((dim,), dtype)          # (D,), grads["gamma"] made for us

    def forward(self, x):                                            # (B, N, D)
        self.cache = x if self.training else None
        return x * self.params["gamma"]

    def backward(self, dout):                                        # (B, N, D)
        self.grads["gamma"] += (dout * self._need_cache()).sum(axis=(0, 1))
        return dout * self.params["gamma"]


class ScaledBlock(L.Block):
    """A Block that owns a parameter itself (a composite with children AND its own "gamma"):
    x + gamma * attn(norm1(x)), then the MLP residual as in Block."""

    def __init__(self, dim, num_heads, dtype="float64", seed=5):
        super().__init__(dim, num_heads, mlp_ratio=2.0, dtype=dtype, seed=seed)
        self.params["gamma"] = 0.5 * L.ones((dim,), dtype)            # (D,)

    def forward(self, x):                                            # (B, N, D)
        a = self.attn.forward(self.norm1.forward(x))                  # (B, N, D)
        x1 = x + self.params["gamma"] * a
        self.cache = a if self.training else None
        return x1 + self.mlp.forward(self.norm2.forward(x1))

    def backward(self, dout):                                        # (B, N, D)
        a = self._need_cache()
        dx1 = dout + self.norm2.backward(self.mlp.backward(dout))
        self.grads["gamma"] += (dx1 * a).sum(axis=(0, 1))
        return dx1 + self.norm1.backward(self.attn.backward(dx1 * self.params["gamma"]))


class RMSNorm(L.Layer):
    """x / sqrt(mean(x^2) + eps) * weight: no mean, no bias (so no "bias" in its params)."""

    def __init__(self, dim, eps=1e-6, dtype="float64"):
        super().__init__()
        self.eps = eps
        self.params["weight"] = L.ones((dim,), dtype)

    def forward(self, x):
        xp = minivit.get_array_module(x)
        r = 1.0 / xp.sqrt((x * x).mean(-1, keepdims=True) + self.eps)   # (B, N, 1)
        self.cache = (x, r) if self.training else None
        return x * r * self.params["weight"]

    def backward(self, dout):
        x, r = self._need_cache()
        xhat = x * r
        self.grads["weight"] += (dout * xhat).reshape(-1, x.shape[-1]).sum(0)
        dxhat = dout * self.params["weight"]
        return r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))


def train_steps(model, steps=3, optimizer=None):
    optimizer = optimizer or SGD(model, lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step)
        model.zero_grad()
        _, dlogits = cross_entropy(model.forward(x), y)
        model.backward(dlogits)
        optimizer.step()
    return optimizer


# --------------------------------------------------------------------------------------------------
# each change is listed at once, under its dotted name
# --------------------------------------------------------------------------------------------------


def test_a_parameter_a_composite_layer_owns_is_listed_trained_and_counted():
    model = tiny()
    before = model.num_params()
    model.blocks[1] = ScaledBlock(8, 2)
    assert "blocks.1.gamma" in model.params and "blocks.1.gamma" in model.grads
    assert model.num_params() == before + 8
    gamma = model.params["blocks.1.gamma"]
    start = gamma.copy()
    train_steps(model)
    assert model.params["blocks.1.gamma"] is gamma                  # updated in place, by the optimizer
    assert np.abs(gamma - start).max() > 1e-4


def test_a_sublayer_swapped_after_construction_takes_the_old_name():
    model = tiny()
    old = model.blocks[0].norm1
    model.blocks[0].norm1 = RMSNorm(8)
    names = list(model.params)
    assert "blocks.0.norm1.weight" in names and "blocks.0.norm1.bias" not in names
    assert model.params["blocks.0.norm1.weight"] is model.blocks[0].norm1.params["weight"]
    assert names.index("blocks.0.norm1.weight") < names.index("blocks.0.attn.qkv.weight")   # same place
    assert old.params["weight"] is not model.params["blocks.0.norm1.weight"]
    train_steps(model)                                               # runs: Block.forward calls self.norm1


def test_a_new_sublayer_and_a_removed_one():
    model = tiny()
    model.blocks[0].ls1 = LayerScale(8)
    assert "blocks.0.ls1.gamma" in model.params
    model.blocks[0].ls1 = None
    assert not any(".ls1." in name for name in model.params)


def test_blocks_replaced_appended_and_deleted_follow_in_params():
    model = tiny()
    model.blocks.append(L.Block(8, 2, mlp_ratio=3.0, dtype="float64"))
    assert model.params["blocks.2.mlp.fc1.weight"].shape == (8, 24)
    x, _ = batch()
    assert model.forward(x).shape == (4, 3)
    del model.blocks[0]
    assert "blocks.2.norm1.weight" not in model.params
    assert model.params["blocks.1.mlp.fc1.weight"].shape == (8, 24)  # renumbered in list order
    names = list(model.params)
    assert names.index("blocks.1.norm1.weight") < names.index("norm.weight")     # blocks before the final norm


def test_a_new_parameter_gets_its_gradient_and_bad_entries_are_refused():
    layer = L.Layer()
    layer.params["w"] = np.ones((2, 3))
    assert layer.grads["w"].shape == (2, 3) and not layer.grads["w"].any()
    with pytest.raises(TypeError, match="must be a numpy or cupy array"):
        layer.params["v"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="without dots"):
        layer.params["a.b"] = np.ones(2)
    del layer.params["w"]
    assert "w" not in layer.grads


def test_two_arrays_with_one_name_are_refused():
    outer = L.Layer()
    outer.params["weight"] = np.ones(2)
    outer.add("", L.LayerNorm(2, dtype="float64"))                  # its "weight" would be a second one
    with pytest.raises(ValueError, match="both named 'weight'"):
        list(outer.params)


# --------------------------------------------------------------------------------------------------
# ... and so saved, loaded, moved, zeroed, copied and optimized
# --------------------------------------------------------------------------------------------------


def test_a_changed_model_saves_and_loads_its_new_parameters(tmp_path):
    model = tiny()
    model.blocks[1] = ScaledBlock(8, 2)
    model.blocks[0].norm2 = RMSNorm(8)
    train_steps(model)
    path = tmp_path / "ckpt.npz"
    checkpoint.save_checkpoint(path, model)
    other = tiny()
    other.blocks[1] = ScaledBlock(8, 2, seed=9)
    other.blocks[0].norm2 = RMSNorm(8)
    other.load_state_dict(checkpoint.load_checkpoint(path)["params"])
    for name, p in model.params.items():
        np.testing.assert_array_equal(other.params[name], p)
    x, _ = batch(3)
    np.testing.assert_array_equal(other.eval().forward(x), model.eval().forward(x))
    with pytest.raises(ValueError, match="blocks.1.gamma.*saved from a changed model"):   # a plain ViT lacks gamma
        checkpoint.load_model(path)


def test_zero_grad_deepcopy_and_to_reach_the_new_parameters():
    model = tiny()
    model.blocks[1] = ScaledBlock(8, 2)
    x, y = batch()
    _, dlogits = cross_entropy(model.forward(x), y)
    model.backward(dlogits)
    assert np.abs(model.grads["blocks.1.gamma"]).max() > 0
    model.zero_grad()
    assert not model.grads["blocks.1.gamma"].any()
    twin = copy.deepcopy(model)
    twin.blocks[1].params["gamma"][...] = 7.0                         # the copy shares nothing
    assert model.params["blocks.1.gamma"][0] == 0.5
    twin.blocks.append(L.Block(8, 2, dtype="float64"))               # and its LayerList is its own
    assert "blocks.2.norm1.weight" in twin.params and "blocks.2.norm1.weight" not in model.params
    model.to("numpy")                                                # rebuilds every layer's own arrays
    assert model.params["blocks.1.gamma"] is model.blocks[1].params["gamma"]


def test_optimizers_follow_a_change_between_steps():
    """A block replaced by a wider one mid-run: its state starts from zero, the others' state is kept,
    the state of what is gone is dropped, and AdamW's result equals a fresh AdamW on the new arrays for
    the new block's first step."""
    model = tiny()
    optimizer = train_steps(model, optimizer=AdamW(model, lr=1e-2))
    kept = optimizer.buffers["exp_avg"]["head.weight"].copy()
    model.blocks[1] = L.Block(8, 2, mlp_ratio=4.0, dtype="float64", seed=3)
    train_steps(model, steps=1, optimizer=optimizer)
    assert optimizer.buffers["exp_avg"]["blocks.1.mlp.fc1.weight"].shape == (8, 32)
    assert not np.array_equal(optimizer.buffers["exp_avg"]["head.weight"], kept * 0.9)   # kept, then updated
    assert set(optimizer.buffers["exp_avg"]) == set(model.params)
    del model.blocks[1]
    train_steps(model, steps=1, optimizer=optimizer)
    assert set(optimizer.buffers["exp_avg"]) == set(model.params)
    assert optimizer.state_dict()["buffers"]["exp_avg"].keys() == set(model.params)


def test_trainer_trains_a_changed_model():
    from minivit.data import Dataset
    from minivit.train import TrainConfig, train

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(64, 8, 8, 3), dtype=np.uint8)
    y = (x[:, :4].mean((1, 2, 3)) > x[:, 4:].mean((1, 2, 3))).astype("int64")
    data = Dataset("shapes", x, y, x[:16], y[:16], ["a", "b"], (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    model = ViT(ViTConfig(img_size=8, patch_size=4, num_classes=2, embed_dim=8, depth=2, num_heads=2), seed=0)
    model.blocks[1] = ScaledBlock(8, 2, dtype="float32")
    gamma = model.params["blocks.1.gamma"].copy()
    cfg = TrainConfig(batch_size=16, max_steps=4, out=None, progress=False, verbose=False, dtype="float32")
    train(cfg, model=model, data=data)
    assert np.abs(model.params["blocks.1.gamma"] - gamma).max() > 0


def test_the_readme_example_of_changing_the_architecture_runs():
    model = minivit.ViT(minivit.presets["vit_cifar_tiny"])
    n = model.num_params()
    model.blocks[0].norm1 = RMSNorm(192, dtype="float32")
    model.blocks[0].ls1 = LayerScale(192, dtype="float32")
    model.blocks[5] = L.Block(192, 3, mlp_ratio=4.0)
    model.blocks.append(L.Block(192, 3))
    assert "blocks.0.ls1.gamma" in model.params and "blocks.0.norm1.bias" not in model.params
    assert model.params["blocks.5.mlp.fc1.weight"].shape == (192, 768) and "blocks.6.head" not in model.params
    size = lambda layer: sum(int(p.size) for p in layer.params.values())   # noqa: E731
    wider = size(L.Block(192, 3, mlp_ratio=4.0)) - size(L.Block(192, 3, mlp_ratio=2.0))
    assert model.num_params() == n - 192 + 192 + wider + size(L.Block(192, 3))   # bias gone, gamma new
