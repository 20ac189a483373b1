"""Classify image files with a trained checkpoint and print the top-5 classes.

    python -m minivit.predict photo.jpg other.png --checkpoint runs/cifar10/checkpoint.npz
    python -m minivit.predict photo.jpg --checkpoint runs/cifar10          # a run folder works too
    python -m minivit.predict photo.jpg --checkpoint vit-base-patch16-224  # a Hugging Face folder: its class names

A file that cannot be read is named on stderr and the others are still classified; the exit code is
then 2 (0 when every file was classified).
"""

import argparse
import os
import sys

from .data import augment as A
from .backend import asarray, to_numpy
from .weights.checkpoint import load_model
from .weights.convert import from_pretrained
from .data import read_image
from .functional import softmax_forward


def read_images(paths, img_size, in_chans):
    """Image files as one uint8 batch (B, H, W, C): RGB, or grey when the model takes 1 channel."""
    import numpy

    return numpy.stack([read_image(path, img_size, "L" if in_chans == 1 else "RGB") for path in paths])


def predict(model, paths, top=5):
    """[(path, [(class name, probability), ...top]), ...] for each image file."""
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top must be a positive int (how many classes to list), got {top!r}")
    meta = getattr(model, "checkpoint_meta", {})
    classes = meta.get("classes") or [str(i) for i in range(model.config.num_classes)]
    mean, std = meta.get("mean", [0.5] * model.config.in_chans), meta.get("std", [0.5] * model.config.in_chans)
    x = read_images(paths, model.config.img_size, model.config.in_chans)   # (B, H, W, C)
    model.eval()
    logits = model.forward(A.normalize(asarray(x), mean, std, model.dtype))  # (B, K)
    probs = to_numpy(softmax_forward(logits)[0])                            # (B, K)
    results = []
    for path, p in zip(paths, probs):
        order = p.argsort()[::-1][:top]
        results.append((path, [(classes[k], float(p[k])) for k in order]))
    return results


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minivit.predict", description="Top-5 classes of image files.")
    p.add_argument("images", nargs="+",
                   help="image files: PNG, JPEG, BMP, GIF, TIFF, WebP or PPM (minivit.data.IMAGE_FORMATS)")
    p.add_argument("--checkpoint", required=True, help="a checkpoint.npz written by minivit.train, or its run folder, "
                   "or a Hugging Face transformers ViT folder (config.json + model.safetensors)")
    p.add_argument("--top", type=_positive_int, default=5, help="how many classes to list per image")
    args = p.parse_args(argv)
    try:
        if os.path.isfile(os.path.join(args.checkpoint, "config.json")):   # a Hugging Face transformers folder
            model = from_pretrained(args.checkpoint, verbose=False)         # its id2label and preprocessor's mean/std
        else:
            model = load_model(args.checkpoint)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    failed = 0
    for path in args.images:            # one at a time: a bad file is named, the others still classified
        try:
            [(_, top)] = predict(model, [path], args.top)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            failed += 1
            continue
        print(path)
        for name, prob in top:
            print(f"  {prob:7.2%}  {name}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
