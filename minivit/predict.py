"""Classify image files with a trained checkpoint and print the top-5 classes.

    python -m minivit.predict photo.jpg other.png --checkpoint runs/cifar10/checkpoint.npz
"""

import argparse
import sys

from . import augment as A
from .backend import asarray, to_numpy
from .checkpoint import load_model
from .functional import softmax_forward


def read_images(paths, img_size, in_chans):
    """Image files as one uint8 batch (B, H, W, C): RGB, or grey when the model takes 1 channel."""
    import numpy
    from PIL import Image

    H, W = img_size
    batch = []
    for path in paths:
        try:
            with Image.open(path) as im:
                im = im.convert("L" if in_chans == 1 else "RGB").resize((W, H), Image.Resampling.BICUBIC)
                arr = numpy.asarray(im, dtype=numpy.uint8)
        except (OSError, ValueError) as err:
            raise ValueError(f"cannot read image {path!r}: {err}") from None
        batch.append(arr[..., None] if arr.ndim == 2 else arr)
    return numpy.stack(batch)                                           # (B, H, W, C)


def predict(model, paths, top=5):
    """[(path, [(class name, probability), ...top]), ...] for each image file."""
    meta = getattr(model, "checkpoint_meta", {})
    classes = meta.get("classes") or [str(i) for i in range(model.config.num_classes)]
    mean, std = meta.get("mean", [0.5] * model.config.in_chans), meta.get("std", [0.5] * model.config.in_chans)
    x = read_images(paths, model.config.img_size, model.config.in_chans)
    model.eval()
    logits = model.forward(A.normalize(asarray(x), mean, std, model.dtype))  # (B, K)
    probs = to_numpy(softmax_forward(logits)[0])                            # (B, K)
    results = []
    for path, p in zip(paths, probs):
        order = p.argsort()[::-1][:top]
        results.append((path, [(classes[k], float(p[k])) for k in order]))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minivit.predict", description="Top-5 classes of image files.")
    p.add_argument("images", nargs="+", help="image files (any format Pillow reads)")
    p.add_argument("--checkpoint", required=True, help="a checkpoint.npz written by minivit.train")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args(argv)
    try:
        model = load_model(args.checkpoint)
        results = predict(model, args.images, args.top)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path, top in results:
        print(path)
        for name, prob in top:
            print(f"  {prob:7.2%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
