"""CLIP's task for the trainer: ``python -m minivit.train --task clip`` (or ``--recipe clip-shapes``).

minivit/train.py runs it with its own set_up, run_loop, evaluate_and_save and finish (progress bar,
metrics.jsonl, summary.json, atomic checkpoints, exact resume, every flag checked): this file gives
only what differs from training a classifier, the data, the model, the batch, the step and the
evaluation. One optimizer step (CLIPTask.train_step):

    x, tokens = the pairs of batch_indices(step)   # (B, H, W, C), (B, L): no caption twice in a batch
    logits = model.forward(x, tokens)              # (B, B) = exp(logit_scale) I T^T
    loss, dlogits = contrastive_loss(logits)       # symmetric InfoNCE
    model.zero_grad(); model.backward(dlogits)     # logit_scale's gradient too
    clip_grad_norm(model, max_norm)                # optional
    optimizer.step(); model.clamp_logit_scale()    # logit_scale kept in [0, log 100]

An evaluation (CLIPTask.evaluate): val_acc is the zero-shot accuracy over all test images (the class
names in the data set's templates, minivit.clip.zero_shot_classifier), also split into the colour-shape
combinations seen in training and those held out; val_loss is the contrastive loss, and recall@1/@5 both
ways, over the test pairs with distinct captions (the first pair of each caption), in batches of the
training batch size.
"""

import dataclasses
import math

from . import augment as A
from . import backend
from .captions import CAPTIONED_DATASETS, Tokenizer, batch_indices, caption_ids, load_captioned, tokenizer_for
from .clip import (CLIP, CLIPConfig, contrastive_loss, encode_images, encode_texts, presets, retrieval_recall,
                   zero_shot_classifier)
from .optim import clip_grad_norm

# The trainer's options CLIP's task has no use for, with the one value each may take (None: not given).
# The model is a preset of minivit.clip.presets (--model), sized to the data set's images and vocabulary.
UNUSED = {"img_size": None, "patch_size": None, "embed_dim": None, "depth": None, "num_heads": None,
          "mlp_ratio": None, "pool": None, "drop_rate": None, "drop_path_rate": None, "pos_embed": None,
          "stem": None, "augment": "none", "mixup": 0.0, "cutmix": 0.0, "random_erasing": 0.0,
          "label_smoothing": 0.0, "init": None, "init_gelu": None, "precision": "float32", "fallback": False,
          "download": False,
          # the loss of a batch is not a mean over its micro-batches: every caption is a negative of every image
          "grad_accum": 1,
          # minivit.stats walks a classifier's stages (the ViT's), not CLIP's two towers
          "log_stats": None}


def check_config(cfg):
    """Refuse, by flag, what a CLIP run cannot do (cfg: a TrainConfig with its recipe applied)."""
    given = [f"--{k.replace('_', '-')} {getattr(cfg, k)!r}" for k, neutral in UNUSED.items()
             if getattr(cfg, k) is not None and getattr(cfg, k) != neutral]
    if given:
        raise ValueError(f"--task clip has no use for {'; '.join(given)} (options of the classifier); "
                         f"the model is a --model preset of minivit.clip.presets: {sorted(presets)}")
    if cfg.model not in presets:
        raise ValueError(f"--task clip needs a CLIP preset, got --model {cfg.model!r}; choose one of {sorted(presets)}")
    if cfg.dataset not in CAPTIONED_DATASETS:
        raise ValueError(f"--task clip trains on a captioned data set: {CAPTIONED_DATASETS}, got --dataset "
                         f"{cfg.dataset!r}")


def load_data(cfg):
    """The CaptionedDataset of cfg.dataset (captioned shapes are generated; Fashion-MNIST read from data_dir)."""
    return load_captioned(cfg.dataset, cfg.data_dir)


def build_model(cfg, data, resumed=None):
    """The CLIP of cfg.model, its image size, channels and vocabulary those of the data; resumed: the
    checkpoint's own config."""
    if resumed is not None:
        try:
            config = CLIPConfig.from_dict(resumed["meta"]["config"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{resumed['path']!r}: the saved CLIP config is not valid ({err})") from None
    else:
        H, W, C = data.image_shape
        preset = presets[cfg.model]
        vocab = tokenizer_for(data, preset.context_length).vocab_size
        config = dataclasses.replace(preset, img_size=(H, W), in_chans=C, vocab_size=vocab)
    return CLIP(config, seed=cfg.seed, dtype=cfg.dtype)


class CLIPTask:
    """What a Run of --task clip needs beyond the classifier's: the tokens of every caption on the backend,
    the batches, the step and the evaluation. run: train.Run, its data on the backend already."""

    # the figures of the last evaluation that summary.json repeats
    SUMMARY = ("zero_shot_accuracy", "zero_shot_seen", "zero_shot_held_out", "image_to_text@1", "text_to_image@1", "image_to_text@5",
               "text_to_image@5", "eval_pairs", "logit_scale")

    def __init__(self, run, tokenizer=None):
        self.run, data = run, run.data
        L = run.model.config.context_length
        self.tokenizer = tokenizer or tokenizer_for(data, L)
        if self.tokenizer.vocab_size != run.model.config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} ids but the model's vocab_size is "
                             f"{run.model.config.vocab_size}")
        on = run.model.backend
        self.ids = caption_ids(data.text_train)                                            # (N,) host
        if run.cfg.batch_size > int(self.ids.max()) + 1:
            raise ValueError(f"batch_size {run.cfg.batch_size} is more than the {int(self.ids.max()) + 1} distinct "
                             f"training captions: a batch would hold a caption twice (a false negative)")
        self.tokens_train = backend.asarray(self.tokenizer(data.text_train), backend=on)  # (N, L)
        first = {}                                              # caption -> the first test pair holding it
        for i, text in enumerate(data.text_test):
            first.setdefault(text, i)
        self.pairs = backend.asarray(list(first.values()), backend=on)   # (n,) test pairs, distinct captions
        self.pair_texts = list(first)                                     # their n captions
        held = set(data.held_out)
        seen = [k not in held for k in range(data.num_classes)]          # (K,)
        self.seen = backend.asarray(seen, backend=on)[run.y_test]        # (N_test,) bool: a seen combination

    def batch(self, step):
        """Images (B, H, W, C) float and tokens (B, L) of optimizer step `step`: a function of (seed, step)."""
        run = self.run
        idx = backend.asarray(batch_indices(step, run.cfg.batch_size, run.cfg.seed, self.ids),
                              backend=run.model.backend)                                     # (B,)
        x = A.normalize(run.x_train[idx], run.data.mean, run.data.std, run.cfg.dtype)      # (B, H, W, C)
        return x, self.tokens_train[idx]

    def train_step(self, x, tokens):
        """One optimizer step on the pairs (x, tokens). Returns (loss, correct, grad_norm); correct counts
        the images whose own caption has the highest logit in the batch."""
        model, optimizer, cfg = self.run.model, self.run.optimizer, self.run.cfg
        xp = backend.get_array_module(x)
        model.zero_grad()
        logits = model.forward(x, tokens)                                   # (B, B)
        loss, dlogits = contrastive_loss(logits)                            # a float, (B, B)
        model.backward(dlogits)
        correct = int((logits.argmax(-1) == xp.arange(x.shape[0])).sum())
        grad_norm = float(clip_grad_norm(model, cfg.clip_grad)) if cfg.clip_grad else None
        if not math.isfinite(loss):                                         # the trainer stops, saving nothing
            return loss, 0, float("nan")
        optimizer.step()
        model.clamp_logit_scale()
        return loss, correct, grad_norm

    def evaluate(self):
        """(val_loss, val_acc, more): the contrastive loss over the distinct-caption test pairs, the
        zero-shot accuracy over all test images, and more = the seen / held-out split of it, recall@1/@5
        both ways and logit_scale."""
        run, model, data = self.run, self.run.model, self.run.data
        xp = backend.get_array_module(run.x_test)
        bs = run.cfg.eval_batch_size
        images = _normalized(run.x_test, data, run.cfg.dtype, bs)                      # (N_test, H, W, C)
        img = encode_images(model, images, bs)                                          # (N_test, E) normalised
        W = zero_shot_classifier(model, self.tokenizer, data.classnames, data.templates)  # (E, K)
        right = (img @ W).argmax(-1) == run.y_test                                      # (N_test,)
        seen = self.seen
        more = {"zero_shot_accuracy": float(right.mean()), "zero_shot_seen": _mean(right[seen]),
                "zero_shot_held_out": _mean(right[~seen])}
        img_pairs = img[self.pairs]                                                      # (n, E)
        txt_pairs = encode_texts(model, self.tokenizer, self.pair_texts, bs)            # (n, E)
        more.update(retrieval_recall(img_pairs, txt_pairs), eval_pairs=len(self.pair_texts),
                    logit_scale=model.logit_scale)
        B, n = run.cfg.batch_size, len(self.pair_texts)
        scale = xp.exp(model.params["logit_scale"])
        losses = []
        for start in range(0, max(n - B, 0) + 1, B):             # whole batches of B (one of n, if n < B)
            i, t = img_pairs[start:start + B], txt_pairs[start:start + B]
            losses.append(contrastive_loss(scale * (i @ t.T))[0])
        return sum(losses) / len(losses), more["zero_shot_accuracy"], more

    def checkpoint_extra(self):
        return {"tokenizer": self.tokenizer.to_dict()}

    @staticmethod
    def tokenizer_of(resumed):
        """The tokenizer a checkpoint was trained with (None if it holds none)."""
        saved = (resumed["meta"].get("extra") or {}).get("tokenizer")
        return None if saved is None else Tokenizer.from_dict(saved)

    def announce_forward(self):
        """One forward in eval mode on two pairs (no caches, no dropout: the run is unchanged), so that
        minivit/ops.py checks every fast twin the model uses before the first step."""
        run = self.run
        was = run.model.training
        try:
            x = A.normalize(run.x_train[:2], run.data.mean, run.data.std, run.cfg.dtype)   # (2, H, W, C)
            run.model.eval().forward(x, self.tokens_train[:2])
        finally:
            run.model.train(was)


def _normalized(x, data, dtype, batch_size):
    xp = backend.get_array_module(x)
    return xp.concatenate([A.normalize(x[s:s + batch_size], data.mean, data.std, dtype)
                           for s in range(0, x.shape[0], batch_size)])


def _mean(flags):
    """The fraction of True in a bool array; None when it is empty (no held-out test image)."""
    return float(flags.mean()) if flags.size else None
