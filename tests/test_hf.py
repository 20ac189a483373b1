"""Hugging Face transformers folders without transformers: minivit writes one (minivit.weights.hf.save_pretrained)
and reads it back, in both naming schemes, sharded or not; and every bad folder is refused with an error that
names the file and what was expected. The comparison with transformers itself is tests/test_hf_parity.py.
"""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import minivit
from minivit.weights import hf
from minivit.clip import CLIP, CLIPConfig


def tiny_vit(**kw):
    base = dict(img_size=(12, 16), patch_size=4, num_classes=5, embed_dim=15, depth=2, num_heads=3, mlp_ratio=2.0,
                norm_eps=1e-12)
    base.update(kw)
    model = minivit.ViT(minivit.ViTConfig(**base), seed=1, dtype="float64")
    rng = np.random.default_rng(0)
    for p in model.params.values():
        p += minivit.asarray(0.1 * rng.standard_normal(p.shape))
    return model


def tiny_clip():
    config = CLIPConfig(embed_dim=8, img_size=20, patch_size=5, vision_width=24, vision_layers=1, vision_heads=3,
                        context_length=9, vocab_size=50, text_width=16, text_layers=1, text_heads=2, gelu="quick")
    return CLIP(config, seed=2, dtype="float64")


def saved(tmp_path, model=None, **kw):
    folder = tmp_path / "vit"
    hf.save_pretrained(model or tiny_vit(), folder, dtype="float64", **kw)
    return folder


def logits(model, seed=3):
    H, W = model.config.img_size
    x = np.random.default_rng(seed).standard_normal((2, H, W, model.config.in_chans))
    return minivit.to_numpy(model.eval().forward(minivit.asarray(x, dtype=model.dtype)))


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_vit_round_trip_keeps_weights_class_names_and_normalisation(tmp_path):
    model = tiny_vit()
    folder = saved(tmp_path, model, class_names=list("abcde"))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]          # no temporaries left
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "vit" and config["image_size"] == [12, 16] and config["layer_norm_eps"] == 1e-12
    assert "vit.encoder.layer.1.attention.attention.query.weight" in load_file(folder / "model.safetensors")
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    again = minivit.from_pretrained(folder, dtype="float64", verbose=False)
    assert again.config == model.config
    assert again.checkpoint_meta == {"classes": list("abcde"), "mean": [0.5] * 3, "std": [0.5] * 3}
    np.testing.assert_array_equal(logits(again), logits(model))
    fresh = minivit.from_pretrained(folder, num_classes=2, verbose=False)           # a new zero head: no class names
    assert fresh.config.num_classes == 2 and "classes" not in fresh.checkpoint_meta


def test_vit_newer_names_and_shards(tmp_path):
    model = tiny_vit(gelu="tanh", qkv_bias=False)
    folder = saved(tmp_path, model)
    arrays = load_file(folder / "model.safetensors")
    new = {}                                      # transformers 5.x's names: vit.layers.N.attention.q_proj ...
    for name, value in arrays.items():
        for old, repl in ((".attention.attention.query.", ".attention.q_proj."),
                          (".attention.attention.key.", ".attention.k_proj."),
                          (".attention.attention.value.", ".attention.v_proj."),
                          (".attention.output.dense.", ".attention.o_proj."), (".intermediate.dense.", ".mlp.fc1."),
                          (".output.dense.", ".mlp.fc2."), ("vit.encoder.layer.", "vit.layers.")):
            name = name.replace(old, repl)
        new[name] = value
    assert "vit.layers.0.mlp.fc1.weight" in new
    os.remove(folder / "model.safetensors")
    names = sorted(new)                           # two shards and the index that maps names to them
    shards = {"model-00001-of-00002.safetensors": names[:20], "model-00002-of-00002.safetensors": names[20:]}
    for file, keys in shards.items():
        save_file({k: new[k] for k in keys}, folder / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / hf.SAFETENSORS_INDEX).write_text(json.dumps(index))
    again = minivit.from_pretrained(folder, dtype="float64", verbose=False)
    assert again.config.gelu == "tanh" and not again.config.qkv_bias
    np.testing.assert_array_equal(logits(again), logits(model))

    os.remove(folder / "model-00002-of-00002.safetensors")
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors.*not in the folder"):
        minivit.from_pretrained(folder, verbose=False)


def test_clip_round_trip_and_eot_rule(tmp_path):
    model = tiny_clip()
    hf.save_pretrained(model, tmp_path / "clip", dtype="float64")
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    assert config["text_config"]["eos_token_id"] == 2 and config["vision_config"]["hidden_act"] == "quick_gelu"
    again = CLIP.from_pretrained(tmp_path / "clip", dtype="float64")
    assert again.config == model.config
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[k], v)

    edit_config(tmp_path / "clip", text_config=dict(config["text_config"], eos_token_id=7))
    seven = CLIP.from_pretrained(tmp_path / "clip", dtype="float64")
    assert seven.config.eot_token == 7
    tokens = np.array([[1, 30, 7, 0, 0, 0, 0, 0, 0], [1, 7, 40, 7, 0, 0, 0, 0, 0]])   # read at the first 7
    moved = tokens.copy()
    moved[:, 4] = 45                               # after the first 7: the causal mask hides it from <end>
    a = minivit.to_numpy(seven.eval().encode_text(minivit.asarray(tokens)))
    b = minivit.to_numpy(seven.encode_text(minivit.asarray(moved)))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="eot_token"):
        CLIPConfig(vocab_size=50, eot_token=50)


@pytest.mark.parametrize("model_type,what", [("deit", "DeiT"), ("swin", "Swin"), ("beit", "BEiT"), ("bert", "text"),
                                             ("clip", "expected 'vit'")])
def test_another_architecture_is_refused_by_model_type(tmp_path, model_type, what):
    folder = saved(tmp_path)
    edit_config(folder, model_type=model_type)
    with pytest.raises(ValueError, match=f"config.json.*model_type='{model_type}'.*{what}"):
        minivit.from_pretrained(folder, verbose=False)


def test_a_vit_folder_is_not_a_clip(tmp_path):
    with pytest.raises(ValueError, match="model_type='vit'.*expected 'clip'"):
        CLIP.from_pretrained(saved(tmp_path))


def test_missing_or_broken_config_json(tmp_path):
    folder = saved(tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json.*not valid JSON"):
        minivit.from_pretrained(folder, verbose=False)
    os.remove(folder / "config.json")
    with pytest.raises(ValueError, match="has no config.json"):
        minivit.from_pretrained(folder, verbose=False)


@pytest.mark.parametrize("change,match", [(dict(hidden_size=18), "do not match config.json: .*mis-shaped"),
                                          (dict(num_hidden_layers=3), "do not match config.json: missing"),
                                          (dict(num_hidden_layers=1), "do not match config.json: unexpected"),
                                          (dict(hidden_act="relu"), "hidden_act='relu'"),
                                          (dict(patch_size="4"), "patch_size must be int")])
def test_config_not_matching_the_weights(tmp_path, change, match):
    folder = saved(tmp_path)
    edit_config(folder, **change)
    with pytest.raises(ValueError, match=match):
        minivit.from_pretrained(folder, verbose=False)


def test_no_weights_and_nan_weights(tmp_path):
    folder = saved(tmp_path)
    arrays = load_file(folder / "model.safetensors")
    arrays["vit.layernorm.weight"][0] = np.nan
    save_file(arrays, folder / "model.safetensors")
    with pytest.raises(ValueError, match="NaN or infinite.*norm.weight"):
        minivit.from_pretrained(folder, verbose=False)
    os.remove(folder / "model.safetensors")
    with pytest.raises(ValueError, match="no weights: expected model.safetensors"):
        minivit.from_pretrained(folder, verbose=False)


def test_pytorch_bin_without_torch_says_how_to_convert(tmp_path):
    try:
        import torch  # noqa: F401
        pytest.skip("torch is installed: the .bin is read with it")
    except ImportError:
        pass
    folder = saved(tmp_path)
    os.rename(folder / "model.safetensors", folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pytorch_model.bin.*only torch can read safely.*safe_serialization"):
        minivit.from_pretrained(folder, verbose=False)


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    folder = saved(tmp_path)
    with pytest.raises(ValueError, match="transformers folder.*num_heads"):
        minivit.from_pretrained(folder, num_heads=3, verbose=False)
    with pytest.raises(TypeError, match="ViT or CLIP, got str"):
        hf.save_pretrained("model", tmp_path / "x")
    with pytest.raises(ValueError, match="dtype must be"):
        hf.save_pretrained(tiny_vit(), tmp_path / "x", dtype="float16")
    with pytest.raises(ValueError, match="class_names has 2 names but the model has 5"):
        hf.save_pretrained(tiny_vit(), tmp_path / "x", class_names=["a", "b"])
    with pytest.raises(ValueError, match="no equivalent of num_registers=2"):
        hf.save_pretrained(tiny_vit(num_registers=2), tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="no Hugging Face model folder"):
        CLIP.from_pretrained(tmp_path / "nowhere")
    assert not (tmp_path / "x").exists()


def test_predict_prints_the_folders_class_names(tmp_path, capsys):
    from PIL import Image

    from minivit import predict
    folder = saved(tmp_path, class_names=["ant", "bee", "cat", "dog", "eel"])
    Image.fromarray(np.zeros((12, 16, 3), np.uint8)).save(tmp_path / "photo.png")
    assert predict.main([str(tmp_path / "photo.png"), "--checkpoint", str(folder), "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("ant", "bee", "cat", "dog", "eel"))


@pytest.mark.parametrize("change,match", [(dict(projection_dim=9), "do not match config.json: mis-shaped"),
                                          (dict(vision_config={"hidden_act": "gelu"}), "one GELU"),
                                          (dict(text_config={"layer_norm_eps": 1e-6}), "layer_norm_eps=1e-06"),
                                          (dict(text_config={"intermediate_size": 48}), "one mlp_ratio"),
                                          (dict(model_type="siglip"), "model_type='siglip', SigLIP")])
def test_clip_config_not_matching_is_refused(tmp_path, change, match):
    hf.save_pretrained(tiny_clip(), tmp_path / "clip")
    config = json.loads((tmp_path / "clip" / "config.json").read_text())
    for key, value in change.items():
        config[key] = dict(config[key], **value) if isinstance(value, dict) else value
    (tmp_path / "clip" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        CLIP.from_pretrained(tmp_path / "clip")


def test_bfloat16_weights_are_read_by_hand(tmp_path):
    """NumPy has no bfloat16: such a file is parsed by hand (JSON header + raw bytes) and widened exactly."""
    folder = tmp_path / "vit"
    hf.save_pretrained(tiny_vit(), folder, dtype="float32")
    arrays = load_file(folder / "model.safetensors")
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in arrays.items():                       # float32 -> bfloat16: the top 16 bits
        raw = (value.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    model = minivit.from_pretrained(folder, verbose=False)
    got = hf.to_hf_vit(model.state_dict(), model.config)
    for name, value in arrays.items():
        want = (value.astype("<f4").view("<u4") & 0xFFFF0000).view("<f4")
        np.testing.assert_array_equal(got[name], want, err_msg=name)


def test_bpe_tokenizer_and_zero_shot_on_a_transformers_clip_folder(tmp_path):
    """Lesson 13's zero-shot code on a CLIP folder, with the folder's own BPE vocabulary (the ids against
    transformers' CLIPTokenizer: tests/test_hf_parity.py)."""
    from minivit import clip as C
    from minivit.captions import BPETokenizer, _bytes_to_unicode
    chars = list(_bytes_to_unicode().values())
    merges = [("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>")]
    vocab = chars + [c + "</w>" for c in chars] + ["ca", "cat</w>", "do", "dog</w>", "<|startoftext|>", "<|endoftext|>"]
    config = CLIPConfig(embed_dim=8, img_size=20, patch_size=5, vision_width=24, vision_layers=1, vision_heads=3,
                        context_length=9, vocab_size=len(vocab), text_width=16, text_layers=1, text_heads=2,
                        gelu="quick", eot_token=len(vocab) - 1)
    folder = tmp_path / "clip"
    hf.save_pretrained(CLIP(config, seed=0), folder)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))

    model = CLIP.from_pretrained(folder)
    tok = BPETokenizer.from_pretrained(folder, context_length=model.config.context_length)
    ids = {t: i for i, t in enumerate(vocab)}
    assert tok("A  cat, dogs")[0].tolist() == [ids["<|startoftext|>"], ids["a</w>"], ids["cat</w>"], ids[",</w>"],
                                               ids["do"], ids["g"], ids["s</w>"], ids["<|endoftext|>"], 0]
    assert tok("a a a a a a a a a a")[0, -1] == ids["<|endoftext|>"]          # cut to fit, <end> kept last
    classifier = C.zero_shot_classifier(model, tok, ["cat", "dog"], ["a {}", "the {}"])
    images = np.random.default_rng(0).standard_normal((3, 20, 20, 3)).astype("float32")
    assert set(minivit.to_numpy(C.zero_shot_predict(model, classifier, minivit.asarray(images))).tolist()) <= {0, 1}
    with pytest.raises(ValueError, match="has no vocab.json, merges.txt"):
        BPETokenizer.from_pretrained(tmp_path)
