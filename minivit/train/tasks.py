"""The tasks room: what a run trains, behind one interface that the loop calls without asking which task it
is. ClassificationTask (a ViT on labels) is here; CLIPTask (CLIP on captions) is minivit/clip/task.py's.

A task type (task_type(cfg.task)) gives, before the run exists:
    load_data(cfg) -> (data, cfg)          the data set (cfg changed by a fallback)
    check_data(cfg, data)                  refuse data the task cannot train on
    build_model(cfg, data, resumed)        the model (resumed: the checkpoint's own config)
    label_classes(model)                   K for the label check (the head's width), or None
    SUMMARY, ACCURACY                      record keys summary.json repeats; what val_acc is called
and, made with task(run, resumed) once the data are on the backend:
    announce_ops() -> lines                which ops run from kernels.py (one probing forward, run unchanged)
    batch(step) -> (x, y)                  the inputs of optimizer step `step`: a function of (seed, step)
    train_step(x, y) -> (loss, correct, grad_norm)   one optimizer step; correct is None for a task without a
                                           training accuracy (MAE): the bar, the log line and the curves leave it out
    evaluate() -> (val_loss, val_acc, more)          more: extra figures for the record
    checkpoint_extra() -> dict             what else the checkpoint must hold to resume

One classifier step (train_step below):
    logits = model.forward(augment(x))          # (B, K)
    loss, dlogits = cross_entropy(logits, y)    # mean over the batch
    model.zero_grad(); model.backward(dlogits)  # fills model.grads
    clip_grad_norm(model, max_norm)             # optional
    optimizer.step()
"""

import dataclasses
import math
import os
from contextlib import nullcontext

import numpy

from ..data import augment as A
from .. import backend, distributed
from ..fast import ops
from ..data import DATASETS, load_dataset
from ..functional import cross_entropy, cross_entropy_backward, cross_entropy_forward
from ..memory import check_fits
from ..model import ViT, ViTConfig, create_model, param_shapes, presets
from ..optim import AdamW, clip_grad_norm
from .config import DEFAULT_RECIPE, MODEL_FIELDS, _flag

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
    from ..data import CIFAR10_ARCHIVE, CIFAR10_MD5, CIFAR10_URL
    from ..data.download import download_file, safe_extract_tar

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
    from ..data import FASHION_MNIST_DIRS

    fashion = any(os.path.isdir(d) for d in FASHION_MNIST_DIRS)
    name = "fashion-mnist" if fashion else "shapes"
    where = "Fashion-MNIST (Debian's copy in /usr/share/datasets/fashion-mnist)" if fashion else \
        "`shapes`, the procedural data set that needs no download"
    if cfg.recipe is None:
        note = f", with the '{DEFAULT_RECIPE[name]}' recipe"
    else:
        note = f", keeping the '{cfg.recipe}' recipe"
    print(CIFAR_UNAVAILABLE.format(reason=reason, root=root, fallback=where, note=note), flush=True)
    cfg = dataclasses.replace(cfg, dataset=name, data_dir=None)
    return load_dataset(cfg.dataset, cfg.data_dir), cfg


def _move_aside_damaged_cifar10(root):
    """Rename the CIFAR-10 copy that failed its checks (the folder, else the archive) to NAME.damaged, so a
    fresh download takes its place and nothing is deleted."""
    from ..data import CIFAR10_ARCHIVE, CIFAR10_FOLDER

    for name in (CIFAR10_FOLDER, CIFAR10_ARCHIVE):       # the order load_cifar10 reads them in
        path = os.path.join(root, name)
        if os.path.exists(path):
            aside, n = path + ".damaged", 1
            while os.path.exists(aside):
                aside, n = f"{path}.damaged{n}", n + 1
            os.replace(path, aside)
            print(f"{path} failed its checks: moved it aside to {aside}", flush=True)
            return


# --------------------------------------------------------------------------------------------------
# The classifier: its model, batches, step and evaluation
# --------------------------------------------------------------------------------------------------


def build_model(cfg, data, resumed=None):
    """The ViT for cfg and this data set: the preset, the overrides, and the data's channels and classes.
    resumed: a checkpoint to continue, whose saved config is used (its weights are loaded later)."""
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
        from ..weights.convert import from_pretrained
        from ..mae.task import finetune_from_checkpoint

        # an MAE run's checkpoint: its encoder, a new zero head; None for any other, read by from_pretrained
        model = finetune_from_checkpoint(cfg.init, data.num_classes, overrides["img_size"], cfg.seed, cfg.dtype)
        if model is None:
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


def batch_for_step(step, cfg, data_x, data_y, steps_per_epoch, mean, std, dtype, num_classes, world=None):
    """The augmented batch of optimizer step `step`: a function of (seed, step) only (see minivit/train/__init__.py).
    data_x: uint8 (N, H, W, C) on the backend; data_y: int64 (N,) on the backend. world: the communicator
    of several ranks (minivit/distributed/), or None: rank r takes rows [r b, (r + 1) b) of the global
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


def announce_ops(model, optimizer, images, mean, std, dtype):
    """Which ops will run from kernels.py and which from functional.py (minivit/fast/ops.py), as lines to print,
    and a line for each group of layers that are your code (or where a kernel dropped out or stayed).
    One training forward and backward on a couple of images, recorded layer by layer (ops.report; the
    model's gradients, caches and random generators are put back, so the run itself is unchanged), makes
    ops check every fast twin the model uses against functional.py as it stands now."""
    p = next(iter(model.params.values()))
    fast_update = ops.uses_twin("adamw", p) if isinstance(optimizer, AdamW) else None
    recorded = ops.report(model, A.normalize(images, mean, std, dtype), training=True)
    if fast_update is not None:
        recorded.note_optimizer("adamw", fast_update, p)
    return recorded.summary_lines(probe_seconds=ops.report().probe_seconds)


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


# --------------------------------------------------------------------------------------------------
# The task interface (see the module docstring)
# --------------------------------------------------------------------------------------------------


class ClassificationTask:
    """A ViT (or any minivit Classifier) on labels: cross-entropy on augmented batches, loss and accuracy on
    the test split. run: a loop.Run, its data on the backend already (run.x_test: this rank's share of the
    test images on several ranks, all of them in one process); run.world, run.dp: its ranks."""

    SUMMARY = ()          # the last evaluation's figures that summary.json repeats: none beyond loss and accuracy
    ACCURACY = "val"      # what val_acc is: "final val accuracy" in the last line of the command line

    @staticmethod
    def load_data(cfg):
        return prepare_data(cfg)

    @staticmethod
    def check_data(cfg, data):
        if data.num_classes < 2:
            where = f" in {os.path.join(cfg.data_dir, 'train')}" if cfg.dataset == "folder" and cfg.data_dir else ""
            raise ValueError(f"{data.name} has {data.num_classes} class{where} ({data.classes}): a classifier needs "
                             f"at least two (one folder per class)")

    @staticmethod
    def build_model(cfg, data, resumed=None):
        return build_model(cfg, data, resumed)

    @staticmethod
    def label_classes(model):
        """The width of the model's head: a label past it would index outside the logits."""
        return getattr(getattr(model, "config", None), "num_classes", None)

    def __init__(self, run, resumed=None):
        self.run = run

    def announce_ops(self):
        run = self.run
        return announce_ops(run.model, run.optimizer, run.x_train[:2], run.data.mean, run.data.std, run.cfg.dtype)

    def batch(self, step):
        """x (B, H, W, C) and labels (B,), or soft targets (B, K) with mixup/cutmix (see batch_for_step)."""
        run, data = self.run, self.run.data
        return batch_for_step(step, run.cfg, run.x_train, run.y_train, run.steps_per_epoch, data.mean, data.std,
                              run.cfg.dtype, data.num_classes, run.world)

    def train_step(self, x, y):
        run = self.run
        return train_step(run.model, run.optimizer, x, y, run.cfg, run.scaler, run.dp)

    def evaluate(self):
        run = self.run
        val_loss, val_acc = evaluate(run.model, run.x_test, run.y_test, run.data.mean, run.data.std, run.cfg.dtype,
                                     run.cfg.eval_batch_size)
        if run.world is not None:                 # each rank evaluated its share: the means over the split
            val_loss, val_acc = distributed.mean_over_ranks(run.world, [val_loss, val_acc], run.x_test.shape[0])
        return val_loss, val_acc, {}

    def checkpoint_extra(self):
        return {}


def task_type(name):
    """The task type of cfg.task: ClassificationTask for "classify", clip.task.CLIPTask for "clip",
    mae.task.MAETask for "mae", deit.task.DistillTask for "distill" (--distill TEACHER)."""
    if name == "clip":
        from ..clip.task import CLIPTask      # imported when asked for: CLIP's modules stay unloaded otherwise

        return CLIPTask
    if name == "mae":
        from ..mae.task import MAETask

        return MAETask
    if name == "distill":
        from ..deit.task import DistillTask    # at call time: it builds on ClassificationTask, above this module

        return DistillTask
    return ClassificationTask
