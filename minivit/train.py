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

What is written to OUT: metrics.jsonl (one line per evaluation), summary.json, checkpoint.npz (model,
optimizer, RNG states, step; written atomically at every evaluation), curves.png. With out=None (from
Python) nothing is written: experiments/ call train(cfg, model=..., data=...) that way.

Reproducibility: the batches of step s are a function of (seed, s) alone: epoch e = s // steps_per_epoch
is shuffled by a generator seeded with (seed, e), and the augmentation of step s by one seeded with
(seed, s). Dropout generators are saved in the checkpoint. So a run stopped and resumed ends with
bit-for-bit the parameters of an uninterrupted one (on the CPU, same seed).
"""

import argparse
import dataclasses
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
from . import backend, ops
from .amp import LossScaler
from .checkpoint import load_checkpoint, restore_dropout_rngs, save_checkpoint
from .data import DATASETS, load_dataset, resize_images
from .functional import cross_entropy
from .model import ViTConfig, create_model, presets
from .optim import SGD, AdamW, WarmupCosine, clip_grad_norm, default_no_decay

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
}


DEFAULT_RECIPE = {"cifar10": "fast", "fashion-mnist": "fashion-cpu", "shapes": "demo", "folder": "demo"}


@dataclass
class TrainConfig:
    """Every setting of a run. None means "take it from the recipe" (then from the preset)."""

    dataset: str = "cifar10"          # cifar10 | fashion-mnist | folder | shapes
    data_dir: str = None              # where the data set lives (cifar10: data/; folder: required)
    recipe: str = None                # a key of RECIPES (default: DEFAULT_RECIPE of the data set)
    model: str = None                 # a preset name (minivit.presets)
    img_size: int = None              # resize images to this (default: the data set's own size)
    patch_size: int = None
    embed_dim: int = None
    depth: int = None
    num_heads: int = None
    mlp_ratio: float = None
    pool: str = None                  # cls | gap
    drop_rate: float = None
    drop_path_rate: float = None
    pos_embed: str = None             # learned | learned2d | sincos2d | none (the paper's App. D.4)
    stem: str = None                  # patch | conv (the hybrid of §3.1)
    epochs: float = None
    max_steps: int = None             # at most this many optimizer steps; without epochs, exactly this many
    batch_size: int = None            # images per optimizer step
    grad_accum: int = 1               # split each step into this many micro-batches (same result, less memory)
    lr: float = None
    min_lr: float = 0.0
    weight_decay: float = None
    warmup_epochs: float = None
    warmup_steps: int = None          # overrides warmup_epochs when given
    label_smoothing: float = None
    optimizer: str = None             # adamw | sgd
    momentum: float = 0.9             # SGD only
    clip_grad: float = None           # clip the global gradient norm to this
    augment: str = None               # none | standard | randaug
    mixup: float = 0.0                # mixup alpha (0: off)
    cutmix: float = 0.0               # cutmix alpha (0: off); with both on, each step picks one
    random_erasing: float = 0.0       # probability of erasing a patch of each image
    seed: int = 0
    backend: str = None               # numpy | cupy (default: the current backend)
    dtype: str = "float32"
    precision: str = "float32"        # float16: mixed precision, float16 matmuls + loss scaling (minivit/amp.py)
    out: str = "runs/default"         # None: write nothing (no metrics, summary, checkpoint or plot)
    resume: bool = False
    eval_every: int = None            # evaluate every N steps (default: at the end of each epoch)
    num_evals: int = None             # or: evaluate this many times, evenly spaced, the last at the end
    eval_batch_size: int = 500
    train_subset: int = None          # use only the first N training images (quick runs, data-size studies)
    init: str = None                  # start from pretrained weights (minivit.from_pretrained)
    new_head: bool = True             # with init: a zero-initialised head, as the paper fine-tunes
    init_gelu: str = None             # with init: "erf" | "tanh" (default: the checkpoint kind's own)
    download: bool = False            # cifar10: download it when missing
    fallback: bool = False            # cifar10 unavailable: fall back to Fashion-MNIST, else shapes
    progress: bool = True             # show the tqdm progress bar
    verbose: bool = True              # print the run's first line and one line per evaluation
    fallback_reason: str = None       # set when --fallback replaced CIFAR-10 (why it was unavailable)


# The fields a resumed run may change; everything else comes from the checkpoint.
RESUME_MAY_CHANGE = ("out", "resume", "progress", "verbose", "backend", "eval_every", "num_evals", "eval_batch_size",
                     "download", "fallback")
MODEL_FIELDS = ("img_size", "patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "pool", "drop_rate",
                "drop_path_rate", "pos_embed", "stem")


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite at optimizer step `step` (0-based: `step` steps had succeeded);
    the last good checkpoint was kept."""

    def __init__(self, message, step=None):
        super().__init__(message)
        self.step = step


@dataclass
class TrainResult:
    model: object
    history: list      # one dict per evaluation
    summary: dict
    out: str


def resolve(cfg):
    """A copy of cfg with every None filled in from its recipe; checked, with errors that name the value."""
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of {DATASETS}")
    if cfg.recipe is None:
        cfg = dataclasses.replace(cfg, recipe=DEFAULT_RECIPE[cfg.dataset])
    if cfg.recipe not in RECIPES:
        raise ValueError(f"unknown recipe {cfg.recipe!r}; choose one of {sorted(RECIPES)}")
    values = dataclasses.asdict(cfg)
    steps_only = cfg.max_steps is not None and cfg.epochs is None   # max_steps alone: exactly that many
    for key, value in RECIPES[cfg.recipe].items():
        if values.get(key) is None and not (key == "epochs" and steps_only):
            values[key] = value
    r = TrainConfig(**values)
    if r.model not in presets:
        raise ValueError(f"unknown model preset {r.model!r}; choose one of {sorted(presets)}")
    if r.optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {r.optimizer!r}")
    if r.augment not in A.POLICIES:
        raise ValueError(f"augment must be one of {A.POLICIES}, got {r.augment!r}")
    if r.dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {r.dtype!r}")
    if r.precision not in ("float32", "float16"):
        raise ValueError(f"precision must be 'float32' or 'float16' (mixed), got {r.precision!r}")
    if r.precision == "float16" and r.dtype != "float32":
        raise ValueError(f"precision 'float16' keeps float32 master weights: it needs dtype 'float32', got {r.dtype!r}")
    if not isinstance(r.batch_size, int) or r.batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {r.batch_size!r}")
    if not isinstance(r.grad_accum, int) or r.grad_accum < 1 or r.batch_size % r.grad_accum:
        raise ValueError(f"grad_accum must be a positive int dividing batch_size={r.batch_size}, got {r.grad_accum!r}")
    if r.epochs is None and r.max_steps is None:
        raise ValueError("give epochs or max_steps")
    if r.epochs is not None and not r.epochs > 0:
        raise ValueError(f"epochs must be > 0, got {r.epochs!r}")
    if r.max_steps is not None and (not isinstance(r.max_steps, int) or r.max_steps < 1):
        raise ValueError(f"max_steps must be a positive int, got {r.max_steps!r}")
    if not r.lr > 0:
        raise ValueError(f"lr must be > 0, got {r.lr!r}")
    if r.clip_grad is not None and not r.clip_grad > 0:
        raise ValueError(f"clip_grad must be > 0, got {r.clip_grad!r}")
    for name in ("mixup", "cutmix"):
        if getattr(r, name) < 0:
            raise ValueError(f"{name} alpha must be >= 0, got {getattr(r, name)!r}")
    if not 0 <= r.random_erasing <= 1:
        raise ValueError(f"random_erasing must be a probability in [0, 1], got {r.random_erasing!r}")
    if r.eval_every is not None and (not isinstance(r.eval_every, int) or r.eval_every < 1):
        raise ValueError(f"eval_every must be a positive int, got {r.eval_every!r}")
    if r.num_evals is not None and (not isinstance(r.num_evals, int) or r.num_evals < 1):
        raise ValueError(f"num_evals must be a positive int, got {r.num_evals!r}")
    if r.eval_every is not None and r.num_evals is not None:
        raise ValueError(f"give eval_every or num_evals, not both (got {r.eval_every!r} and {r.num_evals!r})")
    if r.backend is not None and r.backend not in backend.BACKENDS:
        raise ValueError(f"backend must be one of {backend.BACKENDS}, got {r.backend!r}")
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
    except FileNotFoundError as missing:
        reason = str(missing)
        if cfg.download:
            try:
                _download_cifar10(root)
                return load_dataset("cifar10", root), cfg
            except (OSError, ValueError) as err:  # NetworkError is an OSError
                reason = f"the download failed ({err})"
        if not cfg.fallback:
            raise
    from .data import FASHION_MNIST_DIRS

    fashion = any(os.path.isdir(d) for d in FASHION_MNIST_DIRS)
    name = "fashion-mnist" if fashion else "shapes"
    where = "Fashion-MNIST (Debian's copy in /usr/share/datasets/fashion-mnist)" if fashion else \
        "`shapes`, the procedural data set that needs no download"
    note = f", with the '{DEFAULT_RECIPE[name]}' recipe" if cfg.recipe is None else f", keeping the '{cfg.recipe}' recipe"
    print(CIFAR_UNAVAILABLE.format(reason=reason, root=root, fallback=where, note=note), flush=True)
    cfg = dataclasses.replace(cfg, dataset=name, data_dir=None, fallback_reason=reason)
    return load_dataset(cfg.dataset, cfg.data_dir), cfg


def build_model(cfg, data):
    """The ViT for cfg and this data set: the preset, the overrides, and the data's channels and classes."""
    H, W, C = data.image_shape
    overrides = {k: getattr(cfg, k) for k in MODEL_FIELDS if getattr(cfg, k) is not None}
    overrides.setdefault("img_size", (H, W))
    overrides.update(in_chans=C, num_classes=data.num_classes)
    if cfg.init:
        from .convert import from_pretrained

        model = from_pretrained(cfg.init, num_classes=data.num_classes, img_size=overrides["img_size"],
                                gelu=cfg.init_gelu, seed=cfg.seed, dtype=cfg.dtype, new_head=cfg.new_head)
        return model
    return create_model(cfg.model, seed=cfg.seed, dtype=cfg.dtype, **overrides)


def build_optimizer(cfg, model):
    """AdamW or SGD; biases, LayerNorm weights, the class token and position embeddings get no decay."""
    no_decay = default_no_decay(model.params)
    if cfg.optimizer == "adamw":
        return AdamW(model, cfg.lr, weight_decay=cfg.weight_decay, no_decay=no_decay)
    return SGD(model, cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, no_decay=no_decay)


def batch_for_step(step, cfg, data_x, data_y, steps_per_epoch, mean, std, dtype, num_classes):
    """The augmented batch of optimizer step `step`: a function of (seed, step) only (see the module doc).
    data_x: uint8 (N, H, W, C) on the backend; data_y: int64 (N,) on the backend.
    Returns x float (B, H, W, C) and targets: labels (B,) or soft targets (B, K) with mixup/cutmix."""
    epoch, i = divmod(step, steps_per_epoch)
    order = backend.host_rng([cfg.seed, epoch]).permutation(data_x.shape[0])       # (N,)
    idx = order[i * cfg.batch_size:(i + 1) * cfg.batch_size]                        # (B,)
    idx_dev = backend.asarray(idx, backend=backend.backend_of(data_x))
    rng = backend.host_rng([cfg.seed, 1_000_003, step])
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


def announce_ops(model, optimizer, images, mean, std, dtype):
    """Which ops will run from kernels.py and which from functional.py (minivit/ops.py), as lines to print.
    One forward in eval mode on a couple of images (no caches kept, no dropout drawn, so the run itself is
    unchanged) makes ops check every fast twin the model uses against functional.py as it stands now."""
    was_training = model.training
    try:
        model.eval().forward(A.normalize(images, mean, std, dtype))
    finally:
        model.train(was_training)
    if isinstance(optimizer, AdamW):
        ops.uses_twin("adamw", next(iter(model.params.values())))
    return ops.summary_lines()


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class _StopFlag:
    """Ctrl-C sets the flag; the loop finishes its step, saves a checkpoint and stops. A second Ctrl-C
    interrupts at once."""

    def __init__(self):
        self.stop, self._old = False, None

    def __enter__(self):
        try:
            self._old = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread (e.g. some notebook runners): no handler
            self._old = None
        return self

    def _handle(self, signum, frame):
        if self.stop:
            raise KeyboardInterrupt
        self.stop = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def train_step(model, optimizer, x, y, cfg, scaler=None):
    """One optimizer step on batch (x, y), in cfg.grad_accum micro-batches. Returns (loss, correct, grad_norm).
    scaler: an amp.LossScaler (mixed precision): the backward gets the scaled loss gradient, and a step whose
    gradients overflowed is skipped (grad_norm is then inf)."""
    model.zero_grad()
    micro = x.shape[0] // cfg.grad_accum
    total_loss, correct = 0.0, 0
    # with loss scaling float16 overflows now and then, by design (that step is skipped): NumPy's
    # "overflow encountered" warnings would be noise
    with numpy.errstate(over="ignore", invalid="ignore") if scaler is not None else nullcontext():
        for j in range(cfg.grad_accum):
            xb, yb = x[j * micro:(j + 1) * micro], y[j * micro:(j + 1) * micro]
            logits = model.forward(xb)                                                  # (b, K)
            loss, dlogits = cross_entropy(logits, yb, cfg.label_smoothing)
            if not math.isfinite(loss):
                return loss, 0, float("nan")
            dlogits = dlogits / cfg.grad_accum     # the mean over all micro-batches: each weighs 1/grad_accum
            model.backward(dlogits if scaler is None else scaler.scale(dlogits))
            total_loss += loss / cfg.grad_accum
            labels = yb if yb.ndim == 1 else yb.argmax(-1)
            correct += int((logits.argmax(-1) == labels).sum())
    if scaler is not None:
        finite = scaler.unscale(model)               # gradients / S, before clipping looks at them
        scaler.update(finite)
        if not finite:                               # float16 overflowed: skip the update, S was halved
            return total_loss, correct, float("inf")
    grad_norm = clip_grad_norm(model, cfg.clip_grad) if cfg.clip_grad else None
    optimizer.step()
    return total_loss, correct, grad_norm


def _append_jsonl(path, record):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _write_json_atomic(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def train(cfg, callback=None, model=None, data=None):
    """Run training as cfg (a TrainConfig) says. Returns a TrainResult (model, history, summary, out).

    callback(record), if given, is called after each evaluation with its metrics dict. model: train this
    model (a ViT, or any minivit Classifier such as resnet.ResNet) instead of building cfg's. data: train on
    this minivit.data.Dataset (e.g. a subset) instead of loading cfg.dataset. For experiments: max_steps
    without epochs runs exactly that many steps, num_evals evaluates that many times evenly spaced, and
    out=None writes no file. A NaN or infinite loss raises TrainingDiverged (its .step says when)."""
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"cfg must be a TrainConfig, got {type(cfg).__name__}")
    out = cfg.out
    ckpt_path = None if out is None else os.path.join(out, "checkpoint.npz")
    resumed = None
    if cfg.resume:
        if out is None:
            raise ValueError("resume needs out: the folder that holds checkpoint.npz")
        if not os.path.exists(ckpt_path):
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path!r} (train into --out {out!r} first)")
        resumed = load_checkpoint(ckpt_path)
        saved = resumed["meta"]["extra"].get("train_config")
        if not saved:
            raise ValueError(f"{ckpt_path!r} holds no training state (was it written by minivit.train?)")
        saved.update({k: getattr(cfg, k) for k in RESUME_MAY_CHANGE})
        cfg = TrainConfig(**saved)
    if cfg.backend:
        backend.set_backend(cfg.backend)
    if data is None:
        data, cfg = prepare_data(cfg)
    else:
        cfg = dataclasses.replace(cfg, dataset=data.name)     # the recipe defaults follow the data given
    cfg = resolve(cfg)
    if cfg.img_size is not None and data.image_shape[:2] != _pair(cfg.img_size):
        data = dataclasses.replace(data, x_train=resize_images(data.x_train, _pair(cfg.img_size)),
                                   x_test=resize_images(data.x_test, _pair(cfg.img_size)))
    if cfg.train_subset:
        data = dataclasses.replace(data, x_train=data.x_train[:cfg.train_subset], y_train=data.y_train[:cfg.train_subset])
    n_train = data.x_train.shape[0]
    if n_train < cfg.batch_size:
        raise ValueError(f"batch_size {cfg.batch_size} is larger than the {n_train} training images")
    steps_per_epoch = n_train // cfg.batch_size
    total_steps = math.ceil(cfg.epochs * steps_per_epoch) if cfg.epochs is not None else cfg.max_steps
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round((cfg.warmup_epochs or 0) * steps_per_epoch)
    schedule = WarmupCosine(cfg.lr, total_steps, warmup_steps=min(warmup, total_steps), min_lr=cfg.min_lr)

    given_model = model is not None
    model = model if given_model else build_model(cfg, data)
    model.train()                                   # a model given in eval mode would train without dropout
    model.set_matmul_dtype("float16" if cfg.precision == "float16" else None)
    scaler = LossScaler() if cfg.precision == "float16" else None
    optimizer = build_optimizer(cfg, model)
    step, best, history = 0, 0.0, []
    if resumed is not None:
        model.load_state_dict(resumed["params"])
        optimizer.load_state_dict(resumed["optimizer"])
        restore_dropout_rngs(model, resumed["meta"]["dropout_rng"])
        extra = resumed["meta"]["extra"]
        step, best = extra["step"], extra["best_val_accuracy"]
        if scaler is not None:
            scaler.load_state_dict(extra["loss_scaler"])
        history = _read_history(os.path.join(out, "metrics.jsonl"))
        print(f"resuming {ckpt_path} at step {step} of {total_steps}", flush=True)
    if out is not None:
        os.makedirs(out, exist_ok=True)
        if resumed is None and os.path.exists(os.path.join(out, "metrics.jsonl")):
            os.remove(os.path.join(out, "metrics.jsonl"))   # a fresh run starts a fresh log

    # the whole data set goes to the backend once (on CuPy it then lives on the GPU)
    dev = model.backend
    x_train, y_train = backend.asarray(data.x_train, backend=dev), backend.asarray(data.y_train, backend=dev)
    x_test, y_test = backend.asarray(data.x_test, backend=dev), backend.asarray(data.y_test, backend=dev)
    if cfg.num_evals:      # e.g. 4 evaluations of 150 steps: after steps 37, 75, 112 and 150
        eval_steps = {max(1, total_steps * (i + 1) // cfg.num_evals) for i in range(cfg.num_evals)}
    elif cfg.eval_every:
        eval_steps = set(range(cfg.eval_every, total_steps + 1, cfg.eval_every))
    else:
        eval_steps = set(range(steps_per_epoch, total_steps + 1, steps_per_epoch))
    eval_steps.add(total_steps)

    def save(at_step):
        extra = {"step": at_step, "best_val_accuracy": best, "train_config": dataclasses.asdict(cfg),
                 "classes": data.classes, "mean": list(data.mean), "std": list(data.std), "dataset": data.name}
        if scaler is not None:
            extra["loss_scaler"] = scaler.state_dict()
        save_checkpoint(ckpt_path, model, optimizer, extra)

    if cfg.verbose:
        for line in announce_ops(model, optimizer, x_train[:2], data.mean, data.std, cfg.dtype):
            print(line, flush=True)
        name = "a model given to train()" if given_model else (f"from {cfg.init}" if cfg.init else cfg.model)
        c = model.config
        shape = (f"D={c.embed_dim}, depth={c.depth}, patch={c.patch_size}, img={c.img_size}"
                 if isinstance(c, ViTConfig) else model.extra_repr())
        print(f"training {model.num_params():,}-parameter {type(model).__name__} ({name}: {shape}) on "
              f"{data.name} ({n_train} images, {data.num_classes} classes) with {backend.get_backend()}, "
              f"{total_steps} steps of batch {cfg.batch_size}", flush=True)
    start_time, start_step = time.perf_counter(), step
    run_loss, run_correct, run_seen, interrupted, eval_seconds = 0.0, 0, 0, False, 0.0
    bar = tqdm(total=total_steps, initial=step, disable=not cfg.progress, unit="step", dynamic_ncols=True,
               desc=f"{data.name}")
    with _StopFlag() as flag:
        while step < total_steps:
            optimizer.lr = schedule(step)
            x, y = batch_for_step(step, cfg, x_train, y_train, steps_per_epoch, data.mean, data.std, cfg.dtype,
                                  data.num_classes)
            try:
                loss, correct, _ = train_step(model, optimizer, x, y, cfg, scaler)
            except FloatingPointError as err:             # the loss scaler gave up: see amp.LossScaler
                bar.close()
                raise TrainingDiverged(f"at step {step}: {err}", step=step) from None
            if not math.isfinite(loss):
                bar.close()
                kept = "" if ckpt_path is None else (f" The last good checkpoint is kept at {ckpt_path}"
                                                     + ("" if os.path.exists(ckpt_path) else " (none yet)") + ".")
                raise TrainingDiverged(f"the loss became {loss} at step {step} (lr {optimizer.lr:.3g}); stopping."
                                       f"{kept} Try a lower --lr, a longer warm-up or --clip-grad 1.0.", step=step)
            step += 1
            run_loss += loss * x.shape[0]
            run_correct += correct
            run_seen += x.shape[0]
            elapsed = time.perf_counter() - start_time
            ips = (step - start_step) * cfg.batch_size / max(elapsed, 1e-9)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", acc=f"{correct / x.shape[0]:.2f}", img_s=f"{ips:.0f}")
            if step in eval_steps or flag.stop:
                eval_start = time.perf_counter()
                val_loss, val_acc = evaluate(model, x_test, y_test, data.mean, data.std, cfg.dtype,
                                             cfg.eval_batch_size)
                eval_seconds += time.perf_counter() - eval_start
                best = max(best, val_acc)
                record = {"step": step, "epoch": round(step / steps_per_epoch, 4),
                          "train_loss": run_loss / max(run_seen, 1), "train_acc": run_correct / max(run_seen, 1),
                          "val_loss": val_loss, "val_acc": val_acc, "lr": optimizer.lr,
                          "images_per_second": ips, "wall_seconds": elapsed}
                if scaler is not None:
                    record.update(loss_scale=scaler.scale_value, skipped_steps=scaler.skipped_steps)
                history.append(record)
                if out is not None:
                    _append_jsonl(os.path.join(out, "metrics.jsonl"), record)
                    save(step)
                if cfg.verbose:
                    bar.write(f"epoch {record['epoch']:.2f} step {step}: train loss {record['train_loss']:.4f} "
                              f"acc {record['train_acc']:.2%} | val loss {val_loss:.4f} acc {val_acc:.2%} | "
                              f"{ips:.0f} img/s")
                run_loss, run_correct, run_seen = 0.0, 0, 0
                if callback is not None:
                    callback(record)
            if flag.stop:
                interrupted = True
                where = "no checkpoint (out=None)" if ckpt_path is None else \
                    f"checkpoint saved to {ckpt_path}; continue with --resume"
                bar.write(f"interrupted at step {step}: {where}")
                break
    bar.close()
    wall = time.perf_counter() - start_time
    summary = {"best_val_accuracy": best, "final_val_accuracy": history[-1]["val_acc"] if history else None,
               "final_val_loss": history[-1]["val_loss"] if history else None,
               "steps": step, "total_steps": total_steps, "epochs": round(step / steps_per_epoch, 4),
               "wall_seconds": wall, "eval_seconds": eval_seconds,
               "images_per_second": (step - start_step) * cfg.batch_size / max(wall, 1e-9),
               "interrupted": interrupted, "backend": backend.get_backend(), "dataset": data.name,
               "num_params": model.num_params(), "config": model.config.to_dict(),
               "train_config": dataclasses.asdict(cfg)}
    if scaler is not None:
        summary.update(loss_scale=scaler.scale_value, skipped_steps=scaler.skipped_steps)
    if out is not None:
        _write_json_atomic(os.path.join(out, "summary.json"), summary)
        if history:
            try:
                from .plot import plot_curves

                plot_curves(out, os.path.join(out, "curves.png"))
            except ImportError:  # matplotlib missing: the numbers are in metrics.jsonl
                pass
    return TrainResult(model, history, summary, out)


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


def _read_history(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------------


def _parser():
    p = argparse.ArgumentParser(prog="python -m minivit.train", description="Train a Vision Transformer.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", default="cifar10", choices=DATASETS)
    p.add_argument("--data-dir", help="folder of the data set (cifar10 default: data/)")
    p.add_argument("--recipe", choices=sorted(RECIPES),
                   help="named defaults (see README); default: fast for cifar10, fashion-cpu, demo for shapes/folder")
    p.add_argument("--model", help="preset name, e.g. vit_cifar_tiny (default: the recipe's)")
    for name, kind in (("img-size", int), ("patch-size", int), ("embed-dim", int), ("depth", int),
                       ("num-heads", int), ("mlp-ratio", float), ("drop-rate", float), ("drop-path-rate", float),
                       ("epochs", float), ("max-steps", int), ("batch-size", int), ("lr", float),
                       ("weight-decay", float), ("warmup-epochs", float), ("warmup-steps", int),
                       ("label-smoothing", float), ("clip-grad", float), ("eval-every", int), ("num-evals", int),
                       ("train-subset", int)):
        p.add_argument(f"--{name}", type=kind)
    p.add_argument("--pool", choices=("cls", "gap"))
    p.add_argument("--pos-embed", choices=("learned", "learned2d", "sincos2d", "none"))
    p.add_argument("--stem", choices=("patch", "conv"), help="conv: the hybrid, a CNN feature map cut into 1x1 patches")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=("adamw", "sgd"))
    p.add_argument("--augment", choices=A.POLICIES)
    p.add_argument("--mixup", type=float, default=0.0)
    p.add_argument("--cutmix", type=float, default=0.0)
    p.add_argument("--random-erasing", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=backend.BACKENDS)
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--precision", default="float32", choices=("float32", "float16"),
                   help="float16: mixed precision (float16 matmuls, float32 master weights, loss scaling); for the GPU")
    p.add_argument("--out", default="runs/default", help="folder for metrics, checkpoint and plots")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.npz")
    p.add_argument("--init", help="start from pretrained weights (.npz or .safetensors)")
    p.add_argument("--keep-head", dest="new_head", action="store_false",
                   help="with --init: keep the checkpoint's head instead of a new zero-initialised one")
    p.add_argument("--init-gelu", choices=("erf", "tanh"), help="with --init: the GELU the checkpoint was trained with")
    p.add_argument("--download", action="store_true", help="cifar10: download it when missing")
    p.add_argument("--fallback", action="store_true", help="cifar10 unavailable: use Fashion-MNIST or shapes")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def main(argv=None):
    args = vars(_parser().parse_args(argv))
    cfg = TrainConfig(**{k: v for k, v in args.items()})
    try:
        result = train(cfg)
    except TrainingDiverged as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    s = result.summary
    if s["final_val_accuracy"] is not None:
        print(f"done: {s['steps']} steps in {s['wall_seconds']:.0f} s ({s['images_per_second']:.0f} img/s); "
              f"final val accuracy {s['final_val_accuracy']:.2%}, best {s['best_val_accuracy']:.2%}; "
              f"results in {result.out}/")
    return 130 if s["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
