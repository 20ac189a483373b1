"""Using a trained CLIP: text and image features in eval mode, zero-shot classification from class names
written into prompts, and retrieval recall@k both ways.

Glossary (with functional.py's): E joint embedding width, K zero-shot classes.
"""

from contextlib import contextmanager

from ..backend import asarray, get_array_module
from .loss import l2_normalize_forward


@contextmanager
def _eval_mode(model):
    """Run the body with model in eval mode (no caches, no dropout), then restore its mode."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def encode_texts(model, tokenizer, texts, batch_size=500):
    """Normalised text features (n, E) of n captions, in eval mode, batch_size at a time."""
    xp = get_array_module(model.params["logit_scale"])
    feats = []
    with _eval_mode(model):
        for start in range(0, len(texts), batch_size):
            tokens = asarray(tokenizer(texts[start:start + batch_size]), backend=model.backend)   # (b, L)
            feats.append(l2_normalize_forward(model.encode_text(tokens))[0])                      # (b, E)
    return xp.concatenate(feats)


def encode_images(model, images, batch_size=500):
    """Normalised image features (n, E) of float images (n, H, W, C), in eval mode."""
    xp = get_array_module(model.params["logit_scale"])
    feats = []
    with _eval_mode(model):
        for start in range(0, images.shape[0], batch_size):
            feats.append(l2_normalize_forward(model.encode_image(images[start:start + batch_size]))[0])
    return xp.concatenate(feats)


def zero_shot_classifier(model, tokenizer, classnames, templates):
    """The zero-shot weights (E, K): for each class, its prompts (each template with "{}" filled with the
    class name) encoded and normalised, their mean normalised again, as CLIP does. An image's class is
    then argmax over k of I @ weights (I its normalised features)."""
    if isinstance(classnames, str) or isinstance(templates, str) or not classnames or not templates:
        raise ValueError("classnames and templates must be non-empty lists of str (a template has one '{}')")
    bad = [t for t in templates if t.count("{}") != 1]
    if bad:
        raise ValueError(f"each template must hold exactly one '{{}}' for the class name, got {bad}")
    xp = get_array_module(model.params["logit_scale"])
    columns = []
    for name in classnames:
        feats = encode_texts(model, tokenizer, [t.format(name) for t in templates])    # (T, E) normalised
        columns.append(l2_normalize_forward(feats.mean(0))[0])                          # (E,)
    return xp.stack(columns, axis=1)                                                    # (E, K)


def zero_shot_predict(model, classifier, images, batch_size=500):
    """Class indices (n,) of float images (n, H, W, C): argmax of I @ classifier."""
    return (encode_images(model, images, batch_size) @ classifier).argmax(-1)


def retrieval_recall(image_features, text_features, ks=(1, 5)):
    """Recall@k both ways for n pairs (image i with text i), from features (n, E) (normalised or not:
    the ranking is by cosine similarity). image_to_text@k: the fraction of images whose own text is among
    the k most similar texts; text_to_image@k likewise. Returns {"image_to_text@1": ..., ...}."""
    if image_features.shape != text_features.shape or image_features.ndim != 2:
        raise ValueError(f"image and text features must be two (n, E) arrays of the same shape, got "
                         f"{tuple(image_features.shape)} and {tuple(text_features.shape)}")
    xp = get_array_module(image_features)
    img = l2_normalize_forward(image_features)[0]
    txt = l2_normalize_forward(text_features)[0]
    sim = img @ txt.T                                         # (n, n) image i against text j
    n = sim.shape[0]
    own = sim[xp.arange(n), xp.arange(n)]                     # (n,) each pair's own similarity
    rank_i2t = (sim > own[:, None]).sum(1)                    # (n,) texts ranked above image i's own
    rank_t2i = (sim > own[None, :]).sum(0)                    # (n,) images ranked above text j's own
    out = {}
    for k in ks:
        out[f"image_to_text@{k}"] = float((rank_i2t < k).mean())
        out[f"text_to_image@{k}"] = float((rank_t2i < k).mean())
    return out
