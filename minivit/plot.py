"""Training curves: loss and accuracy against epochs, from OUT/metrics.jsonl.

    python -m minivit.plot runs/cifar10          # writes runs/cifar10/curves.png
"""

import argparse
import json
import os
import sys


def read_metrics(out_dir):
    """The list of evaluation records in OUT/metrics.jsonl (one JSON object per line). A torn last line
    (a run killed while appending it) is dropped with a warning naming the file; a bad line elsewhere
    is a ValueError naming the file and the line."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics at {path!r}: is {out_dir!r} the --out folder of a training run?")
    with open(path) as f:
        lines = [(i, line) for i, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i != lines[-1][0]:
                raise ValueError(f"{path}: line {i} is not a JSON record ({err})") from None
            print(f"warning: {path}: dropped its torn last line {i} (a write cut short): {line.strip()[:60]!r}",
                  file=sys.stderr)
    return records


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
    ax_acc.plot(epochs, [100 * r["train_acc"] for r in history], "o-", label="train")
    ax_acc.plot(epochs, [100 * r["val_acc"] for r in history], "s-", label="validation")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
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
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
