"""Parity of minivit.conv with PyTorch (torch.nn.functional.conv2d / group_norm), in float64.

The llm.c trick: feed the same arbitrary upstream gradient through both (the fake loss (out * dout).sum()),
then the outputs, the input gradient and every parameter gradient must agree to 1e-10 relative. minivit is
channels-last with kernels (kh, kw, C, Co); PyTorch is NCHW with weights (Co, C, kh, kw).
Run: PYTHONPATH=. .venv-parity/bin/python -m pytest tests/test_conv_parity.py -q
"""

import numpy as np
import pytest

import minivit
from minivit import conv as Cv
from minivit import embeddings as E
from minivit.resnet import ResNet, ResNetConfig

torch = pytest.importorskip("torch")
TF = pytest.importorskip("torch.nn.functional")

pytestmark = pytest.mark.parity


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def nchw(x):   # (B, H, W, C) numpy -> (B, C, H, W) torch leaf
    return torch.tensor(np.ascontiguousarray(x.transpose(0, 3, 1, 2)), requires_grad=True)


def kernel_to_torch(w):   # (kh, kw, C, Co) -> (Co, C, kh, kw)
    return torch.tensor(np.ascontiguousarray(w.transpose(3, 2, 0, 1)), requires_grad=True)


@pytest.mark.parametrize("k,stride,padding,shape", [(3, 1, 1, (2, 9, 7, 3)), (3, 2, 1, (2, 9, 8, 4)),
                                                     (1, 2, 0, (3, 6, 6, 5)), (5, 2, 2, (1, 11, 10, 2)),
                                                     (4, 4, 0, (2, 8, 12, 3))])
def test_conv2d_matches_torch(k, stride, padding, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape)
    w = rng.standard_normal((k, k, shape[3], 6))
    b = rng.standard_normal(6)
    out, cache = Cv.conv2d_forward(minivit.asarray(x), minivit.asarray(w), minivit.asarray(b), stride, padding)
    dout = rng.standard_normal(out.shape)
    dx, dw, db = (minivit.to_numpy(a) for a in Cv.conv2d_backward(minivit.asarray(dout), cache))

    tx, tw, tb = nchw(x), kernel_to_torch(w), torch.tensor(b, requires_grad=True)
    tout = TF.conv2d(tx, tw, tb, stride=stride, padding=padding)
    (tout * torch.tensor(dout.transpose(0, 3, 1, 2))).sum().backward()                 # the fake loss
    assert rel(minivit.to_numpy(out), tout.detach().numpy().transpose(0, 2, 3, 1)) < 1e-12
    assert rel(dx, tx.grad.numpy().transpose(0, 2, 3, 1)) < 1e-12
    assert rel(dw, tw.grad.numpy().transpose(2, 3, 1, 0)) < 1e-12
    assert rel(db, tb.grad.numpy()) < 1e-12


@pytest.mark.parametrize("groups,chans", [(1, 6), (2, 6), (3, 6), (8, 16)])
def test_groupnorm_matches_torch(groups, chans):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 4, chans)) * 2 + 0.5
    weight, bias = rng.standard_normal(chans), rng.standard_normal(chans)
    out, cache = Cv.groupnorm_forward(minivit.asarray(x), minivit.asarray(weight), minivit.asarray(bias), groups)
    dout = rng.standard_normal(out.shape)
    dx, dweight, dbias = (minivit.to_numpy(a) for a in Cv.groupnorm_backward(minivit.asarray(dout), cache))

    tx = nchw(x)
    tw, tb = torch.tensor(weight, requires_grad=True), torch.tensor(bias, requires_grad=True)
    tout = TF.group_norm(tx, groups, tw, tb, eps=1e-5)
    (tout * torch.tensor(dout.transpose(0, 3, 1, 2))).sum().backward()
    assert rel(minivit.to_numpy(out), tout.detach().numpy().transpose(0, 2, 3, 1)) < 1e-12
    assert rel(dx, tx.grad.numpy().transpose(0, 2, 3, 1)) < 1e-10
    assert rel(dweight, tw.grad.numpy()) < 1e-12
    assert rel(dbias, tb.grad.numpy()) < 1e-12


def torch_resnet(model, x):
    """The same ResNet written with torch.nn.functional, reading minivit's parameters by name.
    Returns the logits and a dict name -> torch leaf (for the gradients)."""
    leaves = {}
    for k, p in model.params.items():
        a = minivit.to_numpy(p)
        leaves[k] = kernel_to_torch(a) if a.ndim == 4 else torch.tensor(a, requires_grad=True)
    P = leaves

    def conv_norm(h, prefix, stride, act):
        w = P[prefix + "conv.weight"]
        h = TF.conv2d(h, w, stride=stride, padding=w.shape[-1] // 2)
        h = TF.group_norm(h, Cv.groups_for(w.shape[0]), P[prefix + "norm.weight"], P[prefix + "norm.bias"], eps=1e-5)
        return TF.relu(h) if act else h

    h = conv_norm(x, "stem.", 1, True)
    for name, block in [(n, b) for n, b in model.stages() if n.startswith("stages.")]:   # the residual blocks
        stride = block.conv1.stride
        w1, w2 = P[name + ".conv1.weight"], P[name + ".conv2.weight"]
        G = Cv.groups_for(w1.shape[0])
        b = TF.relu(TF.group_norm(TF.conv2d(h, w1, stride=stride, padding=1), G, P[name + ".norm1.weight"],
                                  P[name + ".norm1.bias"], eps=1e-5))
        b = TF.group_norm(TF.conv2d(b, w2, padding=1), G, P[name + ".norm2.weight"], P[name + ".norm2.bias"], eps=1e-5)
        s = h if block.shortcut is None else conv_norm(h, name + ".shortcut.", stride, False)
        h = TF.relu(b + s)
    logits = h.mean((2, 3)) @ P["head.weight"] + P["head.bias"]
    return logits, leaves


def test_resnet_logits_and_every_gradient_match_torch():
    rng = np.random.default_rng(2)
    cfg = ResNetConfig(img_size=12, in_chans=3, num_classes=5, widths=(8, 16, 24), depths=(2, 1, 1))
    model = ResNet(cfg, seed=3, dtype="float64")
    for k, p in model.params.items():            # norms and biases away from 1 / 0
        if "norm" in k or k.endswith("bias"):
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    x = rng.standard_normal((3, 12, 12, 3))
    labels = rng.integers(0, 5, 3)

    logits = model.forward(minivit.asarray(x))
    loss, dlogits = minivit.cross_entropy(logits, minivit.asarray(labels))
    model.zero_grad()
    dx = minivit.to_numpy(model.backward(dlogits))

    tx = nchw(x)
    tlogits, leaves = torch_resnet(model, tx)
    tloss = TF.cross_entropy(tlogits, torch.tensor(labels))
    tloss.backward()
    assert rel(minivit.to_numpy(logits), tlogits.detach().numpy()) < 1e-10
    assert abs(loss - tloss.item()) < 1e-12
    assert rel(dx, tx.grad.numpy().transpose(0, 2, 3, 1)) < 1e-9
    for k, g in model.grads.items():
        tg = leaves[k].grad.numpy()
        tg = tg.transpose(2, 3, 1, 0) if tg.ndim == 4 else tg
        assert rel(minivit.to_numpy(g), tg) < 1e-9, k


def test_conv_stem_matches_torch():
    rng = np.random.default_rng(4)
    stem = Cv.ConvStem(3, (8, 16, 32), 12, dtype="float64")
    for k, p in stem.params.items():
        if "norm" in k or k.endswith("bias"):
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    x = rng.standard_normal((2, 16, 16, 3))
    out = stem.forward(minivit.asarray(x))                              # (B, N, D)
    dout = rng.standard_normal(out.shape)
    stem.zero_grad()
    dx = minivit.to_numpy(stem.backward(minivit.asarray(dout)))

    host = {k: minivit.to_numpy(p) for k, p in stem.params.items()}
    P = {k: kernel_to_torch(a) if a.ndim == 4 else torch.tensor(a, requires_grad=True) for k, a in host.items()}
    tx = nchw(x)
    h = tx
    for i in range(3):
        w = P[f"stages.{i}.conv.weight"]
        h = TF.conv2d(h, w, stride=1 if i == 0 else 2, padding=1)
        h = TF.relu(TF.group_norm(h, Cv.groups_for(w.shape[0]), P[f"stages.{i}.norm.weight"],
                                  P[f"stages.{i}.norm.bias"], eps=1e-5))
    tokens = h.flatten(2).transpose(1, 2)                                 # (B, N, C): 1x1 patches, row-major
    tout = tokens @ P["proj.weight"] + P["proj.bias"]
    (tout * torch.tensor(dout)).sum().backward()
    assert rel(minivit.to_numpy(out), tout.detach().numpy()) < 1e-10
    assert rel(dx, tx.grad.numpy().transpose(0, 2, 3, 1)) < 1e-9
    for k, g in stem.grads.items():
        tg = P[k].grad.numpy()
        tg = tg.transpose(2, 3, 1, 0) if tg.ndim == 4 else tg
        assert rel(minivit.to_numpy(g), tg) < 1e-9, k


def test_sincos2d_matches_timm():
    """timm's build_sincos2d_pos_embed (interleaved: sin, cos of rows, then of columns) holds the same
    numbers as minivit's (columns first, MAE's order) with the two halves swapped."""
    pos = pytest.importorskip("timm.layers.pos_embed_sincos")
    for grid, D in (((4, 4), 16), ((3, 5), 32)):
        ref = pos.build_sincos2d_pos_embed(list(grid), D, interleave_sin_cos=True, dtype=torch.float64).numpy()
        ours = minivit.to_numpy(E.sincos2d_table(grid, D, dtype="float64"))[0]    # (N, D)
        swapped = np.concatenate([ours[:, D // 2:], ours[:, :D // 2]], axis=1)
        np.testing.assert_allclose(swapped, ref, atol=1e-6)     # timm computes the angles in float32
