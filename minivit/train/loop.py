"""The loop room: train(cfg) and the four parts it runs, each a screen: set_up (settings checked, data,
model, optimizer, a resumed state, the run folder), run_loop (the optimizer steps), evaluate_and_save (at
each evaluation), finish (the summary); and the signals that stop a run cleanly, and main, the command line.

The loop does not know which task it trains: run.task (tasks.py's ClassificationTask, or clip/task.py's
CLIPTask) gives each step's batch, the step itself and the evaluation. One pass of run_loop:
    optimizer.lr = schedule(step)
    x, y = task.batch(step)                     # a function of (seed, step) alone
    loss, correct, grad_norm = task.train_step(x, y)
    every eval_steps (and at Ctrl-C or SIGTERM): evaluate_and_save(run)   # metrics.jsonl, checkpoint.npz

Nothing is lost: Ctrl-C or SIGTERM finishes the step, evaluates, saves a checkpoint and exits (130 or
143); a NaN or infinite loss, validation loss or parameter stops the run, keeping the checkpoint of the
last evaluation at which all three were finite; a checkpoint is only ever written from a finite state.
"""

import dataclasses
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy
from tqdm import tqdm

from .. import backend, distributed
from ..fast.amp import LossScaler
from ..weights.checkpoint import save_checkpoint
from ..data import Dataset, resize_images
from ..memory import check_fits, size_text
from ..model import ViTConfig, presets
from ..optim import SGD, AdamW, WarmupCosine, default_no_decay
from . import stats
from .config import MODEL_FIELDS, TrainConfig, _pair, _parser, evaluation_steps, resolve, run_length
from .run_folder import (_append_jsonl, _naming_path, _summary_of_a_finished_run, _write_jsonl_atomic,
                         check_out, check_resume_flags, check_resumed_data, lock_out, open_out, restore,
                         resume_config, settle_replaced, unlock_out, write_summary)
from .plot import read_metrics
from .tasks import check_labels, task_type

# --------------------------------------------------------------------------------------------------
# What train() returns or raises, the optimizer it builds, the signals that stop it
# --------------------------------------------------------------------------------------------------


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


def build_optimizer(cfg, model):
    """AdamW or SGD; biases, LayerNorm weights, the class token and position embeddings get no decay."""
    no_decay = default_no_decay(model.params)
    if cfg.optimizer == "adamw":
        return AdamW(model, cfg.lr, weight_decay=cfg.weight_decay, no_decay=no_decay)
    return SGD(model, cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, no_decay=no_decay)


class SecondSignal(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM: the run stops at once, even during its save (checkpoints are written
    atomically, so the last one completed is whole). signum: the signal."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _StopFlag:
    """Ctrl-C (SIGINT) or SIGTERM (what a cluster scheduler sends before it kills a job) sets the flag;
    the loop finishes its step, evaluates, saves a checkpoint and stops. A second signal interrupts at once.

    The handler only records the signal (signum); whether to stop after a step is decided by agree(), once per
    step (on one process also after an evaluation, whose checkpoint is then the step's), and read through
    `stop` until the next decision. A signal can arrive at any moment, also in the
    middle of a collective or of an evaluation: read directly, it would make one rank stop a step before the
    others, which then wait for it forever (seen: a two-rank job that went on after SIGTERM)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum, self.received, self.decided, self._old = None, False, None, {}

    @property
    def stop(self):
        """Stop after this step: what the last agree() decided."""
        return self.decided is not None

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

    def agree(self, world=None):
        """Decide whether to stop after this step. One process: whether a signal came. Several ranks: whether one
        came to any of them (the launcher forwards a signal to each, not at the same instant), the same answer on
        every rank. signum is only read here, never written: a signal that arrives during the collective is kept
        for the next step's decision, not overwritten. A rank's own signal arriving after a decision to stop is
        not a second one."""
        mine = self.signum or 0
        self.decided = (mine if world is None else world.max(mine, what="the stop signal")) or None

    def __exit__(self, *exc):
        for signum, old in self._old.items():
            signal.signal(signum, old)


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
    world: object = None        # several ranks (mpiexec): their communicator (minivit/distributed/), else None
    dp: object = None           # and the DataParallel that exchanges each step's gradients
    task: object = None         # tasks.ClassificationTask or clip.task.CLIPTask: batches, step, evaluation (set
                                # once the data are on the backend)
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
    seen_correct: int | None = 0   # None for a task without a training accuracy (MAE)
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
    task = task_type(cfg.task)                      # what the run trains: its model, batches, step, evaluation
    model = model if given_model else task.build_model(cfg, data, resumed)
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
    check_labels(data, task.label_classes(model))
    if cfg.out is not None and run.writes:          # every setting has been checked: now the folder is touched
        run.made_out = not os.path.exists(cfg.out)
        run.lock = lock_out(cfg.out)                # refused if another run holds it; held until release_out
    try:
        _set_up_out_and_device(run, task, cfg, data, model, resumed, world, given_model, total_steps)
    except BaseException:
        release_out(run, failed=True)
        raise
    return run


def _set_up_out_and_device(run, task, cfg, data, model, resumed, world, given_model, total_steps):
    """set_up's part that runs under the folder's lock: the folder opened, the data on the backend, the ops
    announced."""
    if run.lock is not None:
        run.replaced = open_out(cfg.out, overwrite=cfg.overwrite)
        if resumed is not None and os.path.exists(os.path.join(cfg.out, "metrics.jsonl")):
            kept = [r for r in read_metrics(cfg.out, kind=None) if r.get("step", 0) <= run.step]   # stats too,
            _write_jsonl_atomic(os.path.join(cfg.out, "metrics.jsonl"), kept)   # without torn or later lines
    # the whole data set goes to the backend once (on CuPy it then lives on the GPU)
    run.x_train, run.y_train = (backend.asarray(a, backend=model.backend) for a in (data.x_train, data.y_train))
    x_test, y_test = (data.x_test, data.y_test) if world is None else distributed.shard(world, data.x_test, data.y_test)
    run.x_test, run.y_test = (backend.asarray(a, backend=model.backend) for a in (x_test, y_test))
    run.task = task(run, resumed)
    if cfg.verbose:
        for line in run.task.announce_ops():
            print(line, flush=True)
        described = _describe(cfg, model, given_model)
        print(f"training {model.num_params():,}-parameter {type(model).__name__} ({described}) "
              f"on {data.name} ({data.x_train.shape[0]} images, {data.num_classes} classes) with "
              f"{backend.get_backend()}, {total_steps} steps of batch {cfg.batch_size}", flush=True)


def load_run_data(cfg, data=None):
    """cfg checked, then resolved for the data set it trains on; that data set (loaded unless given,
    downloaded or fallen back from as cfg allows), resized to cfg.img_size and cut to cfg.train_subset.
    An out that holds a run in the way is refused first, if its name is known before the data."""
    first = resolve(cfg if data is None else dataclasses.replace(cfg, dataset=data.name))  # every setting
    if cfg.out is not None and "{dataset}" not in cfg.out:                          # checked now, before
        check_out(cfg)                                                              # anything slow runs
    task = task_type(first.task)
    if data is None:                                          # (a classifier's may fall back to another data set)
        data, cfg = task.load_data(cfg)
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
    task.check_data(cfg, data)
    if data.x_train.shape[0] < cfg.batch_size:
        raise ValueError(f"batch_size {cfg.batch_size} is larger than the {data.x_train.shape[0]} training images")
    return cfg, data


def check_run_memory(cfg, data):
    """Before the images are resized to --img-size: the bytes the run will hold at least (the resized
    images, and one block's attention weights for one batch on the CPU), refused with the figures and what
    to change when they exceed the memory available (--img-size 20000 was a raw MemoryError)."""
    H, W = _pair(cfg.img_size)
    n, C = data.x_train.shape[0] + data.x_test.shape[0], data.x_train.shape[3]
    images = n * H * W * C                                     # uint8 (N, H, W, C), train and test
    P = cfg.patch_size or getattr(presets.get(cfg.model), "patch_size", None)
    attention = 0
    if P and cfg.backend != "cupy":                            # (B, nh, N, N) weights, kept for backward
        tokens = (H // P) * (W // P) + 1
        attention = cfg.batch_size * (cfg.num_heads or 1) * tokens ** 2 * numpy.dtype(cfg.dtype or "float32").itemsize
    check_fits(images + attention, f"--img-size {cfg.img_size}: the {n:,} images resized ({size_text(images)}) "
               f"and one block's attention for a batch of {cfg.batch_size} ({size_text(attention)})",
               "lower --img-size (or --batch-size, --train-subset), or raise --patch-size")


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
                x, y = run.task.batch(run.step)   # images (B, H, W, C); labels (B,) or (B, K), or CLIP's tokens (B, L)
                if run.world is not None:   # dropout and drop-path draw from a stream of (seed, step, rank)
                    distributed.seed_dropout(model, cfg.seed, run.step, run.world.rank)
                logged = cfg.log_stats and (run.step + 1) % cfg.log_stats == 0
                if logged:                                    # --log-stats: train/stats.py, before and after the step
                    before, acts = stats.snapshot(model), stats.activation_stats(model, x)
                try:
                    loss, correct, _ = run.task.train_step(x, y)
                except FloatingPointError as err:             # the loss scaler gave up: see amp.LossScaler
                    raise run.diverged(str(err)) from None
                if not math.isfinite(loss):
                    raise run.diverged(f"the loss became {loss}")
                run.step += 1
                run.seen_loss += loss * cfg.batch_size        # (with several ranks x holds this rank's slice)
                if logged and run.writes:
                    record = stats.step_record(run.step, model, before, *acts)
                    _append_jsonl(os.path.join(cfg.out, "metrics.jsonl"), record)
                run.seen_correct = None if correct is None else run.seen_correct + correct   # None: no accuracy
                run.seen_images += cfg.batch_size
                bar.update(1)
                shown = {"loss": f"{loss:.3f}", "img_s": f"{run.images_per_second():.0f}"}
                if correct is not None:
                    shown["acc"] = f"{correct / cfg.batch_size:.2f}"
                bar.set_postfix(shown)
                flag.agree(run.world)       # a signal to any rank stops every rank, after this same step
                if run.step in run.eval_steps or flag.stop:
                    record = evaluate_and_save(run)
                    if cfg.verbose:
                        train_acc = "" if record["train_acc"] is None else f" acc {record['train_acc']:.2%}"
                        bar.write(f"epoch {record['epoch']:.2f} step {run.step}: train loss {record['train_loss']:.4f}"
                                  f"{train_acc} | val loss {record['val_loss']:.4f} acc "
                                  f"{record['val_acc']:.2%} | {record['images_per_second']:.0f} img/s")
                    if callback is not None:
                        callback(record)
                    if run.world is None:   # one process: a signal during the evaluation stops after it (saved)
                        flag.agree()
                if flag.stop:
                    where = "no checkpoint (out=None)" if run.ckpt_path is None else \
                        f"checkpoint saved to {run.ckpt_path}; continue with --resume"
                    bar.write(f"{signal.Signals(flag.decided).name} at step {run.step}: {where}")
                    break
        finally:
            bar.close()
    return None if flag.decided is None else signal.Signals(flag.decided).name


def evaluate_and_save(run):
    """Evaluate on the held-out split. If the loss and every parameter are finite, record the metrics
    (run.history, metrics.jsonl) and save a checkpoint; if not, stop with TrainingDiverged, saving nothing.
    Returns the record."""
    start = time.perf_counter()
    images_per_second, wall_seconds = run.images_per_second(), start - run.start_time   # of the training alone
    val_loss, val_acc, more = run.task.evaluate()   # CLIP: val_acc is the zero-shot accuracy; more: recall@1/@5...
    run.eval_seconds += time.perf_counter() - start
    bad = non_finite_params(run.model)
    if not math.isfinite(val_loss) or bad:
        raise run.diverged(f"the validation loss became {val_loss}" if not math.isfinite(val_loss) else
                           f"{len(bad)} parameters ({', '.join(bad[:3])}...) became NaN or infinite")
    run.best = max(run.best, val_acc)
    seen = max(run.seen_images, 1)
    record = {"step": run.step, "epoch": round(run.step / run.steps_per_epoch, 4), "train_loss": run.seen_loss / seen,
              "train_acc": None if run.seen_correct is None else run.seen_correct / seen,   # None: MAE has none
              "val_loss": val_loss, "val_acc": val_acc, "lr": run.optimizer.lr,
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
                 "classes": run.data.classes, "num_classes": len(run.data.classes), "mean": list(run.data.mean),
                 "std": list(run.data.std), "dataset": run.data.name}
        if run.scaler is not None:
            extra["loss_scaler"] = run.scaler.state_dict()
        extra.update(run.task.checkpoint_extra())             # CLIP: its tokenizer
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
               "train_config": dataclasses.asdict(run.cfg),
               "world_size": 1 if run.world is None else run.world.world_size}
    if run.scaler is not None:
        summary.update(loss_scale=run.scaler.scale_value, skipped_steps=run.scaler.skipped_steps)
    summary.update({k: v for k, v in last.items() if k in run.task.SUMMARY})   # CLIP: zero-shot, retrieval
    if run.cfg.out is not None and run.writes:
        write_summary(run.cfg.out, summary, run.history)
    return TrainResult(run.model, run.history, summary, run.cfg.out)




def _describe(cfg, model, given_model):
    """'vit_cifar_tiny with embed_dim, depth changed: D=64, depth=4, patch=4, img=(32, 32)' and the like."""
    c = model.config
    if not isinstance(c, ViTConfig):
        return model.extra_repr()
    if given_model or cfg.init:
        name = "a model given to train()" if given_model else f"from {cfg.init}"
    else:
        preset = presets[cfg.model]
        fields = ("patch_size", "embed_dim", "depth", "num_heads", "mlp_ratio", "pool", "pos_embed", "stem",
                  "drop_rate", "drop_path_rate")
        changed = [f for f in fields if getattr(c, f) != getattr(preset, f)]
        name = cfg.model + (f" with {', '.join(changed)} changed" if changed else "")
    return f"{name}: D={c.embed_dim}, depth={c.depth}, patch={c.patch_size}, img={c.img_size}"


# --------------------------------------------------------------------------------------------------
# The command line (python -m minivit.train: __main__.py); its flags are config._parser's
# --------------------------------------------------------------------------------------------------


def _stop_at_once(signum, frame):
    """SIGTERM while the run is being set up (before the loop can finish a step and save): stop now."""
    raise SecondSignal(signum)


def main(argv=None):
    """Parse the flags, train, print one line of error (exit 1: diverged; 2: a refused setting or a file
    problem; 128 + signal: stopped at once) or the result (0; 130 or 143 when a signal stopped it cleanly)."""
    parser = _parser()
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    unset = object()                               # a default no flag can give: what is left is on the command line
    parser.set_defaults(**{f.name: unset for f in dataclasses.fields(TrainConfig)})
    given = [name for name, value in vars(parser.parse_args(argv)).items() if value is not unset]
    try:                               # until the loop's own handler (_StopFlag): SIGTERM stops at once, as Ctrl-C
        before_loop = signal.signal(signal.SIGTERM, _stop_at_once)   # does, releasing the folder's lock (exit 143)
    except ValueError:                 # not the main thread: no handler
        before_loop = None
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
    finally:
        if before_loop is not None:
            signal.signal(signal.SIGTERM, before_loop)
    s = result.summary
    if s["final_val_accuracy"] is not None:
        print(f"done: {s['steps']} steps in {s['wall_seconds']:.0f} s ({s['images_per_second']:.0f} img/s); "
              f"final {task_type(s['train_config']['task']).ACCURACY} accuracy "
              f"{s['final_val_accuracy']:.2%}, best {s['best_val_accuracy']:.2%}; "
              f"results in {result.out}/")
    return 128 + getattr(signal, s["signal"]) if s["signal"] else 0   # 130 after Ctrl-C, 143 after SIGTERM
