"""Data-size crossover: a ViT, the hybrid and a ResNet of about the same compute, trained on growing subsets.

The miniature of the paper's Fig. 3/4: there the ResNets win on small pre-training sets and the ViTs
overtake them as the data grows (ImageNet -> ImageNet-21k -> JFT-300M; JFT subsets of 9M ... 300M). Here
every model gets the same number of optimizer steps of the same batch size on each subset, so the compute
is the same in every run and only the number of distinct images changes.

    python -m experiments.data_size --quick          # Fashion-MNIST, 250 / 1000 / 4000 images, CPU, ~5 min
    python -m experiments.data_size --backend cupy   # CIFAR-10, 1k ... 50k images, GPU
"""

import sys
import time

if __package__ in (None, ""):  # run as a script: make `experiments` importable
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common

NAME = "data_size"
QUICK = dict(dataset="fashion-mnist", data_dir=None, sizes=[250, 1000, 4000], models=["vit", "hybrid", "resnet"],
             steps=150, batch_size=64, n_test=1000, seeds=1, lr=2e-3, augment="none", backend="numpy",
             vit=common.QUICK_VIT, resnet=common.QUICK_RESNET, stem_width=16)
FULL = dict(dataset="cifar10", data_dir=None, sizes=[1000, 3000, 10000, 25000, 50000],
            models=["vit", "hybrid", "resnet"], steps=6000, batch_size=128, n_test=10000, seeds=1, lr=1e-3,
            augment="standard", backend="cupy", vit=common.FULL_VIT, resnet=common.FULL_RESNET, stem_width=32)
PAPER = {
    "source": "Dosovitskiy et al. 2021, Fig. 3 (ImageNet / ImageNet-21k / JFT-300M pre-training) and Fig. 4 "
              "(JFT subsets of 9M, 30M, 90M, 300M images), §4.2; Fig. 5 for the hybrids",
    "claim": "With little data the ResNets (BiT) beat ViTs of comparable compute: ViT lacks the CNN's "
             "inductive biases (locality, translation equivariance) and overfits more. As the pre-training "
             "set grows the ViTs catch up and then overtake them (ViT-B/32 vs ResNet50: much worse on 9M "
             "images, better from 90M). Hybrids beat plain ViTs at small compute; the gap vanishes for "
             "larger models.",
}


def build(arch, data, s, seed):
    if arch == "resnet":
        return common.resnet_for(data, s["resnet"], seed=seed)
    if arch == "hybrid":
        return common.vit_for(data, s["vit"], seed=seed, stem="conv", stem_width=s["stem_width"])
    if arch == "vit":
        return common.vit_for(data, s["vit"], seed=seed)
    raise ValueError(f"unknown model {arch!r}; choose from vit, hybrid, resnet")


def run(s, argv=None):
    common.use_backend(s)
    data = common.load_data(s["dataset"], max(s["sizes"]), s["n_test"], data_dir=s["data_dir"])
    start, runs = time.perf_counter(), []
    common.print_row("images", "model", "params", "MFLOPs", "test acc", "best", "s/step")
    for n in sorted(s["sizes"]):
        subset = common.take_train(data, n)
        for arch in s["models"]:
            for seed in range(s["seeds"]):
                model = build(arch, data, s, seed)
                r = common.fit(model, subset, s["steps"], s["batch_size"], s["lr"], augment=s["augment"], seed=seed)
                runs.append({"model": arch, "seed": seed, **common.describe(model), **r})
                common.print_row(n, arch, f"{model.num_params():,}", runs[-1]["mflops"], r["final_test_acc"],
                                 r["best_test_acc"], r["seconds_per_step"])
    seconds = time.perf_counter() - start
    return {"experiment": NAME, "settings": s, "runs": runs, "paper": PAPER,
            "provenance": common.provenance(NAME, s["mode"], data, seconds, argv)}


def plot(results):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.6))
    styles = {"vit": ("o-", "ViT"), "hybrid": ("^-", "hybrid (conv stem)"), "resnet": ("s-", "ResNet")}
    for arch in results["settings"]["models"]:
        rows = [r for r in results["runs"] if r["model"] == arch]
        sizes = sorted({r["n_train"] for r in rows})
        accs = [common.mean_std([r["final_test_acc"] for r in rows if r["n_train"] == n])[0] for n in sizes]
        mflops = rows[0]["mflops"]
        style, label = styles[arch]
        ax.plot(sizes, [100 * a for a in accs], style, label=f"{label}, {rows[0]['params']:,} params, "
                                                             f"{mflops:.0f} MFLOPs")
    ax.set_xscale("log")
    ax.set_xticks(results["settings"]["sizes"], [str(n) for n in results["settings"]["sizes"]])
    ax.minorticks_off()
    ax.set(xlabel="training images (log scale)", ylabel="test accuracy (%)",
           title=f"same steps for every size: {results['settings']['steps']} x {results['settings']['batch_size']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(results["provenance"]["label"], fontsize=8)
    return fig


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", help="training-set sizes")
    p.add_argument("--models", nargs="+", choices=("vit", "hybrid", "resnet"))
    p.add_argument("--lr", type=float)
    args = p.parse_args(argv)
    s = common.settings(args, QUICK, FULL)
    return common.run_or_replot(NAME, args, s, run, plot, argv)


if __name__ == "__main__":
    main()
