"""The assembled ViT: config checks, parameter names and counts, FLOPs, the shape trace, saving/loading, bad input."""

import dataclasses
import itertools

import numpy as np
import pytest

import minivit
from minivit import ViT, ViTConfig


def tiny(**kw):
    base = dict(img_size=16, patch_size=4, num_classes=4, embed_dim=16, depth=2, num_heads=2)
    base.update(kw)
    return ViTConfig(**base)


TIMM_COUNTS = {"vit_tiny_patch16_224": 5_717_416, "vit_small_patch16_224": 22_050_664,
               "vit_base_patch16_224": 86_567_656, "vit_large_patch16_224": 304_326_632,
               "vit_huge_patch14_224": 632_045_800, "vit_base_patch32_224": 88_224_232}


@pytest.mark.parametrize("name", sorted(TIMM_COUNTS))
def test_presets_have_timms_parameter_counts(name):
    assert minivit.presets[name].num_params() == TIMM_COUNTS[name]


def built_shapes(config):
    """name -> shape of the parameters a ViT(config) really allocates, in its order."""
    return [(name, tuple(p.shape)) for name, p in ViT(config).params.items()]


# the ImageNet presets with one block (the blocks repeat; the full depth's count is checked against timm above)
PRESETS = [c if c.img_size == (32, 32) else dataclasses.replace(c, depth=1) for _, c in sorted(minivit.presets.items())]
OPTIONS = [dict(pos_embed=pos, stem=stem, pool=pool, representation_size=R, qkv_bias=bias)
           for pos, stem, pool, R, bias in itertools.product(("learned", "learned2d", "sincos2d", "none"),
                                                             ("patch", "conv"), ("cls", "gap"), (None, 6),
                                                             (True, False))]


@pytest.mark.parametrize("config", PRESETS, ids=sorted(minivit.presets))
def test_param_shapes_are_the_presets_models(config):
    assert list(minivit.param_shapes(config).items()) == built_shapes(config)
    assert config.num_params() == ViT(config).num_params()


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_param_shapes_are_the_built_model_for_every_option(options):
    config = ViTConfig(img_size=(16, 8), patch_size=4, in_chans=2, num_classes=5, embed_dim=12, depth=2,
                       num_heads=3, stem_width=4, **options)
    assert list(minivit.param_shapes(config).items()) == built_shapes(config)   # names, shapes and order
    assert config.num_params() == ViT(config).num_params()


REGISTER_OPTIONS = [dict(pos_embed=pos, stem=stem, pool=pool)
                    for pos, stem, pool in itertools.product(("learned", "learned2d", "sincos2d", "none"),
                                                             ("patch", "conv"), ("cls", "gap"))]


@pytest.mark.parametrize("options", REGISTER_OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_param_shapes_are_the_built_model_with_registers(options):
    config = ViTConfig(img_size=(16, 8), patch_size=4, in_chans=2, num_classes=5, embed_dim=12, depth=1,
                       num_heads=3, stem_width=4, num_registers=3, **options)
    shapes = minivit.param_shapes(config)
    assert list(shapes.items()) == built_shapes(config)                        # names, shapes and order
    assert config.num_params() == ViT(config).num_params()
    assert shapes["reg_token"] == (1, 3, 12)
    assert config.num_prefix_tokens == (1 if options["pool"] == "cls" else 0) + 3
    assert config.seq_len == config.num_prefix_tokens + 8
    if options["pos_embed"] == "learned":                                      # timm's no_embed_class=False
        assert shapes["pos_embed"] == (1, config.seq_len, 12)
    without = dataclasses.replace(config, num_registers=0)
    assert config.num_params() - without.num_params() == 3 * 12 * (2 if options["pos_embed"] == "learned" else 1)


def test_registers_timms_names_order_and_init():
    model = ViT(tiny(num_registers=4))
    names = list(model.params)
    assert names[names.index("cls_token"):names.index("cls_token") + 3] == ["cls_token", "reg_token", "pos_embed"]
    reg = minivit.to_numpy(model.params["reg_token"])
    assert reg.shape == (1, 4, 16) and 0 < np.abs(reg).max() < 1e-5                # N(0, 1e-6^2), as timm
    # no registers, no change: the default model draws exactly what it drew before the option existed
    for k, p in ViT(tiny(num_registers=0), seed=2).params.items():
        np.testing.assert_array_equal(minivit.to_numpy(p), minivit.to_numpy(ViT(tiny(), seed=2).params[k]))


def test_registers_flow_through_the_model_and_only_the_patches_reach_gap(rng):
    model = ViT(tiny(num_registers=2, pool="gap"), dtype="float64")
    x = minivit.asarray(rng.standard_normal((3, 16, 16, 3)))
    model.zero_grad()
    logits = model.forward(x)
    assert logits.shape == (3, 4)
    model.backward(minivit.asarray(np.ones((3, 4))))
    assert np.abs(minivit.to_numpy(model.grads["reg_token"])).sum() > 0            # trained through attention
    trace = minivit.trace(model, x, verbose=False)
    assert dict((name, shape) for name, shape, _ in trace)["pos_embed"] == (2 + 16, 16)
    assert "registers" in dict((name, note) for name, _, note in trace)["pool"]


def test_flops_count_the_registers():
    c = tiny()
    # 4 more tokens, no more patches
    assert minivit.flops(dataclasses.replace(c, num_registers=4)) == minivit.flops(
        dataclasses.replace(c, img_size=(16, 20))) - 2 * 4 * c.patch_size ** 2 * 3 * 16


def test_resize_keeps_the_class_token_and_registers_rows(rng):
    model = ViT(tiny(num_registers=2), dtype="float64")
    model.params["reg_token"][...] = minivit.asarray(rng.standard_normal((1, 2, 16)))
    bigger = model.resize_pos_embed(24)
    assert bigger.params["pos_embed"].shape == (1, 3 + 36, 16)
    np.testing.assert_array_equal(minivit.to_numpy(bigger.params["pos_embed"])[:, :3],
                                  minivit.to_numpy(model.params["pos_embed"])[:, :3])
    np.testing.assert_array_equal(minivit.to_numpy(bigger.params["reg_token"]),
                                  minivit.to_numpy(model.params["reg_token"]))
    assert bigger.forward(minivit.asarray(rng.standard_normal((1, 24, 24, 3)))).shape == (1, 4)


def test_flops_of_a_small_config_by_hand():
    # 8x8x1 images, P = 4: N = 4 patches, T = 5 tokens; D = 8, M = 16, K = 3, one block
    c = ViTConfig(img_size=8, patch_size=4, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2,
                  mlp_ratio=2.0)
    patch = 2 * 4 * 16 * 8                              # x_p E: 4 patches of 16 values -> 8     = 1024
    linears = 2 * 5 * (3 * 64 + 64 + 2 * 8 * 16)        # qkv, proj, fc1, fc2 on 5 tokens        = 5120
    attention = 2 * 2 * 5 * 5 * 8                       # q k^T and a v                          = 800
    head = 2 * 8 * 3                                    #                                        = 48
    assert minivit.flops(c) == patch + linears + attention + head == 6992
    # GAP: 4 tokens through the block
    assert minivit.flops(dataclasses.replace(c, pool="gap")) == 1024 + 2 * 4 * 512 + 4 * 16 * 8 + 48 == 5680
    # a representation layer D -> R = 5 before the head: 2 D R + 2 R K in place of 2 D K
    assert minivit.flops(dataclasses.replace(c, representation_size=5)) == 6992 - 48 + 2 * 8 * 5 + 2 * 5 * 3
    # the conv stem, stem_width 2: 3x3 convs 1 -> 2 at 8x8 (stride 1), 2 -> 4 at 4x4, 4 -> 8 at 2x2, then 8 -> D
    stem = 2 * 64 * 9 * 1 * 2 + 2 * 16 * 9 * 2 * 4 + 2 * 4 * 9 * 4 * 8 + 2 * 4 * 8 * 8   # = 7424
    assert minivit.flops(dataclasses.replace(c, stem="conv", stem_width=2)) == stem + 5120 + 800 + 48 == 13392
    with pytest.raises(TypeError, match="ResNetConfig"):
        minivit.flops(minivit.resnet.ResNetConfig())


def test_named_sublayers_name_each_layer_by_its_parameters_prefix():
    model = ViT(tiny(depth=1))
    pairs = list(model.named_sublayers())
    assert pairs[0] == ("", model) and ("", model.pos_embed) in pairs     # timm's top-level cls_token, pos_embed
    names = dict(pairs[1:])
    assert names["blocks.0.attn.qkv"] is model.blocks[0].attn.qkv and names["head"] is model.head
    for name, layer in pairs:                           # each leaf's parameters sit under its name
        if not layer.children:
            prefix = f"{name}." if name else ""
            assert {prefix + k for k in layer.params} <= set(model.params), name
    assert list(model.sublayers()) == [layer for _, layer in pairs]


def test_config_properties():
    c = minivit.presets["vit_base_patch16_224"]
    assert (c.img_size, c.grid_size, c.num_patches, c.seq_len) == ((224, 224), (14, 14), 196, 197)
    assert tiny(pool="gap").seq_len == 16
    assert (tiny(num_registers=4).seq_len, tiny(pool="gap", num_registers=4).seq_len) == (21, 20)
    assert ViTConfig.from_dict(c.to_dict()) == c
    assert ViTConfig.from_dict(tiny(num_registers=4).to_dict()).num_registers == 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(img_size=30, patch_size=4), r"img_size \(30, 30\) must be divisible by patch_size 4"),
    (dict(embed_dim=10, num_heads=3), "embed_dim 10 must be divisible by num_heads 3"),
    (dict(pool="max"), "pool must be 'cls' or 'gap', got 'max'"),
    (dict(gelu="relu"), "gelu must be one of"),
    (dict(depth=0), "depth must be a positive int, got 0"),
    (dict(img_size="224"), "img_size must be an int or a pair"),
    (dict(drop_rate=1.0), "drop_rate must be in"),
    (dict(num_registers=-1), r"num_registers must be an int >= 0 .*got -1"),
    (dict(num_registers=2.0), r"num_registers must be an int >= 0 .*got 2.0"),
    (dict(num_registers=True), r"num_registers must be an int >= 0 .*got True"),
])
def test_config_errors_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kwargs)


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="'float16'"):
        ViT(tiny(), dtype="float16")


def test_forward_shape_and_dtype(rng):
    model = ViT(tiny())
    logits = model.forward(minivit.asarray(rng.standard_normal((3, 16, 16, 3)), dtype="float32"))
    assert logits.shape == (3, 4) and logits.dtype == np.float32


def test_same_seed_same_model_other_seed_other_model():
    a, b, c = ViT(tiny(), seed=3), ViT(tiny(), seed=3), ViT(tiny(), seed=4)
    for k in a.params:
        np.testing.assert_array_equal(minivit.to_numpy(a.params[k]), minivit.to_numpy(b.params[k]))
    assert not np.array_equal(minivit.to_numpy(a.params["head.weight"]), minivit.to_numpy(c.params["head.weight"]))


def test_parameter_names_are_timms():
    names = set(ViT(tiny(depth=1)).params)
    assert names == {"patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed",
                     "blocks.0.norm1.weight", "blocks.0.norm1.bias", "blocks.0.attn.qkv.weight",
                     "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
                     "blocks.0.norm2.weight", "blocks.0.norm2.bias", "blocks.0.mlp.fc1.weight",
                     "blocks.0.mlp.fc1.bias", "blocks.0.mlp.fc2.weight", "blocks.0.mlp.fc2.bias",
                     "norm.weight", "norm.bias", "head.weight", "head.bias"}


def test_trace_of_vit_b16_is_the_papers():
    model = ViT(minivit.presets["vit_base_patch16_224"])
    rows = minivit.trace(model, minivit.asarray(np.zeros((224, 224, 3)), dtype="float32"), verbose=False)
    shapes = dict((name, shape) for name, shape, _ in rows)
    assert shapes["input"] == (224, 224, 3)
    assert shapes["patches"] == (196, 768)
    assert shapes["patch_embed"] == (196, 768)
    assert shapes["pos_embed"] == (197, 768)
    assert shapes["blocks.11"] == (197, 768)
    assert shapes["pool"] == (768,) and shapes["head"] == (1000,)
    assert [r[0] for r in rows][-3:] == ["norm", "pool", "head"]
    assert "(197, 768)" in str(rows)
    # the trace ran in eval mode and kept nothing for backward
    assert all(layer.cache is None for _, layer in model.stages())


def test_eval_mode_keeps_no_caches(rng):
    model = ViT(tiny()).eval()
    model.forward(minivit.asarray(rng.standard_normal((2, 16, 16, 3)), dtype="float32"))

    def caches(layer):
        return [sub.cache for sub in layer.sublayers() if sub.cache is not None]

    assert caches(model) == []
    with pytest.raises(RuntimeError, match="training mode"):
        model.backward(minivit.asarray(np.zeros((2, 4)), dtype="float32"))
    model.train()
    model.forward(minivit.asarray(rng.standard_normal((2, 16, 16, 3)), dtype="float32"))
    assert len(caches(model)) > 10


def test_backward_accumulates_until_zero_grad(rng):
    model = ViT(tiny(), dtype="float64")
    x = minivit.asarray(rng.standard_normal((2, 16, 16, 3)))
    d = minivit.asarray(rng.standard_normal((2, 4)))
    model.zero_grad()
    model.forward(x)
    model.backward(d)
    once = minivit.to_numpy(model.grads["blocks.0.attn.qkv.weight"]).copy()
    model.forward(x)
    model.backward(d)
    np.testing.assert_allclose(minivit.to_numpy(model.grads["blocks.0.attn.qkv.weight"]), 2 * once)
    model.zero_grad()
    assert all(float(abs(g).max()) == 0 for g in model.grads.values())


def test_state_dict_round_trip():
    a, b = ViT(tiny(), seed=1), ViT(tiny(), seed=2)
    b.load_state_dict(a.state_dict())
    for k in a.params:
        np.testing.assert_array_equal(minivit.to_numpy(a.params[k]), minivit.to_numpy(b.params[k]))
    sd = a.state_dict()
    sd["head.bias"][...] = 5.0                    # a copy: changing it leaves the model alone
    assert float(a.params["head.bias"][0]) == 0.0


def test_refused_load_names_the_keys_and_changes_nothing():
    model = ViT(tiny(), seed=1)
    before = model.state_dict()
    bad = ViT(tiny(), seed=2).state_dict()
    del bad["norm.bias"]
    bad["extra.weight"] = np.zeros(3)
    bad["head.weight"] = np.zeros((16, 7))
    with pytest.raises(ValueError) as err:
        model.load_state_dict(bad)
    msg = str(err.value)
    assert "norm.bias" in msg and "extra.weight" in msg and "head.weight: expected (16, 4), got (16, 7)" in msg
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


@pytest.mark.parametrize("make, error, match", [
    (lambda: np.zeros((16, 16, 3), "float32"), ValueError, r"one image .*x\[None\]"),
    (lambda: np.zeros((2, 3, 16, 16), "float32"), ValueError, "channels-first"),
    (lambda: np.zeros((2, 16, 16, 1), "float32"), ValueError, r"expected 3 channels \(B, 16, 16, 3\)"),
    (lambda: np.zeros((2, 32, 32, 3), "float32"), ValueError, "expected images of 16x16"),
    (lambda: np.zeros((2, 16, 16), "float32"), ValueError, "4-D image batch"),
    (lambda: np.zeros((2, 16, 16, 3), "uint8"), TypeError, "floating-point.*astype"),
    (lambda: np.zeros((2, 16, 16, 3), "float64"), TypeError, "float64 but the model is float32"),
    (lambda: [[0.0]], TypeError, "got list"),
])
def test_bad_input_is_refused_clearly(make, error, match):
    model = ViT(tiny())
    x = make()
    if isinstance(x, np.ndarray):
        x = minivit.asarray(x)
    with pytest.raises(error, match=match):
        model.forward(x)


def test_overfits_a_tiny_batch_with_plain_sgd(rng):
    model = ViT(tiny(num_classes=4), seed=0, dtype="float64")
    x = minivit.asarray(rng.standard_normal((8, 16, 16, 3)))
    y = minivit.asarray(np.arange(8) % 4)
    losses = []
    for _ in range(100):
        loss, dlogits = minivit.cross_entropy(model.forward(x), y)
        model.zero_grad()
        model.backward(dlogits)
        for name, p in model.params.items():
            p -= 0.3 * model.grads[name]
        losses.append(loss)
    assert losses[0] > 1.0 and losses[-1] < 0.05, losses[::10]


def test_dropout_changes_training_but_not_eval(rng):
    model = ViT(tiny(drop_rate=0.3, drop_path_rate=0.2))
    x = minivit.asarray(rng.standard_normal((4, 16, 16, 3)), dtype="float32")
    a, b = minivit.to_numpy(model.forward(x)), minivit.to_numpy(model.forward(x))
    assert not np.allclose(a, b)                 # new masks each forward in training
    model.eval()
    c, d = minivit.to_numpy(model.forward(x)), minivit.to_numpy(model.forward(x))
    np.testing.assert_array_equal(c, d)


def test_model_moves_between_backends_by_name():
    model = ViT(tiny()).to("numpy")
    assert model.backend == "numpy"
    with pytest.raises(ValueError, match="'gpu'"):
        model.to("gpu")
