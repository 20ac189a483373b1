"""DistilledViT's weights: timm's VisionTransformerDistilled state dicts and checkpoint files (DeiT's
published deit_*_distilled_patch16_224), and the checkpoints that ``python -m minivit.train --distill`` writes.

timm's layouts are the ViT's (minivit/weights/convert.py) plus two entries, each in minivit's layout after the same
rule: ``dist_token`` (1, 1, D) as it is, and ``head_dist.weight`` (K, D) transposed to (D, K). The position
embeddings have N + 2 rows (class token, distillation token, patches), as a ViT with one register token has:
so the ViT's converter reads the file with dist_token standing in for reg_token, and the result is renamed.
"""

import dataclasses
import os

import numpy

from ..backend import as_numpy
from ..weights.checkpoint import check_finite, load_checkpoint
from ..weights.convert import from_timm_checkpoint, read_checkpoint_file, to_timm
from ..model import ViTConfig
from .model import DistilledViT, check_distilled_config

DISTILLED_KEYS = ("dist_token", "head_dist.weight", "head_dist.bias")


def from_timm_distilled(state_dict, num_heads=None, img_size=None, gelu=None, verbose=True):
    """timm's VisionTransformerDistilled state dict (tensors or arrays) -> (ViTConfig, minivit state dict of
    a DistilledViT). num_heads, img_size and gelu as in convert.from_timm_checkpoint (num_heads is read from
    the width for DeiT's own sizes: 192 -> 3, 384 -> 6, 768 -> 12)."""
    sd = dict(state_dict)
    missing = [k for k in DISTILLED_KEYS if k not in sd]
    if missing:
        raise ValueError(f"not a timm VisionTransformerDistilled state dict: it lacks {missing} (a plain ViT "
                         f"loads with minivit.from_pretrained)")
    if "reg_token" in sd:
        raise ValueError("the state dict has both dist_token and reg_token: DistilledViT has no register tokens")
    head_dist = {k: sd.pop(k) for k in ("head_dist.weight", "head_dist.bias")}
    sd["reg_token"] = sd.pop("dist_token")                       # (1, 1, D): the row after the class token
    config, state = from_timm_checkpoint(sd, num_heads=num_heads, img_size=img_size, gelu=gelu, verbose=verbose)
    config = dataclasses.replace(config, num_registers=0)
    state["dist_token"] = state.pop("reg_token")
    state["head_dist.weight"] = numpy.ascontiguousarray(as_numpy(head_dist["head_dist.weight"]).T)   # (D, K)
    state["head_dist.bias"] = numpy.ascontiguousarray(as_numpy(head_dist["head_dist.bias"]))        # (K,)
    K = config.num_classes
    if state["head_dist.weight"].shape != (config.embed_dim, K):
        raise ValueError(f"head_dist.weight must be (K, D) = ({K}, {config.embed_dim}) as head.weight, got "
                         f"{tuple(as_numpy(head_dist['head_dist.weight']).shape)}")
    check_distilled_config(config)
    return config, state


def to_timm_distilled(state_dict, patch_size, in_chans):
    """A DistilledViT's state dict (or grads) -> timm's layouts (convert.to_timm: head_dist is a linear weight)."""
    return to_timm(state_dict, patch_size, in_chans)


def _from_minivit_checkpoint(path):
    """(config, state) of a checkpoint the trainer wrote with --distill."""
    ckpt = load_checkpoint(path)
    try:
        config = ViTConfig.from_dict(ckpt["meta"]["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{ckpt['path']!r}: the saved model config is not a ViT's ({err})") from None
    if "dist_token" not in ckpt["params"]:
        raise ValueError(f"{ckpt['path']!r} holds a plain ViT (no dist_token): load it with minivit.load_model")
    return config, ckpt["params"]


def from_pretrained(path, num_classes=None, num_heads=None, gelu=None, seed=0, dtype="float32", verbose=True):
    """A DistilledViT with the weights of a timm DeiT distilled checkpoint (.safetensors, .pth, .bin) or of a
    minivit checkpoint written by ``python -m minivit.train --distill`` (a file, or its run folder).
    num_classes: None keeps the checkpoint's heads; another number puts two zero-initialised D -> K heads
    in their place (fine-tuning, as convert.new_head does for one)."""
    kind, arrays = ("minivit", None) if os.path.isdir(path) else read_checkpoint_file(path)
    if kind == "minivit":
        if num_heads is not None or gelu is not None:
            raise ValueError(f"{os.fspath(path)!r} is a minivit checkpoint: its config gives num_heads and gelu")
        config, state = _from_minivit_checkpoint(path)
    elif kind == "google":
        raise ValueError(f"{os.fspath(path)!r} is a JAX ViT release, which has no distilled models: use "
                         f"minivit.from_pretrained")
    else:
        config, state = from_timm_distilled(arrays, num_heads=num_heads, gelu=gelu,
                                            verbose=verbose)
    check_finite(state, repr(os.fspath(path)))
    if num_classes is not None and num_classes != config.num_classes:
        config, state = dataclasses.replace(config, num_classes=num_classes), dict(state)
        dt = numpy.asarray(state["pos_embed"]).dtype
        for head in ("head", "head_dist"):
            state[f"{head}.weight"] = numpy.zeros((config.embed_dim, num_classes), dt)   # (D, K)
            state[f"{head}.bias"] = numpy.zeros((num_classes,), dt)                      # (K,)
    return DistilledViT(config, seed=seed, dtype=dtype).load_state_dict(state)


def load_model(path, backend=None):
    """The DistilledViT saved by ``python -m minivit.train --distill`` (the checkpoint file or its run folder),
    in eval mode, on the current backend unless one is named; its checkpoint's extra in checkpoint_meta."""
    config, state = _from_minivit_checkpoint(path)
    meta = load_checkpoint(path)["meta"]
    check_finite(state, repr(os.fspath(path)))
    model = DistilledViT(config, dtype=meta.get("dtype", "float32"))
    if backend is not None:
        model.to(backend)
    model.load_state_dict(state)
    model.checkpoint_meta = meta.get("extra") or {}
    return model.eval()
