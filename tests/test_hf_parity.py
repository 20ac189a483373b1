"""Parity with Hugging Face transformers (a third oracle, beside timm and open_clip), in float64.

Small random transformers models are built offline (no download), saved with save_pretrained into a
temporary folder, and read by minivit.from_pretrained / CLIP.from_pretrained: logits, the input gradient
and every parameter gradient of the ViT, and CLIP's image and text features, must agree to 1e-9 relative.
The other direction too: a minivit model written by minivit.weights.hf.save_pretrained, read by transformers'
from_pretrained, gives the same outputs. Skipped without torch or transformers (`make test-parity`).
"""

import numpy as np
import pytest

import minivit
from minivit.weights import hf
from minivit.clip import CLIP, CLIPConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.parity

VIT_CONFIGS = {   # transformers ViTConfig arguments: odd widths, 3 heads, non-224 and non-square sizes
    "d24_h3_img20_p5": dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=40,
                            image_size=20, patch_size=5, num_labels=4),
    "d15_h3_nonsquare_tanh_no_qkv_bias": dict(hidden_size=15, num_hidden_layers=3, num_attention_heads=3,
                                              intermediate_size=33, image_size=[8, 16], patch_size=4, num_labels=3,
                                              hidden_act="gelu_pytorch_tanh", qkv_bias=False),
    "d33_h3_grey_eps1e-6": dict(hidden_size=33, num_hidden_layers=1, num_attention_heads=3, intermediate_size=66,
                                image_size=12, patch_size=3, num_channels=1, num_labels=5, layer_norm_eps=1e-6),
}


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def perturbed(model, seed=0):
    """Norms and biases off their 1 / 0 start, the class token off zero: every term counts."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("bias", "cls_token", "class_embedding")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def reference_vit(name, tmp_path, seed=0):
    config = transformers.ViTConfig(**VIT_CONFIGS[name])
    torch.manual_seed(seed)
    ref = perturbed(transformers.ViTForImageClassification(config).double(), seed)
    ref.save_pretrained(tmp_path / name)          # float64 on disk: the comparison is of the math, not the rounding
    return ref.eval(), tmp_path / name


@pytest.mark.parametrize("name", sorted(VIT_CONFIGS))
def test_vit_folder_logits_and_every_gradient_match_transformers(name, tmp_path):
    ref, folder = reference_vit(name, tmp_path)
    model = minivit.from_pretrained(folder, dtype="float64", verbose=False)
    c = model.config
    assert model.checkpoint_meta["classes"] == [f"LABEL_{k}" for k in range(c.num_classes)]
    H, W = c.img_size
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, H, W, c.in_chans))
    dout = rng.standard_normal((3, c.num_classes))   # an arbitrary upstream gradient: loss = (logits * dout).sum()

    logits = minivit.to_numpy(model.forward(minivit.asarray(x)))
    model.zero_grad()
    dx = minivit.to_numpy(model.backward(minivit.asarray(dout)))
    grads = hf.to_hf_vit({k: minivit.to_numpy(g) for k, g in model.grads.items()}, c)

    tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().requires_grad_(True)   # NCHW
    tlogits = ref(pixel_values=tx).logits
    (tlogits * torch.from_numpy(dout)).sum().backward()
    tgrads = {k: p.grad.numpy() for k, p in hf._published_names(dict(ref.named_parameters())).items()}
    assert set(tgrads) == set(grads)
    errors = {"logits": rel(logits, tlogits.detach().numpy()), "dx": rel(dx, tx.grad.permute(0, 2, 3, 1).numpy())}
    # the key bias has no gradient (softmax forgets a shift shared by a row): both are ~1e-17, compared absolutely
    worst = max((rel(grads[k], tgrads[k]) if np.linalg.norm(tgrads[k]) > 1e-12 else np.abs(grads[k]).max(), k)
                for k in tgrads)
    print(f"\n{name}: logits {errors['logits']:.1e}, dx {errors['dx']:.1e}, worst parameter gradient "
          f"{worst[0]:.1e} ({worst[1]})")
    for what, err in errors.items():
        assert err < 1e-9, (what, err)
    assert worst[0] < 1e-9, worst


def test_vit_sharded_folder_and_vitmodel_without_classifier(tmp_path):
    ref, _ = reference_vit("d24_h3_img20_p5", tmp_path)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / hf.SAFETENSORS_INDEX).exists()
    model = minivit.from_pretrained(tmp_path / "sharded", dtype="float64", verbose=False)
    x = np.random.default_rng(2).standard_normal((2, 20, 20, 3))
    want = ref(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2)).logits.detach().numpy()
    assert rel(minivit.to_numpy(model.forward(minivit.asarray(x))), want) < 1e-12

    ref.vit.save_pretrained(tmp_path / "bare")                      # a ViTModel: no classifier, a pooler
    with pytest.raises(ValueError, match="no head"):
        minivit.from_pretrained(tmp_path / "bare", verbose=False)
    model = minivit.from_pretrained(tmp_path / "bare", num_classes=24, dtype="float64", verbose=False)
    assert model.config.num_classes == 24 and not model.params["head.weight"].any()
    model.params["head.weight"][...] = minivit.asarray(np.eye(24))    # the head as the identity: the features
    feats = ref.vit(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2)).last_hidden_state[:, 0].detach().numpy()
    assert rel(minivit.to_numpy(model.forward(minivit.asarray(x))), feats) < 1e-12


@pytest.mark.parametrize("name", ["d24_h3_img20_p5", "d15_h3_nonsquare_tanh_no_qkv_bias"])
def test_minivit_vit_saved_loads_in_transformers_with_the_same_logits(name, tmp_path):
    kw = VIT_CONFIGS[name]
    config = minivit.ViTConfig(img_size=tuple(kw["image_size"]) if isinstance(kw["image_size"], list) else
                               kw["image_size"], patch_size=kw["patch_size"], num_classes=kw["num_labels"],
                               embed_dim=kw["hidden_size"], depth=kw["num_hidden_layers"],
                               num_heads=kw["num_attention_heads"],
                               mlp_ratio=kw["intermediate_size"] / kw["hidden_size"],
                               qkv_bias=kw.get("qkv_bias", True), gelu=hf.GELU_BY_ACT[kw.get("hidden_act", "gelu")])
    model = minivit.ViT(config, seed=3, dtype="float64")
    for p in model.params.values():
        p += minivit.asarray(0.1 * np.random.default_rng(4).standard_normal(p.shape))
    names = [f"class {k}" for k in range(config.num_classes)]
    hf.save_pretrained(model, tmp_path / "mine", class_names=names, dtype="float64")
    ref = transformers.ViTForImageClassification.from_pretrained(tmp_path / "mine", dtype=torch.float64).eval()
    assert ref.config.id2label[1] == "class 1"
    H, W = config.img_size
    x = np.random.default_rng(5).standard_normal((2, H, W, 3))
    want = ref(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2)).logits.detach().numpy()
    err = rel(minivit.to_numpy(model.forward(minivit.asarray(x))), want)
    print(f"\n{name}: minivit -> save_pretrained -> transformers: logits {err:.1e}")
    assert err < 1e-12
    again = minivit.from_pretrained(tmp_path / "mine", dtype="float64", verbose=False)   # and back
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(again.state_dict()[k], v)


# --------------------------------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------------------------------

def reference_clip(eos_token_id, hidden_act="quick_gelu", seed=0):
    text = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=9, hidden_act=hidden_act, eos_token_id=eos_token_id, bos_token_id=1,
                pad_token_id=0)
    vision = dict(hidden_size=24, num_hidden_layers=2, num_attention_heads=3, intermediate_size=48, image_size=20,
                  patch_size=5, hidden_act=hidden_act)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    torch.manual_seed(seed)
    ref = perturbed(transformers.CLIPModel(config).double(), seed)
    with torch.no_grad():
        ref.logit_scale.fill_(2.3)
    return ref.eval()


def clip_batch(eos, B=4, seed=1):
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((B, 20, 20, 3))
    tokens = np.zeros((B, 9), dtype=np.int64)
    for b in range(B):                 # <start>=1, words, <end>; with eos 7 the words include ids above it
        n = int(rng.integers(1, 6))
        tokens[b, :n + 2] = [1] + list(rng.integers(2, 40, size=n)) + [eos]
    return images, tokens


@pytest.mark.parametrize("eos,act", [(2, "quick_gelu"), (7, "quick_gelu"), (7, "gelu")])
def test_clip_folder_features_match_transformers(eos, act, tmp_path):
    ref = reference_clip(eos, act)
    ref.save_pretrained(tmp_path / "clip")
    model = CLIP.from_pretrained(tmp_path / "clip", dtype="float64")
    assert model.config.eot_token == (None if eos == 2 else eos)
    images, tokens = clip_batch(49 if eos == 2 else eos)   # eos == 2: <end> is read at the highest id (49)
    img = minivit.to_numpy(model.eval().encode_image(minivit.asarray(images)))
    txt = minivit.to_numpy(model.encode_text(minivit.asarray(tokens)))
    with torch.no_grad():
        timg = ref.get_image_features(pixel_values=torch.from_numpy(images).permute(0, 3, 1, 2))
        ttxt = ref.get_text_features(input_ids=torch.from_numpy(tokens))
    timg = getattr(timg, "pooler_output", timg).numpy()
    ttxt = getattr(ttxt, "pooler_output", ttxt).numpy()
    errors = {"image": rel(img, timg), "text": rel(txt, ttxt)}
    print(f"\nCLIP eos={eos} {act}: image features {errors['image']:.1e}, text features {errors['text']:.1e}")
    for what, err in errors.items():
        assert err < 1e-9, (what, err)


def test_minivit_clip_saved_loads_in_transformers_with_the_same_features(tmp_path):
    config = CLIPConfig(embed_dim=8, img_size=20, patch_size=5, vision_width=24, vision_layers=2, vision_heads=3,
                        context_length=9, vocab_size=50, text_width=16, text_layers=1, text_heads=2, gelu="quick")
    model = CLIP(config, seed=2, dtype="float64")
    for p in model.params.values():
        p += minivit.asarray(0.1 * np.random.default_rng(4).standard_normal(p.shape))
    hf.save_pretrained(model, tmp_path / "mine", dtype="float64")
    ref = transformers.CLIPModel.from_pretrained(tmp_path / "mine", dtype=torch.float64).eval()
    images, tokens = clip_batch(49)
    with torch.no_grad():
        out = ref(pixel_values=torch.from_numpy(images).permute(0, 3, 1, 2), input_ids=torch.from_numpy(tokens))
    logits = minivit.to_numpy(model.eval().forward(minivit.asarray(images), minivit.asarray(tokens)))
    err = rel(logits, out.logits_per_image.numpy())
    print(f"\nminivit CLIP -> save_pretrained -> transformers: logits {err:.1e}")
    assert err < 1e-12


def test_in_memory_names_and_pytorch_bin(tmp_path):
    """transformers 5.x's own parameter names (vit.layers.N.attention.q_proj ...) written as they are, and a
    pytorch_model.bin (read with torch, which this venv has): the same logits."""
    ref, folder = reference_vit("d24_h3_img20_p5", tmp_path)
    from safetensors.torch import save_file
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert any(".q_proj." in k for k in state)
    x = np.random.default_rng(2).standard_normal((2, 20, 20, 3))
    want = ref(pixel_values=torch.from_numpy(x).permute(0, 3, 1, 2)).logits.detach().numpy()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    model = minivit.from_pretrained(folder, dtype="float64", verbose=False)
    assert rel(minivit.to_numpy(model.forward(minivit.asarray(x))), want) < 1e-12
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    model = minivit.from_pretrained(folder, dtype="float64", verbose=False)
    assert rel(minivit.to_numpy(model.forward(minivit.asarray(x))), want) < 1e-12


def test_bfloat16_folder_reads_exactly_as_float32(tmp_path):
    ref, folder = reference_vit("d24_h3_img20_p5", tmp_path)
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = minivit.from_pretrained(tmp_path / "bf16", verbose=False)
    want = {k: v.detach().float().numpy() for k, v in hf._published_names(dict(ref.named_parameters())).items()}
    got = hf.to_hf_vit(model.state_dict(), model.config)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def write_bpe_vocab(folder):
    """A small vocabulary laid out as OpenAI's: the 256 byte characters, the same with </w>, the merged
    pieces in merge order, then <|startoftext|> and <|endoftext|>."""
    import json

    from minivit.captions import _bytes_to_unicode
    chars = list(_bytes_to_unicode().values())
    merges = [("t", "h"), ("th", "e</w>"), ("c", "a"), ("ca", "t</w>"), ("o", "f</w>"), ("p", "h"), ("ph", "o"),
              ("t", "o</w>"), ("pho", "to</w>"), ("d", "o"), ("do", "g</w>"), ("a", "n"), ("an", "d</w>")]
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    folder.mkdir(exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return len(vocab)


def test_bpe_tokenizer_matches_transformers(tmp_path):
    from minivit.captions import BPETokenizer
    write_bpe_vocab(tmp_path)
    ref = transformers.CLIPTokenizer(vocab=str(tmp_path / "vocab.json"), merges=str(tmp_path / "merges.txt"))
    tok = BPETokenizer.from_pretrained(tmp_path, context_length=40)
    texts = ["a photo of the cat", "A PHOTO of a dog and a cat.", "the catalogue: 3 dogs, 12 cats!", "don't  stop",
             "photophobia x_y (the) #7"]
    for text in texts:
        want = ref(text)["input_ids"]
        got = tok([text])[0]
        assert list(got[:len(want)]) == want and not got[len(want):].any(), (text, want, got)
