"""Patch size 2, 4, 8 on 32x32 images: what each costs (tokens, FLOPs, time per step) and what it reaches.

N = HW / P^2, so halving P quadruples the sequence and attention costs grow with its square: on 32x32,
P = 8 gives 16 patches, P = 4 gives 64 and P = 2 gives 256. Same model width and depth, same steps.

    python -m experiments.patch_size --quick         # Fashion-MNIST padded to 32x32, 10000 images, CPU, ~1 min
    python -m experiments.patch_size --backend cupy  # CIFAR-10, GPU
"""

import sys
import time

if __package__ in (None, ""):
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import common

NAME = "patch_size"
QUICK = dict(dataset="fashion-mnist", data_dir=None, patch_sizes=[2, 4, 8], n_train=10000, steps=80, batch_size=32,
             n_test=500, num_evals=2, seeds=1, lr=2e-3, augment="none", backend="numpy", vit=common.QUICK_VIT)
FULL = dict(dataset="cifar10", data_dir=None, patch_sizes=[2, 4, 8], n_train=50000, steps=6000, batch_size=128,
            n_test=10000, num_evals=4, seeds=1, lr=1e-3, augment="standard", backend="cupy", vit=common.FULL_VIT)
PAPER = {
    "source": "Dosovitskiy et al. 2021, §3.1 and §4.1 (model variants); Table 5 / Fig. 5 (B/32 vs B/16)",
    "claim": "The sequence length is inversely proportional to the square of the patch size, so smaller "
             "patches cost more compute; at equal width and depth they are more accurate (ViT-B/16 beats "
             "ViT-B/32 at about 4x the compute).",
}


def run(s, argv=None):
    common.use_backend(s)
    data = common.load_data(s["dataset"], s["n_train"], s["n_test"], data_dir=s["data_dir"])
    if data.image_shape[:2] != (32, 32):     # Fashion-MNIST's 28x28 -> 32x32 (2 black pixels around)
        data = common.pad_to(data, 32)
    start, runs = time.perf_counter(), []
    common.print_row("P", "tokens", "params", "MFLOPs", "test acc", "best", "s/step")
    for P in s["patch_sizes"]:
        for seed in range(s["seeds"]):
            model = common.vit_for(data, s["vit"], seed=seed, patch_size=P)
            r = common.fit(model, data, s["steps"], s["batch_size"], s["lr"], augment=s["augment"], seed=seed,
                           num_evals=s["num_evals"])
            runs.append({"seed": seed, **common.describe(model), **r})
            common.print_row(P, model.config.seq_len, f"{model.num_params():,}", runs[-1]["mflops"],
                             r["final_test_acc"], r["best_test_acc"], r["seconds_per_step"])
    seconds = time.perf_counter() - start
    return {"experiment": NAME, "settings": s, "runs": runs, "paper": PAPER,
            "provenance": common.provenance(NAME, s["mode"], data, seconds, argv)}


def plot(results):
    import matplotlib.pyplot as plt

    sizes = results["settings"]["patch_sizes"]
    rows = {P: [r for r in results["runs"] if r["patch_size"] == P] for P in sizes}
    acc = [100 * common.mean_std([r["final_test_acc"] for r in rows[P]])[0] for P in sizes]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4))
    ax0.plot(sizes, acc, "o-")
    ax0.set(xlabel="patch size P", ylabel="test accuracy (%)", title="accuracy, same steps", xticks=sizes)
    mflops = [rows[P][0]["mflops"] for P in sizes]
    sps = [common.mean_std([r["seconds_per_step"] for r in rows[P]])[0] for P in sizes]
    ax1.semilogy(sizes, mflops, "o-", label="MFLOPs per image (forward)")
    ax1.semilogy(sizes, [1000 * t for t in sps], "s-", label="ms per training step (measured)")
    for P, m, r in zip(sizes, mflops, rows.values()):
        ax1.annotate(f"{r[0]['tokens']} tokens", (P, m), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax1.set(xlabel="patch size P", title="cost", xticks=sizes)
    ax1.legend(fontsize=8)
    for ax in (ax0, ax1):
        ax.grid(alpha=0.3)
    fig.suptitle(results["provenance"]["label"], fontsize=8)
    return fig


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--patch-sizes", type=int, nargs="+")
    p.add_argument("--lr", type=float)
    args = p.parse_args(argv)
    s = common.settings(args, QUICK, FULL)
    return common.run_or_replot(NAME, args, s, run, plot, argv)


if __name__ == "__main__":
    main()
