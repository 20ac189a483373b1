"""Training curves: loss and accuracy against epochs, from OUT/metrics.jsonl; with --log-stats, the
per-layer statistics too (plot_stats).

    python -m minivit.plot runs/cifar10          # writes runs/cifar10/curves.png (and stats.png)
"""

import argparse
import json
import os
import sys


def read_metrics(out_dir, kind="eval"):
    """The records in OUT/metrics.jsonl (one JSON object per line) of this kind: "eval" (one per evaluation:
    those without a "kind" field), "stats" (--log-stats: minivit.train.stats), None: all, in file order. A torn
    last line (a run killed while appending it) is dropped with a warning naming the file; a bad line
    elsewhere is a ValueError naming the file and the line."""
    if kind not in ("eval", "stats", None):
        raise ValueError(f"kind must be 'eval', 'stats' or None, got {kind!r}")
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics at {path!r}: is {out_dir!r} the --out folder of a training run?")
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, line in lines:
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {i} is {type(record).__name__} {line.strip()[:40]!r}, expected a "
                                 f"JSON object (a record written by minivit.train)")
            records.append(record)
        except json.JSONDecodeError as err:
            if i != lines[-1][0]:
                raise ValueError(f"{path}: line {i} is not a JSON record ({err})") from None
            print(f"warning: {path}: dropped its torn last line {i} (a write cut short): {line.strip()[:60]!r}",
                  file=sys.stderr)
    return [r for r in records if kind is None or r.get("kind", "eval") == kind]


def plot_curves(history, path=None, title=None):
    """Two panels, loss and accuracy (train and validation) against epochs. history: a list of records
    (TrainResult.history) or a run folder. Saves to path when given; returns the matplotlib Figure."""
    import matplotlib

    if path is not None and matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(history, (str, os.PathLike)):
        title = title or os.path.basename(os.path.normpath(history))
        history = read_metrics(history)
    if not history:
        raise ValueError("no evaluation records to plot")
    epochs = [r["epoch"] for r in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=90)
    ax_loss.plot(epochs, [r["train_loss"] for r in history], "o-", label="train")
    ax_loss.plot(epochs, [r["val_loss"] for r in history], "s-", label="validation")
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    if all(r.get("train_acc") is not None for r in history):       # MAE has no training accuracy
        ax_acc.plot(epochs, [100 * r["train_acc"] for r in history], "o-", label="train")
    ax_acc.plot(epochs, [100 * r["val_acc"] for r in history], "s-", label="validation")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    return _finish(fig, title, path)


def plot_stats(records, path=None, title=None):
    """Four panels (2 x 2, a legend right of each) from --log-stats records (a list, or a run folder): against
    the step, the std of each stage's output; the gradient norm and the update-to-parameter ratio
    ||theta' - theta|| / ||theta|| of every weight matrix (log scale; the dashed line is the 1e-3 rule of
    thumb); each block's attention entropy (1: uniform, 0: one-hot) and fraction of GELU inputs in its flat
    tail. Saves to path when given; returns the matplotlib Figure."""
    import matplotlib

    if path is not None and matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(records, (str, os.PathLike)):
        title = title or os.path.basename(os.path.normpath(records))
        records = read_metrics(records, kind="stats")
    records = [r for r in records if r.get("kind") == "stats"]
    if not records:
        raise ValueError("no stats records to plot (train with --log-stats K)")
    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(12, 6.6), dpi=90)
    axes = axes.ravel()                               # activations, gradient norms / update ratios, blocks
    stages = list(records[0]["activations"])
    colours = plt.cm.viridis([i / max(len(stages) - 1, 1) for i in range(len(stages))])
    for name, colour in zip(stages, colours):
        axes[0].plot(steps, [r["activations"][name]["std"] for r in records], color=colour, label=name)
    axes[0].set(xlabel="step", ylabel="std", title="activations: std of each stage's output", yscale="log")
    weights = [n for n in records[0]["params"] if n.endswith("weight") and "norm" not in n]   # the matrices
    colours = plt.cm.plasma([i / max(len(weights) - 1, 1) for i in range(len(weights))])
    for name, colour in zip(weights, colours):
        axes[1].plot(steps, [r["params"][name]["grad_norm"] for r in records], color=colour, lw=1, label=name)
        ratio = [r["params"][name]["update_ratio"] for r in records]
        axes[2].plot(steps, [float("nan") if v is None else v for v in ratio], color=colour, lw=1, label=name)
    axes[1].set(xlabel="step", ylabel="||g||", title="gradient norm of each weight matrix", yscale="log")
    axes[2].axhline(1e-3, color="k", ls="--", lw=0.8)
    axes[2].set(xlabel="step", ylabel="||update|| / ||param||", title="update-to-parameter ratio", yscale="log")
    blocks = list(records[0]["blocks"])
    colours = plt.cm.viridis([i / max(len(blocks) - 1, 1) for i in range(len(blocks))])
    for name, colour in zip(blocks, colours):
        entropy = [r["blocks"][name]["attn_entropy"] for r in records]
        axes[3].plot(steps, entropy, color=colour, label=f"{name} attention entropy")
        axes[3].plot(steps, [r["blocks"][name]["gelu_flat"] for r in records], color=colour, ls=":",
                     label=f"{name} GELU flat")
    axes[3].set(xlabel="step", ylim=(-0.03, 1.03), title="attention entropy / log N (solid), GELU flat (dotted)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.title.set_fontsize(10)
    for ax in axes:                                   # every panel gets a legend; a long one shows every k-th line
        handles, labels = ax.get_legend_handles_labels()
        k = -(-len(handles) // 8)                     # ceil: at most 8 entries
        ax.legend(handles[::k], labels[::k], fontsize=7, title=None if k == 1 else f"1 line in {k} named, in order",
                  title_fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _finish(fig, title, path)


def _finish(fig, title, path):
    """The figure titled, laid out, and saved to path (then closed) when a path is given; returns it."""
    import matplotlib.pyplot as plt
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path)
        plt.close(fig)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minivit.plot", description="Plot training curves of a run.")
    p.add_argument("out", help="the --out folder of a training run")
    p.add_argument("--path", help="where to write the PNG (default OUT/curves.png)")
    args = p.parse_args(argv)
    path = args.path or os.path.join(args.out, "curves.png")
    try:
        plot_curves(args.out, path)
        has_stats = bool(read_metrics(args.out, kind="stats"))
        if has_stats:
            plot_stats(args.out, os.path.join(os.path.dirname(path) or ".", "stats.png"))
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}" + (" and stats.png beside it" if has_stats else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
