"""Pretrained weights: the JAX release's .npz and timm's files into minivit, position embeddings for
another resolution (paper §3.2), a new zero head, a few fine-tuning steps. No network: every checkpoint
is made here.

The tests marked parity use timm's own loader for the JAX layout (timm's _load_weights) as the oracle
that a written .npz is right, and compare logits with timm's in float64; they skip without torch/timm.
The others need only NumPy (and safetensors / scipy where they say so).
"""

import dataclasses
import math

import numpy as np
import pytest

import minivit
from minivit import ViT, ViTConfig
from minivit.weights import convert
from minivit import embeddings as E
from minivit import layers as L


def tiny(**kw):
    base = dict(img_size=16, patch_size=4, in_chans=3, num_classes=7, embed_dim=24, depth=2, num_heads=4)
    base.update(kw)
    return ViTConfig(**base)


def perturbed(config, seed=0):
    """A float64 model with every parameter moved off its init (biases, norms, cls token all matter)."""
    model = ViT(config, seed=seed, dtype="float64")
    rng = np.random.default_rng(100 + seed)
    for p in model.params.values():
        p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    return model


def logits_of(model, x):
    model.eval()
    return minivit.to_numpy(model.forward(minivit.asarray(x, dtype=model.dtype)))


def images(config, n=3, seed=1):
    H, W = config.img_size
    return np.random.default_rng(seed).standard_normal((n, H, W, config.in_chans))


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-300))


def same_params(a, b):
    assert set(a.params) == set(b.params)
    for k in a.params:
        np.testing.assert_array_equal(minivit.to_numpy(a.params[k]), minivit.to_numpy(b.params[k]), err_msg=k)


# --------------------------------------------------------------------------------------------------
# The JAX layout, without torch
# --------------------------------------------------------------------------------------------------

ROUND_TRIP = {
    "cls_tanh_with_pre_logits": dict(gelu="tanh", representation_size=10),
    "cls_erf": dict(gelu="erf"),
    "gap_nonsquare_grey": dict(img_size=(8, 16), in_chans=1, pool="gap", num_heads=3, mlp_ratio=2.0),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP))
def test_google_npz_round_trip_gives_identical_parameters_and_logits(name, tmp_path):
    config = tiny(**ROUND_TRIP[name])
    model = perturbed(config)
    path = tmp_path / "ViT.npz"
    arrays = convert.to_google_npz(model.state_dict(), config, path)
    # the file has exactly the JAX release's names and shapes
    assert {k: v.shape for k, v in arrays.items()} == convert.google_shapes(config)
    assert arrays["embedding/kernel"].shape == (4, 4, config.in_chans, 24)
    nh = config.num_heads
    assert arrays["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel"].shape == (24, nh, 24 // nh)
    assert arrays["Transformer/encoderblock_1/MultiHeadDotProductAttention_1/out/kernel"].shape == (nh, 24 // nh, 24)
    assert ("cls" in arrays) == (config.pool == "cls")

    img_size = config.img_size if config.img_size[0] != config.img_size[1] else None  # non-square: told
    loaded_config, state = convert.from_google_npz(path, img_size=img_size, gelu=config.gelu, verbose=False)
    assert loaded_config == config
    loaded = ViT(loaded_config, dtype="float64").load_state_dict(state)
    same_params(loaded, model)
    x = images(config)
    np.testing.assert_array_equal(logits_of(loaded, x), logits_of(model, x))
    # the one-call path reads the same file to the same model
    again = convert.from_pretrained(path, gelu=config.gelu, checkpoint_img_size=img_size, dtype="float64",
                                    verbose=False)
    np.testing.assert_array_equal(logits_of(again, x), logits_of(model, x))


def flax_style_logits(w, x, gelu_tanh=True):
    """The JAX model's forward written straight from its arrays, as Flax computes it (einsums over the
    (D, nh, hs) kernels, the patch conv as a sum over (P, P, C)): an oracle independent of the converter."""
    B, H, W, C = x.shape
    P, _, _, D = w["embedding/kernel"].shape
    patches = x.reshape(B, H // P, P, W // P, P, C).transpose(0, 1, 3, 2, 4, 5)            # (B, gh, gw, P, P, C)
    z = np.einsum("bijpqc,pqcd->bijd", patches, w["embedding/kernel"]).reshape(B, -1, D)  # (B, N, D)
    z = z + w["embedding/bias"]
    z = np.concatenate([np.broadcast_to(w["cls"], (B, 1, D)), z], axis=1)                  # (B, N+1, D)
    z = z + w["Transformer/posembed_input/pos_embedding"]

    def ln(v, name):
        mu, var = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
        return (v - mu) / np.sqrt(var + 1e-6) * w[name + "/scale"] + w[name + "/bias"]

    def gelu(v):
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))

    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in w:
        b = f"Transformer/encoderblock_{i}/"
        a = b + "MultiHeadDotProductAttention_1/"
        y = ln(z, b + "LayerNorm_0")
        q, k, v = (np.einsum("bnd,dhk->bnhk", y, w[f"{a}{n}/kernel"]) + w[f"{a}{n}/bias"]
                   for n in ("query", "key", "value"))                                     # (B, N, nh, hs)
        s = np.einsum("bqhk,bvhk->bhqv", q, k) / math.sqrt(q.shape[-1])                     # (B, nh, N, N)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        o = np.einsum("bhqv,bvhk->bqhk", s, v)                                             # (B, N, nh, hs)
        z = z + np.einsum("bqhk,hkd->bqd", o, w[a + "out/kernel"]) + w[a + "out/bias"]
        y = ln(z, b + "LayerNorm_2")
        m = b + "MlpBlock_3/"
        h = gelu(y @ w[m + "Dense_0/kernel"] + w[m + "Dense_0/bias"])
        z = z + h @ w[m + "Dense_1/kernel"] + w[m + "Dense_1/bias"]
        i += 1
    y = ln(z, "Transformer/encoder_norm")[:, 0]                                            # (B, D)
    if "pre_logits/kernel" in w:
        y = np.tanh(y @ w["pre_logits/kernel"] + w["pre_logits/bias"])                    # (B, R)
    return y @ w["head/kernel"] + w["head/bias"]                                           # (B, K)


def test_google_layout_means_what_a_flax_style_forward_computes():
    config = tiny(num_heads=3, representation_size=10)
    rng = np.random.default_rng(5)
    # random arrays of the documented shapes: no minivit model, no inverse converter involved
    w = {k: 0.3 * rng.standard_normal(shape) for k, shape in convert.google_shapes(config).items()}
    loaded_config, state = convert.from_google_npz(w, verbose=False)
    assert loaded_config == dataclasses.replace(config, gelu="tanh")
    model = ViT(loaded_config, dtype="float64").load_state_dict(state)
    x = images(config)
    assert rel(logits_of(model, x), flax_style_logits(w, x)) < 1e-12


def test_jax_checkpoints_default_to_tanh_gelu_and_say_so(tmp_path, capsys):
    config = tiny(gelu="tanh")
    path = tmp_path / "ViT.npz"
    convert.to_google_npz(perturbed(config).state_dict(), config, path)
    assert convert.from_pretrained(path).config.gelu == "tanh"
    out = capsys.readouterr().out
    assert "gelu='tanh'" in out and "Flax" in out
    assert convert.from_pretrained(path, gelu="erf").config.gelu == "erf"   # the caller overrides
    assert capsys.readouterr().out == ""                                # and is not told what it chose


def test_num_heads_is_read_from_the_jax_layout_and_a_wrong_one_is_refused(tmp_path):
    config = tiny(num_heads=6)
    path = tmp_path / "ViT.npz"
    convert.to_google_npz(perturbed(config).state_dict(), config, path)
    assert convert.load_checkpoint_file(path, verbose=False)[0].num_heads == 6
    with pytest.raises(ValueError, match=r"num_heads=4, but the checkpoint's query kernel \(24, 6, 4\) has 6"):
        convert.load_checkpoint_file(path, num_heads=4, verbose=False)


# --------------------------------------------------------------------------------------------------
# timm's files, without torch: .safetensors through the safetensors package's NumPy API
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [dict(), dict(pool="gap", qkv_bias=False, img_size=(8, 16), in_chans=1)])
def test_timm_safetensors_load_to_identical_parameters(tmp_path, kw):
    st = pytest.importorskip("safetensors.numpy")
    config = tiny(**kw)
    model = perturbed(config)
    path = tmp_path / "model.safetensors"
    st.save_file(convert.to_timm(model.state_dict(), config.patch_size, config.in_chans), str(path))
    img_size = kw.get("img_size")
    loaded = convert.from_pretrained(path, num_heads=4, checkpoint_img_size=img_size, dtype="float64", verbose=False)
    assert loaded.config == config
    same_params(loaded, model)


def test_timm_num_heads_default_from_the_preset_widths_and_refused_otherwise(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    config = tiny(embed_dim=192, num_heads=3, depth=1, mlp_ratio=1.0)
    path = tmp_path / "model.safetensors"
    st.save_file(convert.to_timm(ViT(config).state_dict(), 4, 3), str(path))
    assert convert.load_checkpoint_file(path, verbose=False)[0].num_heads == 3      # ViT-Ti's width
    config = tiny()
    st.save_file(convert.to_timm(ViT(config).state_dict(), 4, 3), str(path))
    with pytest.raises(ValueError, match=r"num_heads cannot be read from timm weights.*width 24.*pass num_heads"):
        convert.load_checkpoint_file(path, verbose=False)
    assert convert.load_checkpoint_file(path, num_heads=4, verbose=False)[0].num_heads == 4


def test_a_minivit_checkpoint_is_a_starting_point_too(tmp_path):
    checkpoint = pytest.importorskip("minivit.weights.checkpoint")
    config = tiny(gelu="tanh")
    model = perturbed(config)
    checkpoint.save_checkpoint(tmp_path / "run.npz", model)
    assert convert.read_checkpoint_file(tmp_path / "run.npz")[0] == "minivit"
    again = convert.from_pretrained(tmp_path / "run.npz", dtype="float64")
    assert again.config == config
    same_params(again, model)
    new = convert.from_pretrained(tmp_path / "run.npz", num_classes=2, img_size=32, dtype="float64")
    assert new.config.num_classes == 2 and new.config.grid_size == (8, 8)


def test_vit_from_pretrained_is_minivit_from_pretrained(tmp_path):
    """minivit.ViT.from_pretrained (transformers' spelling) gives the model minivit.from_pretrained gives."""
    checkpoint = pytest.importorskip("minivit.weights.checkpoint")
    model = perturbed(tiny())
    checkpoint.save_checkpoint(tmp_path / "run.npz", model)
    for kwargs in ({}, {"num_classes": 2, "img_size": 32}):
        ours = minivit.ViT.from_pretrained(tmp_path / "run.npz", dtype="float64", verbose=False, **kwargs)
        theirs = minivit.from_pretrained(tmp_path / "run.npz", dtype="float64", verbose=False, **kwargs)
        assert type(ours) is minivit.ViT and ours.config == theirs.config
        same_params(ours, theirs)
    x = np.random.default_rng(0).standard_normal((2, *model.config.img_size, 3))
    again = minivit.ViT.from_pretrained(tmp_path / "run.npz", dtype="float64", verbose=False)
    np.testing.assert_array_equal(logits_of(again, x), logits_of(model, x))


def test_a_minivit_checkpoint_with_registers_loads_and_resizes(tmp_path):
    checkpoint = pytest.importorskip("minivit.weights.checkpoint")
    model = perturbed(tiny(num_registers=2))
    checkpoint.save_checkpoint(tmp_path / "reg.npz", model)
    again = convert.from_pretrained(tmp_path / "reg.npz", dtype="float64")
    assert again.config.num_registers == 2
    same_params(again, model)
    new = convert.from_pretrained(tmp_path / "reg.npz", img_size=32, dtype="float64")
    assert new.params["pos_embed"].shape == (1, 1 + 2 + 64, 24)
    with pytest.raises(ValueError, match="no register tokens: num_registers=2"):
        convert.to_google_npz(model.state_dict(), model.config)


def test_a_minivit_checkpoint_of_a_variant_loads_and_refuses_a_resize_it_cannot_do(tmp_path):
    """The shapes a checkpoint must have come from model.param_shapes, which knows every option."""
    checkpoint = pytest.importorskip("minivit.weights.checkpoint")
    config = tiny(stem="conv", stem_width=4, pos_embed="learned2d")
    model = perturbed(config)
    checkpoint.save_checkpoint(tmp_path / "hybrid.npz", model)
    again = convert.from_pretrained(tmp_path / "hybrid.npz", dtype="float64")
    assert again.config == config
    same_params(again, model)
    with pytest.raises(ValueError, match="pos_embed='learned'.*pos_embed='learned2d'"):
        convert.from_pretrained(tmp_path / "hybrid.npz", img_size=32, dtype="float64")


# --------------------------------------------------------------------------------------------------
# Position embeddings for another resolution (paper §3.2)
# --------------------------------------------------------------------------------------------------


def test_resize_is_the_identity_at_the_same_grid():
    pe = np.random.default_rng(0).standard_normal((1, 1 + 3 * 5, 8))
    np.testing.assert_array_equal(E.resize_pos_embed(pe, (3, 5), (3, 5)), pe)
    model = perturbed(tiny())
    same = model.resize_pos_embed(16)
    assert same is not model
    same_params(same, model)
    x = images(tiny())
    np.testing.assert_array_equal(logits_of(same, x), logits_of(model, x))


@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_a_checkpoint_with_registers_resizes_as_the_model_does(pool):
    model = perturbed(tiny(num_registers=3, pool=pool))
    config, state = convert.resize_state_dict(model.config, model.state_dict(), 24)
    bigger = model.resize_pos_embed(24)
    assert config == bigger.config and state["pos_embed"].shape == (1, config.num_prefix_tokens + 36, 24)
    same_params(ViT(config, dtype="float64").load_state_dict(state), bigger)   # the prefix rows kept as they were


@pytest.mark.parametrize("old, new", [((3, 5), (7, 4)), ((14, 14), (24, 24)), ((6, 6), (4, 3))])
def test_a_linear_ramp_over_the_grid_stays_that_ramp(old, new):
    """Bilinear with corners aligned reproduces a ramp exactly (to rounding, 1e-12 here): value
    a + b * row/(gh-1) + c * col/(gw-1) at every new grid point, up- or down-sampling."""
    D = 4
    a, b, c = np.array([0.5, -1, 2, 0]), np.array([1, 2, -3, 0.25]), np.array([-2, 0.5, 1, 4])

    def ramp(gh, gw):
        r = np.linspace(0, 1, gh)[:, None, None]
        s = np.linspace(0, 1, gw)[None, :, None]
        return (a + b * r + c * s).reshape(1, gh * gw, D)                   # (1, gh*gw, D)

    cls = np.full((1, 1, D), 7.0)
    pe = np.concatenate([cls, ramp(*old)], axis=1)
    out = E.resize_pos_embed(pe, old, new)
    assert out.shape == (1, 1 + new[0] * new[1], D)
    np.testing.assert_array_equal(out[:, :1], cls)                        # the class token's kept as is
    np.testing.assert_allclose(out[:, 1:], ramp(*new), rtol=0, atol=1e-12)


def test_resize_is_the_jax_releases_scipy_zoom_order_1():
    ndimage = pytest.importorskip("scipy.ndimage")
    gh, gw, D = 5, 7, 6
    pe = np.random.default_rng(3).standard_normal((1, gh * gw, D))       # a GAP model: no prefix token
    out = E.resize_pos_embed(pe, (gh, gw), (9, 4), num_prefix_tokens=0)
    ref = ndimage.zoom(pe[0].reshape(gh, gw, D), (9 / gh, 4 / gw, 1), order=1)   # as checkpoint.py does
    assert ref.shape == (9, 4, D)
    np.testing.assert_allclose(out[0].reshape(9, 4, D), ref, rtol=0, atol=1e-12)


def test_resized_model_takes_only_its_new_size_and_the_old_one_only_its_own():
    model = perturbed(tiny())
    bigger = model.resize_pos_embed((24, 32))
    assert bigger.config.img_size == (24, 32) and bigger.config.grid_size == (6, 8)
    assert model.config.img_size == (16, 16) and model.params["pos_embed"].shape == (1, 17, 24)
    assert bigger.params["pos_embed"].shape == (1, 49, 24)
    x_new, x_old = images(bigger.config, 2), images(model.config, 2)
    with pytest.raises(ValueError, match=r"expected images of 16x16 .* img_size=\(16, 16\)"):
        model.forward(minivit.asarray(x_new))
    with pytest.raises(ValueError, match=r"expected images of 24x32"):
        bigger.forward(minivit.asarray(x_old))
    # the two share no arrays, and the new one trains (backward folds patches back to 24x32)
    bigger.params["head.bias"][...] = 1.0
    assert float(model.params["head.bias"][0]) != 1.0
    bigger.train()
    bigger.zero_grad()
    dx = bigger.backward(bigger.forward(minivit.asarray(x_new)))
    assert dx.shape == (2, 24, 32, 3) and float(abs(bigger.grads["pos_embed"]).sum()) > 0


def test_vit_b16_resized_to_384_traces_576_then_577_tokens():
    model = minivit.create_model("vit_base_patch16_224")          # float32, ~350 MB
    resized = model.resize_pos_embed(384)
    with pytest.raises(ValueError, match="expected images of 224x224"):
        model.check_input(minivit.asarray(np.zeros((1, 384, 384, 3)), dtype="float32"))
    del model
    rows = minivit.trace(resized, minivit.asarray(np.zeros((384, 384, 3)), dtype="float32"), verbose=False)
    shapes = dict((name, shape) for name, shape, _ in rows)
    assert shapes["patches"] == (576, 768) and shapes["patch_embed"] == (576, 768)
    assert shapes["pos_embed"] == (577, 768) and shapes["blocks.11"] == (577, 768)
    assert shapes["head"] == (1000,)
    assert resized.config.grid_size == (24, 24)


# --------------------------------------------------------------------------------------------------
# Files that are not what they should be
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def good_npz(tmp_path):
    config = tiny()
    path = tmp_path / "ViT.npz"
    arrays = convert.to_google_npz(perturbed(config).state_dict(), config, path)
    return path, arrays


def test_a_text_file_is_refused_saying_what_it_looks_like(tmp_path):
    path = tmp_path / "ViT-B_16.npz"
    path.write_text("<html><body>404 Not Found</body></html>\n")
    with pytest.raises(ValueError, match="not a checkpoint minivit can read.*looks like text"):
        convert.from_pretrained(path)


@pytest.mark.parametrize("content, match", [
    (b"", "is empty"),
    (b"\x93NUMPY\x01\x00v\x00{'descr': '<f8'", r"single NumPy array \(.npy\)"),
    (b"\x1f\x8b\x08\x00" + bytes(20), "gzip"),
])
def test_other_kinds_of_file_are_refused(tmp_path, content, match):
    path = tmp_path / "weights.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        convert.load_checkpoint_file(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint file"):
        convert.load_checkpoint_file(tmp_path / "nope.npz")
    with pytest.raises(ValueError, match="is a directory"):
        convert.load_checkpoint_file(tmp_path)


def test_a_truncated_npz_is_refused(good_npz, tmp_path):
    path, _ = good_npz
    cut = tmp_path / "cut.npz"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        convert.from_pretrained(cut)


def test_a_truncated_safetensors_is_refused(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "model.safetensors"
    st.save_file(convert.to_timm(ViT(tiny()).state_dict(), 4, 3), str(path))
    data = path.read_bytes()
    for n in (len(data) - 100, 20):                 # data cut short; header cut short
        (tmp_path / "cut.safetensors").write_bytes(data[:n])
        with pytest.raises(ValueError, match="truncated"):
            convert.load_checkpoint_file(tmp_path / "cut.safetensors", num_heads=4)


def test_an_npz_missing_keys_names_them(good_npz, tmp_path):
    _, arrays = good_npz
    arrays = dict(arrays)
    del arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_1/bias"]
    del arrays["Transformer/encoder_norm/scale"]
    np.savez(tmp_path / "holes.npz", **arrays)
    with pytest.raises(ValueError, match=r"does not make a ViT.*missing "
                                         r"Transformer/encoderblock_1/MlpBlock_3/Dense_1/bias, "
                                         r"Transformer/encoder_norm/scale"):
        convert.from_pretrained(tmp_path / "holes.npz")


def test_shapes_that_do_not_make_a_vit_are_named(good_npz, tmp_path):
    _, arrays = good_npz
    arrays = dict(arrays)
    arrays["Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel"] = np.zeros((24, 50))   # block 1 wider
    np.savez(tmp_path / "odd.npz", **arrays)
    with pytest.raises(ValueError, match=r"mis-shaped Transformer/encoderblock_1/MlpBlock_3/Dense_0/kernel: "
                                         r"expected \(24, 96\), got \(24, 50\)"):
        convert.load_checkpoint_file(tmp_path / "odd.npz")
    arrays = dict(good_npz[1])
    arrays["Transformer/encoderblock_0/MultiHeadDotProductAttention_1/query/kernel"] = np.zeros((24, 5, 4))
    np.savez(tmp_path / "odd.npz", **arrays)
    with pytest.raises(ValueError, match=r"query/kernel must be \(D, nh, hs\) with nh \* hs = D = 24"):
        convert.load_checkpoint_file(tmp_path / "odd.npz")


def test_an_npz_of_other_arrays_and_a_non_square_grid_without_img_size(tmp_path):
    np.savez(tmp_path / "other.npz", weights=np.zeros(3), bias=np.ones(2))
    with pytest.raises(ValueError, match="neither the JAX release's ViT.*nor timm's"):
        convert.load_checkpoint_file(tmp_path / "other.npz")
    config = tiny(img_size=(8, 16))                 # 2x4 = 8 patches: not a square
    convert.to_google_npz(ViT(config).state_dict(), config, tmp_path / "wide.npz")
    with pytest.raises(ValueError, match="8 patch position embeddings, not a square grid: pass the img_size"):
        convert.load_checkpoint_file(tmp_path / "wide.npz", verbose=False)


def test_a_headless_checkpoint_needs_num_classes_and_gets_a_zero_head(good_npz, tmp_path):
    arrays = {k: v for k, v in good_npz[1].items() if not k.startswith("head/")}
    np.savez(tmp_path / "features.npz", **arrays)
    with pytest.raises(ValueError, match="has no head.*pass num_classes"):
        convert.from_pretrained(tmp_path / "features.npz", verbose=False)
    model = convert.from_pretrained(tmp_path / "features.npz", num_classes=5, verbose=False)
    assert model.params["head.weight"].shape == (24, 5) and float(abs(model.params["head.weight"]).max()) == 0


# --------------------------------------------------------------------------------------------------
# The representation layer (pre_logits) and the new head
# --------------------------------------------------------------------------------------------------


def test_tanh_and_pre_logits_backward_pass_the_gradient_check(arr):
    minivit.gradcheck(L.Tanh(), arr(3, 7) * 2, tol=1e-7).assert_ok()
    minivit.gradcheck(L.PreLogits(6, 4, dtype="float64"), arr(3, 6), tol=1e-7).assert_ok()
    model = perturbed(tiny(depth=1, representation_size=5))
    report = minivit.gradcheck(model, arr(2, 16, 16, 3), tol=1e-7, max_checks=40)
    report.assert_ok()
    assert {"pre_logits.fc.weight", "pre_logits.fc.bias", "head.weight"} <= set(report.errors())


def test_pre_logits_config_counts_names_and_math():
    config = tiny(representation_size=10)
    model = ViT(config, dtype="float64")
    assert model.num_params() == config.num_params() == tiny().num_params() + 24 * 10 + 10 + (10 - 24) * 7
    assert model.params["pre_logits.fc.weight"].shape == (24, 10) and model.params["head.weight"].shape == (10, 7)
    assert [n for n, _ in model.stages()][-3:] == ["pool", "pre_logits", "head"]
    with pytest.raises(ValueError, match="representation_size must be None or a positive int, got 0"):
        tiny(representation_size=0)
    with pytest.raises(ValueError, match="no representation layer"):
        convert.timm_kwargs(config)


def test_a_new_num_classes_gives_a_zero_head_and_drops_pre_logits(tmp_path):
    config = tiny(representation_size=10, gelu="tanh")
    model = perturbed(config)
    path = tmp_path / "ViT.npz"
    convert.to_google_npz(model.state_dict(), config, path)
    kept = convert.from_pretrained(path, dtype="float64", verbose=False)          # num_classes None: as it was
    assert kept.config.representation_size == 10
    x = images(config)
    np.testing.assert_array_equal(logits_of(kept, x), logits_of(model, x))
    same = convert.from_pretrained(path, num_classes=7, dtype="float64", verbose=False)   # the same K: kept too
    same_params(same, kept)
    new = convert.from_pretrained(path, num_classes=3, dtype="float64", verbose=False)
    assert new.config.num_classes == 3 and new.config.representation_size is None
    assert "pre_logits.fc.weight" not in new.params and new.params["head.weight"].shape == (24, 3)
    assert float(abs(new.params["head.weight"]).max()) == 0 == float(abs(new.params["head.bias"]).max())
    np.testing.assert_array_equal(minivit.to_numpy(new.params["blocks.1.mlp.fc1.weight"]),
                                  minivit.to_numpy(model.params["blocks.1.mlp.fc1.weight"]))
    np.testing.assert_array_equal(logits_of(new, x), 0)                         # a zero head: uniform start


def test_fine_tuning_a_few_sgd_steps_at_a_higher_resolution_lowers_the_loss(tmp_path):
    """The paper's recipe in miniature: a pre-trained checkpoint, a new zero head for 3 classes, position
    embeddings resized 16 -> 24 px, SGD with momentum 0.9, gradient clipping at norm 1."""
    from minivit.optim import SGD, clip_grad_norm
    config = tiny(gelu="tanh")
    path = tmp_path / "pretrained.npz"
    convert.to_google_npz(perturbed(config).state_dict(), config, path)
    model = convert.from_pretrained(path, num_classes=3, img_size=24, dtype="float64", verbose=False)
    assert model.config.img_size == (24, 24) and model.params["pos_embed"].shape == (1, 37, 24)
    rng = np.random.default_rng(0)
    x = minivit.asarray(rng.standard_normal((12, 24, 24, 3)))
    y = minivit.asarray(np.arange(12) % 3)
    opt = SGD(model, lr=0.05, momentum=0.9)
    losses = []
    for _ in range(10):
        loss, dlogits = minivit.cross_entropy(model.forward(x), y)
        model.zero_grad()
        model.backward(dlogits)
        clip_grad_norm(model, 1.0)
        opt.step()
        losses.append(loss)
    assert abs(losses[0] - math.log(3)) < 1e-12          # the zero head starts at chance exactly
    assert losses[-1] < 0.7 * losses[0], losses


# --------------------------------------------------------------------------------------------------
# Parity with timm (torch + timm; run with the .venv-parity interpreter)
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def timm_vit():
    pytest.importorskip("torch")
    return pytest.importorskip("timm.models.vision_transformer")


def timm_model(timm_vit, config, seed, **overrides):
    import torch
    torch.manual_seed(seed)
    kwargs = convert.timm_kwargs(config)
    kwargs.update(overrides)
    model = timm_vit.VisionTransformer(**kwargs).double().eval()
    with torch.no_grad():                           # off timm's init: biases, norms, cls token all matter
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def timm_logits(model, x):
    import torch
    with torch.no_grad():
        return model(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()).numpy()


def assert_same_timm_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert (sa[k] == sb[k]).all(), k


@pytest.mark.parity
@pytest.mark.parametrize("gelu", ["erf", "tanh"])
@pytest.mark.parametrize("pool", ["cls", "gap"])
def test_a_google_npz_written_from_timm_loads_to_timms_logits(timm_vit, tmp_path, gelu, pool):
    config = tiny(gelu=gelu, pool=pool)
    ref = timm_model(timm_vit, config, seed=0)
    path = tmp_path / "ViT.npz"
    convert.to_google_npz(convert.from_timm(ref.state_dict()), config, path)
    # the oracle that the file is in the JAX layout: timm's own loader for it gives back the same model
    oracle = timm_model(timm_vit, config, seed=1)
    timm_vit._load_weights(oracle, str(path))
    assert_same_timm_weights(oracle, ref)

    model = convert.from_pretrained(path, gelu=gelu, dtype="float64", verbose=False)
    assert model.config == config
    x = images(config)
    expected = timm_logits(ref, x)
    assert rel(logits_of(model, x), expected) < 1e-9
    if gelu == "erf":   # the JAX default (tanh) on an erf-trained model: close, but measurably not equal
        default = convert.from_pretrained(path, dtype="float64", verbose=False)
        assert default.config.gelu == "tanh" and 1e-7 < rel(logits_of(default, x), expected) < 1e-2


@pytest.mark.parity
def test_the_representation_layer_against_timms_features(timm_vit, tmp_path):
    """timm 1.x has no pre_logits layer: its features (num_classes=0, loaded from the same .npz by its own
    loader, which skips pre_logits and the head) go through tanh(y W_r + b_r) W_h + b_h in torch."""
    import torch
    config = tiny(gelu="tanh", representation_size=10)
    features = timm_model(timm_vit, tiny(gelu="tanh"), seed=0, num_classes=0)     # head = Identity
    rng = np.random.default_rng(2)
    state = convert.from_timm(features.state_dict())
    state.update({"pre_logits.fc.weight": rng.standard_normal((24, 10)), "pre_logits.fc.bias": rng.standard_normal(10),
                  "head.weight": rng.standard_normal((10, 7)), "head.bias": rng.standard_normal(7)})
    path = tmp_path / "ViT.npz"
    convert.to_google_npz(state, config, path)
    oracle = timm_model(timm_vit, tiny(gelu="tanh"), seed=1, num_classes=0)
    timm_vit._load_weights(oracle, str(path))
    assert_same_timm_weights(oracle, features)

    x = images(config)
    y = torch.from_numpy(timm_logits(oracle, x))                                   # (B, D) features
    t = {k: torch.from_numpy(v) for k, v in state.items() if k.startswith(("pre_logits", "head"))}
    expected = (torch.tanh(y @ t["pre_logits.fc.weight"] + t["pre_logits.fc.bias"]) @ t["head.weight"]
                + t["head.bias"]).numpy()
    model = convert.from_pretrained(path, dtype="float64", verbose=False)
    assert model.config.representation_size == 10
    assert rel(logits_of(model, x), expected) < 1e-9


@pytest.mark.parity
def test_timm_safetensors_pth_and_bin_load_to_timms_logits(timm_vit, tmp_path):
    import torch
    from safetensors.torch import save_file
    config = tiny()
    ref = timm_model(timm_vit, config, seed=0)
    sd = {k: v.contiguous() for k, v in ref.state_dict().items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    torch.save(sd, tmp_path / "model.pth")
    torch.save({"model": sd, "epoch": 3}, tmp_path / "pytorch_model.bin")     # a training checkpoint's nesting
    x = images(config)
    expected = timm_logits(ref, x)
    for name in ("model.safetensors", "model.pth", "pytorch_model.bin"):
        model = convert.from_pretrained(tmp_path / name, num_heads=4, dtype="float64", verbose=False)
        assert model.config == config, name
        assert rel(logits_of(model, x), expected) < 1e-9, name
    data = (tmp_path / "model.pth").read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        convert.from_pretrained(tmp_path / "cut.pth", num_heads=4)


@pytest.mark.parity
def test_resize_equals_torch_bilinear_with_aligned_corners(timm_vit):
    import torch
    from timm.layers import resample_abs_pos_embed
    pe = np.random.default_rng(4).standard_normal((1, 1 + 4 * 6, 8)).astype(np.float32)
    ours = E.resize_pos_embed(pe, (4, 6), (7, 9))
    theirs = resample_abs_pos_embed(torch.from_numpy(pe), new_size=(7, 9), old_size=(4, 6), num_prefix_tokens=1,
                                    interpolation="bilinear", antialias=False, align_corners=True).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)    # torch interpolates in float32
