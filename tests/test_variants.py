"""The paper's variants: position-embedding kinds, the hybrid conv stem, the ResNet baseline, the experiments.

Gradient checks in float64 (minivit.gradcheck) for every new pair and layer and for whole models with each
option; convolution and GroupNorm against plain loops; exact parameter counts; errors that name the value;
a ResNet that learns; the experiment scripts' quick paths. tests/test_conv_parity.py compares with PyTorch.
"""

import itertools
import json

import numpy as np
import pytest

import minivit
from minivit import conv as Cv
from minivit import embeddings as E
from minivit.model import ViT, ViTConfig
from minivit.resnet import ResNet, ResNetConfig

GC = dict(seed=3)  # gradcheck's upstream gradient comes from seed 3, never the input's stream


def to_np(a):
    return minivit.to_numpy(a)


def small_vit(**kw):
    base = dict(img_size=8, patch_size=2, in_chans=3, num_classes=4, embed_dim=8, depth=1, num_heads=2,
                mlp_ratio=2.0)
    return ViTConfig(**{**base, **kw})


# --------------------------------------------------------------------------------------------------
# Oracles: plain loops
# --------------------------------------------------------------------------------------------------


def naive_conv2d(x, w, b, stride, padding):
    """Loop over output pixels. x (B, H, W, C), w (kh, kw, C, Co) -> (B, Ho, Wo, Co)."""
    B, H, W, C = x.shape
    kh, kw, _, Co = w.shape
    xp_ = np.pad(x, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    Ho, Wo = (H + 2 * padding - kh) // stride + 1, (W + 2 * padding - kw) // stride + 1
    out = np.zeros((B, Ho, Wo, Co))
    for i in range(Ho):
        for j in range(Wo):
            window = xp_[:, i * stride:i * stride + kh, j * stride:j * stride + kw, :]     # (B, kh, kw, C)
            out[:, i, j] = np.tensordot(window, w, axes=([1, 2, 3], [0, 1, 2])) + (0 if b is None else b)
    return out


def naive_groupnorm(x, weight, bias, G, eps):
    B, H, W, C = x.shape
    out = np.empty_like(x)
    for n in range(B):
        for g in range(G):
            chans = slice(g * C // G, (g + 1) * C // G)
            v = x[n, :, :, chans]
            out[n, :, :, chans] = (v - v.mean()) / np.sqrt(v.var() + eps)
    return out * weight + bias


def mae_sincos_2d(embed_dim, grid_size):
    """MAE's get_2d_sincos_pos_embed (facebookresearch/mae, util/pos_embed.py), square grid, no class token."""
    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64)
        omega /= dim / 2.0
        omega = 1.0 / 10000 ** omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape(2, 1, grid_size, grid_size)
    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


# --------------------------------------------------------------------------------------------------
# Convolution, GroupNorm, ReLU, GAP: the pairs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k,stride,padding,shape", [(3, 1, 1, (2, 7, 6, 3)), (3, 2, 1, (2, 7, 6, 3)),
                                                     (1, 2, 0, (2, 6, 6, 4)), (2, 2, 0, (1, 8, 6, 2)),
                                                     (3, 1, 0, (2, 5, 7, 3)), (5, 3, 2, (1, 9, 8, 2))])
def test_conv2d_equals_a_loop_over_output_pixels(rng, k, stride, padding, shape):
    x = rng.standard_normal(shape)
    w = rng.standard_normal((k, k, shape[3], 5))
    b = rng.standard_normal(5)
    out, _ = Cv.conv2d_forward(minivit.asarray(x), minivit.asarray(w), minivit.asarray(b), stride, padding)
    np.testing.assert_allclose(to_np(out), naive_conv2d(x, w, b, stride, padding), rtol=1e-12, atol=1e-12)


def test_col2im_is_the_adjoint_of_im2col(rng):
    """<im2col(x), c> = <x, col2im(c)> for every x, c: the backward of a linear map is its transpose."""
    x = rng.standard_normal((2, 7, 5, 3))
    cols = to_np(Cv.im2col(minivit.asarray(x), 3, 3, 2, 1))
    c = rng.standard_normal(cols.shape)
    back = to_np(Cv.col2im(minivit.asarray(c), x.shape, 3, 3, 2, 1))
    assert np.isclose((cols * c).sum(), (x * back).sum(), rtol=1e-12)


def test_groupnorm_equals_a_loop_over_images_and_groups(rng):
    x = rng.standard_normal((3, 4, 5, 6)) * 3 + 1
    weight, bias = rng.standard_normal(6), rng.standard_normal(6)
    out, _ = Cv.groupnorm_forward(minivit.asarray(x), minivit.asarray(weight), minivit.asarray(bias), 3, 1e-5)
    np.testing.assert_allclose(to_np(out), naive_groupnorm(x, weight, bias, 3, 1e-5), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k,stride,padding,bias", [(3, 1, 1, True), (3, 2, 1, False), (1, 2, 0, True),
                                                    (2, 2, 0, True), (3, 1, 0, False)])
def test_conv2d_gradcheck(arr, k, stride, padding, bias):
    layer = Cv.Conv2d(3, 4, k, stride, padding, bias=bias, dtype="float64")
    minivit.gradcheck(layer, arr(2, 7, 6, 3), **GC).assert_ok()


@pytest.mark.parametrize("groups,chans", [(1, 4), (2, 4), (4, 4), (3, 6)])
def test_groupnorm_gradcheck(arr, groups, chans):
    layer = Cv.GroupNorm(groups, chans, dtype="float64")
    layer.params["weight"][...] = minivit.asarray(np.linspace(0.5, 1.5, chans))   # away from the 1/0 init
    layer.params["bias"][...] = minivit.asarray(np.linspace(-0.3, 0.3, chans))
    minivit.gradcheck(layer, arr(2, 5, 3, chans), **GC).assert_ok()


def test_relu_and_gap_gradcheck(arr):
    minivit.gradcheck(Cv.ReLU(), arr(2, 3, 4, 5), **GC).assert_ok()
    minivit.gradcheck(Cv.GlobalAvgPool(), arr(2, 3, 4, 5), **GC).assert_ok()


def test_relu_passes_gradient_only_where_positive():
    x = minivit.asarray(np.array([-2.0, -0.5, 0.5, 3.0]))
    layer = Cv.ReLU()
    np.testing.assert_array_equal(to_np(layer.forward(x)), [0, 0, 0.5, 3.0])
    np.testing.assert_array_equal(to_np(layer.backward(minivit.asarray(np.ones(4)))), [0, 0, 1, 1])


# --------------------------------------------------------------------------------------------------
# Conv layers, the stem and the ResNet
# --------------------------------------------------------------------------------------------------


def test_conv_norm_act_and_stem_gradcheck(arr):
    minivit.gradcheck(Cv.ConvNormAct(3, 4, 3, 2, dtype="float64"), arr(2, 6, 6, 3), **GC).assert_ok()
    stem = Cv.ConvStem(3, (4, 8), 6, dtype="float64")
    assert stem.forward(arr(2, 8, 8, 3)).shape == (2, 16, 6)          # 8x8 -> one stride 2 -> 4x4 = 16 tokens
    minivit.gradcheck(stem, arr(2, 8, 8, 3), max_checks=60, **GC).assert_ok()


@pytest.mark.parametrize("c_in,c_out,stride", [(4, 4, 1), (4, 8, 2), (4, 8, 1)])
def test_basic_block_gradcheck(arr, c_in, c_out, stride):
    block = Cv.BasicBlock(c_in, c_out, stride, dtype="float64")
    assert (block.shortcut is None) == (stride == 1 and c_in == c_out)
    minivit.gradcheck(block, arr(2, 6, 6, c_in), max_checks=60, **GC).assert_ok()


def test_resnet_gradcheck_whole_model(arr):
    cfg = ResNetConfig(img_size=8, in_chans=3, num_classes=3, widths=(4, 8), depths=(1, 1))
    model = ResNet(cfg, dtype="float64")
    report = minivit.gradcheck(model, arr(2, 8, 8, 3), max_checks=20, **GC)
    report.assert_ok()
    assert len(report.rows) == 1 + len(model.params)


@pytest.mark.parametrize("widths,depths", [((16, 32, 64), (1, 1, 1)), ((8, 16), (2, 3)), ((12,), (2,))])
def test_resnet_num_params_is_exact(widths, depths):
    cfg = ResNetConfig(in_chans=1, num_classes=7, widths=widths, depths=depths)
    assert ResNet(cfg).num_params() == cfg.num_params()


def test_resnet_names_shapes_and_state_dict_round_trip(rng):
    cfg = ResNetConfig(img_size=8, widths=(4, 8), depths=(1, 1), num_classes=3)
    model = ResNet(cfg, seed=1, dtype="float64")
    assert model.params["stem.conv.weight"].shape == (3, 3, 3, 4)                  # (kh, kw, C, Co)
    assert model.params["stages.1.0.shortcut.conv.weight"].shape == (1, 1, 4, 8)
    assert "stages.0.0.shortcut.conv.weight" not in model.params                  # same shape: identity
    x = minivit.asarray(rng.standard_normal((2, 8, 8, 3)))
    other = ResNet(cfg, seed=2, dtype="float64").load_state_dict(model.state_dict())
    np.testing.assert_array_equal(to_np(other.forward(x)), to_np(model.forward(x)))
    with pytest.raises(ValueError, match="missing keys"):
        other.load_state_dict({k: v for k, v in model.state_dict().items() if k != "head.bias"})


def test_resnet_training_lowers_the_loss(rng):
    from minivit.optim import AdamW

    model = ResNet(ResNetConfig(img_size=8, widths=(8, 16), depths=(1, 1), num_classes=4), seed=0)
    x = minivit.asarray(rng.standard_normal((16, 8, 8, 3)), dtype="float32")
    y = minivit.asarray(rng.integers(0, 4, 16))
    opt = AdamW(model, 1e-2, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss, dlogits = minivit.cross_entropy(model.forward(x), y)
        model.zero_grad()
        model.backward(dlogits)
        opt.step()
        losses.append(loss)
    assert losses[-1] < 0.2 * losses[0], losses                     # it memorises the 16 images
    assert float((model.forward(x).argmax(-1) == y).mean()) == 1.0


def test_resnet_checks_its_input():
    model = ResNet(ResNetConfig(img_size=8, widths=(4,), depths=(1,)))
    with pytest.raises(ValueError, match=r"\(B, H, W, 3\)"):
        model.forward(minivit.asarray(np.zeros((2, 3, 8, 8), "float32")))
    with pytest.raises(TypeError, match="float64 but the model is float32"):
        model.forward(minivit.asarray(np.zeros((2, 8, 8, 3))))


# --------------------------------------------------------------------------------------------------
# Position embeddings
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,class_token", list(itertools.product(["learned2d", "sincos2d", "none"], [True, False])))
def test_grid_pos_embed_gradcheck(arr, kind, class_token):
    layer = E.GridPosEmbed((2, 3), 8, kind, class_token, dtype="float64")
    out = layer.forward(arr(2, 6, 8))
    assert out.shape == (2, 7 if class_token else 6, 8)
    minivit.gradcheck(layer, arr(2, 6, 8), **GC).assert_ok()


def test_learned2d_token_gets_its_row_and_its_column(rng):
    gh, gw, D = 3, 4, 6
    layer = E.GridPosEmbed((gh, gw), D, "learned2d", class_token=True, dtype="float64")
    row, col = to_np(layer.params["pos_embed_row"])[0], to_np(layer.params["pos_embed_col"])[0]  # (gh, D/2), (gw, D/2)
    x = rng.standard_normal((2, gh * gw, D))
    out = to_np(layer.forward(minivit.asarray(x)))
    for r, c in [(0, 0), (1, 3), (2, 1)]:
        np.testing.assert_allclose(out[:, 1 + r * gw + c], x[:, r * gw + c] + np.concatenate([row[r], col[c]]))
    np.testing.assert_allclose(out[:, 0], np.broadcast_to(to_np(layer.params["cls_token"])[0, 0], (2, D)))


def test_sincos2d_is_maes_table_and_has_no_parameters():
    layer = E.GridPosEmbed((5, 5), 16, "sincos2d", class_token=False, dtype="float64")
    assert layer.params == {}
    np.testing.assert_allclose(to_np(layer.table)[0], mae_sincos_2d(16, 5), rtol=1e-12, atol=1e-12)
    t = to_np(E.sincos2d_table((2, 3), 8, dtype="float64"))[0]            # non-square: row-major over (2, 3)
    np.testing.assert_allclose(t[4, :2], [np.sin(1.0), np.sin(1.0 / 100)])   # row 1, column 1: sin(c w_k), w = 1, 1/100
    np.testing.assert_allclose(t[5, 4:6], [np.sin(1.0), np.sin(0.01)])      # row 1, column 2: sin(r w_k)


def test_no_position_embedding_means_a_bag_of_patches(rng):
    """Without position embeddings (and with GAP) the ViT cannot tell where a patch is: shuffling the
    patches leaves the logits unchanged. With learned 1-D embeddings it does not."""
    x = rng.standard_normal((1, 8, 8, 3))
    perm = rng.permutation(16)
    patches = x.reshape(1, 4, 2, 4, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(1, 16, 2, 2, 3)[:, perm]
    shuffled = patches.reshape(1, 4, 4, 2, 2, 3).transpose(0, 1, 3, 2, 4, 5).reshape(1, 8, 8, 3)
    for kind, same in (("none", True), ("learned", False)):
        model = ViT(small_vit(pool="gap", pos_embed=kind), dtype="float64").eval()
        a, b = to_np(model.forward(minivit.asarray(x))), to_np(model.forward(minivit.asarray(shuffled)))
        assert np.allclose(a, b, rtol=1e-10, atol=1e-12) == same, kind


# --------------------------------------------------------------------------------------------------
# The ViT with each option
# --------------------------------------------------------------------------------------------------

OPTIONS = [dict(pos_embed=k, pool=p) for k in ("learned", "learned2d", "sincos2d", "none") for p in ("cls", "gap")]
OPTIONS += [dict(stem="conv", stem_width=4), dict(stem="conv", stem_width=4, pos_embed="sincos2d", pool="gap")]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_whole_vit_gradcheck_with_each_option(arr, options):
    model = ViT(small_vit(**options), seed=1, dtype="float64")
    if "cls_token" in model.params:
        # at its 1e-6 init, with no position embedding added, the class token sits where the first LayerNorm
        # (var ~ 1e-12 << eps) curves like eps^-1.5: too sharp for a central difference. Give it a trained size.
        model.params["cls_token"][...] = arr(1, 1, 8) * 0.5
    # and let the image, not a fixed sin-cos table of size 1, dominate the tokens (else dx is tiny next to
    # the loss and the finite differences see mostly rounding)
    model.params["patch_embed.proj.weight"][...] *= 10
    report = minivit.gradcheck(model, arr(2, 8, 8, 3), max_checks=25, **GC)
    report.assert_ok()
    assert {r[0] for r in report.rows} == {"input"} | set(model.params)


def test_parameter_names_of_the_options():
    names = lambda **kw: set(ViT(small_vit(**kw)).params)   # noqa: E731
    default = names()
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight"} <= default            # unchanged: timm's names
    assert names(pos_embed="learned2d") == default - {"pos_embed"} | {"pos_embed_row", "pos_embed_col"}
    assert names(pos_embed="sincos2d") == default - {"pos_embed"} == names(pos_embed="none")
    assert names(pos_embed="none", pool="gap") == default - {"pos_embed", "cls_token"}
    m = ViT(small_vit(pos_embed="learned2d"))
    assert m.params["pos_embed_row"].shape == (1, 4, 4) and m.params["pos_embed_col"].shape == (1, 4, 4)
    conv = names(stem="conv", stem_width=4)                                          # P = 2: one stride-2 stage
    assert {"patch_embed.stages.0.conv.weight", "patch_embed.stages.1.norm.bias", "patch_embed.proj.weight"} <= conv
    assert not any(k.startswith("patch_embed.stages.2") for k in conv)
    assert ViT(small_vit(stem="conv", stem_width=4)).params["patch_embed.proj.weight"].shape == (8, 8)  # 2w -> D


def test_default_model_is_unchanged_by_the_new_fields(rng):
    """Same seed, same weights as a model built without naming the new fields (they only add options)."""
    a = ViT(small_vit(), seed=5).state_dict()
    b = ViT(small_vit(pos_embed="learned", stem="patch", stem_width=99), seed=5).state_dict()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_hybrid_has_the_patch_grid_and_trace_shows_the_feature_map():
    cfg = ViTConfig(img_size=16, patch_size=4, num_classes=3, embed_dim=8, depth=1, num_heads=2, stem="conv",
                    stem_width=4)
    assert cfg.stem_channels == (4, 8, 16)
    model = ViT(cfg)
    rows = minivit.trace(model, minivit.asarray(np.zeros((16, 16, 3), "float32")), verbose=False)
    assert rows[1][0] == "feature map" and rows[1][1] == (4, 4, 16)                  # 16 / 4 = 4: the patch grid
    assert rows[2] == ("patch_embed", (16, 8), rows[2][2]) and "1x1" in rows[2][2]
    assert rows[3][1] == (17, 8)


def test_option_models_survive_state_dict_and_backend_moves(rng):
    x = minivit.asarray(rng.standard_normal((2, 8, 8, 3)))
    for kw in (dict(pos_embed="sincos2d"), dict(pos_embed="learned2d", stem="conv", stem_width=4)):
        model = ViT(small_vit(**kw), seed=1, dtype="float64")
        other = ViT(small_vit(**kw), seed=2, dtype="float64").load_state_dict(model.state_dict())
        np.testing.assert_array_equal(to_np(other.forward(x)), to_np(model.forward(x)))
        moved = model.to(minivit.get_backend())                                  # re-homes the sincos table too
        np.testing.assert_array_equal(to_np(moved.forward(x)), to_np(other.forward(x)))


@pytest.mark.parametrize("kw,match", [
    (dict(pos_embed="2d"), "pos_embed must be one of .* got '2d'"),
    (dict(pos_embed="learned2d", embed_dim=9, num_heads=3), "even embed_dim .* embed_dim=9"),
    (dict(pos_embed="sincos2d", embed_dim=6, num_heads=2), "divisible by 4 .* embed_dim=6"),
    (dict(stem="cnn"), "stem must be 'patch' or 'conv', got 'cnn'"),
    (dict(stem="conv", img_size=12, patch_size=3), "power-of-two patch_size .* patch_size=3"),
    (dict(stem_width=0), "stem_width must be a positive int, got 0"),
])
def test_bad_configs_name_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        small_vit(**kw)


def test_bad_layer_arguments_name_the_value(arr):
    with pytest.raises(ValueError, match="6 channels cannot be split into 4"):
        Cv.GroupNorm(4, 6)
    with pytest.raises(ValueError, match="input has 2 channels .* expects 3"):
        Cv.conv2d_forward(arr(1, 4, 4, 2), arr(3, 3, 3, 5))
    with pytest.raises(ValueError, match="got 'relative'"):
        E.GridPosEmbed((2, 2), 8, "relative")
    with pytest.raises(ValueError, match=r"widths \(4, 8\) and depths \(1,\)"):
        ResNetConfig(widths=(4, 8), depths=(1,))
    with pytest.raises(ValueError, match="widths must be a non-empty tuple of positive ints, got \\(\\)"):
        ResNetConfig(widths=(), depths=())
    with pytest.raises(ValueError, match="pos_embed='sincos2d'"):
        ViT(small_vit(pos_embed="sincos2d")).resize_pos_embed(16)


def test_train_cli_builds_the_options():
    from minivit import train

    args = train._parser().parse_args(["--pos-embed", "learned2d", "--stem", "conv"])
    cfg = train.TrainConfig(**vars(args))
    assert {"pos_embed", "stem"} <= set(train.MODEL_FIELDS) and (cfg.pos_embed, cfg.stem) == ("learned2d", "conv")


# --------------------------------------------------------------------------------------------------
# FLOP counts and the experiments' quick paths
# --------------------------------------------------------------------------------------------------


def test_forward_flops_count_every_matmul_and_convolution(monkeypatch, rng):
    """Count 2 * rows * in * out of every linear and im2col product actually run (plus the two attention
    products, 2 * 2 * T^2 * D per block), and compare with minivit.flops and ResNetConfig.flops (which
    experiments/common.py and benchmarks/bench.py use)."""
    from experiments import common
    from minivit import functional as F
    from minivit import ops

    counted = []
    real_linear, real_conv = F.linear_forward, Cv.conv2d_forward

    def linear(x, w, b=None):
        d_in, d_out = w.shape
        counted.append(2 * (x.size // d_in) * d_in * d_out)            # 2 * rows * in * out
        return real_linear(x, w, b)

    def conv(x, w, b=None, stride=1, padding=0):
        out, cache = real_conv(x, w, b, stride, padding)
        kh, kw, c_in, c_out = w.shape
        counted.append(2 * (out.size // c_out) * kh * kw * c_in * c_out)  # 2 * output pixels * window * Co
        return out, cache

    monkeypatch.setattr(F, "linear_forward", linear)
    monkeypatch.setattr(Cv, "conv2d_forward", conv)
    monkeypatch.setattr(ops, "fast_kernels_enabled", lambda: False)   # every product through functional.py
    x = minivit.asarray(rng.standard_normal((1, 16, 16, 3)), dtype="float32")
    resnet = ResNet(ResNetConfig(img_size=16, widths=(4, 8), depths=(2, 1), num_classes=5))
    counted.clear(); resnet.forward(x)                                                   # noqa: E702
    assert sum(counted) == resnet.config.flops() == common.forward_flops(resnet)
    for kw in (dict(), dict(stem="conv", stem_width=4), dict(pool="gap", representation_size=6)):
        vit = ViT(ViTConfig(img_size=16, patch_size=4, num_classes=5, embed_dim=8, depth=2, num_heads=2, **kw))
        counted.clear(); vit.forward(x)                                                  # noqa: E702
        T, D = vit.config.seq_len, vit.config.embed_dim
        assert sum(counted) + vit.config.depth * 4 * T * T * D == minivit.flops(vit.config) == common.forward_flops(vit)


def test_experiment_full_mode_says_it_needs_a_gpu(tmp_path):
    from experiments import pos_embed

    if minivit.gpu_available():
        pytest.skip("a GPU is here: full mode would really run")
    with pytest.raises(SystemExit, match="full mode runs on a GPU"):
        pos_embed.main(["--out", str(tmp_path)])


EXPERIMENTS = {
    "data_size": ["--sizes", "16", "32", "--models", "vit", "hybrid", "resnet"],
    "pos_embed": [],
    "pool_lr": ["--lrs", "1e-3", "3e-3"],
    "patch_size": [],
}


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_quick_path_writes_json_and_plot(tmp_path, name):
    import importlib

    module = importlib.import_module(f"experiments.{name}")
    argv = ["--quick", "--dataset", "shapes", "--steps", "2", "--batch-size", "8", "--n-train", "32",
            "--n-test", "16", "--out", str(tmp_path)] + EXPERIMENTS[name]
    results = module.main(argv)
    with open(tmp_path / f"{name}_quick.json") as f:
        saved = json.load(f)
    assert (tmp_path / f"{name}_quick.png").stat().st_size > 1000
    assert saved["provenance"]["label"].startswith("QUICK CPU RUN (shapes")
    assert saved["provenance"]["command"].startswith(f"python -m experiments.{name} --quick")
    expected = {"data_size": 6, "pos_embed": 4, "pool_lr": 4, "patch_size": 3}[name]
    assert len(saved["runs"]) == len(results["runs"]) == expected
    assert all(r["steps"] == 2 and 0.0 <= r["final_test_acc"] <= 1.0 for r in saved["runs"])
    assert saved["paper"]["claim"]
