"""CLIP's task for the trainer: ``python -m minivit.train --task clip`` (or ``--recipe clip-shapes``).

minivit/train/loop.py runs it with its own set_up, run_loop, evaluate_and_save and finish (progress bar,
metrics.jsonl, summary.json, atomic checkpoints, exact resume, every flag checked): this file gives
only what differs from training a classifier, the data, the model, the batch, the step and the
evaluation, behind the task interface of minivit/train/tasks.py (ClassificationTask is the other one).
One optimizer step (CLIPTask.train_step):

    x, tokens = the pairs of batch_indices(step)   # (B, H, W, C), (B, L): no caption twice in a batch
    logits = model.forward(x, tokens)              # (B, B) = exp(logit_scale) I T^T
    loss, dlogits = contrastive_loss(logits)       # symmetric InfoNCE
    model.zero_grad(); model.backward(dlogits)     # logit_scale's gradient too
    clip_grad_norm(model, max_norm)                # optional
    optimizer.step(); model.clamp_logit_scale()    # logit_scale kept in [0, log 100]

On R ranks (mpiexec) rank r takes its b = B / R pairs of the same global batch, and the loss still
compares every image with all B captions: the features are all-gathered, each rank computes its b rows
and b columns of the (B, B) logits, and the features' gradients go back to the ranks that made them
(global_batch_backward). DataParallel then averages the gradients, clips by their global norm and
steps, as for a classifier; the parameters equal one process's to rounding.

An evaluation (CLIPTask.evaluate): val_acc is the zero-shot accuracy over all test images (the class
names in the data set's templates, minivit.clip.zero_shot_classifier), also split into the colour-shape
combinations seen in training and those held out; val_loss is the contrastive loss, and recall@1/@5 both
ways, over the test pairs with distinct captions (the first pair of each caption), in batches of the
training batch size. On R ranks each encodes its share of the test images, the features are gathered,
and every rank computes the same figures from all of them (recall@k ranks each pair against all others).
"""

import dataclasses
import math

from .. import backend, distributed
from ..fast import ops
from . import (CLIP, CLIPConfig, contrastive_loss, contrastive_loss_rows, encode_images, encode_texts, presets,
               retrieval_recall, similarity_backward, similarity_forward, zero_shot_classifier)
from .captions import CAPTIONED_DATASETS, Tokenizer, batch_indices, caption_ids, load_captioned, tokenizer_for
from ..data import augment as A
from ..optim import AdamW, clip_grad_norm

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
    """The task of a Run of --task clip (the interface of minivit/train/tasks.py): the tokens of every caption
    on the backend, the batches, the step and the evaluation. run: train.loop.Run, its data on the backend
    already (run.x_test: this rank's share of the test images, all of them in one process); run.world,
    run.dp: its ranks. resumed: the checkpoint the run continues, whose tokenizer it keeps."""

    # the figures of the last evaluation that summary.json repeats
    SUMMARY = ("zero_shot_accuracy", "zero_shot_seen", "zero_shot_held_out", "image_to_text@1", "text_to_image@1",
               "image_to_text@5", "text_to_image@5", "eval_pairs", "logit_scale")
    ACCURACY = "zero-shot"      # what val_acc is: "final zero-shot accuracy" in the last line of the command line

    @staticmethod
    def load_data(cfg):
        """(the CaptionedDataset, cfg unchanged)."""
        return load_data(cfg), cfg

    @staticmethod
    def check_data(cfg, data):
        """Nothing to refuse beyond check_config's: a captioned data set has its classes (for zero-shot)."""

    @staticmethod
    def build_model(cfg, data, resumed=None):
        return build_model(cfg, data, resumed)

    @staticmethod
    def label_classes(model):
        """None: CLIP has no head; the labels (zero-shot's answers) are checked against the data's classes."""
        return None

    def __init__(self, run, resumed=None):
        self.run, data = run, run.data
        L = run.model.config.context_length
        self.tokenizer = (None if resumed is None else self.tokenizer_of(resumed)) or tokenizer_for(data, L)
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
        self.y_test = backend.asarray(data.y_test, backend=on)           # (N_test,) every test label
        self.seen = backend.asarray(seen, backend=on)[self.y_test]       # (N_test,) bool: a seen combination

    def batch(self, step):
        """Images (B, H, W, C) float and tokens (B, L) of optimizer step `step`: a function of (seed, step).
        On R ranks, rank r's rows [r b, (r + 1) b) of it: (b, H, W, C) and (b, L)."""
        run = self.run
        idx = batch_indices(step, run.cfg.batch_size, run.cfg.seed, self.ids)                # (B,)
        if run.world is not None:
            idx = idx[distributed.local_slice(run.cfg.batch_size, run.world.rank, run.world.world_size)]  # (b,)
        idx = backend.asarray(idx, backend=run.model.backend)
        x = A.normalize(run.x_train[idx], run.data.mean, run.data.std, run.cfg.dtype)      # (B, H, W, C)
        return x, self.tokens_train[idx]

    def train_step(self, x, tokens):
        """One optimizer step on the pairs (x, tokens) (on R ranks: this rank's b pairs of the global batch).
        Returns (loss, correct, grad_norm) of the global batch; correct counts the images whose own caption
        has the highest logit in the batch."""
        model, optimizer, cfg, dp = self.run.model, self.run.optimizer, self.run.cfg, self.run.dp
        xp = backend.get_array_module(x)
        model.zero_grad()
        if dp is None:                     # one process: the whole (B, B) logits
            logits = model.forward(x, tokens)                               # (B, B)
            loss, dlogits = contrastive_loss(logits)                        # a float, (B, B)
            model.backward(dlogits)
            labels = xp.arange(x.shape[0])                                  # (B,) the diagonal
        else:                              # rank r: its rows of them, against every rank's features
            loss, logits, labels = global_batch_backward(model, dp.comm, x, tokens)   # logits (b, B), labels (b,)
            dp.average_gradients()                                          # g <- 1/R sum_r g_r
        correct = int((logits.argmax(-1) == labels).sum())
        if dp is not None:                 # the global batch's loss and count, the same on every rank
            loss, correct = dp.batch_metrics(loss, correct)
        grad_norm = None
        if cfg.clip_grad:
            grad_norm = float(clip_grad_norm(model, cfg.clip_grad) if dp is None else dp.clip_grad_norm(cfg.clip_grad))
        if not math.isfinite(loss):                                         # the trainer stops, saving nothing
            return loss, 0, float("nan")
        if dp is None:
            optimizer.step()
        else:
            dp.step()                      # ZeRO-1: this rank's shard, then an all-gather of all
        model.clamp_logit_scale()
        return loss, correct, grad_norm

    def evaluate(self):
        """(val_loss, val_acc, more): the contrastive loss over the distinct-caption test pairs, the
        zero-shot accuracy over all test images, and more = the seen / held-out split of it, recall@1/@5
        both ways and logit_scale."""
        run, model, data = self.run, self.run.model, self.run.data
        xp = backend.get_array_module(run.x_test)
        bs = run.cfg.eval_batch_size
        images = _normalized(run.x_test, data, run.cfg.dtype, bs)                      # (n_r, H, W, C) this rank's
        img = encode_images(model, images, bs)                                          # (n_r, E) normalised
        if run.world is not None:                           # every rank's share, in test order
            img = distributed.all_gather_shards(run.world, img, self.y_test.shape[0])  # (N_test, E)
        W = zero_shot_classifier(model, self.tokenizer, data.classnames, data.templates)  # (E, K)
        right = (img @ W).argmax(-1) == self.y_test                                     # (N_test,)
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

    def announce_ops(self):
        """Which ops run from kernels.py and which from functional.py, as lines to print: one forward in eval
        mode on two pairs (no caches, no dropout: the run is unchanged) makes minivit/fast/ops.py check every
        fast twin the model uses before the first step; the lines say which ops ran so far, not per layer."""
        run = self.run
        was = run.model.training
        try:
            x = A.normalize(run.x_train[:2], run.data.mean, run.data.std, run.cfg.dtype)   # (2, H, W, C)
            run.model.eval().forward(x, self.tokens_train[:2])
        finally:
            run.model.train(was)
        if isinstance(run.optimizer, AdamW):       # the fused update's twin, checked now as well
            ops.uses_twin("adamw", next(iter(run.model.params.values())))
        return ops.summary_lines()


def global_batch_backward(model, comm, x, tokens):
    """Rank r's forward and backward of the contrastive loss of the global batch of B = R b pairs, its
    own b pairs x (b, H, W, C), tokens (b, L) (open_clip's local loss with gather_with_grad):

        I_r, T_r = model.features(x, tokens)               (b, E) each, normalised
        I, T = every rank's I_r, T_r, all-gathered         (B, E), the same on every rank
        logits_img = s I_r T^T,  logits_txt = s T_r I^T    (b, B): rank r's rows, and columns, of s I T^T
        L_r = (CE(logits_img, r b + arange b) + CE(logits_txt, r b + arange b)) / 2

    The loss of the global batch is L = 1/R sum_q L_q (clip.contrastive_loss of the (B, B) logits). I_r
    reaches sum_q L_q along two paths, rank r's logits_img and every rank's copy of it in I:
        d(sum_q L_q)/dI_r = s dlogits_img T + rows [r b, (r + 1) b) of sum_q s dlogits_txt_q^T T_q
    the sum over q a reduce-scatter (distributed.all_gather_rows_backward); T_r likewise. So the towers'
    backward leaves in model.grads rank r's part of d(sum_q L_q)/dθ, logit_scale's too (its own rows'
    sum(dlogits * logits)), and DataParallel.average_gradients, which sums the parts and divides by R,
    gives dL/dθ. Returns (L_r as a float, logits_img (b, B), the labels (b,))."""
    xp = backend.get_array_module(x)
    I_r, T_r = model.features(x, tokens)                                 # (b, E) each
    I, T = distributed.all_gather_rows(comm, I_r), distributed.all_gather_rows(comm, T_r)   # (B, E) each
    logits_img, cache_img = similarity_forward(I_r, T, model.params["logit_scale"])   # (b, B)
    logits_txt, cache_txt = similarity_forward(T_r, I, model.params["logit_scale"])   # (b, B)
    loss, dlogits_img, dlogits_txt = contrastive_loss_rows(logits_img, logits_txt, comm.rank)
    dI_r, dT, dscale_img = similarity_backward(dlogits_img, cache_img)  # (b, E), (B, E), ()
    dT_r, dI, dscale_txt = similarity_backward(dlogits_txt, cache_txt)  # (b, E), (B, E), ()
    dI_r = dI_r + distributed.all_gather_rows_backward(comm, dI)         # (b, E) + every rank's use of I_r
    dT_r = dT_r + distributed.all_gather_rows_backward(comm, dT)         # (b, E) + every rank's use of T_r
    model.grads["logit_scale"] += dscale_img + dscale_txt               # () d L_r / d logit_scale
    model.features_backward(dI_r, dT_r)
    b = x.shape[0]
    return float(loss), logits_img, comm.rank * b + xp.arange(b)


def _normalized(x, data, dtype, batch_size):
    xp = backend.get_array_module(x)
    return xp.concatenate([A.normalize(x[s:s + batch_size], data.mean, data.std, dtype)
                           for s in range(0, x.shape[0], batch_size)])


def _mean(flags):
    """The fraction of True in a bool array; None when it is empty (no held-out test image)."""
    return float(flags.mean()) if flags.size else None
