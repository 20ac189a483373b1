"""MAE pre-training, then fine-tuning with few labels, against the same ViT trained from scratch (lesson 19).

    python -m experiments.mae            # Fashion-MNIST, about 15 minutes on two shared CPU cores

1. Pre-train one small MAE (minivit.mae, the mae_tiny preset: an encoder of 4 blocks of width 64, patch 4, a
   decoder of 2 blocks of width 32, 75% of the patches removed) on the 60,000 Fashion-MNIST training images,
   their labels unused, with the trainer (--task mae). One pre-training, seed 0, shared by every fine-tune.
2. For 1% (600) and 10% (6,000) of the labels, and seeds 0, 1, 2 (each seed its own random labelled subset
   and its own head): fine-tune the MAE's encoder (a ViT with pos_embed="sincos2d" and a new zero head), and
   train the same ViT from scratch, with the same steps, batch, AdamW, schedule and clipping.
3. Write experiments/results/mae.md (the table, mean +- std over the seeds, with wall time, and the command)
   and mae.json (every run), and with --save-model the pre-trained MAE to notebooks/assets/mae_fashion.npz
   (lesson 19 shows its reconstructions).

Small on purpose: MAE's gains are reported after hundreds of pre-training epochs of ViT-B on ImageNet; here
the pre-training is about one epoch of a 150k-parameter model. The table says what it shows at this size.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from experiments.common import RESULTS_DIR, fit, load_data, mean_std, provenance
from minivit import checkpoint
from minivit.mae import finetune_vit
from minivit.model import ViT
from minivit.train import TrainConfig, train

ASSET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks", "assets",
                     "mae_fashion.npz")


def arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pretrain-steps", type=int, default=600, help="MAE steps of batch 128 (600: 1.3 epochs)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.01, 0.1], help="shares of the labels")
    p.add_argument("--steps", type=int, nargs="+", default=[150, 300], help="fine-tuning steps, one per fraction")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--n-test", type=int, default=2000, help="test images every run is evaluated on")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--save-model", action="store_true", help="write the pre-trained MAE to " + ASSET)
    return p.parse_args(argv)


def pretrain(data, steps):
    cfg = TrainConfig(task="mae", dataset=data.name, max_steps=steps, epochs=None, batch_size=128, out=None,
                      progress=False, verbose=False, num_evals=1)
    start = time.perf_counter()
    result = train(cfg, data=data)
    return result.model, {"steps": steps, "batch_size": 128, "epochs": round(steps * 128 / len(data.y_train), 2),
                          "reconstruction_loss": result.summary["reconstruction_loss"],
                          "knn_accuracy": result.summary["knn_accuracy"],
                          "seconds": round(time.perf_counter() - start, 1)}


def labelled_subset(data, n, seed):
    """n training images drawn at random (seeded) with their labels; the test images unchanged."""
    import dataclasses
    idx = np.random.default_rng([seed, 33]).permutation(len(data.y_train))[:n]
    return dataclasses.replace(data, x_train=data.x_train[idx], y_train=data.y_train[idx])


def main(argv=None):
    args = arguments(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    start = time.perf_counter()
    data = load_data("fashion-mnist", n_test=args.n_test, seed=0)       # all 60,000 training images
    mae, pre = pretrain(data, args.pretrain_steps)
    print(f"pre-trained: {pre}", flush=True)
    if args.save_model:
        checkpoint.save_checkpoint(ASSET, mae)
        print("wrote", ASSET)
    runs = []
    for fraction, steps in zip(args.fractions, args.steps):
        n = round(fraction * len(data.y_train))
        for seed in range(args.seeds):
            sub = labelled_subset(data, n, seed)
            for init in ("mae", "scratch"):
                if init == "mae":
                    model = finetune_vit(mae.config, mae.state_dict(), sub.num_classes, seed=seed)
                else:
                    model = ViT(mae.config.encoder_config(sub.num_classes), seed=seed)
                r = fit(model, sub, steps=steps, batch_size=args.batch_size, lr=args.lr, seed=seed, num_evals=1)
                runs.append({"init": init, "fraction": fraction, "n_labels": n, "seed": seed,
                             **{k: r[k] for k in ("final_test_acc", "steps", "batch_size", "lr", "epochs", "seconds")}})
                print(f"{init:8s} {fraction:.0%} seed {seed}: test acc {r['final_test_acc']:.3f} "
                      f"({r['seconds']:.0f} s)", flush=True)
    seconds = time.perf_counter() - start
    results = {"pretraining": pre, "runs": runs, "settings": vars(args),
               "provenance": provenance("mae", "full", data, seconds, argv)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "mae.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "mae.md"), "w") as f:
        f.write(table(results))
    print(table(results))


def table(results):
    """The markdown table of results: mean +- std of the test accuracy over the seeds, and wall time."""
    pre, runs, prov = results["pretraining"], results["runs"], results["provenance"]
    lines = ["# MAE pre-training, then fine-tuning with few labels (Fashion-MNIST)", "",
             f"Made by `{prov['command']}` on {prov['cpu_count']} CPU cores ({prov['date']}, "
             f"{prov['wall_seconds'] / 60:.1f} min in all).", "",
             f"Pre-training (labels unused): {pre['steps']} steps of batch {pre['batch_size']} ({pre['epochs']} "
             f"epochs of the 60,000 training images), {pre['seconds']:.0f} s; reconstruction loss on the test "
             f"images {pre['reconstruction_loss']:.3f}, 20-NN accuracy of its encoder's features "
             f"{pre['knn_accuracy']:.1%}.", "",
             f"Test accuracy on {results['settings']['n_test']} test images, mean +- std over "
             f"{results['settings']['seeds']} seeds (each its own labelled subset and head):", "",
             "| labels | from MAE | from scratch | difference | steps (epochs) | wall time per run, MAE / scratch |",
             "|---|---|---|---|---|---|"]
    for fraction in results["settings"]["fractions"]:
        group = {init: [r for r in runs if r["fraction"] == fraction and r["init"] == init]
                 for init in ("mae", "scratch")}
        m, s = (mean_std([r["final_test_acc"] for r in group[i]]) for i in ("mae", "scratch"))
        diffs = [a["final_test_acc"] - b["final_test_acc"] for a, b in zip(group["mae"], group["scratch"])]
        d = mean_std(diffs)
        r0 = group["mae"][0]
        t_m, t_s = (np.mean([r["seconds"] for r in group[i]]) for i in ("mae", "scratch"))
        lines.append(f"| {fraction:.0%} ({r0['n_labels']:,}) | {m[0]:.1%} +- {m[1]:.1%} | {s[0]:.1%} +- {s[1]:.1%} | "
                     f"{d[0]:+.1%} +- {d[1]:.1%} | {r0['steps']} ({r0['epochs']}) | {t_m:.0f} s / {t_s:.0f} s |")
    lines += ["", "The difference is per seed (the same labelled subset for both), then averaged. The pre-training's "
              "own time is not in the per-run times.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
