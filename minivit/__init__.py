"""minivit: a from-scratch Vision Transformer on NumPy/CuPy, every backward pass written by hand.

    import minivit
    model = minivit.ViT(minivit.presets["vit_cifar_tiny"])
    logits = model.forward(x)                       # x: (B, 32, 32, 3) float32
    loss, dlogits = minivit.cross_entropy(logits, labels)
    model.zero_grad(); model.backward(dlogits)      # fills model.grads
"""

from . import _blas_env  # noqa: F401  (first: a setting NumPy's BLAS reads when NumPy is imported)
from . import amp  # noqa: F401  (minivit.amp.LossScaler: mixed precision)
from .backend import (asarray, backend_module, get_array_module, get_backend, gpu_available, set_backend,
                      to_numpy)
from .checkpoint import load_model
from .functional import cross_entropy
from .gradcheck import GradcheckReport, gradcheck
from .model import ViT, ViTConfig, create_model, presets, trace

__version__ = "0.1.0"

__all__ = ["asarray", "backend_module", "get_array_module", "get_backend", "gpu_available", "set_backend",
           "to_numpy", "cross_entropy", "gradcheck", "GradcheckReport", "ViT", "ViTConfig", "create_model",
           "presets", "trace", "load_model"]
