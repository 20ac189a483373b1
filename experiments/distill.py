"""DeiT distillation: a distilled ViT taught by a ResNet, against the same ViT trained alone, on small subsets.

The miniature of DeiT's claim (Touvron et al., ICML 2021, Table 2-3): a ViT trained on ImageNet alone gains
from a CNN teacher through its distillation token. Here, for each training-set size, a ResNet teacher is
trained on the same images (seed 0), then for each seed the same ViT (same config, same initial weights for
every shared parameter, same batches, same steps) is trained twice: alone (cross-entropy), and as a
DistilledViT with the teacher (hard distillation, python -m minivit.train --distill's task). Each run goes
through minivit.train (common.fit). Results: results/distill.json and results/distill.md, a table of the
test accuracy as mean +- std over the seeds, with the wall time per run.

    OPENBLAS_NUM_THREADS=1 python -m experiments.distill          # Fashion-MNIST 1,000 and 10,000, 3 seeds, CPU
    python -m experiments.distill --quick                         # `shapes`, tiny: what the tests run
"""

import os
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make `experiments` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import minivit
from experiments import common
from minivit.deit import DistilledViT
from minivit.model import ViT, ViTConfig
from minivit.train import TrainConfig, train

NAME = "distill"
VIT = dict(patch_size=4, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0)
QUICK = dict(dataset="shapes", data_dir=None, sizes=[128, 256], seeds=2, steps=6, batch_size=32, n_test=128,
             lr=2e-3, teacher_steps=6, teacher_lr=2e-3, backend="numpy",
             vit=dict(VIT, embed_dim=16, depth=1, num_heads=2), teacher=dict(widths=(8,), depths=(1,)), augment="none")
# the committed run: about 5 CPU-minutes (it took longer on two cores shared with other jobs)
FULL = dict(dataset="fashion-mnist", data_dir=None, sizes=[1000, 10000], seeds=3, steps=150, batch_size=64,
            n_test=500, lr=2e-3, teacher_steps=300, teacher_lr=1e-2, backend="numpy", vit=VIT,
            teacher=dict(widths=(8, 16), depths=(1, 1)), augment="none")
PAPER = {
    "source": "Touvron et al. 2021 (DeiT), Tables 2-3 and 5: DeiT-B on ImageNet-1k, RegNetY-16GF teacher",
    "claim": "A ViT trained on ImageNet alone gains from a convnet teacher through a distillation token: "
             "hard distillation beats soft and no distillation (81.8% -> 83.4% top-1 for DeiT-B, 300 epochs), "
             "and the distilled student even passes its teacher's accuracy.",
}


def vit_config(data, s):
    H, W, C = data.image_shape
    return ViTConfig(img_size=(H, W), in_chans=C, num_classes=data.num_classes, **s["vit"])


def train_teacher(subset, s, folder):
    """A ResNet trained on the subset by the trainer, written to folder as --distill reads it. Returns
    (test accuracy, seconds)."""
    model = common.resnet_for(subset, s["teacher"], seed=0)
    cfg = TrainConfig(dataset=subset.name, max_steps=s["teacher_steps"], batch_size=min(s["batch_size"], len(
        subset.y_train)), lr=s["teacher_lr"], weight_decay=0.05, warmup_steps=round(0.1 * s["teacher_steps"]),
        optimizer="adamw", clip_grad=1.0, augment=s["augment"], num_evals=1, out=folder, progress=False,
        verbose=False, overwrite=True)
    summary = train(cfg, model=model, data=subset).summary
    return summary["final_val_accuracy"], summary["wall_seconds"], model


def run(s, argv=None):
    common.use_backend(s)
    data = common.load_data(s["dataset"], max(s["sizes"]), s["n_test"], data_dir=s["data_dir"])
    start, runs, teachers = time.perf_counter(), [], []
    common.print_row("images", "model", "seed", "test acc", "seconds")
    with tempfile.TemporaryDirectory() as tmp:
        for n in sorted(s["sizes"]):
            subset = common.take_train(data, n)
            folder = os.path.join(tmp, f"teacher_{n}")
            acc, seconds, teacher = train_teacher(subset, s, folder)
            teachers.append({"n_train": n, "test_acc": acc, "seconds": round(seconds, 2), **common.describe(teacher)})
            common.print_row(n, "teacher", 0, acc, round(seconds, 1))
            for seed in range(s["seeds"]):
                for arch in ("vit", "distilled"):
                    config = vit_config(data, s)
                    model = ViT(config, seed=seed) if arch == "vit" else DistilledViT(config, seed=seed)
                    r = common.fit(model, subset, s["steps"], s["batch_size"], s["lr"], augment=s["augment"],
                                   seed=seed, num_evals=2, distill=folder if arch == "distilled" else None)
                    runs.append({"model": arch, "seed": seed, "params": model.num_params(), **r})
                    common.print_row(n, arch, seed, r["final_test_acc"], r["seconds"])
    seconds = time.perf_counter() - start
    return {"experiment": NAME, "settings": s, "teachers": teachers, "runs": runs, "paper": PAPER,
            "provenance": common.provenance(NAME, s["mode"], data, seconds, argv)}


def table(results):
    """The markdown table of results: per size, the teacher, then each model's mean +- std over the seeds."""
    s, prov = results["settings"], results["provenance"]
    lines = [f"# DeiT distillation in miniature ({prov['dataset']})", "",
             f"Made by `{prov['command']}` on {prov['date']} ({prov['cpu_count']} CPU cores, {prov['backend']}; "
             f"{prov['wall_seconds'] / 60:.1f} min in all). Test accuracy on {s['n_test']} test images after "
             f"{s['steps']} AdamW steps of batch {s['batch_size']}, mean +- std over {s['seeds']} seeds; the "
             f"teacher is one ResNet per size (seed 0, {s['teacher_steps']} steps, lr {s['teacher_lr']}), "
             f"trained on the same images. Time: wall seconds per run, on a machine shared with other jobs.", "",
             "| training images | teacher (ResNet) | ViT alone | ViT distilled (hard) | difference | "
             "s/run alone | s/run distilled |", "|---|---|---|---|---|---|---|"]
    for t in results["teachers"]:
        n = t["n_train"]
        cells = {}
        for arch in ("vit", "distilled"):
            rows = [r for r in results["runs"] if r["model"] == arch and r["n_train"] == n]
            cells[arch] = (common.mean_std([r["final_test_acc"] for r in rows]),
                           common.mean_std([r["seconds"] for r in rows])[0])
        diffs = common.mean_std([d["final_test_acc"] - a["final_test_acc"] for a, d in zip(
            [r for r in results["runs"] if r["model"] == "vit" and r["n_train"] == n],
            [r for r in results["runs"] if r["model"] == "distilled" and r["n_train"] == n])])
        (va, vs), vt = cells["vit"]
        (da, ds), dt = cells["distilled"]
        lines.append(f"| {n:,} | {100 * t['test_acc']:.1f}% | {100 * va:.1f} +- {100 * vs:.1f}% | "
                     f"{100 * da:.1f} +- {100 * ds:.1f}% | {100 * diffs[0]:+.1f} +- {100 * diffs[1]:.1f} | "
                     f"{vt:.0f} | {dt:.0f} |")
    v = s["vit"]
    lines += ["", f"ViT: patch {v['patch_size']}, D {v['embed_dim']}, {v['depth']} blocks, {v['num_heads']} heads; "
              f"the distilled one has the same weights at the start for every shared parameter (same seed) plus "
              f"the distillation token and head_dist. Difference: distilled minus alone, seed by seed."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", help="training-set sizes")
    p.add_argument("--lr", type=float)
    p.add_argument("--teacher-steps", type=int)
    p.add_argument("--teacher-lr", type=float)
    args = p.parse_args(argv)
    s = common.settings(args, QUICK, FULL)
    if args.backend is None:
        s["backend"] = "numpy"
    results = common.run_or_replot(NAME, args, s, run, None, argv)
    path = common.results_path(args.out, NAME, s["mode"], "md")
    with open(path, "w") as f:
        f.write(table(results))
    print("wrote", path)
    print(table(results))
    return results


if __name__ == "__main__":
    minivit.set_backend("numpy")
    main()
