"""A search for the paper's Figure 7 spread on a small run: which data, patch size, position embedding
or query/key initialisation make a small ViT's first blocks attend locally? Trains one setting through
minivit.train and prints one JSON line: the test accuracy and the mean attention distance (viz) of every
head, on 128 test images. Lesson 9 quotes what these runs gave (none showed the spread), e.g.

    OMP_NUM_THREADS=1 python experiments/attention_locality.py --kind scatter --epochs 8 --qk-std 0.125

--kind shapes: minivit's `shapes`; scatter: 3-5 small copies of the class shape per image, on a jittered
3 x 3 grid (so that a patch's neighbours belong to its own object); many: 6-9 smaller copies; lines: an
8 x 8 grid of flat-coloured 4 x 4 tiles, equal along rows, columns, diagonals or anti-diagonals (4 classes:
one tile says nothing, a tile and its neighbours say everything). The lines run is the one that showed the
spread; it made lesson 9's second committed model (notebooks/assets/README.md):

    OMP_NUM_THREADS=1 python experiments/attention_locality.py --kind lines --patch 4 --epochs 20 --evals 20 \
        --augment none --qk-std 0.125 --save notebooks/assets/lines_vit.npz

--qk-std: the std of the query and key weights at initialisation (timm's, and minivit's, is 0.02)."""
import argparse
import dataclasses
import json
import time

import numpy as np

from minivit import augment as A
from minivit import viz
from minivit.data import SHAPES_CLASSES, Dataset, channel_mean_std, make_lines, make_shapes
from minivit.weights.checkpoint import save_checkpoint
from minivit.data.synthetic import _draw_shape_images, _shape_mask
from minivit.model import ViT, ViTConfig
from minivit.train import TrainConfig, train


def draw_scatter(n, rng, S, count=(3, 5), radius=(0.10, 0.16), cells=3):
    """n images, each holding `count` copies of its class shape on a jittered cells x cells grid."""
    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    base = _draw_shape_images(labels, rng, S, radius=np.full((n, 1, 1), 0.01 * S, np.float32))  # bg only
    img = base.astype(np.float32)
    coords = np.arange(S, dtype=np.float32) + 0.5
    yy, xx = coords[None, :, None], coords[None, None, :]
    cell = S / cells
    k = rng.integers(count[0], count[1] + 1, size=n)
    order = np.argsort(rng.random((n, cells * cells)), axis=1)
    for j in range(count[1]):
        on = (j < k)
        c = order[:, j]
        r = rng.uniform(*radius, size=(n, 1, 1)).astype(np.float32) * S
        margin = np.minimum(r, cell / 2)
        cx = (c % cells)[:, None, None] * cell + margin + rng.random((n, 1, 1)) * (cell - 2 * margin)
        cy = (c // cells)[:, None, None] * cell + margin + rng.random((n, 1, 1)) * (cell - 2 * margin)
        th = rng.uniform(-0.08, 0.08, size=(n, 1, 1))
        dx, dy = (xx - cx) / r, (yy - cy) / r
        u = np.cos(th) * dx + np.sin(th) * dy
        v = -np.sin(th) * dx + np.cos(th) * dy
        fg = rng.uniform(135, 255, size=(n, 1, 1, 3)).astype(np.float32)
        mask = np.zeros((n, S, S), bool)
        for cls in range(10):
            idx = np.flatnonzero(labels == cls)
            mask[idx] = _shape_mask(cls, u[idx], v[idx])
        mask &= on[:, None, None]
        img = np.where(mask[..., None], fg, img)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), labels


def dataset(kind, S, seed=0, n_train=10000, n_test=2000):
    if kind == "lines":
        if S != 32:
            raise ValueError(f"--kind lines draws 32 x 32 images (8 x 8 tiles of 4 x 4), got --S {S}")
        # train() takes its recipe's defaults from the data set's name, and knows only its own sets:
        # lines trains under shapes' recipe (every setting that matters is given below anyway)
        return dataclasses.replace(make_lines(n_train, n_test, seed), name="shapes")
    if kind == "shapes":
        (xt, yt), (xv, yv) = make_shapes(n_train, n_test, seed, S)
    else:
        a, b = np.random.SeedSequence(seed).spawn(2)
        opts = dict(scatter=dict(), many=dict(count=(6, 9), radius=(0.09, 0.12)),
                    few=dict(count=(2, 3), radius=(0.12, 0.16)))[kind]
        xt, yt = draw_scatter(n_train, np.random.default_rng(a), S, **opts)
        xv, yv = draw_scatter(n_test, np.random.default_rng(b), S, **opts)
    mean, std = channel_mean_std(xt)
    return Dataset("shapes", xt, yt, xv, yv, list(SHAPES_CLASSES), mean, std)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kind", default="scatter")
    p.add_argument("--S", type=int, default=32)
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--evals", type=int, default=4)
    p.add_argument("--pos", default=None)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--augment", default="standard")
    p.add_argument("--out", default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--qk-std", type=float, default=None)
    a = p.parse_args()
    data = dataset(a.kind, a.S)
    g = a.S // a.patch
    xs = data.x_test[:128]
    t0 = time.time()

    cfg = TrainConfig(dataset="shapes", patch_size=a.patch, embed_dim=a.dim, depth=a.depth, num_heads=a.heads,
                      mlp_ratio=2.0, epochs=a.epochs, batch_size=128, lr=a.lr, weight_decay=0.05, warmup_epochs=1,
                      augment=a.augment, num_evals=a.evals, seed=0, out=a.out, progress=False, pos_embed=a.pos)
    model = None
    if a.qk_std:
        model = ViT(ViTConfig(img_size=a.S, patch_size=a.patch, embed_dim=a.dim, depth=a.depth, num_heads=a.heads,
                              mlp_ratio=2.0, num_classes=data.num_classes,
                              **({"pos_embed": a.pos} if a.pos else {})), seed=0)
        for i in range(a.depth):
            w = model.params[f"blocks.{i}.attn.qkv.weight"]
            w[:, :2 * a.dim] *= a.qk_std / 0.02
        cfg = dataclasses.replace(cfg, patch_size=None, embed_dim=None, depth=None, num_heads=None,
                                                mlp_ratio=None, pos_embed=None)
    r = train(cfg, data=data, model=model)
    model = r.model
    x = A.normalize(xs, data.mean, data.std, "float32")
    att = viz.attention_weights(model, x)
    k = 1                                                        # the class token
    d = viz.mean_attention_distance(att, (g, g), a.patch, k)
    uni = viz.patch_distances((g, g), a.patch).mean()
    acc = r.summary.get("best_val_accuracy", r.summary.get("val_accuracy"))
    print(json.dumps(dict(args=vars(a), acc=acc, secs=round(time.time() - t0), uniform=round(float(uni), 2),
                          per_block=np.round(d.mean(1), 2).tolist(), min_block=np.round(d.min(1), 2).tolist(),
                          max_block=np.round(d.max(1), 2).tolist(), heads=np.round(d, 1).tolist())))
    if a.save:                                                   # the weights and what a lesson needs to use them
        command = "python experiments/attention_locality.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if v is not None)
        save_checkpoint(a.save, model, None, {
            "dataset": f"experiments/attention_locality.py --kind {a.kind}", "img_size": a.S, "kind": a.kind,
            "test_accuracy": acc, "classes": list(data.classes), "mean": np.asarray(data.mean).tolist(),
            "std": np.asarray(data.std).tolist(), "command": command,
            "mean_attention_distance": np.round(d, 3).tolist(), "uniform_distance": float(uni)})


if __name__ == "__main__":
    main()
