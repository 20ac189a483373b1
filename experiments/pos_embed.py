"""Position-embedding ablation: the four kinds of position information, same model, same budget (Table 8).

"learned" is the 1-D table of Eq. 1; "learned2d" a row and a column table of D/2 each, concatenated;
"sincos2d" the fixed 2-D sin-cos of MAE; "none" no position information at all (a bag of patches).

    python -m experiments.pos_embed --quick          # Fashion-MNIST, 10000 images, CPU, ~1 min
    python -m experiments.pos_embed --backend cupy   # CIFAR-10, 3 seeds, GPU
"""

import sys
import time

if __package__ in (None, ""):
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common

NAME = "pos_embed"
KINDS = ["none", "learned", "learned2d", "sincos2d"]
QUICK = dict(dataset="fashion-mnist", data_dir=None, kinds=KINDS, n_train=10000, steps=150, batch_size=64,
             n_test=1000, seeds=1, lr=2e-3, augment="none", backend="numpy", vit=common.QUICK_VIT)
FULL = dict(dataset="cifar10", data_dir=None, kinds=KINDS, n_train=50000, steps=6000, batch_size=128,
            n_test=10000, seeds=3, lr=1e-3, augment="standard", backend="cupy", vit=common.FULL_VIT)
PAPER = {
    "source": "Dosovitskiy et al. 2021, Appendix D.4, Table 8 (ViT-B/16, ImageNet 5-shot linear accuracy)",
    "table8": {"none": 0.614, "learned": 0.642, "learned2d": 0.640, "relative": 0.640},
    "claim": "Without position embeddings accuracy drops clearly (0.614 vs 0.642); which kind of position "
             "embedding is used matters little (1-D, 2-D and relative all within 0.002).",
}


def run(s, argv=None):
    common.use_backend(s)
    data = common.load_data(s["dataset"], s["n_train"], s["n_test"], data_dir=s["data_dir"])
    start, runs = time.perf_counter(), []
    common.print_row("pos_embed", "seed", "params", "test acc", "best", "s/step")
    for kind in s["kinds"]:
        for seed in range(s["seeds"]):
            model = common.vit_for(data, s["vit"], seed=seed, pos_embed=kind)
            r = common.fit(model, data, s["steps"], s["batch_size"], s["lr"], augment=s["augment"], seed=seed)
            runs.append({"pos_embed_kind": kind, "seed": seed, **common.describe(model), **r})
            common.print_row(kind, seed, f"{model.num_params():,}", r["final_test_acc"], r["best_test_acc"],
                             r["seconds_per_step"])
    seconds = time.perf_counter() - start
    return {"experiment": NAME, "settings": s, "runs": runs, "paper": PAPER,
            "provenance": common.provenance(NAME, s["mode"], data, seconds, argv)}


def summary(results):
    """{kind: (mean, std)} of the final test accuracy over seeds."""
    return {k: common.mean_std([r["final_test_acc"] for r in results["runs"] if r["pos_embed_kind"] == k])
            for k in results["settings"]["kinds"]}


def plot(results):
    import matplotlib.pyplot as plt

    ours = summary(results)
    kinds = list(ours)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    bars = ax0.bar(kinds, [100 * ours[k][0] for k in kinds], yerr=[100 * ours[k][1] for k in kinds], color="C0")
    ax0.bar_label(bars, fmt="%.1f", fontsize=8)
    lo = min(100 * m for m, _ in ours.values())
    ax0.set(ylabel="test accuracy (%)", title=f"minivit ({results['provenance']['dataset']})", ylim=(lo - 5, None))
    paper = PAPER["table8"]
    pk = ["none", "learned", "learned2d", "relative"]
    ax1.bar_label(ax1.bar(pk, [100 * paper[k] for k in pk], color="C1"), fmt="%.1f", fontsize=8)
    ax1.set(ylabel="5-shot linear accuracy (%)", title="paper, Table 8 (ViT-B/16, ImageNet)", ylim=(55, 66))
    for ax in (ax0, ax1):
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(results["provenance"]["label"], fontsize=8)
    return fig


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--kinds", nargs="+", choices=KINDS)
    p.add_argument("--lr", type=float)
    args = p.parse_args(argv)
    s = common.settings(args, QUICK, FULL)
    return common.run_or_replot(NAME, args, s, run, plot, argv)


if __name__ == "__main__":
    main()
