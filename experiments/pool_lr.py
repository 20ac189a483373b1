"""Class token vs global average pooling, each over a sweep of learning rates (the paper's Fig. 9).

"cls": the class token's final state is the image representation (Eq. 4); "gap": the mean over the
patch tokens after the final LayerNorm, with no class token (the paper's GAP). Both are trained at
every learning rate of the sweep, so each can be compared at its own best one.

    python -m experiments.pool_lr --quick            # Fashion-MNIST, 10000 images, 4 rates, CPU, ~2 min
    python -m experiments.pool_lr --backend cupy     # CIFAR-10, 5 rates, 2 seeds, GPU
"""

import sys
import time

if __package__ in (None, ""):
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common

NAME = "pool_lr"
QUICK = dict(dataset="fashion-mnist", data_dir=None, pools=["cls", "gap"], lrs=[3e-4, 1e-3, 3e-3, 1e-2], n_train=10000,
             steps=120, batch_size=64, n_test=1000, seeds=1, augment="none", backend="numpy", vit=common.QUICK_VIT)
FULL = dict(dataset="cifar10", data_dir=None, pools=["cls", "gap"], lrs=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2], n_train=50000,
            steps=6000, batch_size=128, n_test=10000, seeds=2, augment="standard", backend="cupy",
            vit=common.FULL_VIT)
PAPER = {
    "source": "Dosovitskiy et al. 2021, Appendix D.3, Fig. 9 (ViT-S/16 on ImageNet, linear 5-shot)",
    "claim": "A class token and global average pooling work equally well, but need different learning rates: "
             "GAP trained at the class token's learning rate does clearly worse.",
}


def run(s, argv=None):
    common.use_backend(s)
    data = common.load_data(s["dataset"], s["n_train"], s["n_test"], data_dir=s["data_dir"])
    start, runs = time.perf_counter(), []
    common.print_row("pool", "lr", "seed", "test acc", "best", "s/step")
    for pool in s["pools"]:
        for lr in s["lrs"]:
            for seed in range(s["seeds"]):
                model = common.vit_for(data, s["vit"], seed=seed, pool=pool)
                r = common.fit(model, data, s["steps"], s["batch_size"], lr, augment=s["augment"], seed=seed)
                runs.append({"pool_mode": pool, "seed": seed, **common.describe(model), **r})
                common.print_row(pool, lr, seed, r["final_test_acc"], r["best_test_acc"], r["seconds_per_step"])
    seconds = time.perf_counter() - start
    return {"experiment": NAME, "settings": s, "runs": runs, "paper": PAPER,
            "provenance": common.provenance(NAME, s["mode"], data, seconds, argv)}


def curve(results, pool):
    """[(lr, mean final test accuracy)] for one pooling mode."""
    rows = [r for r in results["runs"] if r["pool_mode"] == pool]
    return [(lr, common.mean_std([r["final_test_acc"] for r in rows if r["lr"] == lr])[0])
            for lr in results["settings"]["lrs"]]


def plot(results):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.4))
    for pool, style in (("cls", "o-"), ("gap", "s-")):
        if pool in results["settings"]["pools"]:
            pts = curve(results, pool)
            ax.plot([p[0] for p in pts], [100 * (p[1] or 0) for p in pts], style,
                    label="class token" if pool == "cls" else "global average pooling")
    ax.set_xscale("log")
    lrs = results["settings"]["lrs"]
    ax.set_xticks(lrs, [f"{lr:.0e}" for lr in lrs])
    ax.minorticks_off()
    ax.set(xlabel="peak learning rate (AdamW, log scale)", ylabel="test accuracy (%)",
           title="class token vs GAP: each at its own learning rate (paper Fig. 9)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.suptitle(results["provenance"]["label"], fontsize=8)
    return fig


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--lrs", type=float, nargs="+", help="the learning rates of the sweep")
    p.add_argument("--pools", nargs="+", choices=("cls", "gap"))
    args = p.parse_args(argv)
    s = common.settings(args, QUICK, FULL)
    return common.run_or_replot(NAME, args, s, run, plot, argv)


if __name__ == "__main__":
    main()
