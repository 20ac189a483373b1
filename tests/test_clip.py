"""CLIP (minivit/clip/, minivit/clip/captions.py): every new pair gradient-checked in float64, the text
tower's causal mask, the loss and its temperature, the tokenizer, the captioned data, the open_clip layout
round trip, zero-shot and retrieval, and a tiny CLIP that learns to match its pairs."""

import math
import warnings

import numpy as np
import pytest

import minivit
from minivit import captions as C
from minivit import clip
from minivit import functional as F
from minivit import kernels, ops
from minivit import layers as L
from minivit.gradcheck import PairLayer

TOL = 1e-7


Pair = PairLayer   # a pure pair (forward(x) -> out, cache; backward(dout, cache) -> dx) as a layer


class WithTokens:
    """A model fed fixed tokens, so that gradcheck can perturb its parameters (and the images)."""

    def __init__(self, model, tokens):
        self.model, self.tokens = model, tokens
        self.params, self.grads = model.params, model.grads

    def train(self):
        self.model.train()

    def zero_grad(self):
        self.model.zero_grad()

    def forward(self, x):
        if isinstance(self.model, clip.TextTransformer):
            return self.model.forward(self.tokens)        # x unused: only the parameters are checked
        return self.model.forward(x, self.tokens)

    def backward(self, dout):
        return self.model.backward(dout)


def check(layer, x, **kw):
    report = minivit.gradcheck(layer, x, tol=TOL, **kw)
    report.assert_ok()
    return report


TINY = clip.CLIPConfig(embed_dim=8, img_size=8, patch_size=4, vision_width=12, vision_layers=2, vision_heads=3,
                       context_length=6, vocab_size=11, text_width=8, text_layers=2, text_heads=2, mlp_ratio=2.0)


def tokens_of(rng, B, L=6, V=11):
    """B random captions: <start>=2, words from 3..V-2, <end>=V-1 (the highest id), then <pad>=0."""
    t = np.zeros((B, L), dtype=np.int64)
    for b in range(B):
        n = int(rng.integers(1, L - 1))
        t[b, :n + 2] = [2] + list(rng.integers(3, V - 1, size=n)) + [V - 1]
    return minivit.asarray(t)


def perturb(model, rng):
    """Move norms and biases off their 1 / 0 start, so that every gradient term is exercised."""
    for k, p in model.params.items():
        if k.endswith(".bias") or "norm" in k:
            p += minivit.asarray(0.1 * rng.standard_normal(p.shape))


# ---- the new pairs ---------------------------------------------------------------------------------


def test_masked_attention_pair(arr):
    mask = F.causal_mask(arr(2, 5, 8))                         # (5, 5)
    check(Pair(lambda qkv: F.attention_forward(qkv, 2, mask), F.attention_backward), arr(2, 5, 3 * 8))


def test_causal_mask_is_zero_on_and_below_the_diagonal(arr):
    m = minivit.to_numpy(F.causal_mask(arr(1, 4, 2)))
    assert m.shape == (4, 4) and (m[np.tril_indices(4)] == 0).all() and np.isneginf(m[np.triu_indices(4, 1)]).all()


def test_masked_attention_reads_no_future_token(arr):
    qkv = arr(1, 5, 3 * 4)
    mask = F.causal_mask(qkv)
    out, cache = F.attention_forward(qkv, 2, mask)
    changed = qkv.copy()
    changed[:, 3:] += 1.0                                      # tokens 3 and 4 (their q, k and v) change
    out2, _ = F.attention_forward(changed, 2, mask)
    assert np.allclose(minivit.to_numpy(out[:, :3]), minivit.to_numpy(out2[:, :3]))    # 0..2 do not see it
    assert not np.allclose(minivit.to_numpy(out[:, 3:]), minivit.to_numpy(out2[:, 3:]))
    w = minivit.to_numpy(F.attention_weights(cache))           # (1, nh, 5, 5)
    assert np.allclose(np.triu(w[0, 0], 1), 0) and np.allclose(w.sum(-1), 1)


def test_quick_gelu(arr):
    check(L.GELU("quick"), arr(3, 10) * 3)
    x = np.linspace(-6, 6, 13)
    out, _ = F.gelu_forward(minivit.asarray(x), "quick")
    assert np.allclose(minivit.to_numpy(out), x / (1 + np.exp(-1.702 * x)), rtol=1e-12)


def test_embedding_pair_sums_repeated_ids(rng):
    weight = minivit.asarray(rng.standard_normal((5, 3)))
    ids = minivit.asarray(np.array([[1, 4, 1], [0, 1, 2]]))
    out, cache = F.embedding_forward(ids, weight)
    assert np.array_equal(minivit.to_numpy(out), minivit.to_numpy(weight)[minivit.to_numpy(ids)])
    dout = rng.standard_normal((2, 3, 3))
    dweight = minivit.to_numpy(F.embedding_backward(minivit.asarray(dout), cache))
    assert np.allclose(dweight[1], dout[0, 0] + dout[0, 2] + dout[1, 1])   # id 1 three times: three terms
    assert np.allclose(dweight[3], 0)                                      # id 3 never read


def test_l2_normalize_pair(arr):
    check(Pair(clip.l2_normalize_forward, clip.l2_normalize_backward), arr(4, 6) * 3 + 1)   # (+1: not along dout)
    y, _ = clip.l2_normalize_forward(arr(4, 6))
    assert np.allclose(np.linalg.norm(minivit.to_numpy(y), axis=-1), 1)


def test_similarity_with_temperature_is_gradient_checked(arr):
    txt = arr(4, 6)

    class Logits(L.Layer):                                     # img -> logits, with logit_scale a parameter
        def __init__(self):
            super().__init__()
            self.sim = self.add("", clip.Similarity(0.7, dtype="float64"))

        def forward(self, img):
            return self.sim.forward(img, txt)

        def backward(self, dlogits):
            return self.sim.backward(dlogits)[0]

    report = check(Logits(), arr(3, 6))
    assert "logit_scale" in report.errors()


def test_contrastive_loss_gradient_and_value(arr):
    logits = arr(5, 5) * 2

    def forward(z):
        loss, dz = clip.contrastive_loss(z)
        return minivit.asarray(np.array([loss])), dz

    check(Pair(forward, lambda dout, dz: dz * dout[0]), logits, dout=minivit.asarray(np.array([1.0])))
    z = minivit.to_numpy(logits)
    rows = -np.mean([z[i, i] - np.log(np.exp(z[i]).sum()) for i in range(5)])
    cols = -np.mean([z[i, i] - np.log(np.exp(z[:, i]).sum()) for i in range(5)])
    loss, dz = clip.contrastive_loss(logits)
    assert np.isclose(loss, (rows + cols) / 2, rtol=1e-12)
    soft_rows = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    soft_cols = np.exp(z) / np.exp(z).sum(0, keepdims=True)
    assert np.allclose(minivit.to_numpy(dz), (soft_rows + soft_cols - 2 * np.eye(5)) / 10, rtol=1e-12)


def test_loss_through_the_temperature(arr):
    """d loss / d logit_scale from the backward against central differences of the loss itself."""
    img, txt = clip.l2_normalize_forward(arr(4, 6))[0], clip.l2_normalize_forward(arr(4, 6))[0]
    sim = clip.Similarity(1.3, dtype="float64")

    def loss_at(t):
        sim.params["logit_scale"][...] = t
        return clip.contrastive_loss(sim.forward(img, txt))

    sim.zero_grad()
    _, dlogits = loss_at(1.3)
    sim.backward(dlogits)
    eps = 1e-6
    numeric = (loss_at(1.3 + eps)[0] - loss_at(1.3 - eps)[0]) / (2 * eps)
    assert abs(float(sim.grads["logit_scale"]) - numeric) < 1e-8 * max(1, abs(numeric))


def test_contrastive_loss_refuses_bad_logits(arr):
    with pytest.raises(ValueError, match="square"):
        clip.contrastive_loss(arr(3, 4))
    with pytest.raises(TypeError, match="floating"):
        clip.contrastive_loss(minivit.asarray(np.eye(3, dtype=np.int64)))


def test_perfect_pairs_give_a_loss_near_zero_and_random_ones_log_b(arr):
    B = 8
    loss, _ = clip.contrastive_loss(minivit.asarray(np.eye(B) * 100.0))
    assert loss < 1e-30
    loss, _ = clip.contrastive_loss(minivit.asarray(np.zeros((B, B))))
    assert np.isclose(loss, math.log(B))


# ---- the towers and the whole model ----------------------------------------------------------------


def test_text_tower_gradcheck(rng):
    tower = clip.TextTransformer(11, 6, 8, 2, 2, 5, mlp_ratio=2.0, dtype="float64", seed=3)
    perturb(tower, rng)
    report = check(WithTokens(tower, tokens_of(rng, 3)), minivit.asarray(np.zeros(1)), check_input=False,
                   max_checks=40)
    assert {"token_embedding.weight", "pos_embed", "blocks.1.attn.qkv.weight", "norm.weight",
            "proj.weight"} <= set(report.errors())


@pytest.mark.parametrize("gelu", ["erf", "quick"])
def test_whole_clip_gradcheck(rng, arr, gelu):
    import dataclasses

    model = clip.CLIP(dataclasses.replace(TINY, gelu=gelu), seed=1, dtype="float64")
    perturb(model, rng)
    report = check(WithTokens(model, tokens_of(rng, 3)), arr(3, 8, 8, 3), max_checks=25)
    names = set(report.errors())
    assert {"input", "logit_scale", "visual.norm_pre.weight", "visual.head.weight", "text.proj.weight",
            "text.token_embedding.weight", "visual.blocks.1.mlp.fc1.weight"} <= names
    assert "visual.head.bias" not in names and "visual.patch_embed.proj.bias" not in names


def test_text_features_ignore_what_comes_after_end(rng):
    model = clip.CLIP(TINY, dtype="float64").eval()
    tokens = minivit.to_numpy(tokens_of(rng, 4))
    base = minivit.to_numpy(model.encode_text(minivit.asarray(tokens)))
    changed = tokens.copy()
    for b in range(4):                                         # overwrite every <pad> after <end> with words
        end = int(changed[b].argmax())
        changed[b, end + 1:] = 5
    after = minivit.to_numpy(model.encode_text(minivit.asarray(changed)))
    assert np.allclose(base, after, rtol=1e-12, atol=1e-12)     # the causal mask: <end> never reads them
    changed[:, 1] = 7                                          # a word before <end> does change them
    assert not np.allclose(base, minivit.to_numpy(model.encode_text(minivit.asarray(changed))))


def test_the_image_tower_is_minivits_vit_with_clips_options():
    model = clip.CLIP(TINY)
    assert isinstance(model.visual, minivit.ViT)
    c = model.visual.config
    assert c.pre_norm and not c.patch_bias and not c.head_bias and c.norm_eps == 1e-5 and c.num_classes == 8
    assert model.visual.norm.eps == 1e-5 and model.visual.blocks[0].norm1.eps == 1e-5
    assert isinstance(model.text.blocks[0], L.Block)
    assert model.num_params() == TINY.num_params()
    assert np.isclose(model.logit_scale, math.log(1 / 0.07))


def test_clamp_logit_scale_after_a_step():
    model = clip.CLIP(TINY)
    model.params["logit_scale"][...] = 7.0
    model.clamp_logit_scale()
    assert np.isclose(model.logit_scale, math.log(100))
    model.params["logit_scale"][...] = -1.0
    model.clamp_logit_scale()
    assert model.logit_scale == 0.0


def test_no_decay_for_logit_scale_biases_and_norms():
    from minivit.optim import default_no_decay

    names = default_no_decay(clip.CLIP(TINY).params)
    assert {"logit_scale", "text.blocks.0.norm1.weight", "visual.blocks.0.attn.qkv.bias", "visual.norm_pre.bias",
            "text.pos_embed", "visual.pos_embed", "visual.cls_token"} <= names
    assert "text.blocks.0.attn.qkv.weight" not in names and "text.token_embedding.weight" not in names


def test_bad_tokens_and_mismatched_batches_are_refused(rng, arr):
    model = clip.CLIP(TINY)
    x = arr(2, 8, 8, 3, dtype="float32")
    with pytest.raises(ValueError, match=r"\(B, 6\)"):
        model.forward(x, minivit.asarray(np.zeros((2, 5), dtype=np.int64)))
    with pytest.raises(TypeError, match="integer"):
        model.forward(x, minivit.asarray(np.zeros((2, 6))))
    with pytest.raises(ValueError, match=r"\[0, 11\)"):
        model.encode_text(minivit.asarray(np.full((2, 6), 11)))
    with pytest.raises(ValueError, match="3 images but 2 captions"):
        model.forward(arr(3, 8, 8, 3, dtype="float32"), tokens_of(rng, 2))
    with pytest.raises(ValueError, match="vision_width 12 must be divisible by vision_heads 5"):
        clip.CLIPConfig(vision_width=12, vision_heads=5)


def test_state_dict_round_trip_and_config_dict():
    a, b = clip.CLIP(TINY, seed=0), clip.CLIP(TINY, seed=1)
    b.load_state_dict(a.state_dict())
    assert all(np.array_equal(minivit.to_numpy(b.params[k]), v) for k, v in a.state_dict().items())
    assert clip.CLIPConfig.from_dict(TINY.to_dict()) == TINY


def test_open_clip_layout_round_trip():
    model = clip.CLIP(TINY, seed=2)
    sd = model.state_dict()
    oc = clip.to_open_clip(sd)
    assert oc["visual.conv1.weight"].shape == (12, 3, 4, 4)
    assert oc["visual.transformer.resblocks.1.attn.in_proj_weight"].shape == (36, 12)
    assert oc["transformer.resblocks.0.mlp.c_fc.weight"].shape == (16, 8)
    assert oc["visual.class_embedding"].shape == (12,) and oc["positional_embedding"].shape == (6, 8)
    assert oc["visual.proj"].shape == (12, 8) and oc["text_projection"].shape == (8, 8)
    assert oc["logit_scale"].shape == ()
    back = clip.from_open_clip(oc)
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    config = clip.open_clip_config(oc, vision_heads=3, text_heads=2)
    assert config == TINY
    again = clip.CLIP.from_open_clip(oc, vision_heads=3, text_heads=2, quick_gelu=True)
    assert again.config.gelu == "quick" and np.array_equal(minivit.to_numpy(again.params["text.pos_embed"]),
                                                          sd["text.pos_embed"])


# ---- zero-shot and retrieval -----------------------------------------------------------------------


def test_retrieval_recall_counts_ranks_both_ways():
    e = np.eye(6)
    r = clip.retrieval_recall(minivit.asarray(e), minivit.asarray(e))
    assert all(v == 1.0 for v in r.values())
    txt = e[[1, 0, 2, 3, 4, 5]] + 0.1 * e              # texts 0 and 1 swapped: each matches the other image better
    r = clip.retrieval_recall(minivit.asarray(e), minivit.asarray(txt), ks=(1, 2))
    assert r["image_to_text@1"] == r["text_to_image@1"] == 4 / 6
    assert r["image_to_text@2"] == r["text_to_image@2"] == 1.0
    with pytest.raises(ValueError, match="same shape"):
        clip.retrieval_recall(minivit.asarray(e), minivit.asarray(e[:3]))


def test_zero_shot_classifier_averages_normalised_prompts():
    tok = C.Tokenizer(["a", "photo", "of", "red", "circle", "blue", "ring"], context_length=8)
    config = clip.CLIPConfig(embed_dim=8, img_size=8, patch_size=4, vision_width=12, vision_layers=1,
                             vision_heads=3, context_length=8, vocab_size=tok.vocab_size, text_width=8,
                             text_layers=1, text_heads=2)
    model = clip.CLIP(config, dtype="float64")
    w = minivit.to_numpy(clip.zero_shot_classifier(model, tok, ["red circle", "blue ring"],
                                                   ["a {}", "a photo of a {}"]))
    assert w.shape == (8, 2) and np.allclose(np.linalg.norm(w, axis=0), 1)
    feats = minivit.to_numpy(clip.encode_texts(model, tok, ["a red circle", "a photo of a red circle"]))
    mean = feats.mean(0)
    assert np.allclose(w[:, 0], mean / np.linalg.norm(mean))
    assert model.training                                    # the mode it had is given back
    with pytest.raises(ValueError, match="exactly one"):
        clip.zero_shot_classifier(model, tok, ["red circle"], ["a photo"])


# ---- the tokenizer and the captioned data -----------------------------------------------------------


def test_tokenizer_layout_end_is_the_highest_id():
    tok = C.Tokenizer.from_captions(["a red circle", "the L-shape is blue"], context_length=7)
    assert tok.itos[:3] == ["<pad>", "<unk>", "<start>"] and tok.itos[-1] == "<end>"
    assert tok.end_id == tok.vocab_size - 1 and "l-shape" in tok.words
    t = tok(["a red circle", "the L-shape is blue"])
    assert t.shape == (2, 7) and t.dtype == np.int64
    assert list(t[0]) == [2, tok.stoi["a"], tok.stoi["red"], tok.stoi["circle"], tok.end_id, 0, 0]
    assert list(t.argmax(-1)) == [4, 5]                       # the text tower pools where <end> is
    assert tok.decode(t) == ["a red circle", "the l-shape is blue"]


def test_tokenizer_warns_naming_unknown_words_and_refuses_long_captions():
    tok = C.Tokenizer(["a", "red", "circle"], context_length=5)
    with pytest.warns(UserWarning, match=r"\['green', 'ring'\]"):
        t = tok("a green ring")
    assert list(t[0]) == [2, tok.stoi["a"], 1, 1, tok.end_id]
    with pytest.raises(ValueError, match="more than context_length - 2 = 3"):
        tok("a red circle a red")
    with pytest.raises(TypeError, match="str"):
        tok([3])


def test_captioned_shapes_hold_out_combinations_from_training():
    data = C.make_captioned_shapes(num_train=400, num_test=600, seed=1)
    assert data.x_train.shape == (400, 32, 32, 3) and len(data.text_train) == 400 and data.num_classes == 60
    held = {data.classnames[k] for k in data.held_out}
    assert len(held) == 10 and "red circle" in held
    assert not set(data.y_train.tolist()) & set(data.held_out)                  # never in training
    assert set(data.y_test.tolist()) & set(data.held_out)                        # but tested
    for text, y in zip(data.text_train, data.y_train):
        colour, shape = data.classnames[y].split(" ", 1)
        assert colour in text and shape in text
    assert len(set(data.text_train)) > 150                                      # several phrasings
    tok = C.tokenizer_for(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                          # every prompt's word is known
        tok([t.format(c) for c in data.classnames for t in data.templates] + data.text_test)
    # the drawn colour is the caption's: red shapes are red where they are brightest
    red = data.x_train[[data.classnames[y].startswith("red ") for y in data.y_train]].astype(float)
    top = red.reshape(len(red), -1, 3)
    bright = top[np.arange(len(top))[:, None], np.argsort(top.sum(-1), 1)[:, -20:]]   # (n, 20, 3)
    assert (bright[..., 0].mean(1) > bright[..., 1].mean(1) + 60).mean() > 0.9


def test_caption_fashion_names_the_class_and_shade(rng):
    x = rng.integers(0, 256, size=(20, 28, 28, 1)).astype(np.uint8)
    y = np.arange(20) % 10
    texts = C.caption_fashion(x, y, rng)
    assert all(C.FASHION_NOUNS[k] in t for t, k in zip(texts, y))


def test_batches_never_hold_a_caption_twice_and_depend_on_seed_and_step_only():
    texts = [f"caption {i % 40}" for i in range(400)]          # 40 distinct captions, each 10 times
    ids = C.caption_ids(texts)
    for step in range(30):
        idx = C.batch_indices(step, 32, 0, ids)
        assert len(idx) == 32 and len({texts[i] for i in idx}) == 32
    assert np.array_equal(C.batch_indices(7, 32, 0, ids), C.batch_indices(7, 32, 0, ids))
    assert not np.array_equal(C.batch_indices(7, 32, 0, ids), C.batch_indices(7, 32, 1, ids))
    with pytest.raises(ValueError, match="41 is more than the 40 distinct captions"):
        C.batch_indices(0, 41, 0, ids)


# ---- it learns -------------------------------------------------------------------------------------


def test_a_tiny_clip_learns_to_match_its_pairs(rng):
    from minivit.optim import AdamW, default_no_decay

    B = 8
    model = clip.CLIP(TINY, seed=0)
    x = minivit.asarray(rng.standard_normal((B, 8, 8, 3)).astype("float32"))
    tokens = tokens_of(rng, B)
    opt = AdamW(model, 3e-3, weight_decay=0.01, no_decay=default_no_decay(model.params))
    losses = []
    for _ in range(200):                                       # about a second
        model.zero_grad()
        loss, dlogits = clip.contrastive_loss(model.forward(x, tokens))
        model.backward(dlogits)
        opt.step()
        model.clamp_logit_scale()
        losses.append(loss)
    assert losses[0] > 0.8 * math.log(B) and losses[-1] < 0.05, (losses[0], losses[-1])
    assert model.logit_scale != math.log(1 / 0.07)            # the temperature was learned too


# ---- the fast paths of the new pairs (minivit/fast/kernels.py), against the reference in float64 -------------

needs_numba = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="the CPU fast paths need Numba")


def rel(a, b):
    a, b = minivit.to_numpy(a).astype(np.float64), minivit.to_numpy(b).astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _fast_against_reference(xp_of, rng):
    """QuickGELU and causally masked attention, forward and backward: kernels (float32) against
    functional (float64), on arrays of backend xp_of."""
    x = np.concatenate([rng.standard_normal(10_007) * 4, [-100.0, -60.0, 0.0, 60.0, 100.0]])
    dout = rng.standard_normal(x.shape)
    out, cache = kernels.gelu_forward(xp_of(x, "float32"), "quick")
    ref, ref_cache = F.gelu_forward(xp_of(x, "float64"), "quick")
    assert rel(out, ref) < 1e-6
    assert rel(kernels.gelu_backward(xp_of(dout, "float32"), cache),
               F.gelu_backward(xp_of(dout, "float64"), ref_cache)) < 1e-6

    qkv = rng.standard_normal((5, 13, 3 * 12)) * 2                     # 13 tokens, 3 heads of 4
    dctx = rng.standard_normal((5, 13, 12))
    q32, q64 = xp_of(qkv, "float32"), xp_of(qkv, "float64")
    out, cache = kernels.attention_forward(q32, 3, F.causal_mask(q32))
    ref, ref_cache = F.attention_forward(q64, 3, F.causal_mask(q64))
    assert rel(out, ref) < 1e-5
    assert rel(kernels.attention_backward(xp_of(dctx, "float32"), cache),
               F.attention_backward(xp_of(dctx, "float64"), ref_cache)) < 1e-5


@needs_numba
def test_fast_paths_of_quick_gelu_and_masked_attention_cpu(rng):
    _fast_against_reference(lambda a, dtype: np.asarray(a, dtype=dtype), rng)


@pytest.mark.gpu
def test_fast_paths_of_quick_gelu_and_masked_attention_gpu(rng):
    _fast_against_reference(lambda a, dtype: minivit.asarray(a, dtype=dtype, backend="cupy"), rng)


@needs_numba
def test_a_float32_clip_runs_the_checked_twins_and_reads_causal_weights(rng):
    """ops probes QuickGELU and the masked attention like the others, and takes their twins; the weights
    recomputed from the fused cache are causal."""
    import dataclasses

    ops.reset()
    model = clip.CLIP(dataclasses.replace(TINY, gelu="quick"))
    tokens = tokens_of(rng, 3)
    model.forward(minivit.asarray(rng.standard_normal((3, 8, 8, 3)).astype("float32")), tokens)
    rows = {(r[0], r[2]): r[3] for r in ops.report()}
    assert rows[("gelu", ("quick",))] == "kernels.py"
    assert rows[("attention", (6, 8, 2, True))] == "kernels.py"          # the text tower's, masked
    assert rows[("attention", (5, 12, 3, False))] == "kernels.py"         # the image tower's
    w = minivit.to_numpy(model.text.blocks[0].attn.attn)                  # (3, 2, 6, 6) from the fused cache
    assert np.abs(np.triu(w, 1)).max() < 1e-30 and np.allclose(w.sum(-1), 1, atol=1e-5)


def test_vit_options_for_clip_count_names_and_checks(arr):
    config = minivit.ViTConfig(img_size=8, patch_size=4, num_classes=5, embed_dim=12, depth=1, num_heads=3,
                               pre_norm=True, patch_bias=False, norm_eps=1e-5, head_bias=False, gelu="quick")
    model = minivit.ViT(config, dtype="float64")
    assert model.num_params() == config.num_params()
    assert list(minivit.param_shapes(config).items()) == [(n, tuple(p.shape)) for n, p in model.params.items()]
    assert "norm_pre.weight" in model.params and "patch_embed.proj.bias" not in model.params
    assert "head.bias" not in model.params and model.blocks[0].mlp.act.approximate == "quick"
    assert [n for n, _ in model.stages()][:3] == ["patch_embed", "pos_embed", "norm_pre"]
    check(model, arr(2, 8, 8, 3), max_checks=30)
    plain = minivit.ViTConfig(img_size=8, patch_size=4, num_classes=5, embed_dim=12, depth=1, num_heads=3)
    assert config.num_params() == plain.num_params() + 2 * 12 - 12 - 5     # + norm_pre, - the two biases
    for bad, match in ((dict(pre_norm=1), "pre_norm must be True or False"), (dict(norm_eps=0.0), "norm_eps"),
                       (dict(stem="conv", patch_bias=False), "patch stem")):
        with pytest.raises(ValueError, match=match):
            minivit.ViTConfig(img_size=8, patch_size=4, embed_dim=12, num_heads=3, **bad)
