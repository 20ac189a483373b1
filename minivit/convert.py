"""Translate parameters between minivit's layouts and timm's. The names are the same; only the
layouts differ:

    what                        timm (PyTorch)            minivit
    linear weights              (out, in)                 (in, out)          y = x W + b
    patch_embed.proj.weight     (D, C, P, P) a conv       (P*P*C, D)         rows in (P, P, C) order
    everything else             same                      same

Both directions take and return dicts of host NumPy arrays (torch tensors are accepted as input and
converted, without importing torch here).
"""

import numpy

from .backend import to_numpy

PATCH_KEY = "patch_embed.proj.weight"


def _as_numpy(value):
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    return numpy.array(to_numpy(value))


def _is_linear_weight(name, value):
    return name.endswith(".weight") and value.ndim == 2 and name != PATCH_KEY


def from_timm(state_dict):
    """timm's VisionTransformer state dict -> minivit's (a dict of NumPy arrays, same keys)."""
    out = {}
    for name, value in state_dict.items():
        value = _as_numpy(value)
        if name == PATCH_KEY:
            if value.ndim != 4 or value.shape[2] != value.shape[3]:
                raise ValueError(f"{PATCH_KEY} must be a (D, C, P, P) conv kernel in timm's layout, "
                                 f"got shape {value.shape}")
            D, C, P, _ = value.shape
            value = value.transpose(2, 3, 1, 0).reshape(P * P * C, D)      # (D, C, P, P) -> (P, P, C, D)
        elif _is_linear_weight(name, value):
            value = value.T                                                 # (out, in) -> (in, out)
        out[name] = numpy.ascontiguousarray(value)
    return out


def to_timm(state_dict, patch_size, in_chans):
    """minivit's state dict (or grads) -> timm's layouts. patch_size and in_chans are needed to fold the
    (P*P*C, D) projection back into a (D, C, P, P) conv kernel."""
    out = {}
    for name, value in state_dict.items():
        value = _as_numpy(value)
        if name == PATCH_KEY:
            P, C = patch_size, in_chans
            if value.ndim != 2 or value.shape[0] != P * P * C:
                raise ValueError(f"{PATCH_KEY} must be (P*P*C, D) = ({P * P * C}, D) for patch_size={P}, "
                                 f"in_chans={C}; got shape {value.shape}")
            D = value.shape[1]
            value = value.reshape(P, P, C, D).transpose(3, 2, 0, 1)          # (P, P, C, D) -> (D, C, P, P)
        elif _is_linear_weight(name, value):
            value = value.T                                                 # (in, out) -> (out, in)
        out[name] = numpy.ascontiguousarray(value)
    return out


def timm_kwargs(config):
    """The keyword arguments of timm.models.vision_transformer.VisionTransformer that build the same
    model as a minivit ViTConfig (the paper's GAP: final LayerNorm, then the mean, no fc_norm)."""
    return dict(img_size=config.img_size, patch_size=config.patch_size, in_chans=config.in_chans,
                num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
                num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias,
                class_token=config.pool == "cls", global_pool="token" if config.pool == "cls" else "avg",
                fc_norm=False)
