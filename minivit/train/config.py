"""The settings room: TrainConfig (every setting, its default, --help and choices), the recipes (named sets
of defaults), resolve (a config checked and filled in from its recipe), the run's length and evaluation
cadence, and the command line's parser generated from TrainConfig's fields.

Nothing here runs a step or touches a file: the run folder is run_folder.py, the tasks tasks.py, the loop
loop.py.
"""

import argparse
import dataclasses
import math
from dataclasses import dataclass

from ..data import augment as A
from .. import backend
from ..data import DATASETS
from ..functional import GELU_KINDS
from ..embeddings import POS_EMBED_KINDS
from ..model import DTYPES, presets

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
    # CLIP (--task clip, minivit/clip/task.py) on the captioned shapes: 6.5 minutes of one CPU core (README)
    "clip-shapes": dict(task="clip", model="clip_shapes_tiny", epochs=20, batch_size=128, lr=2e-3, weight_decay=0.1,
                        warmup_epochs=1, label_smoothing=0.0, optimizer="adamw", augment="none"),
    # CLIP on Fashion-MNIST captioned from its class names and each image's shade
    "clip-fashion": dict(task="clip", model="clip_shapes_tiny", epochs=3, batch_size=64, lr=2e-3, weight_decay=0.1,
                         warmup_epochs=0.3, label_smoothing=0.0, optimizer="adamw", augment="none"),
    # MAE pre-training (--task mae, minivit/mae/task.py): the encoder the shape of fashion-cpu's / demo's ViT
    "mae-fashion": dict(task="mae", model="mae_tiny", epochs=3, batch_size=128, lr=2e-3, weight_decay=0.05,
                        warmup_epochs=0.3, label_smoothing=0.0, optimizer="adamw", augment="none"),
    "mae-shapes": dict(task="mae", model="mae_tiny", epochs=8, batch_size=128, lr=2e-3, weight_decay=0.05,
                       warmup_epochs=1, label_smoothing=0.0, optimizer="adamw", augment="none"),
}

# What a field takes when neither the command line nor the recipe gives it. In TrainConfig these fields
# are None ("not given"), like every other setting, so that a recipe can set them (the `long` recipe's
# cutmix and random_erasing) and a resumed run can tell a flag given, even at this value, from one left out.
BASE = dict(grad_accum=1, min_lr=0.0, momentum=0.9, mixup=0.0, cutmix=0.0, random_erasing=0.0, seed=0,
            dtype="float32", precision="float32", distill_kind="hard", distill_tau=3.0, distill_alpha=0.1)

DEFAULT_RECIPE = {"cifar10": "fast", "fashion-mnist": "fashion-cpu", "shapes": "demo", "folder": "demo"}
CLIP_RECIPE = {"shapes": "clip-shapes", "fashion-mnist": "clip-fashion"}   # --task clip's defaults
MAE_RECIPE = {"shapes": "mae-shapes", "fashion-mnist": "mae-fashion"}      # --task mae's defaults
TASKS = ("classify", "clip", "mae", "distill")  # clip: minivit/clip/task.py's batches, step and evaluation; mae:
                                        # mae/task.py; distill: minivit/deit/task.py's (a DistilledViT and a
                                        # teacher; --distill sets it)
DISTILL_KINDS = ("hard", "soft")        # minivit/deit/loss.py
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
    task: str = option(None, "classify: a ViT on labels; clip: CLIP on captions (minivit/clip/task.py); mae: "
                             "masked-autoencoder pre-training, labels unused (minivit/mae/task.py; default: "
                             "the recipe's, else classify)", TASKS)
    data_dir: str = option(None, "where the data set lives (cifar10: data/; folder: required)")
    recipe: str = option(None, "named defaults (see README; default: fast for cifar10, fashion-cpu for "
                               "fashion-mnist, demo for shapes and folder)", tuple(sorted(RECIPES)))
    # the model: None takes the recipe's value, else the preset's
    model: str = option(None, "a preset name, e.g. vit_cifar_tiny (minivit.presets; default: the recipe's)")
    img_size: int | tuple = option(None, "resize images to this side (default: the recipe's, else the data set's own)",
                                   parse=int)
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
    # DeiT's distillation (minivit/deit/task.py): a distilled ViT taught by a trained classifier
    distill: str = option(None, "train a distilled ViT (DeiT) taught by this checkpoint, a trained classifier (the "
                                "ResNet of minivit/resnet.py, or a ViT) of the same classes: --task distill")
    distill_kind: str = option(None, "hard: 1/2 CE(labels) + 1/2 CE(the teacher's argmax); soft: (1 - alpha) CE + "
                                     "alpha tau^2 KL (the paper's)", DISTILL_KINDS)
    distill_tau: float = option(None, "soft distillation's temperature tau")
    distill_alpha: float = option(None, "soft distillation's weight alpha of the teacher's term")
    # the data's augmentation
    augment: str = option(None, "none; standard: crop and flip; randaug: RandAugment" + FROM_RECIPE, A.POLICIES)
    mixup: float = option(None, "mixup alpha (0: off)")
    cutmix: float = option(None, "cutmix alpha (0: off); with both on, each step picks one")
    random_erasing: float = option(None, "the probability of erasing a patch of each image")
    seed: int = option(None, "the seed of the model's initialisation, the batches and the augmentation")
    zero: bool = option(False, "with several ranks (mpiexec): shard the optimizer state across them (ZeRO-1, "
                               "minivit/distributed/data_parallel.py); no effect in one process")
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
                                  "parameter ratio into metrics.jsonl (records of kind 'stats': minivit.train.stats)")
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
        default = {"clip": CLIP_RECIPE, "mae": MAE_RECIPE}.get(cfg.task, DEFAULT_RECIPE)
        if cfg.dataset not in default:
            what = "trains on a captioned data set:" if cfg.task == "clip" else "has a default recipe for"
            raise ValueError(f"--task {cfg.task} {what} {tuple(default)}, got {cfg.dataset!r}")
        cfg = dataclasses.replace(cfg, recipe=default[cfg.dataset])
    if cfg.recipe not in RECIPES:
        raise ValueError(f"unknown recipe {cfg.recipe!r}; choose one of {sorted(RECIPES)}")
    recipe_task = RECIPES[cfg.recipe].get("task", "classify")
    if cfg.task not in (None, recipe_task) and not (cfg.task == "distill" and recipe_task == "classify"):
        raise ValueError(f"recipe {cfg.recipe!r} is one of --task {recipe_task}, not --task {cfg.task}")
    values = dataclasses.asdict(cfg)
    steps_only = cfg.max_steps is not None and cfg.epochs is None   # max_steps alone: exactly that many
    for key, value in RECIPES[cfg.recipe].items():      # (with --init the model's shape is the checkpoint's)
        if values.get(key) is None and not (key == "epochs" and steps_only) and not (cfg.init and key in MODEL_FIELDS):
            values[key] = value
    for key, value in BASE.items():                                # then what no recipe sets
        if values[key] is None:
            values[key] = value
    values["task"] = values["task"] or ("distill" if cfg.distill else "classify")
    r = TrainConfig(**values)
    if (r.task == "distill") != (r.distill is not None):       # --distill TEACHER is the distillation task
        raise ValueError("--task distill needs --distill TEACHER_CHECKPOINT" if r.distill is None else
                         f"--distill {r.distill!r} trains a distilled ViT (--task distill), not --task {r.task}")
    if r.task == "clip":
        from ..clip.task import check_config

        check_config(r)                            # the classifier's options refused by name, the CLIP preset
    elif r.task == "mae":
        from ..mae.task import check_config

        check_config(r)                            # the classifier's options refused by name, the MAE preset
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
    for name in ("epochs", "lr", "clip_grad", "distill_tau"):      # > 0 (where given)
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
    if not 0 <= r.distill_alpha <= 1:
        raise ValueError(f"distill_alpha must be in [0, 1], got {r.distill_alpha!r}")
    if not 0 <= r.random_erasing <= 1:
        raise ValueError(f"random_erasing must be a probability in [0, 1], got {r.random_erasing!r}")
    if r.eval_every is not None and r.num_evals is not None:
        raise ValueError(f"give eval_every or num_evals, not both (got {r.eval_every!r} and {r.num_evals!r})")
    if r.log_stats and r.out is None:
        raise ValueError(f"log_stats {r.log_stats} writes its records to out/metrics.jsonl, but out is None")
    if r.resume and r.overwrite:
        raise ValueError("give resume (continue the run in out) or overwrite (replace it), not both")
    return r


def _flag(name):
    """The command-line flag of a TrainConfig field: --the-name, or the one its option() names."""
    return TrainConfig.__dataclass_fields__[name].metadata["flag"] or "--" + name.replace("_", "-")


def _cadence(cfg):
    if cfg.num_evals:
        return f"{cfg.num_evals} evaluations evenly spaced"
    return f"every {cfg.eval_every} steps" if cfg.eval_every else "at the end of each epoch"


def run_length(cfg, steps_per_epoch):
    """Optimizer steps of the run: ceil(epochs * steps_per_epoch), at most max_steps; max_steps alone: that many."""
    total = math.ceil(cfg.epochs * steps_per_epoch) if cfg.epochs is not None else cfg.max_steps
    return total if cfg.max_steps is None else min(total, cfg.max_steps)


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


def evaluation_steps(cfg, total_steps, steps_per_epoch):
    """The steps after which the run evaluates and saves: cfg's cadence, and always the last."""
    if cfg.num_evals:      # e.g. 4 evaluations of 150 steps: after steps 37, 75, 112 and 150
        return EvalSteps(total_steps, num_evals=cfg.num_evals)
    return EvalSteps(total_steps, every=cfg.eval_every or steps_per_epoch)


def _pair(size):
    return (size, size) if isinstance(size, int) else tuple(size)


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


