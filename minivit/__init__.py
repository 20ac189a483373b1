"""minivit: a from-scratch Vision Transformer on NumPy/CuPy, every backward pass written by hand.

    import minivit
    model = minivit.ViT(minivit.presets["vit_cifar_tiny"])
    logits = model.forward(x)                       # x: (B, 32, 32, 3) float32
    loss, dlogits = minivit.cross_entropy(logits, labels)
    model.zero_grad(); model.backward(dlogits)      # fills model.grads

Every module is an attribute: ``minivit.layers``, ``minivit.convert``, ``minivit.optim``... The ones that
only training, the data sets or the pictures need (tqdm, Pillow, matplotlib) are imported the first
time they are named.
"""

import importlib

from . import _blas_env  # noqa: F401  (first: a setting NumPy's BLAS reads when NumPy is imported)
from . import _moved  # (second: installs the old import paths of modules that moved into a subpackage)
from . import backend, conv, embeddings, fast, functional, layers, model, optim, weights  # noqa: F401
from .weights import checkpoint, convert, hf  # noqa: F401  (also minivit.checkpoint, .convert, .hf)
from .fast import amp, kernels, ops  # noqa: F401  (also minivit.amp, .kernels, .ops: the same modules)
from .backend import (asarray, backend_module, get_array_module, get_backend, gpu_available, set_backend,
                      to_numpy)
from .weights.checkpoint import load_model
from .weights.convert import from_pretrained
from .functional import cross_entropy
from .gradcheck import GradcheckReport, gradcheck
from .model import ViT, ViTConfig, create_model, flops, param_shapes, presets, trace

__version__ = "0.1.0"

__all__ = ["asarray", "backend_module", "get_array_module", "get_backend", "gpu_available", "set_backend",
           "to_numpy", "cross_entropy", "gradcheck", "GradcheckReport", "ViT", "ViTConfig", "create_model",
           "flops", "param_shapes", "presets", "trace", "load_model", "from_pretrained"]

# Imported on first use: minivit.train (tqdm), .data (.data.download: tqdm), .viz (matplotlib inside),
# .predict (Pillow inside), .resnet, .clip (CLIP), .deit (DeiT), .mae (MAE). The old names of moved modules
# (.augment, .download, .captions, .clip_train, .plot, .stats: _moved.MOVED) likewise.
_LAZY = ("check", "clip", "data", "deit", "distributed", "mae", "predict", "resnet", "train", "viz")


def __getattr__(name):
    """``minivit.train`` and the other modules of _LAZY: imported when first named (the import then
    sets the attribute, so this runs once per module)."""
    if name in _LAZY or name in _moved.old_names():
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'minivit' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_moved.old_names()))
