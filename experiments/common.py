"""What the experiments share: data, the two kinds of model, one training loop, FLOP counts, results files.

Every experiment has two modes:
    --quick   tiny: Fashion-MNIST (or `shapes`) on the CPU, about a minute or two; what the committed
              results/*_quick.json hold, and what tests/test_variants.py runs (smaller still)
    (full)    CIFAR-10 on a GPU (--backend cupy), the models of minivit's CIFAR presets

Each writes experiments/results/<name>[_quick].json (settings, one record per run, where and how long it
ran, the paper's claim) and a .png of the same numbers. notebooks/11_variants_and_ablations.ipynb
plots them next to the paper.

Every run trains through minivit.train (fit is a thin wrapper around train(cfg, model=..., data=...)), so
a ViT and the ResNet go through exactly the trainer's code: same batches, same AdamW, same warm-up +
cosine schedule, same evaluation.
"""

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from functools import lru_cache

import numpy as np

import minivit
from minivit import augment as A
from minivit import backend
from minivit.data import SHAPES_CLASSES, Dataset, channel_mean_std, load_dataset, make_shapes
from minivit.model import ViT, ViTConfig
from minivit.resnet import ResNet, ResNetConfig
from minivit.train import TrainConfig, TrainingDiverged, train

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# the ViT of quick mode: 4 blocks of width 64 (the `demo` recipe's model); on 28x28 Fashion-MNIST with
# patch 4 it has 7x7 = 49 patches and costs ~16 MFLOPs per image forward, like ResNet-8 below
QUICK_VIT = dict(patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0)
QUICK_RESNET = dict(widths=(16, 32, 64), depths=(1, 1, 1))        # ~19 MFLOPs at 28x28x1
# full mode (CIFAR-10): vit_cifar_tiny (~250 MFLOPs at 32x32) and a ResNet-14 of width 32 (~210 MFLOPs)
FULL_VIT = dict(patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=2.0)
FULL_RESNET = dict(widths=(32, 64, 128), depths=(2, 2, 2))


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _load(name, data_dir, img_size):
    """A data set read once per process (the tests and the notebook run several experiments in one)."""
    return load_dataset(name, data_dir, img_size)


def load_data(name, n_train=None, n_test=None, img_size=None, data_dir=None, seed=0):
    """A Dataset with a fixed, seeded random subset of n_train training and n_test test images.
    Nested: with the same seed, the first 1000 of a 5000-image subset are the 1000-image subset.
    `shapes` is generated with exactly n_train / n_test images (at img_size, default 32)."""
    if name == "shapes":
        (x_train, y_train), (x_test, y_test) = make_shapes(n_train or 10000, n_test or 2000, seed=seed,
                                                           img_size=img_size or 32)
        mean, std = channel_mean_std(x_train)
        return Dataset("shapes", x_train, y_train, x_test, y_test, list(SHAPES_CLASSES), mean, std)
    data = _load(name, data_dir, img_size)
    train_order = np.random.default_rng([seed, 1]).permutation(len(data.y_train))
    test_order = np.random.default_rng([seed, 2]).permutation(len(data.y_test))
    tr, te = train_order[:n_train], test_order[:n_test]
    return dataclasses.replace(data, x_train=data.x_train[tr], y_train=data.y_train[tr],
                               x_test=data.x_test[te], y_test=data.y_test[te])


def pad_to(data, size):
    """Zero-pad every image to size x size, centred (28x28 Fashion-MNIST -> 32x32, as LeNet-5 padded MNIST),
    with mean and std recomputed from the padded training images."""
    H, W, _ = data.image_shape
    top, left = (size - H) // 2, (size - W) // 2
    pad = ((0, 0), (top, size - H - top), (left, size - W - left), (0, 0))
    x_train, x_test = np.pad(data.x_train, pad), np.pad(data.x_test, pad)     # (N, size, size, C)
    mean, std = channel_mean_std(x_train)
    return dataclasses.replace(data, x_train=x_train, x_test=x_test, mean=mean, std=std)


def take_train(data, n):
    """The first n training images of data (its subsets are already in random order)."""
    if n > len(data.y_train):
        raise ValueError(f"asked for {n} training images but the data set holds {len(data.y_train)}")
    return dataclasses.replace(data, x_train=data.x_train[:n], y_train=data.y_train[:n])


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


def vit_for(data, base, seed=0, **overrides):
    """A ViT for this data set's images and classes: base (QUICK_VIT or FULL_VIT) with overrides."""
    H, W, C = data.image_shape
    cfg = ViTConfig(img_size=(H, W), in_chans=C, num_classes=data.num_classes, **{**base, **overrides})
    return ViT(cfg, seed=seed)


def resnet_for(data, base, seed=0, **overrides):
    H, W, C = data.image_shape
    cfg = ResNetConfig(img_size=(H, W), in_chans=C, num_classes=data.num_classes, **{**base, **overrides})
    return ResNet(cfg, seed=seed)


def forward_flops(model):
    """FLOPs of one image's forward pass through the matrix multiplies and convolutions (a multiply-add
    counts 2; norms, activations and softmax are left out, as usual): minivit.flops for a ViT,
    ResNetConfig.flops for the ResNet. A training step costs about 3x."""
    c = model.config
    return c.flops() if isinstance(c, ResNetConfig) else minivit.flops(c)


def describe(model):
    """A short dict that names a model in the results."""
    c = model.config
    if isinstance(c, ResNetConfig):
        return {"arch": "resnet", "widths": list(c.widths), "depths": list(c.depths),
                "params": model.num_params(), "mflops": round(forward_flops(model) / 1e6, 2)}
    return {"arch": "vit" if c.stem == "patch" else "hybrid", "patch_size": c.patch_size, "embed_dim": c.embed_dim,
            "depth": c.depth, "num_heads": c.num_heads, "pool": c.pool, "pos_embed": c.pos_embed, "stem": c.stem,
            "tokens": c.seq_len, "params": model.num_params(), "mflops": round(forward_flops(model) / 1e6, 2)}


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def fit(model, data, steps, batch_size, lr, weight_decay=0.05, warmup=0.1, augment="none", seed=0,
        num_evals=4, clip=1.0, label_smoothing=0.0, distill=None):
    """Train model on data.x_train with minivit.train: `steps` AdamW steps of batch_size images (warm-up for
    the first `warmup` fraction, then cosine to 0, gradients clipped to norm `clip`), evaluating on
    data.x_test num_evals times, evenly spaced; no files written. Returns a dict for the results file:
    final and best test accuracy, the training loss since the previous evaluation, time and images seen.
    A run whose loss becomes NaN comes back with diverged=True and final_test_acc None. distill: a teacher's
    checkpoint, for a minivit.deit.DistilledViT model (the run is --distill's, hard distillation)."""
    n = len(data.y_train)
    batch_size = min(batch_size, n)               # a tiny subset: one batch is the whole set
    cfg = TrainConfig(dataset=data.name, max_steps=steps, batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                      warmup_steps=round(warmup * steps), optimizer="adamw", clip_grad=clip or None,
                      augment=augment, label_smoothing=label_smoothing, seed=seed, dtype=model.dtype,
                      num_evals=num_evals, out=None, progress=False, verbose=False, distill=distill)
    history = []                                  # train's records, kept even if the run diverges
    start = time.perf_counter()
    try:
        summary = train(cfg, callback=history.append, model=model, data=data).summary
        diverged, done = False, summary["steps"]
        seconds, eval_seconds = summary["wall_seconds"], summary["eval_seconds"]
    except TrainingDiverged as err:
        diverged, done = True, err.step           # err.step steps succeeded
        seconds, eval_seconds = time.perf_counter() - start, None
    curve = [{"step": r["step"], "epoch": round(r["step"] * batch_size / n, 3), "train_loss": r["train_loss"],
              "test_acc": r["val_acc"]} for r in history]
    if diverged:
        curve.append({"step": done + 1, "test_acc": None, "diverged": True})
    accs = [r["test_acc"] for r in curve if r["test_acc"] is not None]
    return {"final_test_acc": None if diverged or not accs else accs[-1],
            "best_test_acc": max(accs) if accs else None,
            "final_train_loss": history[-1]["train_loss"] if history else None,
            "diverged": diverged,
            "steps": done, "batch_size": batch_size, "lr": lr, "n_train": n, "n_test": len(data.y_test),
            "epochs": round(done * batch_size / n, 2), "seconds": round(seconds, 2),   # epochs: images seen / n
            "eval_seconds": None if diverged else round(eval_seconds, 2),
            "seconds_per_step": None if diverged else round((seconds - eval_seconds) / max(done, 1), 4),  # training
            "curve": curve}


# --------------------------------------------------------------------------------------------------
# Command line, results and provenance
# --------------------------------------------------------------------------------------------------


def parser(description):
    """The flags every experiment takes; None means "the mode's default"."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny CPU version (Fashion-MNIST/shapes, a minute or two)")
    p.add_argument("--dataset", choices=("cifar10", "fashion-mnist", "shapes"), help="default: the mode's")
    p.add_argument("--data-dir", help="where CIFAR-10 lives (default data/)")
    p.add_argument("--backend", choices=backend.BACKENDS, help="default: cupy in full mode, numpy in quick")
    p.add_argument("--steps", type=int, help="optimizer steps per run")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--n-train", type=int, help="training images (the largest subset)")
    p.add_argument("--n-test", type=int, help="test images evaluated")
    p.add_argument("--seeds", type=int, help="runs per setting, seeds 0, 1, ...")
    p.add_argument("--augment", choices=A.POLICIES)
    p.add_argument("--out", default=RESULTS_DIR, help="folder for the JSON and the PNG")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the saved JSON, no training")
    return p


def run_or_replot(name, args, s, run, plot, argv=None):
    """Run the experiment (with --replot: read its saved results instead), write the JSON and the plot."""
    if args.replot:
        with open(results_path(args.out, name, s["mode"], "json")) as f:
            results = json.load(f)
    else:
        results = run(s, argv)
    for path in save(results, name, args.out, None if args.no_plot else plot):
        print("wrote", path)
    return results


def settings(args, quick, full):
    """The mode's defaults (quick or full dict), overridden by any flag given."""
    s = dict(quick if args.quick else full)
    for key, value in vars(args).items():
        if key in s and value is not None:
            s[key] = value
    s["mode"] = "quick" if args.quick else "full"
    if args.backend:
        s["backend"] = args.backend
    return s


def provenance(name, mode, data, seconds, argv=None):
    """Where, how long and on what a run ran: written into every results file."""
    cpu = os.cpu_count()
    where = backend.get_backend()
    argv = sys.argv[1:] if argv is None else list(argv)
    label = (f"QUICK CPU RUN ({data.name}, at most {len(data.y_train)} training images, {cpu} CPU cores, "
             f"{seconds:.0f} s): a miniature, far from the paper's scale" if mode == "quick" else
             f"FULL RUN ({data.name} on {where}, {seconds / 60:.1f} min)")
    info = {"label": label, "mode": mode, "dataset": data.name, "backend": where,
            "host": platform.node(), "cpu_count": cpu, "python": platform.python_version(),
            "numpy": np.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "wall_seconds": round(seconds, 1), "command": " ".join(["python -m experiments." + name] + argv)}
    if where == "cupy":
        try:
            import cupy

            info["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        except Exception:  # a name is nice to have, never worth failing a finished run
            pass
    return info


def results_path(out, name, mode, ext):
    return os.path.join(out, f"{name}{'_quick' if mode == 'quick' else ''}.{ext}")


def save(results, name, out, plot=None):
    """Write results (a dict) as JSON and, if plot is given, plot(results, png_path). Returns the paths."""
    os.makedirs(out, exist_ok=True)
    path = results_path(out, name, results["provenance"]["mode"], "json")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)
    paths = [path]
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plot(results)
        png = results_path(out, name, results["provenance"]["mode"], "png")
        fig.savefig(png, dpi=90, bbox_inches="tight")
        plt.close(fig)
        paths.append(png)
    return paths


def use_backend(s):
    """Switch to the run's backend (full mode defaults to cupy, and says so when there is no GPU)."""
    name = s.get("backend") or "numpy"
    if name == "cupy" and not backend.gpu_available():
        raise SystemExit("full mode runs on a GPU (--backend cupy) but CuPy or a GPU is missing here: "
                         "use --quick, or --backend numpy to run the full settings on the CPU (hours)")
    minivit.set_backend(name)


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values))


def print_row(*cells):
    print("  ".join(str(c) for c in cells), flush=True)
