"""Training a ViT from scratch (or fine-tuning one): the loop, its recipes and the command line.

    python -m minivit.train --dataset cifar10 --recipe fast --backend cupy --out runs/cifar10
    python -m minivit.train --dataset shapes --recipe demo              # offline, two minutes on a CPU
    python -m minivit.train --out runs/cifar10 --resume                 # continue where it stopped

One optimizer step, written out (see train_step below):
    logits = model.forward(augment(x))          # (B, K)
    loss, dlogits = cross_entropy(logits, y)    # mean over the batch
    model.zero_grad(); model.backward(dlogits)  # fills model.grads
    clip_grad_norm(model, max_norm)             # optional
    optimizer.lr = schedule(step); optimizer.step()

train(cfg) is four parts, each a screen: set_up (settings checked, data, model, optimizer, a resumed
state, the run folder), run_loop (the steps above), evaluate_and_save (at each evaluation), finish (the
summary). TrainConfig is every setting; the command line is generated from its fields.

What is written to OUT: metrics.jsonl (one line per evaluation), summary.json, checkpoint.npz (model,
optimizer, RNG states, step; written atomically at every evaluation), curves.png. With out=None (from
Python) nothing is written: experiments/ call train(cfg, model=..., data=...) that way. An OUT that
already holds a run is refused unless --resume (continue it) or --overwrite (replace it) says what to do.

Nothing is lost: Ctrl-C or SIGTERM finishes the step, evaluates, saves a checkpoint and exits (130 or
143); a NaN or infinite loss, validation loss or parameter stops the run, keeping the checkpoint of the
last evaluation at which all three were finite; a checkpoint is only ever written from a finite state.

Reproducibility: the batches of step s are a function of (seed, s) alone: epoch e = s // steps_per_epoch
is shuffled by a generator seeded with (seed, e), and the augmentation of step s by one seeded with
(seed, s). Dropout generators are saved in the checkpoint. So a run stopped and resumed ends with
bit-for-bit the parameters of an uninterrupted one (on the CPU, same seed).
"""

import argparse
import dataclasses
import errno
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy
from tqdm import tqdm

from . import augment as A
from . import backend, distributed, stats
from .fast import ops
from .fast.amp import LossScaler
from .checkpoint import (check_finite, load_checkpoint, remove_stale_temporaries, restore_dropout_rngs,
                         save_checkpoint, write_atomic)
from .data import DATASETS, Dataset, load_dataset, resize_images
from .functional import GELU_KINDS, cross_entropy, cross_entropy_backward, cross_entropy_forward
from .layers import POS_EMBED_KINDS
from .memory import check_fits, size_text
from .model import DTYPES, ViT, ViTConfig, create_model, param_shapes, presets
from .optim import SGD, AdamW, WarmupCosine, clip_grad_norm, default_no_decay
from .plot import read_metrics

# --------------------------------------------------------------------------------------------------
# Recipes: named sets of defaults. Any flag given on the command line overrides its recipe's value.
# --------------------------------------------------------------------------------------------------

RECIPES = {
    # CIFAR-10, one modern GPU: aimed at >= 80% test accuracy in about 15 minutes
    "fast": dict(model="vit_cifar_tiny", epochs=30, batch_size=128, lr=1e-3, weight_decay=0.05, warmup_epochs=2,
                 label_smoothing=0.1, optimizer="adamw", augment="standard"),
    # CIFAR-10, the long schedule aimed at >= 90%: wider model, RandAugment, erasing, stochastic depth
    "long": dict(model="vit_cifar_small", epochs=200, batch_size=128, lr=1e-3, weight_decay=0.05, warmup_epochs=5,
                 label_smoothing=0.1, optimizer="adamw", augment="randaug", random_erasing=0.25, cutmix=1.0,
                 drop_path_rate=0.1),
    # Fashion-MNIST on two CPU cores: 4 blocks of width 64, patch 4, three epochs (about six minutes)
    "fashion-cpu": dict(model="vit_cifar_tiny", embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0, epochs=3,
                        batch_size=128, lr=3e-3, weight_decay=0.05, warmup_epochs=0.3, label_smoothing=0.0,
                        optimizer="adamw", augment="none"),
    # the offline demo on `shapes`: a small model, a few epochs, a couple of minutes on two CPU cores
    "demo": dict(model="vit_cifar_tiny", embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0, epochs=8,
                 batch_size=128, lr=3e-3, weight_decay=0.05, warmup_epochs=1, label_smoothing=0.0,
                 optimizer="adamw", augment="none"),
    # the paper's fine-tuning (App. B.1.1): SGD momentum 0.9, no decay, clip at norm 1, batch 512,
    # 500 warm-up steps then cosine, resolution 384 (use with --init PATH)
    "finetune": dict(model="vit_base_patch16_224", img_size=384, epochs=None, max_steps=10000, batch_size=512,
                     lr=0.01, weight_decay=0.0, warmup_steps=500, label_smoothing=0.0, optimizer="sgd",
                     momentum=0.9, clip_grad=1.0, augment="standard"),
    # CLIP (--task clip, minivit/clip_train.py) on the captioned shapes: 6.5 minutes of one CPU core (README)
    "clip-shapes": dict(task="clip", model="clip_shapes_tiny", epochs=20, batch_size=128, lr=2e-3, weight_decay=0.1,
                        warmup_epochs=1, label_smoothing=0.0, optimizer="adamw", augment="none"),
    # CLIP on Fashion-MNIST captioned from its class names and each image's shade
    "clip-fashion": dict(task="clip", model="clip_shapes_tiny", epochs=3, batch_size=64, lr=2e-3, weight_decay=0.1,
                         warmup_epochs=0.3, label_smoothing=0.0, optimizer="adamw", augment="none"),
}

# What a field takes when neither the command line nor the recipe gives it. In TrainConfig these fields
# are None ("not given"), like every other setting, so that a recipe can set them (the `long` recipe's
# cutmix and random_erasing) and a resumed run can tell a flag given, even at this value, from one left out.
BASE = dict(grad_accum=1, min_lr=0.0, momentum=0.9, mixup=0.0, cutmix=0.0, random_erasing=0.0, seed=0,
            dtype="float32", precision="float32")

DEFAULT_RECIPE = {"cifar10": "fast", "fashion-mnist": "fashion-cpu", "shapes": "demo", "folder": "demo"}
CLIP_RECIPE = {"shapes": "clip-shapes", "fashion-mnist": "clip-fashion"}   # --task clip's defaults
TASKS = ("classify", "clip")            # clip: minivit/clip_train.py's batches, step and evaluation
OPTIMIZERS = ("adamw", "sgd")
PRECISIONS = ("float32", "float16")     # float16: mixed precision (minivit/fast/amp.py)

# --------------------------------------------------------------------------------------------------
# Every setting, with its default, its --help and its choices in one place
# --------------------------------------------------------------------------------------------------


def option(default, help, choices=None, flag=None, parse=None):
    """A TrainConfig field: default, help text and choices, read by resolve (which checks the choices and
    the field's type) and by the command line (_parser). flag: the flag's name when it is not --the-name
    (an on/off field whose default is True needs one that turns it off); parse: the command line's type
    when it is not the field's."""
    return dataclasses.field(default=default, metadata=dict(help=help, choices=choices, flag=flag, parse=parse))


FROM_RECIPE = " (default: the recipe's)"


@dataclass
class TrainConfig:
    """Every setting of a run; the command line's flags are these names with - for _.
    None means "take it from the recipe" (then from the preset)."""

    # the data and the recipe
    dataset: str = option("cifar10", "the data set", DATASETS)
    task: str = option(None, "classify: a ViT on labels; clip: CLIP on captions (minivit/clip_train.py; default: "
                             "the recipe's, else classify)", TASKS)
    data_dir: str = option(None, "where the data set lives (cifar10: data/; folder: required)")
    recipe: str = option(None, "named defaults (see README; default: fast for cifar10, fashion-cpu for "
                               "fashion-mnist, demo for shapes and folder)", tuple(sorted(RECIPES)))
    # the model: None takes the recipe's value, else the preset's
    model: str = option(None, "a preset name, e.g. vit_cifar_tiny (minivit.presets; default: the recipe's)")
    img_size: int | tuple = option(None, "resize images to this side (default: the recipe's, else the data set's own)", parse=int)
    patch_size: int = option(None, "P: the side of a patch (default: the preset's)")
    embed_dim: int = option(None, "D: the width of every token (default: the recipe's, else the preset's)")
    depth: int = option(None, "the number of transformer blocks (default: the recipe's, else the preset's)")
    num_heads: int = option(None, "the attention heads of each block, dividing D (default: the recipe's, else "
                                  "the preset's)")
    mlp_ratio: float = option(None, "each MLP's hidden width, as a multiple of D (default: the recipe's, else "
                                    "the preset's)")
    pool: str = option(None, "cls: the class token (Eq. 4); gap: the mean of the tokens (default: the preset's)")
    drop_rate: float = option(None, "dropout after the position embedding, attention proj and MLP (default: 0)")
    drop_path_rate: float = option(None, "stochastic depth of the last block, 0 for the first (default: the "
                                         "recipe's, else 0)")
    pos_embed: str = option(None, "the position embedding, the paper's App. D.4 (default: learned)", POS_EMBED_KINDS)
    stem: str = option(None, "patch: P x P patches; conv: the hybrid, a CNN's feature map cut into 1x1 patches "
                             "(default: patch)")
    num_registers: int = option(None, "learned register tokens after the class token (Darcet et al. 2024; "
                                      "default: 0)")
    # the schedule and the optimizer
    epochs: float = option(None, "passes over the training images" + FROM_RECIPE)
    max_steps: int = option(None, "at most this many optimizer steps; without epochs, exactly this many")
    batch_size: int = option(None, "images per optimizer step" + FROM_RECIPE)
    grad_accum: int = option(None, "split each step into this many micro-batches (same result, less memory)")
    lr: float = option(None, "the peak learning rate, after warm-up and before the cosine decay" + FROM_RECIPE)
    min_lr: float = option(None, "the learning rate the cosine ends at")
    weight_decay: float = option(None, "decoupled weight decay, not on biases, norms, tokens or position "
                                       "embeddings" + FROM_RECIPE)
    warmup_epochs: float = option(None, "linear warm-up of the learning rate, in epochs" + FROM_RECIPE)
    warmup_steps: int = option(None, "linear warm-up in steps (overrides warmup_epochs)")
    label_smoothing: float = option(None, "eps: the target becomes (1 - eps) onehot + eps / K" + FROM_RECIPE)
    optimizer: str = option(None, "the update rule" + FROM_RECIPE, OPTIMIZERS)
    momentum: float = option(None, "SGD only: the momentum")
    clip_grad: float = option(None, "clip the global gradient norm to this (default: no clipping)")
    # the data's augmentation
    augment: str = option(None, "none; standard: crop and flip; randaug: RandAugment" + FROM_RECIPE, A.POLICIES)
    mixup: float = option(None, "mixup alpha (0: off)")
    cutmix: float = option(None, "cutmix alpha (0: off); with both on, each step picks one")
    random_erasing: float = option(None, "the probability of erasing a patch of each image")
    seed: int = option(None, "the seed of the model's initialisation, the batches and the augmentation")
    zero: bool = option(False, "with several ranks (mpiexec): shard the optimizer state across them (ZeRO-1, "
                               "minivit/distributed.py); no effect in one process")
    # where it runs, what it writes
    backend: str = option(None, "where to compute (default: the current backend)", backend.BACKENDS)
    dtype: str = option(None, "the parameters' dtype", DTYPES)
    precision: str = option(None, "float16: mixed precision (float16 matmuls, float32 master weights, "
                                       "loss scaling; for the GPU)", PRECISIONS)
    out: str | None = option("runs/default", "the run folder (metrics, checkpoint, summary, curves); {dataset} in it "
                                      "becomes the data set's name; None (from Python): write nothing", parse=str)
    resume: bool = option(False, "continue the run in OUT from its checkpoint")
    overwrite: bool = option(False, "replace the run that OUT holds (without --resume or this, it is refused)")
    eval_every: int = option(None, "evaluate (and save a checkpoint) every N steps (default: each epoch's end)")
    num_evals: int = option(None, "or: evaluate this many times, evenly spaced, the last at the end")
    eval_batch_size: int = option(500, "images per forward pass of an evaluation")
    train_subset: int = option(None, "train on the first N training images only (quick runs, data-size studies)")
    log_stats: int = option(None, "every K steps, per-layer activation mean/std, gradient norm and update-to-"
                                  "parameter ratio into metrics.jsonl (records of kind 'stats': minivit.stats)")
    # fine-tuning
    init: str = option(None, "start from pretrained weights (.npz, .safetensors or a Hugging Face folder: "
                                   "minivit.from_pretrained)")
    new_head: bool = option(True, "with --init: keep the checkpoint's head instead of a new zero-initialised one",
                            flag="--keep-head")
    init_gelu: str = option(None, "with --init: the GELU the checkpoint was trained with (default: its kind's own)",
                            GELU_KINDS)
    # the data set's availability, and the terminal
    download: bool = option(False, "cifar10: download it when missing or damaged")
    fallback: bool = option(False, "cifar10 unavailable: fall back to Fashion-MNIST, else shapes")
    progress: bool = option(True, "no progress bar", flag="--no-progress")
    verbose: bool = option(True, "without the run's first line and one line per evaluation", flag="--quiet")


# A resumed run takes its settings from the checkpoint. Where and how it runs may change freely; its
# length and evaluation cadence change when asked for (said in one line); any other setting that differs
# is refused by name.
RESUME_RUNTIME = ("out", "resume", "overwrite", "progress", "verbose", "backend", "eval_batch_size", "download",
                  "fallback", "zero", "log_stats")
RESUME_APPLIED = ("epochs", "max_steps", "eval_every", "num_evals")
RUN_FILES = ("checkpoint.npz", "metrics.jsonl", "summary.json", "curves.png")
MODEL_FIELDS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "pool", "drop_rate",
                "drop_path_rate", "pos_embed", "stem", "num_registers")


class TrainingDiverged(RuntimeError):
    """The loss, the validation loss or a parameter became NaN or infinite after `step` optimizer steps
    had run (`step` is the 0-based index of the step whose loss was not finite); the checkpoint of the
    last finite evaluation was kept."""

    def __init__(self, message, step=None):
        super().__init__(message)
        self.step = step


@dataclass
class TrainResult:
    model: object
    history: list      # one dict per evaluation
    summary: dict
    out: str


def _one_of(choices):
    return f"{choices[0]!r} or {choices[1]!r}" if len(choices) == 2 else f"one of {choices}"


def _check_types_and_choices(cfg):
    """Each field's value of its annotated type (None where None is the default), and among its choices."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None and f.default is None:
            continue
        kind = (int, float) if f.type is float else f.type              # an int is a fine float
        if not isinstance(value, kind) or (isinstance(value, bool) and f.type is not bool):
            raise TypeError(f"{f.name} must be of type {getattr(f.type, '__name__', f.type)}, got {value!r}")
        choices = f.metadata["choices"]
        if choices is not None and value not in choices:
            raise ValueError(f"{f.name} must be {_one_of(choices)}, got {value!r}")


def resolve(cfg):
    """A copy of cfg with every None filled in from its recipe; checked, with errors that name the value."""
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of {DATASETS}")
    if cfg.recipe is None:
        default = CLIP_RECIPE if cfg.task == "clip" else DEFAULT_RECIPE
        if cfg.dataset not in default:
            raise ValueError(f"--task clip trains on a captioned data set: {tuple(default)}, got {cfg.dataset!r}")
        cfg = dataclasses.replace(cfg, recipe=default[cfg.dataset])
    if cfg.recipe not in RECIPES:
        raise ValueError(f"unknown recipe {cfg.recipe!r}; choose one of {sorted(RECIPES)}")
    recipe_task = RECIPES[cfg.recipe].get("task", "classify")
    if cfg.task not in (None, recipe_task):
        raise ValueError(f"recipe {cfg.recipe!r} is one of --task {recipe_task}, not --task {cfg.task}")
    values = dataclasses.asdict(cfg)
    steps_only = cfg.max_steps is not None and cfg.epochs is None   # max_steps alone: exactly that many
    for key, value in RECIPES[cfg.recipe].items():      # (with --init the model's shape is the checkpoint's)
        if values.get(key) is None and not (key == "epochs" and steps_only) and not (cfg.init and key in MODEL_FIELDS):
            values[key] = value
    for key, value in BASE.items():                                # then what no recipe sets
        if values[key] is None:
            values[key] = value
    values["task"] = values["task"] or "classify"
    r = TrainConfig(**values)
    if r.task == "clip":
        from .clip_train import check_config

        check_config(r)                            # the classifier's options refused by name, the CLIP preset
    elif r.model not in presets:
        raise ValueError(f"unknown model preset {r.model!r}; choose one of {sorted(presets)}")
    _check_types_and_choices(r)
    if r.precision == "float16" and r.dtype != "float32":
        raise ValueError(f"precision 'float16' keeps float32 master weights: it needs dtype 'float32', got {r.dtype!r}")
    if r.epochs is None and r.max_steps is None:
        raise ValueError("give epochs or max_steps")
    for name in ("batch_size", "max_steps", "eval_every", "num_evals", "eval_batch_size", "train_subset", "log_stats"):
        if getattr(r, name) is not None and getattr(r, name) < 1:
            raise ValueError(f"{name} must be a positive int, got {getattr(r, name)!r}")
    if r.grad_accum < 1 or r.batch_size % r.grad_accum:
        raise ValueError(f"grad_accum must be a positive int dividing batch_size={r.batch_size}, got {r.grad_accum!r}")
    for name in ("epochs", "lr", "clip_grad"):                     # > 0 (where given)
        if getattr(r, name) is not None and not 0 < getattr(r, name) < math.inf:
            raise ValueError(f"{name} must be > 0 and finite, got {getattr(r, name)!r}")
    for name in ("weight_decay", "warmup_epochs", "warmup_steps", "seed", "mixup", "cutmix"):   # >= 0
        if getattr(r, name) is not None and not 0 <= getattr(r, name) < math.inf:
            raise ValueError(f"{name} must be >= 0 and finite, got {getattr(r, name)!r}")
    if not 0 <= r.min_lr <= r.lr:
        raise ValueError(f"min_lr must be in [0, lr={r.lr}], got {r.min_lr!r}")
    for name in ("momentum", "label_smoothing"):
        if not 0 <= getattr(r, name) < 1:
            raise ValueError(f"{name} must be in [0, 1), got {getattr(r, name)!r}")
    if not 0 <= r.random_erasing <= 1:
        raise ValueError(f"random_erasing must be a probability in [0, 1], got {r.random_erasing!r}")
    if r.eval_every is not None and r.num_evals is not None:
        raise ValueError(f"give eval_every or num_evals, not both (got {r.eval_every!r} and {r.num_evals!r})")
    if r.log_stats and r.out is None:
        raise ValueError(f"log_stats {r.log_stats} writes its records to out/metrics.jsonl, but out is None")
    if r.resume and r.overwrite:
        raise ValueError("give resume (continue the run in out) or overwrite (replace it), not both")
    return r


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

CIFAR_UNAVAILABLE = """\
CIFAR-10 is not available: {reason}
Download it with `python data_scripts/download_cifar10.py --root {root}` (163 MiB from the University of
Toronto), or put cifar-10-python.tar.gz (md5 c58f30108f718f92721af3b95e74349a) into {root}/ by hand.
So that this command still shows a training run, it falls back to {fallback}{note}."""


def _download_cifar10(root):
    """Fetch and unpack CIFAR-10 into root; raises NetworkError/ValueError when it cannot."""
    from .data import CIFAR10_ARCHIVE, CIFAR10_MD5, CIFAR10_URL
    from .download import download_file, safe_extract_tar

    archive = os.path.join(root, CIFAR10_ARCHIVE)
    download_file(CIFAR10_URL, archive, CIFAR10_MD5[CIFAR10_ARCHIVE])
    safe_extract_tar(archive, root)


def prepare_data(cfg):
    """Load cfg.dataset; for CIFAR-10 download it when asked, and fall back when allowed.
    Returns (Dataset, cfg), cfg's dataset changed by a fallback. Runs before the recipe is applied, so a
    run without an explicit recipe gets the fallback data set's own (sized for a CPU)."""
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of {DATASETS}")
    if cfg.dataset != "cifar10":
        return load_dataset(cfg.dataset, cfg.data_dir), cfg
    root = cfg.data_dir or "data"
    try:
        return load_dataset("cifar10", root), cfg
    except (FileNotFoundError, ValueError) as unavailable:   # missing, or damaged (checksum, archive)
        reason = str(unavailable)
        if cfg.download:
            if not isinstance(unavailable, FileNotFoundError):
                _move_aside_damaged_cifar10(root)          # so that the download replaces it
            try:
                _download_cifar10(root)
                return load_dataset("cifar10", root), cfg
            except (OSError, ValueError) as err:  # NetworkError is an OSError
                reason = f"{reason}; the download failed ({err})"
        if not cfg.fallback:
            if cfg.download:
                raise type(unavailable)(reason) from None
            raise
    from .data import FASHION_MNIST_DIRS

    fashion = any(os.path.isdir(d) for d in FASHION_MNIST_DIRS)
    name = "fashion-mnist" if fashion else "shapes"
    where = "Fashion-MNIST (Debian's copy in /usr/share/datasets/fashion-mnist)" if fashion else \
        "`shapes`, the procedural data set that needs no download"
    note = f", with the '{DEFAULT_RECIPE[name]}' recipe" if cfg.recipe is None else f", keeping the '{cfg.recipe}' recipe"
    print(CIFAR_UNAVAILABLE.format(reason=reason, root=root, fallback=where, note=note), flush=True)
    cfg = dataclasses.replace(cfg, dataset=name, data_dir=None)
    return load_dataset(cfg.dataset, cfg.data_dir), cfg


def _move_aside_damaged_cifar10(root):
    """Rename the CIFAR-10 copy that failed its checks (the folder, else the archive) to NAME.damaged, so a
    fresh download takes its place and nothing is deleted."""
    from .data import CIFAR10_ARCHIVE, CIFAR10_FOLDER

    for name in (CIFAR10_FOLDER, CIFAR10_ARCHIVE):       # the order load_cifar10 reads them in
        path = os.path.join(root, name)
        if os.path.exists(path):
            aside, n = path + ".damaged", 1
            while os.path.exists(aside):
                aside, n = f"{path}.damaged{n}", n + 1
            os.replace(path, aside)
            print(f"{path} failed its checks: moved it aside to {aside}", flush=True)
            return


def build_model(cfg, data, resumed=None):
    """The ViT for cfg and this data set: the preset, the overrides, and the data's channels and classes.
    resumed: a checkpoint to continue, whose saved config is used (its weights are loaded later)."""
    if cfg.task == "clip":
        from .clip_train import build_model as build_clip

        return build_clip(cfg, data, resumed)
    if resumed is not None:
        try:
            config = ViTConfig.from_dict(resumed["meta"]["config"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{resumed['path']!r}: the saved model config is not valid ({err})") from None
        return ViT(config, seed=cfg.seed, dtype=cfg.dtype)
    H, W, C = data.image_shape
    overrides = {k: getattr(cfg, k) for k in MODEL_FIELDS if getattr(cfg, k) is not None}
    overrides.setdefault("img_size", (H, W))
    overrides.update(in_chans=C, num_classes=data.num_classes)
    if cfg.init:
        from .convert import from_pretrained

        model = from_pretrained(cfg.init, num_classes=data.num_classes, img_size=overrides["img_size"],
                                gelu=cfg.init_gelu, seed=cfg.seed, dtype=cfg.dtype, new_head=cfg.new_head)
        differ = [f"{_flag(k)} {getattr(cfg, k)!r} (the checkpoint's: {getattr(model.config, k)!r})"
                  for k in MODEL_FIELDS if k != "img_size" and getattr(cfg, k) is not None
                  and getattr(cfg, k) != getattr(model.config, k)]
        if differ:
            raise ValueError(f"--init {cfg.init} builds the checkpoint's model, and these flags ask for another: "
                             f"{'; '.join(differ)}. Leave them out (only --img-size changes a checkpoint's model)")
        return model
    if cfg.model in presets:          # weights, gradients and AdamW's two moments: 4 copies, before one is made
        config = dataclasses.replace(presets[cfg.model], **overrides)
        n = sum(math.prod(shape) for shape in param_shapes(config).values())
        check_fits(4 * n * numpy.dtype(cfg.dtype or "float32").itemsize,
                   f"the model ({n:,} parameters: weights, gradients, the optimizer's two moments)",
                   "lower --embed-dim or --depth, or choose a smaller --model")
    return create_model(cfg.model, seed=cfg.seed, dtype=cfg.dtype, **overrides)


def build_optimizer(cfg, model):
    """AdamW or SGD; biases, LayerNorm weights, the class token and position embeddings get no decay."""
    no_decay = default_no_decay(model.params)
    if cfg.optimizer == "adamw":
        return AdamW(model, cfg.lr, weight_decay=cfg.weight_decay, no_decay=no_decay)
    return SGD(model, cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, no_decay=no_decay)


def batch_for_step(step, cfg, data_x, data_y, steps_per_epoch, mean, std, dtype, num_classes, world=None):
    """The augmented batch of optimizer step `step`: a function of (seed, step) only (see the module doc).
    data_x: uint8 (N, H, W, C) on the backend; data_y: int64 (N,) on the backend. world: the communicator
    of several ranks (minivit/distributed.py), or None: rank r takes rows [r b, (r + 1) b) of the global
    batch, b = B / R, and augments them from its own stream of (seed, step, r).
    Returns x float (B, H, W, C) and targets: labels (B,) or soft targets (B, K) with mixup/cutmix."""
    epoch, i = divmod(step, steps_per_epoch)
    order = backend.host_rng([cfg.seed, epoch]).permutation(data_x.shape[0])       # (N,)
    idx = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]                        # (B,)
    seed = [cfg.seed, 1_000_003, step]
    if world is not None:                         # several ranks: this rank's rows, its own stream
        idx = idx[distributed.local_slice(cfg.batch_size, world.rank, world.world_size)]   # (b,)
        seed = distributed.rank_seed(seed, world.rank)
    idx_dev = backend.asarray(idx, backend=backend.backend_of(data_x))
    rng = backend.host_rng(seed)
    x = A.augment_batch(data_x[idx_dev], rng, cfg.augment, mean, std, dtype)       # (B, H, W, C)
    y = data_y[idx_dev]                                                             # (B,)
    if cfg.random_erasing:
        x = A.random_erasing(x, rng, p=cfg.random_erasing)
    if cfg.mixup or cfg.cutmix:
        use_cutmix = cfg.cutmix and (not cfg.mixup or rng.random() < 0.5)
        if use_cutmix:
            x, y = A.cutmix(x, y, rng, cfg.cutmix, num_classes=num_classes)        # y: (B, K)
        else:
            x, y = A.mixup(x, y, rng, cfg.mixup, num_classes=num_classes)
    return x, y


def evaluate(model, x_test, y_test, mean, std, dtype, batch_size=500):
    """Mean loss and accuracy over a held-out split, in eval mode (no caches, no dropout)."""
    was_training = model.training
    model.eval()
    total_loss, correct, n = 0.0, 0, x_test.shape[0]
    try:
        for start in range(0, n, batch_size):
            xb = A.normalize(x_test[start:start + batch_size], mean, std, dtype)   # (b, H, W, C)
            yb = y_test[start:start + batch_size]                                    # (b,)
            logits = model.forward(xb)                                              # (b, K)
            loss, _ = cross_entropy(logits, yb)
            total_loss += loss * yb.shape[0]
            correct += int((logits.argmax(-1) == yb).sum())
    finally:
        model.train(was_training)
    return total_loss / n, correct / n


def announce_ops(model, optimizer, images, mean, std, dtype, forward=True):
    """Which ops will run from kernels.py and which from functional.py (minivit/fast/ops.py), as lines to print,
    and a line for each group of layers that are your code (or where a kernel dropped out or stayed).
    One training forward and backward on a couple of images, recorded layer by layer (ops.report; the
    model's gradients, caches and random generators are put back, so the run itself is unchanged), makes
    ops check every fast twin the model uses against functional.py as it stands now.
    forward=False: the caller has run that forward (CLIPTask.announce_forward); the lines then say which
    ops ran so far, not per layer."""
    p = next(iter(model.params.values()))
    fast_update = ops.uses_twin("adamw", p) if isinstance(optimizer, AdamW) else None
    if not forward:
        return ops.summary_lines()
    recorded = ops.report(model, A.normalize(images, mean, std, dtype), training=True)
    if fast_update is not None:
        recorded.note_optimizer("adamw", fast_update, p)
    return recorded.summary_lines(probe_seconds=ops.report().probe_seconds)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class SecondSignal(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: the run stops at once, even during its save (checkpoints are written
    atomically, so the last one completed is whole). signum: the signal."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM (what a cluster scheduler sends before it kills a job) sets the flag;
    the loop finishes its step, evaluates, saves a checkpoint and stops. A second signal interrupts at once."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum, self.received, self._old = None, False, {}

    @property
    def stop(self):
        return self.signum is not None

    def __enter__(self):
        for signum in self.SIGNALS:
            try:
                self._old[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread (e.g. some notebook runners): no handler
                pass
        return self

    def _handle(self, signum, frame):
        if self.received:
            raise SecondSignal(signum)
        self.signum, self.received = signum, True

    def agree(self, world):
        """Several ranks: all stop after this step when any of them was told to (the launcher forwards a
        signal to each, not at the same instant). A rank's own signal arriving after that is not a second one."""
        self.signum = world.max(self.signum or 0, what="the stop signal") or None

    def __exit__(self, *exc):
        for signum, old in self._old.items():
            signal.signal(signum, old)


def train_step(model, optimizer, x, y, cfg, scaler=None, dp=None):
    """One optimizer step on batch (x, y), in cfg.grad_accum micro-batches. Returns (loss, correct, grad_norm).
    scaler: an amp.LossScaler (mixed precision): the backward gets the scaled loss gradient, and a step whose
    gradients overflowed is skipped (grad_norm is then inf). y's labels were checked once, for the whole data
    set (check_labels); the loss, the count of correct answers, the scaler's finiteness and the gradient
    norm stay where the arrays are until the end of the step, then come to the host in ONE transfer: on the
    GPU the only time a step waits for the device. dp: a distributed.DataParallel when several ranks train
    (x, y: this rank's slice): the gradients are averaged over the ranks before anything looks at them."""
    model.zero_grad()
    micro = x.shape[0] // cfg.grad_accum
    xp = backend.get_array_module(x)
    total_loss, correct = 0.0, 0                   # 0-d arrays on x's device after the first micro-batch
    # with loss scaling float16 overflows now and then, by design (that step is skipped): NumPy's
    # "overflow encountered" warnings would be noise
    with numpy.errstate(over="ignore", invalid="ignore") if scaler is not None else nullcontext():
        for j in range(cfg.grad_accum):
            xb, yb = x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro]
            logits = model.forward(xb)                                                  # (b, K)
            loss, cache = cross_entropy_forward(logits, yb, cfg.label_smoothing)        # loss: 0-d, on the device
            dlogits = cross_entropy_backward(cache) / cfg.grad_accum   # each micro-batch weighs 1/grad_accum
            model.backward(dlogits if scaler is None else scaler.scale(dlogits))
            total_loss = total_loss + loss / cfg.grad_accum
            labels = yb if yb.ndim == 1 else yb.argmax(-1)
            correct = correct + (logits.argmax(-1) == labels).sum()
    if dp is not None:
        dp.average_gradients()                       # g <- 1/R sum_r g_r: the whole global batch's gradient
    step_numbers = [total_loss, correct]
    if scaler is not None:                           # gradients / S, before clipping looks at them
        step_numbers.append(scaler.unscale(model) if dp is None else dp.unscale(scaler))
    if cfg.clip_grad:
        step_numbers.append(clip_grad_norm(model, cfg.clip_grad) if dp is None else dp.clip_grad_norm(cfg.clip_grad))
    read = backend.to_numpy(xp.stack([xp.asarray(v, dtype="float64") for v in step_numbers]))  # the one read
    loss, correct = float(read[0]), int(read[1])
    if dp is not None:                               # the global batch's loss and count, the same on every rank
        loss, correct = dp.batch_metrics(loss, correct)
    if not math.isfinite(loss):
        return loss, 0, float("nan")
    if scaler is not None:
        finite = bool(read[2])
        scaler.update(finite)
        if not finite:                               # float16 overflowed: skip the update, S was halved
            return loss, correct, float("inf")
    grad_norm = float(read[-1]) if cfg.clip_grad else None
    if dp is None:
        optimizer.step()
    else:
        dp.step()                                    # ZeRO-1: this rank's shard, then an all-gather of all
    return loss, correct, grad_norm


def check_labels(data, num_classes=None):
    """The labels of both splits in [0, K), checked once on the host before they go to the device (the
    training step then checks nothing: on the GPU each check would wait for the device). K: the model's
    num_classes where it has one (its head's width: a label past it would index outside the logits)."""
    K = data.num_classes if num_classes is None else num_classes
    if num_classes is not None and num_classes != data.num_classes:
        raise ValueError(f"the model has {num_classes} classes and {data.name} has {data.num_classes}: give a "
                         f"model with num_classes={data.num_classes}")
    for split, y in (("y_train", data.y_train), ("y_test", data.y_test)):
        y = numpy.asarray(y)
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise ValueError(f"{data.name}: {split} must be integer class indices (N,), got {y.dtype} {y.shape}")
        if y.size and (y.min() < 0 or y.max() >= K):
            raise ValueError(f"{data.name}: {split} must be in [0, {K}) for {K} classes, "
                         f"got values from {y.min()} to {y.max()}")


def non_finite_params(model):
    """Names of the parameters holding a NaN or an infinity. One reduction per array, stacked into one
    vector, so that a device waits once however many parameters the model has."""
    names, params = list(model.params), list(model.params.values())
    if not params:
        return []
    xp = backend.get_array_module(params[0])
    finite = backend.to_numpy(xp.stack([xp.isfinite(p).all() for p in params]))   # (num_arrays,) bool
    return [name for name, ok in zip(names, finite) if not ok]


# --------------------------------------------------------------------------------------------------
# The run folder: refused when it holds a run nobody asked to continue or replace, checked writable before
# the first step, every write atomic (or an append whose torn end is dropped on resume)
# --------------------------------------------------------------------------------------------------


def _naming_path(err, path):
    """The OSError err, naming the file being written (a failed write() names none, a failed temporary file
    its own name), with the original cause."""
    return OSError(err.errno, err.strerror or str(err), path)


def _append_jsonl(path, record):
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:
        raise _naming_path(err, path) from None


def _write_json_atomic(path, obj):
    try:
        write_atomic(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))
    except OSError as err:
        raise _naming_path(err, path) from None


def _write_jsonl_atomic(path, records):
    try:
        write_atomic(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
    except OSError as err:
        raise _naming_path(err, path) from None


def check_out(cfg):
    """Refuse, before anything is read or written, an out that is a file, or that holds a run (checkpoint,
    metrics or summary) which cfg neither resumes nor overwrites."""
    out = cfg.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(errno.ENOTDIR, "--out must be a folder, and a file is in the way", out)
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):                 # the folders makedirs would create: under a file?
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"--out cannot be created: {parent} is a file", out)
    check_not_in_use(out)
    held = [name for name in RUN_FILES[:3] if os.path.exists(os.path.join(out, name))]
    if held and not (cfg.resume or cfg.overwrite) and "checkpoint.npz" not in held:
        raise ValueError(f"--out {out} holds the start of a run that saved no checkpoint ({', '.join(held)}; "
                         f"stopped before or during its first save): nothing to resume; replace it with "
                         f"--overwrite, or choose another --out")
    if held and not (cfg.resume or cfg.overwrite):
        raise ValueError(f"--out {out} already holds a run ({', '.join(held)}): continue it with --resume, "
                         f"replace it with --overwrite, or choose another --out")


LOCK_FILE = ".lock"            # OUT/.lock: held (fcntl.flock) by the run writing OUT, holding its pid, removed at its end
REPLACED = ".replaced-run"     # OUT/.replaced-run/: the run --overwrite replaces, kept until the new one's first checkpoint


class RunFolderInUse(RuntimeError):
    """Another process holds the lock of the run folder: two runs writing one folder would interleave their
    metrics and overwrite each other's checkpoints."""


def _lock_pid(fd):
    """The pid written in an open lock file (None when it holds none)."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _in_use(out, pid):
    return RunFolderInUse(f"--out {out} is in use by another run (pid {pid if pid is not None else 'unknown'}, which "
                          f"holds {os.path.join(out, LOCK_FILE)}): wait for it to end or stop it, or choose another --out")


def check_not_in_use(out):
    """Refuse, before anything is read, an out whose lock another live run holds (a look, not a lock: the run
    takes it in lock_out). Skipped under an MPI launcher, where rank 0 alone takes the lock, maybe already."""
    path = os.path.join(out, LOCK_FILE)
    if distributed.launched_by_mpi() or not os.path.isfile(path):
        return
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return                                    # unreadable: lock_out will say why
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out, _lock_pid(fd)) from None
    finally:
        os.close(fd)


def lock_out(out):
    """Take the advisory lock of out (created if missing) for the life of this run, writing this pid into
    OUT/.lock. Another live run's lock is refused naming its pid; a lock file whose process has ended (the
    kernel dropped its lock) is taken over, saying so. Returns the lock's file descriptor (for unlock_out)."""
    import fcntl

    path = os.path.join(out, LOCK_FILE)
    while True:
        try:
            os.makedirs(out, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise OSError(err.errno, f"--out cannot be used as the run folder: {err.strerror or err}", out) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _lock_pid(fd)
            os.close(fd)
            raise _in_use(out, pid) from None
        try:                                      # the file locked is still the one at path (the run before
            if os.path.samestat(os.fstat(fd), os.stat(path)):   # may have removed it meanwhile): then it is ours
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    old = _lock_pid(fd)
    if old is not None and old != os.getpid():
        print(f"{os.path.join(out, LOCK_FILE)}: the run of pid {old} ended without releasing it (killed?); "
              f"taking it over", flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_out(fd, out):
    """Release lock_out's lock: OUT/.lock is removed while still locked (a run that opened it meanwhile sees,
    once it holds the lock, that the file at that path is no longer the one it locked, and starts again)."""
    try:
        os.remove(os.path.join(out, LOCK_FILE))
    except OSError:
        pass                                      # the lock itself is what matters, and closing releases it
    os.close(fd)


def open_out(out, overwrite=False):
    """Make out ready for the first step: created, written to once (a probe file), cleared of the temporary
    files of an interrupted write; an earlier --overwrite that a hard kill interrupted is settled (settle_replaced);
    with overwrite, the run out holds is moved aside to OUT/.replaced-run/ (deleted at the new run's first
    checkpoint, moved back if the new run fails before it). Returns that folder, or None. An OSError names
    out and the cause."""
    aside = None
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-probe.tmp")
        with open(probe, "w") as f:
            f.write("minivit checks that it can write here\n")
        os.remove(probe)
        stale = remove_stale_temporaries(out)
        settle_replaced(out)
        present = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
        if overwrite and present:
            aside = os.path.join(out, REPLACED)
            os.makedirs(aside)
            for name in present:
                os.replace(os.path.join(out, name), os.path.join(aside, name))
    except OSError as err:
        raise OSError(err.errno, f"--out cannot be used as the run folder: {err.strerror or err}", out) from None
    if stale:
        print(f"removed {len(stale)} temporary file(s) of an interrupted write: "
              f"{', '.join(os.path.basename(p) for p in stale)}", flush=True)
    return aside


def settle_replaced(out, failed=False):
    """The run that --overwrite moved aside to OUT/.replaced-run/: deleted once the new run has a checkpoint;
    moved back (over the new run's files) when the new run failed (failed=True) or a hard kill stopped it
    before its first checkpoint."""
    import shutil

    aside = os.path.join(out, REPLACED)
    if not os.path.isdir(aside):
        return
    if not failed and os.path.exists(os.path.join(out, "checkpoint.npz")):
        shutil.rmtree(aside)
        return
    for name in RUN_FILES:
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in os.listdir(aside):
        os.replace(os.path.join(aside, name), os.path.join(out, name))
    os.rmdir(aside)
    print(f"the run that --overwrite was to replace is back in {out}: the new run ended before its first "
          f"checkpoint", flush=True)


# --------------------------------------------------------------------------------------------------
# Resuming
# --------------------------------------------------------------------------------------------------


def _flag(name):
    """The command-line flag of a TrainConfig field: --the-name, or the one its option() names."""
    return TrainConfig.__dataclass_fields__[name].metadata["flag"] or "--" + name.replace("_", "-")


def _resume_folder(cfg):
    """cfg.out, with "{dataset}" replaced: by cfg.dataset, or with fallback by the first data set the run
    may have fallen back to whose folder holds a checkpoint."""
    if "{dataset}" not in cfg.out:
        return cfg.out
    names = [cfg.dataset] + (["fashion-mnist", "shapes"] if cfg.fallback and cfg.dataset == "cifar10" else [])
    for name in names:
        folder = cfg.out.replace("{dataset}", name)
        if os.path.exists(os.path.join(folder, "checkpoint.npz")):
            return folder
    return cfg.out.replace("{dataset}", cfg.dataset)


def resume_config(cfg):
    """The run in cfg.out to continue: (its TrainConfig with cfg's permitted changes, the checkpoint, the
    TrainConfig it was saved with, {field: new value} of the changes applied). A field of cfg that is not
    its default and differs from the run's own is a change: applied if it is the run's length or its
    evaluation cadence (RESUME_APPLIED), refused by name otherwise; where and how it runs always follow cfg."""
    if cfg.out is None:
        raise ValueError("resume needs out: the folder that holds checkpoint.npz")
    out = _resume_folder(cfg)
    check_not_in_use(out)
    ckpt_path = os.path.join(out, "checkpoint.npz")
    if not os.path.exists(ckpt_path) and os.path.exists(os.path.join(out, "metrics.jsonl")):
        raise FileNotFoundError(f"--resume: the run in {out} saved no checkpoint (stopped before or during its "
                                f"first save): nothing to resume; start it again with --overwrite")
    if not os.path.exists(ckpt_path):
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path!r} (train into --out {out!r} first)")
    resumed = load_checkpoint(ckpt_path)
    extra = resumed["meta"].get("extra") or {}
    missing = [k for k in ("train_config", "step", "best_val_accuracy") if k not in extra]
    if resumed["optimizer"] is None:
        missing.append("optimizer state")
    if missing:
        raise ValueError(f"{ckpt_path!r} holds no training state to resume (no {', '.join(missing)}): "
                         f"was it written by minivit.train?")
    check_finite(resumed["params"], repr(ckpt_path))
    check_finite({f"optim/{kind}/{name}": buf for kind, buffers in resumed["optimizer"]["buffers"].items()
                  for name, buf in buffers.items()}, repr(ckpt_path), "optimizer buffers",
                 "a damaged or edited file: resume from another checkpoint, or start a new run")
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in extra["train_config"].items()
             if k in fields}                             # JSON made img_size a list; older runs may have more keys
    before = TrainConfig(**saved)
    fell_back = cfg.fallback and cfg.dataset == "cifar10" and saved.get("dataset") != "cifar10"
    applied, refused = {}, []
    for name, value in dataclasses.asdict(cfg).items():
        if name in RESUME_RUNTIME or value == fields[name] or value == saved.get(name, fields[name]):
            continue
        if fell_back and name in ("dataset", "data_dir"):   # asked again for the CIFAR-10 it fell back from
            continue
        if name in RESUME_APPLIED:
            applied[name] = value
        else:
            refused.append(f"{_flag(name)} {value!r} (the run's: {saved.get(name, fields[name])!r})")
    if refused:
        raise ValueError(f"--resume continues the run in {out} with its own settings, and these differ from "
                         f"them: {'; '.join(refused)}. On resume only {', '.join(map(_flag, RESUME_APPLIED))} "
                         f"may change; to change the rest, start a new run (another --out, or --overwrite)")
    if "epochs" in applied or "max_steps" in applied:        # the new length, said as a fresh run says it
        saved.update(epochs=applied.get("epochs"), max_steps=applied.get("max_steps"))
    if "eval_every" in applied or "num_evals" in applied:
        saved.update(eval_every=applied.get("eval_every"), num_evals=applied.get("num_evals"))
    saved.update({k: getattr(cfg, k) for k in RESUME_RUNTIME}, out=out)
    return TrainConfig(**saved), resumed, before, applied


def check_resumed_data(resumed, data):
    """Refuse to resume on other data than the run's: another data set, or classes renamed, added or removed
    (a renamed class folder would swap the labels silently). The checkpoint stores the data set's name, its
    class names and their count; each change is named."""
    path, extra = resumed["path"], resumed["meta"]["extra"]
    changes = []
    if "dataset" in extra and extra["dataset"] != data.name:
        changes.append(f"the data set is {data.name!r}, the run's was {extra['dataset']!r}")
    saved, now = extra.get("classes"), getattr(data, "classes", None)
    if saved is not None and now is not None and list(saved) != list(now):
        gone, new = [c for c in saved if c not in now], [c for c in now if c not in saved]
        if len(gone) == len(new) and gone:
            changes.append("classes renamed: " + ", ".join(f"{a!r} -> {b!r}" for a, b in zip(gone, new)))
        else:
            if new:
                changes.append(f"classes added: {new}")
            if gone:
                changes.append(f"classes removed: {gone}")
            if not new and not gone:
                changes.append(f"the classes are in another order: {list(now)}, the run's {list(saved)}")
    count = extra.get("num_classes", len(saved) if saved is not None else None)
    if count is not None and now is not None and count != len(now) and not changes:
        changes.append(f"{len(now)} classes, the run's model has {count}")
    if changes:
        raise ValueError(f"--resume: the data differ from those the run in {os.path.dirname(path)} trained on: "
                         f"{'; '.join(changes)}. Resume on the run's own data, or start a new run (another --out, "
                         f"or --overwrite)")


def _cadence(cfg):
    if cfg.num_evals:
        return f"{cfg.num_evals} evaluations evenly spaced"
    return f"every {cfg.eval_every} steps" if cfg.eval_every else "at the end of each epoch"


def run_length(cfg, steps_per_epoch):
    """Optimizer steps of the run: ceil(epochs * steps_per_epoch), at most max_steps; max_steps alone: that many."""
    total = math.ceil(cfg.epochs * steps_per_epoch) if cfg.epochs is not None else cfg.max_steps
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


def _history_to_resume(out, step):
    """The evaluation records of the run in out up to its checkpoint's step (a record written after the
    checkpoint, and a torn last line, are dropped: the resumed run writes them again)."""
    if not os.path.exists(os.path.join(out, "metrics.jsonl")):
        return []
    records = read_metrics(out)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) < len(records):
        print(f"dropped {len(records) - len(kept)} record(s) of {os.path.join(out, 'metrics.jsonl')} written "
              f"after the checkpoint's step {step}", flush=True)
    return kept


def restore(run, resumed, before, applied):
    """Put the checkpoint's state into run (weights, optimizer, dropout RNGs, loss scale, step, history),
    and say what cfg changed: the run's length (its schedule recomputed) or its evaluation cadence."""
    path, meta, extra = resumed["path"], resumed["meta"], resumed["meta"]["extra"]
    if run.scaler is not None and "loss_scaler" not in extra:
        raise ValueError(f"{path!r} has no loss-scaler state for its float16 run (an edited file?)")
    try:
        run.model.load_state_dict(resumed["params"])
        run.optimizer.load_state_dict(resumed["optimizer"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path!r}: {err}") from None
    restore_dropout_rngs(run.model, meta.get("dropout_rng") or {})
    if run.scaler is not None:
        run.scaler.load_state_dict(extra["loss_scaler"])
    run.step = run.start_step = run.saved_step = extra["step"]
    run.best = extra["best_val_accuracy"]
    if run.total_steps < run.step:
        raise ValueError(f"{' '.join(f'{_flag(k)} {v}' for k, v in applied.items())}: the run is already at "
                         f"step {run.step}, past the {run.total_steps} steps that asks for")
    run.history = _history_to_resume(run.cfg.out, run.step)
    print(f"resuming {path} at step {run.step} of {run.total_steps}", flush=True)
    old_total = run_length(resolve(before), run.steps_per_epoch)
    if run.total_steps != old_total:
        print(f"the run now ends at step {run.total_steps} instead of {old_total}: the learning-rate schedule is "
              f"recomputed for {run.total_steps} steps from step {run.step} on, so the result differs from that "
              f"of a run set up for {run.total_steps} steps from the start", flush=True)
    if _cadence(run.cfg) != _cadence(before):
        print(f"from step {run.step} on, evaluations and checkpoints {_cadence(run.cfg)} (the run had them "
              f"{_cadence(before)})", flush=True)


# --------------------------------------------------------------------------------------------------
# The run: set_up, run_loop, evaluate_and_save, finish
# --------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One training run: what set_up built, and the state that run_loop advances."""

    cfg: TrainConfig            # resolved: every None filled in from the recipe
    data: Dataset               # host arrays; x_train ... y_test below are their copies on the backend
    model: object
    optimizer: object
    scaler: object              # an amp.LossScaler when precision is float16, else None
    schedule: WarmupCosine      # the learning rate of each step
    steps_per_epoch: int
    total_steps: int
    eval_steps: object          # an EvalSteps: evaluate, record and save after these steps (and at a Ctrl-C or SIGTERM)
    given_model: bool = False   # a model passed to train(), not built from cfg
    world: object = None        # several ranks (mpiexec): their communicator (minivit/distributed.py), else None
    dp: object = None           # and the DataParallel that exchanges each step's gradients
    task: object = None         # --task clip: a clip_train.CLIPTask (batches, step, evaluation); None: classify
    x_train: object = None      # uint8 (N, H, W, C) on the backend
    y_train: object = None      # int64 (N,)
    x_test: object = None
    y_test: object = None
    step: int = 0               # optimizer steps done
    best: float = 0.0           # the best validation accuracy so far
    history: list = dataclasses.field(default_factory=list)   # one record per evaluation
    saved_step: int = None      # the step of the checkpoint in cfg.out (None: none written yet)
    start_step: int = 0         # where this session started (0, or the resumed step)
    start_time: float = 0.0
    eval_seconds: float = 0.0
    seen_loss: float = 0.0      # the training loss, summed over the images seen since the last evaluation
    seen_correct: int = 0
    seen_images: int = 0
    lock: int = None            # the file descriptor of OUT/.lock while this run holds it (lock_out)
    made_out: bool = False      # OUT did not exist before this run: removed again if the run fails in set_up
    replaced: str = None        # OUT/.replaced-run/ until the first checkpoint (--overwrite; open_out)

    @property
    def writes(self):
        """One process, or rank 0 of several: the one that writes the run's files."""
        return self.world is None or self.world.rank == 0

    @property
    def ckpt_path(self):
        return None if self.cfg.out is None else os.path.join(self.cfg.out, "checkpoint.npz")

    def images_per_second(self):
        return (self.step - self.start_step) * self.cfg.batch_size / max(time.perf_counter() - self.start_time, 1e-9)

    def diverged(self, what):
        """The TrainingDiverged of this step: what was not finite, when, and which checkpoint is left."""
        kept = ""
        if self.ckpt_path is not None:
            kept = (f" The last good checkpoint, of step {self.saved_step}, is kept at {self.ckpt_path}."
                    if self.saved_step is not None else " No checkpoint had been written yet.")
        return TrainingDiverged(f"{what} at step {self.step} (lr {self.optimizer.lr:.3g}); stopping.{kept} Try a "
                                f"lower --lr, a longer warm-up or --clip-grad 1.0.", step=self.step)


def train(cfg, callback=None, model=None, data=None):
    """Run training as cfg (a TrainConfig) says. Returns a TrainResult (model, history, summary, out).

    callback(record), if given, is called after each evaluation with its metrics dict. model: train this
    model (a ViT, or any minivit Classifier such as resnet.ResNet) instead of building cfg's. data: train on
    this minivit.data.Dataset (e.g. a subset) instead of loading cfg.dataset. For experiments: max_steps
    without epochs runs exactly that many steps, num_evals evaluates that many times evenly spaced, and
    out=None writes no file. A NaN or infinite loss, validation loss or parameter raises TrainingDiverged
    (its .step says when). Every setting is checked before out is touched."""
    run = set_up(cfg, model, data)
    failed = True
    try:
        stopped_by = run_loop(run, callback)
        result = finish(run, stopped_by)
        failed = False
        return result
    finally:
        release_out(run, failed)


def release_out(run, failed):
    """The end of the run's hold on its folder: a run that failed before its first checkpoint puts back the
    run it was to --overwrite (and removes the folder it made, if nothing else is in it); the lock is released."""
    if run.lock is None:
        return
    out = run.cfg.out
    try:
        if failed and run.replaced is not None:
            settle_replaced(out, failed=True)
    finally:
        unlock_out(run.lock, out)
        run.lock = None
        if failed and run.made_out and not os.listdir(out):
            os.rmdir(out)


def set_up(cfg, model=None, data=None):
    """Check every setting, then build the run: its data, schedule, model, optimizer and any resumed
    state; the run folder is touched only once all of that has succeeded. Returns a Run."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    resumed, before, applied = None, None, {}
    if cfg.resume:
        cfg, resumed, before, applied = resume_config(cfg)
    cfg, data = load_run_data(cfg, data)
    if cfg.backend:
        backend.set_backend(cfg.backend)
    world = distributed.init()                      # None for one process (no mpiexec): nothing below changes
    if world is not None:                           # each rank takes B / R images of every batch
        distributed.check_global_batch(cfg.batch_size, world.world_size, cfg.grad_accum, resumed is not None)
        if world.rank != 0:                         # rank 0 alone shows the progress bar
            cfg = dataclasses.replace(cfg, progress=False)
    steps_per_epoch = data.x_train.shape[0] // cfg.batch_size
    total_steps = run_length(cfg, steps_per_epoch)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round((cfg.warmup_epochs or 0) * steps_per_epoch)
    schedule = WarmupCosine(cfg.lr, total_steps, warmup_steps=min(warmup, total_steps), min_lr=cfg.min_lr)
    given_model = model is not None
    if resumed is not None:
        check_resumed_data(resumed, data)
    model = model if given_model else build_model(cfg, data, resumed)
    if cfg.init and not given_model:                # record the model's real shape, the checkpoint's
        cfg = dataclasses.replace(cfg, **{k: getattr(model.config, k) for k in MODEL_FIELDS})
    model.train()                                   # a model given in eval mode would train without dropout
    model.set_matmul_dtype("float16" if cfg.precision == "float16" else None)
    scaler = LossScaler() if cfg.precision == "float16" else None
    run = Run(cfg, data, model, build_optimizer(cfg, model), scaler, schedule, steps_per_epoch, total_steps,
              evaluation_steps(cfg, total_steps, steps_per_epoch), given_model, world)
    if resumed is not None:
        restore(run, resumed, before, applied)
    if world is not None:                           # after restore: ZeRO-1 shares out the optimizer state it loaded
        run.dp = distributed.DataParallel(world, model, run.optimizer, zero=cfg.zero)
    check_labels(data, None if cfg.task == "clip" else getattr(getattr(model, "config", None), "num_classes", None))
    if cfg.out is not None and run.writes:          # every setting has been checked: now the folder is touched
        run.made_out = not os.path.exists(cfg.out)
        run.lock = lock_out(cfg.out)                # refused if another run holds it; held until release_out
    try:
        _set_up_out_and_device(run, cfg, data, model, resumed, world, given_model, total_steps)
    except BaseException:
        release_out(run, failed=True)
        raise
    return run


def _set_up_out_and_device(run, cfg, data, model, resumed, world, given_model, total_steps):
    """set_up's part that runs under the folder's lock: the folder opened, the data on the backend, the ops announced."""
    if run.lock is not None:
        run.replaced = open_out(cfg.out, overwrite=cfg.overwrite)
        if resumed is not None and os.path.exists(os.path.join(cfg.out, "metrics.jsonl")):
            kept = [r for r in read_metrics(cfg.out, kind=None) if r.get("step", 0) <= run.step]   # stats too,
            _write_jsonl_atomic(os.path.join(cfg.out, "metrics.jsonl"), kept)   # without torn or later lines
    # the whole data set goes to the backend once (on CuPy it then lives on the GPU)
    run.x_train, run.y_train = (backend.asarray(a, backend=model.backend) for a in (data.x_train, data.y_train))
    x_test, y_test = (data.x_test, data.y_test) if world is None else distributed.shard(world, data.x_test, data.y_test)
    run.x_test, run.y_test = (backend.asarray(a, backend=model.backend) for a in (x_test, y_test))
    if cfg.task == "clip":
        from .clip_train import CLIPTask

        run.task = CLIPTask(run, None if resumed is None else CLIPTask.tokenizer_of(resumed))
    if cfg.verbose:
        if run.task is not None:
            run.task.announce_forward()             # announce_ops' forward, on (image, caption) pairs
        for line in announce_ops(model, run.optimizer, run.x_train[:2], data.mean, data.std, cfg.dtype,
                                 forward=run.task is None):
            print(line, flush=True)
        print(f"training {model.num_params():,}-parameter {type(model).__name__} ({_describe(cfg, model, given_model)}) "
              f"on {data.name} ({data.x_train.shape[0]} images, {data.num_classes} classes) with "
              f"{backend.get_backend()}, {total_steps} steps of batch {cfg.batch_size}", flush=True)


def load_run_data(cfg, data=None):
    """cfg checked, then resolved for the data set it trains on; that data set (loaded unless given,
    downloaded or fallen back from as cfg allows), resized to cfg.img_size and cut to cfg.train_subset.
    An out that holds a run in the way is refused first, if its name is known before the data."""
    first = resolve(cfg if data is None else dataclasses.replace(cfg, dataset=data.name))  # every setting
    if cfg.out is not None and "{dataset}" not in cfg.out:                          # checked now, before
        check_out(cfg)                                                              # anything slow runs
    if data is None and first.task == "clip":
        from .clip_train import load_data

        data = load_data(first)                               # a captions.CaptionedDataset
    elif data is None:
        data, cfg = prepare_data(cfg)
    else:
        cfg = dataclasses.replace(cfg, dataset=data.name)     # the recipe defaults follow the data given
    cfg = resolve(cfg)                                        # after any fallback: that data set's recipe
    if cfg.out is not None and "{dataset}" in cfg.out:
        cfg = dataclasses.replace(cfg, out=cfg.out.replace("{dataset}", cfg.dataset))
        check_out(cfg)
    if cfg.train_subset:
        if cfg.train_subset > data.x_train.shape[0]:
            raise ValueError(f"train_subset {cfg.train_subset} is more than the {data.x_train.shape[0]} training "
                             f"images of {data.name}")
        n = cfg.train_subset
        data = dataclasses.replace(data, x_train=data.x_train[:n], y_train=data.y_train[:n],
                                   **({"text_train": data.text_train[:n]} if hasattr(data, "text_train") else {}))
    if cfg.img_size is not None and data.image_shape[:2] != _pair(cfg.img_size):
        check_run_memory(cfg, data)
        data = dataclasses.replace(data, x_train=resize_images(data.x_train, _pair(cfg.img_size)),
                                   x_test=resize_images(data.x_test, _pair(cfg.img_size)))
    if cfg.task != "clip" and data.num_classes < 2:
        where = f" in {os.path.join(cfg.data_dir, 'train')}" if cfg.dataset == "folder" and cfg.data_dir else ""
        raise ValueError(f"{data.name} has {data.num_classes} class{where} ({data.classes}): a classifier needs at "
                         f"least two (one folder per class)")
    if data.x_train.shape[0] < cfg.batch_size:
        raise ValueError(f"batch_size {cfg.batch_size} is larger than the {data.x_train.shape[0]} training images")
    return cfg, data


@dataclasses.dataclass(frozen=True)
class EvalSteps:
    """The steps after which the run evaluates and saves: after every `every` steps, or num_evals times spread
    evenly, and always after the last. A rule answering `step in eval_steps`, not a set of steps, so that
    --max-steps 1e12 --eval-every 1 costs no memory (a set of them was built: a raw MemoryError)."""
    total: int               # the run's last step
    every: int = 0           # evaluate after each multiple of this ...
    num_evals: int = 0       # ... or after steps max(1, total * k // num_evals), k = 1 .. num_evals

    def __contains__(self, step):
        if step == self.total:
            return True
        if not 1 <= step < self.total:
            return False
        if not self.num_evals:
            return step % self.every == 0
        n, total = self.num_evals, self.total
        k = -(-step * n // total)          # the first k with total * k // n >= step (the k's give increasing steps)
        return (k <= n and total * k // n == step) or (step == 1 and total < n)   # max(1, ...): step 0 -> 1


def check_run_memory(cfg, data):
    """Before the images are resized to --img-size: the bytes the run will hold at least (the resized
    images, and one block's attention weights for one batch on the CPU), refused with the figures and what
    to change when they exceed the memory available (--img-size 20000 was a raw MemoryError)."""
    H, W = _pair(cfg.img_size)
    n, C = data.x_train.shape[0] + data.x_test.shape[0], data.x_train.shape[3]
    images = n * H * W * C                                     # uint8 (N, H, W, C), train and test
    P = cfg.patch_size or getattr(presets.get(cfg.model), "patch_size", None)
    attention = 0
    if P and cfg.task != "clip" and cfg.backend != "cupy":     # (B, nh, N, N) weights, kept for backward
        tokens = (H // P) * (W // P) + 1
        attention = cfg.batch_size * (cfg.num_heads or 1) * tokens ** 2 * numpy.dtype(cfg.dtype or "float32").itemsize
    check_fits(images + attention, f"--img-size {cfg.img_size}: the {n:,} images resized ({size_text(images)}) "
               f"and one block's attention for a batch of {cfg.batch_size} ({size_text(attention)})",
               "lower --img-size (or --batch-size, --train-subset), or raise --patch-size")


def evaluation_steps(cfg, total_steps, steps_per_epoch):
    """The steps after which the run evaluates and saves: cfg's cadence, and always the last."""
    if cfg.num_evals:      # e.g. 4 evaluations of 150 steps: after steps 37, 75, 112 and 150
        return EvalSteps(total_steps, num_evals=cfg.num_evals)
    return EvalSteps(total_steps, every=cfg.eval_every or steps_per_epoch)


def run_loop(run, callback=None):
    """The optimizer steps from run.step to run.total_steps, as the module docstring writes them; after
    each step of run.eval_steps, and after a Ctrl-C or SIGTERM, an evaluation and a checkpoint
    (evaluate_and_save). Returns the name of the signal that stopped the run, or None."""
    cfg, model, optimizer, data = run.cfg, run.model, run.optimizer, run.data
    bar = tqdm(total=run.total_steps, initial=run.step, disable=not cfg.progress, unit="step", dynamic_ncols=True,
               desc=data.name)
    run.start_time, run.start_step = time.perf_counter(), run.step
    with _StopFlag() as flag:
        try:
            while run.step < run.total_steps:
                optimizer.lr = run.schedule(run.step)
                if run.task is None:
                    x, y = batch_for_step(run.step, cfg, run.x_train, run.y_train, run.steps_per_epoch, data.mean,
                                          data.std, cfg.dtype, data.num_classes, run.world)  # (B, H, W, C), (B,) or (B, K)
                else:
                    x, y = run.task.batch(run.step)           # CLIP: images (B, H, W, C), their tokens (B, L)
                if run.world is not None:   # dropout and drop-path draw from a stream of (seed, step, rank)
                    distributed.seed_dropout(model, cfg.seed, run.step, run.world.rank)
                logged = cfg.log_stats and (run.step + 1) % cfg.log_stats == 0
                if logged:                                    # --log-stats: minivit.stats, before and after the step
                    before, acts = stats.snapshot(model), stats.activation_stats(model, x)
                try:
                    loss, correct, _ = (train_step(model, optimizer, x, y, cfg, run.scaler, run.dp) if run.task is None
                                        else run.task.train_step(x, y))
                except FloatingPointError as err:             # the loss scaler gave up: see amp.LossScaler
                    raise run.diverged(str(err)) from None
                if not math.isfinite(loss):
                    raise run.diverged(f"the loss became {loss}")
                run.step += 1
                run.seen_loss += loss * cfg.batch_size        # (with several ranks x holds this rank's slice)
                if logged and run.writes:
                    _append_jsonl(os.path.join(cfg.out, "metrics.jsonl"), stats.step_record(run.step, model, before, *acts))
                run.seen_correct += correct
                run.seen_images += cfg.batch_size
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", acc=f"{correct / cfg.batch_size:.2f}",
                                img_s=f"{run.images_per_second():.0f}")
                if run.world is not None:   # a signal to any rank stops every rank, after this same step
                    flag.agree(run.world)
                if run.step in run.eval_steps or flag.stop:
                    record = evaluate_and_save(run)
                    if cfg.verbose:
                        bar.write(f"epoch {record['epoch']:.2f} step {run.step}: train loss {record['train_loss']:.4f} "
                                  f"acc {record['train_acc']:.2%} | val loss {record['val_loss']:.4f} acc "
                                  f"{record['val_acc']:.2%} | {record['images_per_second']:.0f} img/s")
                    if callback is not None:
                        callback(record)
                if flag.stop:
                    where = "no checkpoint (out=None)" if run.ckpt_path is None else \
                        f"checkpoint saved to {run.ckpt_path}; continue with --resume"
                    bar.write(f"{signal.Signals(flag.signum).name} at step {run.step}: {where}")
                    break
        finally:
            bar.close()
    return None if flag.signum is None else signal.Signals(flag.signum).name


def evaluate_and_save(run):
    """Evaluate on the held-out split. If the loss and every parameter are finite, record the metrics
    (run.history, metrics.jsonl) and save a checkpoint; if not, stop with TrainingDiverged, saving nothing.
    Returns the record."""
    start = time.perf_counter()
    images_per_second, wall_seconds = run.images_per_second(), start - run.start_time   # of the training alone
    if run.task is None:
        val_loss, val_acc = evaluate(run.model, run.x_test, run.y_test, run.data.mean, run.data.std, run.cfg.dtype,
                                     run.cfg.eval_batch_size)
        more = {}
    else:                     # CLIP: val_acc is the zero-shot accuracy; more: its split, recall@1/@5, logit_scale
        val_loss, val_acc, more = run.task.evaluate()
    if run.world is not None and run.task is None:   # each rank evaluated its share: the means over the split
        val_loss, val_acc = distributed.mean_over_ranks(run.world, [val_loss, val_acc], run.x_test.shape[0])
    run.eval_seconds += time.perf_counter() - start
    bad = non_finite_params(run.model)
    if not math.isfinite(val_loss) or bad:
        raise run.diverged(f"the validation loss became {val_loss}" if not math.isfinite(val_loss) else
                           f"{len(bad)} parameters ({', '.join(bad[:3])}...) became NaN or infinite")
    run.best = max(run.best, val_acc)
    seen = max(run.seen_images, 1)
    record = {"step": run.step, "epoch": round(run.step / run.steps_per_epoch, 4), "train_loss": run.seen_loss / seen,
              "train_acc": run.seen_correct / seen, "val_loss": val_loss, "val_acc": val_acc, "lr": run.optimizer.lr,
              "images_per_second": images_per_second, "wall_seconds": wall_seconds, **more}
    if run.scaler is not None:
        record.update(loss_scale=run.scaler.scale_value, skipped_steps=run.scaler.skipped_steps)
    run.history.append(record)
    run.seen_loss, run.seen_correct, run.seen_images = 0.0, 0, 0
    if run.cfg.out is not None and run.dp is not None:
        run.dp.gather_optimizer_state()              # ZeRO-1: the whole state, for the checkpoint (every rank)
    if run.cfg.out is not None and run.writes:      # rank 0 alone writes
        _append_jsonl(os.path.join(run.cfg.out, "metrics.jsonl"), record)
        extra = {"step": run.step, "best_val_accuracy": run.best, "train_config": dataclasses.asdict(run.cfg),
                 "classes": run.data.classes, "num_classes": len(run.data.classes), "mean": list(run.data.mean), "std": list(run.data.std),
                 "dataset": run.data.name}
        if run.scaler is not None:
            extra["loss_scaler"] = run.scaler.state_dict()
        if run.task is not None:
            extra.update(run.task.checkpoint_extra())         # CLIP: its tokenizer
        try:
            save_checkpoint(run.ckpt_path, run.model, run.optimizer, extra)
        except OSError as err:
            raise _naming_path(err, run.ckpt_path) from None
        if run.replaced is not None:                 # the new run has started: the run it replaces goes
            settle_replaced(run.cfg.out)
            run.replaced = None
    if run.cfg.out is not None:
        run.saved_step = run.step
    if run.dp is not None:
        run.dp.release_optimizer_state()
    return record


def _summary_of_a_finished_run(run):
    """A finished run resumed trains no step: its summary.json is kept as it is (rewritten, it said 0 img/s)
    and returned; None when this run trained, or there is no readable summary to keep."""
    path = None if run.cfg.out is None else os.path.join(run.cfg.out, "summary.json")
    if run.step != run.start_step or run.step == 0 or path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != run.step:
        return None
    if run.cfg.verbose:
        print(f"the run in {run.cfg.out} had already finished its {run.step} steps: nothing trained, its summary "
              f"kept (to train on, resume with a larger --max-steps or --epochs)", flush=True)
    return summary


def finish(run, stopped_by):
    """The run's summary, written to out with the curves; returns the TrainResult."""
    kept = _summary_of_a_finished_run(run)
    if kept is not None:
        return TrainResult(run.model, run.history, kept, run.cfg.out)
    wall = time.perf_counter() - run.start_time
    last = run.history[-1] if run.history else {}
    summary = {"best_val_accuracy": run.best, "final_val_accuracy": last.get("val_acc"),
               "final_val_loss": last.get("val_loss"), "steps": run.step, "total_steps": run.total_steps,
               "epochs": round(run.step / run.steps_per_epoch, 4), "wall_seconds": wall,
               "eval_seconds": run.eval_seconds,
               "images_per_second": (run.step - run.start_step) * run.cfg.batch_size / max(wall, 1e-9),
               "interrupted": stopped_by is not None, "signal": stopped_by, "backend": backend.get_backend(),
               "dataset": run.data.name, "num_params": run.model.num_params(), "config": run.model.config.to_dict(),
               "train_config": dataclasses.asdict(run.cfg), "world_size": 1 if run.world is None else run.world.world_size}
    if run.scaler is not None:
        summary.update(loss_scale=run.scaler.scale_value, skipped_steps=run.scaler.skipped_steps)
    if run.task is not None:                          # CLIP: the last evaluation's zero-shot and retrieval figures
        summary.update({k: v for k, v in last.items() if k in run.task.SUMMARY})
    out = run.cfg.out
    if out is not None and run.writes:
        _write_json_atomic(os.path.join(out, "summary.json"), summary)
        if run.history:
            try:
                from .plot import plot_curves

                plot_curves(out, os.path.join(out, "curves.png"))
            except ImportError:  # matplotlib missing: the numbers are in metrics.jsonl
                pass
    return TrainResult(run.model, run.history, summary, out)


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


def _describe(cfg, model, given_model):
    """'vit_cifar_tiny with embed_dim, depth changed: D=64, depth=4, patch=4, img=(32, 32)' and the like."""
    c = model.config
    if not isinstance(c, ViTConfig):
        return model.extra_repr()
    if given_model or cfg.init:
        name = "a model given to train()" if given_model else f"from {cfg.init}"
    else:
        preset = presets[cfg.model]
        changed = [f for f in ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "pool", "pos_embed", "stem",
                               "drop_rate", "drop_path_rate") if getattr(c, f) != getattr(preset, f)]
        name = cfg.model + (f" with {', '.join(changed)} changed" if changed else "")
    return f"{name}: D={c.embed_dim}, depth={c.depth}, patch={c.patch_size}, img={c.img_size}"


# --------------------------------------------------------------------------------------------------
# The command line: one flag per TrainConfig field
# --------------------------------------------------------------------------------------------------


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where it would mislead: an on/off flag is off unless
    given ("--no-progress (default: True)" reads the wrong way round), and None means "see the help"."""

    def _get_help_string(self, action):
        if action.nargs == 0 or action.default is None:
            return action.help
        return super()._get_help_string(action)


def _parser():
    """The command line, generated from TrainConfig: each field's flag, type, default, choices and help."""
    p = argparse.ArgumentParser(prog="python -m minivit.train", description="Train a Vision Transformer.",
                                formatter_class=_HelpFormatter)
    for f in dataclasses.fields(TrainConfig):
        help = f.metadata["help"]
        if f.type is bool:         # an on/off flag: given, it turns the field's default around
            p.add_argument(_flag(f.name), dest=f.name, action="store_false" if f.default else "store_true", help=help)
        else:
            if f.name in BASE:
                help += f" (default: the recipe's, else {BASE[f.name]})"
            p.add_argument(_flag(f.name), dest=f.name, type=f.metadata["parse"] or f.type, default=f.default,
                           choices=f.metadata["choices"], help=help)
    return p


def check_resume_flags(cfg, given):
    """resume_config cannot tell a flag given with its default's value (--dataset cifar10) from no flag;
    main can: such a flag that differs from the run's own setting is refused, as resume_config refuses the
    rest. given: the names of the flags on the command line."""
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    path = os.path.join(_resume_folder(cfg), "checkpoint.npz")
    try:                                   # the metadata alone; a file that cannot be read is resume_config's to name
        with numpy.load(path, allow_pickle=False) as npz:
            saved = json.loads(str(npz["meta"]))["extra"]["train_config"]
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
    except Exception:
        return
    fell_back = cfg.fallback and saved.get("dataset") != "cifar10"
    refused = [f"{_flag(name)} {fields[name]!r} (the run's: {saved[name]!r})" for name in given
               if name in saved and getattr(cfg, name) == fields[name] != saved[name]
               and name not in RESUME_RUNTIME + RESUME_APPLIED and not (fell_back and name in ("dataset", "data_dir"))]
    if refused:
        raise ValueError(f"--resume continues the run in {os.path.dirname(path)} with its own settings, and these "
                         f"differ from them: {'; '.join(refused)}; to change them, start a new run (another --out, "
                         f"or --overwrite)")


def main(argv=None):
    parser = _parser()
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    unset = object()                               # a default no flag can give: what is left is on the command line
    parser.set_defaults(**{f.name: unset for f in dataclasses.fields(TrainConfig)})
    given = [name for name, value in vars(parser.parse_args(argv)).items() if value is not unset]
    try:
        if cfg.resume and cfg.out is not None:
            check_resume_flags(cfg, given)
        result = train(cfg)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:             # permission, no space left, a file in the way: one line, the path and why
        where = f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err)
        print(f"error: {where}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:   # a second signal (SecondSignal), or Ctrl-C before training began
        signum = getattr(err, "signum", signal.SIGINT)
        kept = "" if cfg.out is None else (f"; {os.path.join(cfg.out, 'checkpoint.npz')}, if there is one, is whole "
                                           f"(written atomically): continue from it with --resume")
        print(f"error: {signal.Signals(signum).name}: stopped at once{kept}", file=sys.stderr)
        return 128 + signum
    s = result.summary
    if s["final_val_accuracy"] is not None:
        print(f"done: {s['steps']} steps in {s['wall_seconds']:.0f} s ({s['images_per_second']:.0f} img/s); "
              f"final {'zero-shot' if s['train_config']['task'] == 'clip' else 'val'} accuracy "
              f"{s['final_val_accuracy']:.2%}, best {s['best_val_accuracy']:.2%}; "
              f"results in {result.out}/")
    return 128 + getattr(signal, s["signal"]) if s["signal"] else 0   # 130 after Ctrl-C, 143 after SIGTERM


if __name__ == "__main__":
    sys.exit(distributed.exit_status(main()))   # with several ranks, an error on one ends them all
