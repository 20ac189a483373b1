"""Translate parameters between minivit's layouts and the published ones (the files are read by files.py).

The names minivit uses are timm's; the layouts are minivit's own:

    what                  timm (PyTorch)              Google JAX release (.npz)              minivit
    patch projection E    patch_embed.proj.weight     embedding/kernel (P, P, C, D)          (P*P*C, D), rows
                          (D, C, P, P), a conv                                               in (P, P, C) order
    linear weights        (out, in)                   Dense_*/kernel (in, out)               (in, out): y = x W + b
    q, k, v               attn.qkv.weight (3D, D)     {query,key,value}/kernel (D, nh, hs)   attn.qkv.weight (D, 3D)
                                                      and bias (nh, hs)                      columns [q | k | v]
    attention output      attn.proj.weight (D, D)     out/kernel (nh, hs, D)                 attn.proj.weight (D, D)
    LayerNorms            norm1, norm2, norm          LayerNorm_0, LayerNorm_2, encoder_norm scale -> weight
    GELU                  erf (exact)                 tanh (Flax's approximation)            ViTConfig.gelu

Loading a published checkpoint, or one of minivit's own (the format is told by the file's content):

    config, state = load_checkpoint_file("ViT-B_16.npz")        # (ViTConfig, minivit state dict)
    model = minivit.from_pretrained("ViT-B_16.npz", num_classes=10, img_size=384)   # a ViT, in one call

The names and shapes a ViT must have come from model.param_shapes; the position-embedding resize for
another resolution is embeddings.resize_pos_embed. This file sits above the model and the checkpoints.

Every function takes and returns host NumPy arrays (torch tensors are accepted and converted; torch
is imported only to read a .pth/.bin file, safetensors only to read a .safetensors one).
"""

import dataclasses
import math
import os

import numpy

from ..backend import as_numpy
from .checkpoint import check_finite, check_is_vit, load_checkpoint
from .files import PATCH_KEY, SAFETENSORS_FLOATS, read_checkpoint_file  # noqa: F401  (old names, kept)
from ..embeddings import resize_pos_embed
from .hf import load_vit
from ..model import ViT, ViTConfig, param_shapes


# num_heads cannot be read from timm's weights (one packed qkv matrix); the presets' widths tell it
HEADS_BY_WIDTH = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}   # Ti, S, B, L, H (paper Table 1, DeiT)


def _is_linear_weight(name, value):
    return name.endswith(".weight") and value.ndim == 2 and name != PATCH_KEY


# --------------------------------------------------------------------------------------------------
# timm <-> minivit
# --------------------------------------------------------------------------------------------------


def from_timm(state_dict):
    """timm's VisionTransformer state dict -> minivit's (a dict of NumPy arrays, same keys)."""
    out = {}
    for name, value in state_dict.items():
        value = as_numpy(value)
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
        value = as_numpy(value)
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
    if getattr(config, "pos_embed", "learned") != "learned" or getattr(config, "stem", "patch") != "patch":
        raise ValueError(f"timm's VisionTransformer has only learned 1-D position embeddings and the patch stem; "
                         f"got pos_embed={config.pos_embed!r}, stem={config.stem!r}")
    if config.representation_size is not None:
        raise ValueError(f"timm's VisionTransformer has no representation layer (removed in timm 0.9), so "
                         f"representation_size={config.representation_size} has no timm equivalent")
    kwargs = dict(img_size=config.img_size, patch_size=config.patch_size, in_chans=config.in_chans,
                  num_classes=config.num_classes, embed_dim=config.embed_dim, depth=config.depth,
                  num_heads=config.num_heads, mlp_ratio=config.mlp_ratio, qkv_bias=config.qkv_bias,
                  class_token=config.pool == "cls", global_pool="token" if config.pool == "cls" else "avg",
                  fc_norm=False)
    if getattr(config, "num_registers", 0):
        kwargs["reg_tokens"] = config.num_registers   # reg_token (1, nr, D); pos_embed covers them
                                                      # (no_embed_class=False)
    if config.pre_norm != (not config.patch_bias):
        raise ValueError(f"timm drops the patch projection's bias exactly when pre_norm is on (as CLIP does); "
                         f"pre_norm={config.pre_norm} with patch_bias={config.patch_bias} has no timm equivalent")
    if not config.head_bias:
        raise ValueError("timm's head always has a bias: head_bias=False has no timm equivalent (CLIP's image "
                         "projection is open_clip's visual.proj, see minivit.clip.to_open_clip)")
    if config.gelu == "tanh":
        kwargs["act_layer"] = "gelu_tanh"    # timm's name for nn.GELU(approximate="tanh")
    elif config.gelu == "quick":
        kwargs["act_layer"] = "quick_gelu"   # timm's QuickGELU, x * sigmoid(1.702 x)
    if config.pre_norm:
        kwargs["pre_norm"] = True            # timm's norm_pre, without the patch bias
    if config.norm_eps != 1e-6:
        import functools

        from timm.layers import LayerNorm    # only here: these kwargs are for timm anyway
        kwargs["norm_layer"] = functools.partial(LayerNorm, eps=config.norm_eps)
    return kwargs


def _check_arrays(what, arrays, shapes):
    """Refuse, naming the keys, a dict of arrays whose names or shapes are not those expected."""
    missing = [k for k in shapes if k not in arrays]
    unexpected = [k for k in arrays if k not in shapes]
    wrong = [f"{k}: expected {tuple(shapes[k])}, got {tuple(arrays[k].shape)}"
             for k in shapes if k in arrays and tuple(arrays[k].shape) != tuple(shapes[k])]
    if not (missing or unexpected or wrong):
        return

    def some(items):
        return ", ".join(items[:6]) + (f" and {len(items) - 6} more" if len(items) > 6 else "")

    parts = []
    if missing:
        parts.append(f"missing {some(missing)}")
    if unexpected:
        parts.append(f"unexpected {some(unexpected)}")
    if wrong:
        parts.append(f"mis-shaped {some(wrong)}")
    raise ValueError(f"{what} does not make a ViT as minivit builds it: " + "; ".join(parts))


def _grid(num_patches, img_size, patch_size, what):
    """img_size (H, W) of a checkpoint with num_patches position embeddings: the given one, checked, or
    a square grid."""
    if img_size is not None:
        H, W = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        if (H // patch_size) * (W // patch_size) != num_patches or H % patch_size or W % patch_size:
            raise ValueError(f"img_size={img_size} with patch size {patch_size} gives a "
                             f"{H // patch_size}x{W // patch_size} grid, but {what} has {num_patches} "
                             f"patch position embeddings")
        return H, W
    g = math.isqrt(num_patches)
    if g * g != num_patches:
        raise ValueError(f"{what} has {num_patches} patch position embeddings, not a square grid: pass the "
                         f"img_size (H, W) it was trained at")
    return g * patch_size, g * patch_size


def _say_gelu(verbose, what, gelu, why):
    if verbose:
        print(f"minivit.convert: {what}: gelu={gelu!r} ({why}); pass gelu=... to choose the other")


def _mlp_ratio(M, D, what):
    ratio = M / D
    if int(D * ratio) != M:
        raise ValueError(f"{what}: MLP width {M} is not int(mlp_ratio * {D}) for any float mlp_ratio")
    return ratio


def from_timm_checkpoint(state_dict, num_heads=None, img_size=None, gelu=None, num_classes=None, verbose=True):
    """A timm VisionTransformer state dict (a dict of tensors or arrays) -> (ViTConfig, minivit state dict).

    The config is read from the shapes. num_heads cannot be (timm packs all heads into one qkv matrix):
    by default it is the preset's for the width (192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16).
    img_size: the checkpoint's resolution, needed only for a non-square patch grid. gelu: "erf" by
    default (timm's nn.GELU). num_classes: as in new_head (None keeps the checkpoint's head).
    """
    sd = dict(state_dict)
    what = "the timm state dict"
    if PATCH_KEY not in sd:
        raise ValueError(f"{what} has no {PATCH_KEY!r}, so it is not a timm ViT; its keys start with "
                         f"{sorted(sd)[:5]}")
    if "dist_token" in sd:           # DeiT's VisionTransformerDistilled: a second token and head (minivit/deit)
        raise ValueError(f"{what} is a DeiT distilled model (dist_token, head_dist), not a ViT: "
                         f"minivit.from_pretrained(FILE) or minivit.deit.from_timm_distilled reads it")
    if "fc_norm.weight" in sd:
        raise ValueError(f"{what} has fc_norm (a LayerNorm after average pooling, timm's default with "
                         f"global_pool='avg'); minivit follows the paper (final LayerNorm, then the mean)")
    kernel = as_numpy(sd[PATCH_KEY])
    if kernel.ndim != 4 or kernel.shape[2] != kernel.shape[3]:
        raise ValueError(f"{what}: {PATCH_KEY} must be a (D, C, P, P) conv kernel, got {kernel.shape}")
    D, C, P, _ = kernel.shape
    depth = 0
    while f"blocks.{depth}.norm1.weight" in sd:
        depth += 1
    if depth == 0 or "blocks.0.mlp.fc1.weight" not in sd:
        raise ValueError(f"{what} has no transformer blocks (blocks.0.norm1.weight, blocks.0.mlp.fc1.weight)")
    if num_heads is None:
        if D not in HEADS_BY_WIDTH:
            raise ValueError(f"num_heads cannot be read from timm weights (the qkv projection packs all "
                             f"heads), and width {D} is not a preset's ({sorted(HEADS_BY_WIDTH)}): pass num_heads")
        num_heads = HEADS_BY_WIDTH[D]
    M = tuple(sd["blocks.0.mlp.fc1.weight"].shape)[0]
    class_token = "cls_token" in sd
    if "pos_embed" not in sd or len(sd["pos_embed"].shape) != 3:
        raise ValueError(f"{what} needs pos_embed (1, N+1, D), got "
                         f"{tuple(sd['pos_embed'].shape) if 'pos_embed' in sd else 'none'}")
    num_registers = tuple(sd["reg_token"].shape)[1] if "reg_token" in sd else 0      # (1, nr, D)
    num_prefix = (1 if class_token else 0) + num_registers
    num_patches = sd["pos_embed"].shape[1] - num_prefix
    if num_prefix and img_size is None and math.isqrt(num_patches) ** 2 != num_patches \
            and math.isqrt(num_patches + num_prefix) ** 2 == num_patches + num_prefix:
        raise ValueError(f"{what}: pos_embed {tuple(sd['pos_embed'].shape)} has rows for the patches only, not "
                         f"for the {num_prefix} class/register token(s) before them (timm's no_embed_class=True, "
                         f"as DINOv2 and DeiT III): minivit's learned pos_embed covers every token "
                         f"(no_embed_class=False) and cannot load it")
    H, W = _grid(num_patches, img_size, P, what)
    R = tuple(sd["pre_logits.fc.weight"].shape)[0] if "pre_logits.fc.weight" in sd else None
    K = tuple(sd["head.weight"].shape)[0] if "head.weight" in sd else None
    if gelu is None:
        gelu = "erf"
        _say_gelu(verbose, "timm checkpoint", gelu, "timm's nn.GELU; a model made with act_layer='gelu_tanh' "
                                                   "needs 'tanh'")
    config = ViTConfig(img_size=(H, W), patch_size=P, in_chans=C, num_classes=K or num_classes or 1,
                       embed_dim=D, depth=depth, num_heads=num_heads, mlp_ratio=_mlp_ratio(M, D, what),
                       pool="cls" if class_token else "gap", qkv_bias="blocks.0.attn.qkv.bias" in sd,
                       gelu=gelu, representation_size=R if K else None, num_registers=num_registers)
    state = from_timm(sd)
    shapes = param_shapes(config)
    if K is None:  # a headless checkpoint (timm's num_classes=0): the head comes from new_head below
        shapes = {k: v for k, v in shapes.items() if not k.startswith(("head.", "pre_logits."))}
        state = {k: v for k, v in state.items() if not k.startswith("pre_logits.")}
    _check_arrays(what, state, shapes)
    return _finish_head(config, state, K, num_classes, what)


# --------------------------------------------------------------------------------------------------
# The original JAX release (google-research/vision_transformer) <-> minivit
# --------------------------------------------------------------------------------------------------


def google_shapes(config):
    """name -> shape of every array in the JAX release's .npz for a config: the layout, as a table."""
    c = config
    if c.num_registers:
        raise ValueError(f"the JAX release's ViT layout has no register tokens: num_registers={c.num_registers} "
                         f"has no such file (timm's layout has them: to_timm)")
    D, M, P, C, nh = c.embed_dim, c.mlp_dim, c.patch_size, c.in_chans, c.num_heads
    hs = D // nh
    shapes = {"embedding/kernel": (P, P, C, D), "embedding/bias": (D,)}
    if c.pool == "cls":
        shapes["cls"] = (1, 1, D)
    shapes["Transformer/posembed_input/pos_embedding"] = (1, c.seq_len, D)
    for i in range(c.depth):
        b = f"Transformer/encoderblock_{i}/"
        a = b + "MultiHeadDotProductAttention_1/"
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            shapes.update({f"{b}{ln}/scale": (D,), f"{b}{ln}/bias": (D,)})
        for name in ("query", "key", "value"):
            shapes.update({f"{a}{name}/kernel": (D, nh, hs), f"{a}{name}/bias": (nh, hs)})
        shapes.update({a + "out/kernel": (nh, hs, D), a + "out/bias": (D,),
                       b + "MlpBlock_3/Dense_0/kernel": (D, M), b + "MlpBlock_3/Dense_0/bias": (M,),
                       b + "MlpBlock_3/Dense_1/kernel": (M, D), b + "MlpBlock_3/Dense_1/bias": (D,)})
    shapes.update({"Transformer/encoder_norm/scale": (D,), "Transformer/encoder_norm/bias": (D,)})
    head_in = D
    if c.representation_size is not None:
        R = head_in = c.representation_size
        shapes.update({"pre_logits/kernel": (D, R), "pre_logits/bias": (R,)})
    shapes.update({"head/kernel": (head_in, c.num_classes), "head/bias": (c.num_classes,)})
    return shapes


# minivit name (within a block, after "blocks.{i}.") -> the JAX name (after "Transformer/encoderblock_{i}/")
_GOOGLE_BLOCK = {"norm1.weight": "LayerNorm_0/scale", "norm1.bias": "LayerNorm_0/bias",
                 "norm2.weight": "LayerNorm_2/scale", "norm2.bias": "LayerNorm_2/bias",
                 "attn.proj.bias": "MultiHeadDotProductAttention_1/out/bias",
                 "mlp.fc1.weight": "MlpBlock_3/Dense_0/kernel", "mlp.fc1.bias": "MlpBlock_3/Dense_0/bias",
                 "mlp.fc2.weight": "MlpBlock_3/Dense_1/kernel", "mlp.fc2.bias": "MlpBlock_3/Dense_1/bias"}
_GOOGLE_TOP = {"patch_embed.proj.bias": "embedding/bias", "cls_token": "cls",
               "pos_embed": "Transformer/posembed_input/pos_embedding",
               "norm.weight": "Transformer/encoder_norm/scale", "norm.bias": "Transformer/encoder_norm/bias",
               "pre_logits.fc.weight": "pre_logits/kernel", "pre_logits.fc.bias": "pre_logits/bias",
               "head.weight": "head/kernel", "head.bias": "head/bias"}


def _google_arrays(path_or_arrays):
    """The arrays of a JAX-layout checkpoint, keys without any 'opt/target/' prefix."""
    if isinstance(path_or_arrays, (str, os.PathLike)):
        kind, arrays = read_checkpoint_file(path_or_arrays)
        if kind != "google":
            raise ValueError(f"{os.fspath(path_or_arrays)!r} is a {kind} checkpoint, not the JAX release's "
                             f".npz: use load_checkpoint_file")
    else:
        arrays = {k: as_numpy(v) for k, v in dict(path_or_arrays).items()}
    if "opt/target/embedding/kernel" in arrays:   # early checkpoints saved the optimizer's target
        arrays = {k[len("opt/target/"):]: v for k, v in arrays.items() if k.startswith("opt/target/")}
    if any(k.startswith("params/") for k in arrays) or "pos_embedding" in arrays:
        raise ValueError("this is a big_vision checkpoint (params/..., stacked blocks), not the original "
                         "JAX release's layout; minivit reads only the latter")
    if "conv_root/kernel" in arrays:
        raise ValueError("this is a hybrid (ResNet + ViT, paper §3.1) checkpoint; minivit has no ResNet stem")
    return arrays


def from_google_npz(path_or_arrays, num_heads=None, img_size=None, gelu=None, num_classes=None, verbose=True):
    """The original JAX release's .npz (a path, or a dict of its arrays) -> (ViTConfig, minivit state dict).

    Everything is read from the shapes: P, C, D from embedding/kernel (P, P, C, D); nh, hs from a
    query kernel (D, nh, hs); M from Dense_0; K from the head; R from pre_logits when present; the class
    token from `cls` (without it, a GAP model). num_heads, if given, must agree. img_size: the
    checkpoint's resolution, needed only for a non-square grid. gelu: "tanh" by default (the Flax
    models' approximation), said in a message. num_classes: as in new_head (None keeps the head).
    """
    a = _google_arrays(path_or_arrays)
    what = "the JAX checkpoint"
    if "embedding/kernel" not in a:
        raise ValueError(f"{what} has no 'embedding/kernel', so it is not a ViT in the JAX release's layout; "
                         f"its keys start with {sorted(a)[:5]}")
    kernel = a["embedding/kernel"]
    if kernel.ndim != 4 or kernel.shape[0] != kernel.shape[1]:
        raise ValueError(f"{what}: embedding/kernel must be (P, P, C, D), got {kernel.shape}")
    P, _, C, D = kernel.shape
    depth = 0
    while f"Transformer/encoderblock_{depth}/LayerNorm_0/scale" in a:
        depth += 1
    attn0 = "Transformer/encoderblock_0/MultiHeadDotProductAttention_1/"
    mlp0 = "Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"
    if depth == 0 or attn0 + "query/kernel" not in a or mlp0 not in a:
        raise ValueError(f"{what} has no encoder blocks (missing {attn0}query/kernel or {mlp0})")
    q = a[attn0 + "query/kernel"]
    if q.ndim != 3 or q.shape[0] != D or q.shape[1] * q.shape[2] != D:
        raise ValueError(f"{what}: {attn0}query/kernel must be (D, nh, hs) with nh * hs = D = {D}, "
                         f"got {q.shape}")
    nh = q.shape[1]
    if num_heads is not None and num_heads != nh:
        raise ValueError(f"num_heads={num_heads}, but the checkpoint's query kernel {q.shape} has {nh} heads")
    M = a[mlp0].shape[-1]
    class_token = "cls" in a
    pos = a.get("Transformer/posembed_input/pos_embedding")
    if pos is None or pos.ndim != 3:
        raise ValueError(f"{what} needs Transformer/posembed_input/pos_embedding (1, N+1, D), got "
                         f"{'none' if pos is None else pos.shape}")
    H, W = _grid(pos.shape[1] - (1 if class_token else 0), img_size, P, what)
    R = a["pre_logits/kernel"].shape[-1] if "pre_logits/kernel" in a else None
    K = a["head/kernel"].shape[-1] if "head/kernel" in a else None
    if gelu is None:
        gelu = "tanh"
        _say_gelu(verbose, "JAX checkpoint", gelu, "Flax's nn.gelu, the tanh approximation, as the models "
                                                  "were trained")
    config = ViTConfig(img_size=(H, W), patch_size=P, in_chans=C, num_classes=K or num_classes or 1,
                       embed_dim=D, depth=depth, num_heads=nh, mlp_ratio=_mlp_ratio(M, D, what),
                       pool="cls" if class_token else "gap", qkv_bias=True, gelu=gelu,
                       representation_size=R if K else None)
    shapes = google_shapes(config)
    if K is None:
        shapes = {k: v for k, v in shapes.items() if not k.startswith(("head/", "pre_logits/"))}
        a = {k: v for k, v in a.items() if not k.startswith("pre_logits/")}
    _check_arrays(what, a, shapes)

    state = {"patch_embed.proj.weight": kernel.reshape(P * P * C, D)}   # (P, P, C, D) -> (P*P*C, D)
    for name, key in _GOOGLE_TOP.items():
        if key in a:
            state[name] = a[key]
    for i in range(depth):
        b, g = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        for name, key in _GOOGLE_BLOCK.items():
            state[b + name] = a[g + key]
        att = g + "MultiHeadDotProductAttention_1/"
        # (D, nh, hs) -> (D, D): head h's columns are h*hs ... h*hs + hs - 1, as in minivit's qkv
        state[b + "attn.qkv.weight"] = numpy.concatenate(
            [a[f"{att}{n}/kernel"].reshape(D, D) for n in ("query", "key", "value")], axis=1)   # (D, 3D)
        state[b + "attn.qkv.bias"] = numpy.concatenate(
            [a[f"{att}{n}/bias"].reshape(D) for n in ("query", "key", "value")])                # (3D,)
        state[b + "attn.proj.weight"] = a[att + "out/kernel"].reshape(D, D)   # (nh, hs, D) -> (D, D)
    state = {k: numpy.ascontiguousarray(v) for k, v in state.items()}
    return _finish_head(config, state, K, num_classes, what)


def to_google_npz(state_dict, config, path=None):
    """minivit's state dict -> the JAX release's arrays (the inverse of from_google_npz); written to
    path with numpy.savez when given. Returns the dict of arrays."""
    c = config
    if not c.qkv_bias:
        raise ValueError("the JAX layout always has q, k, v biases: a qkv_bias=False model has no such file")
    if c.stem != "patch" or c.pos_embed != "learned":
        raise ValueError(f"the JAX release's ViT layout has the patch stem and learned 1-D position embeddings; "
                         f"got stem={c.stem!r}, pos_embed={c.pos_embed!r}")
    google_shapes(c)   # refuses what the layout cannot hold (register tokens)
    _check_arrays("the state dict", state_dict, param_shapes(c))
    sd = {k: as_numpy(v) for k, v in state_dict.items()}
    D, P, C, nh = c.embed_dim, c.patch_size, c.in_chans, c.num_heads
    hs = D // nh
    out = {"embedding/kernel": sd[PATCH_KEY].reshape(P, P, C, D)}            # (P*P*C, D) -> (P, P, C, D)
    for name, key in _GOOGLE_TOP.items():
        if name in sd:
            out[key] = sd[name]
    for i in range(c.depth):
        b, g = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        for name, key in _GOOGLE_BLOCK.items():
            out[g + key] = sd[b + name]
        att = g + "MultiHeadDotProductAttention_1/"
        w, bias = sd[b + "attn.qkv.weight"], sd[b + "attn.qkv.bias"]          # (D, 3D), (3D,)
        for j, n in enumerate(("query", "key", "value")):
            out[f"{att}{n}/kernel"] = w[:, j * D:(j + 1) * D].reshape(D, nh, hs)   # (D, nh, hs)
            out[f"{att}{n}/bias"] = bias[j * D:(j + 1) * D].reshape(nh, hs)        # (nh, hs)
        out[att + "out/kernel"] = sd[b + "attn.proj.weight"].reshape(nh, hs, D)    # (nh, hs, D)
    out = {k: numpy.ascontiguousarray(v) for k, v in out.items()}
    if path is not None:
        numpy.savez(path, **out)
    return out


# --------------------------------------------------------------------------------------------------
# Fine-tuning: a new head, position embeddings for another resolution
# --------------------------------------------------------------------------------------------------


def new_head(config, state, num_classes):
    """A zero-initialised D -> K head in place of the checkpoint's, and no representation layer: the
    paper's fine-tuning (§3.1; the JAX release drops pre_logits the same way). Returns (config, state)."""
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    dtype = numpy.asarray(state["pos_embed"]).dtype
    state = {k: v for k, v in state.items() if not k.startswith(("head.", "pre_logits."))}
    state["head.weight"] = numpy.zeros((config.embed_dim, num_classes), dtype)   # (D, K)
    state["head.bias"] = numpy.zeros((num_classes,), dtype)                      # (K,)
    return dataclasses.replace(config, num_classes=num_classes, representation_size=None), state


def _finish_head(config, state, K, num_classes, what):
    """Keep the checkpoint's head (num_classes None or equal to its K), or put a new one."""
    if K is None and num_classes is None:
        raise ValueError(f"{what} has no head (a feature extractor): pass num_classes to get a new, "
                         f"zero-initialised one")
    if K is None or (num_classes is not None and num_classes != K):
        return new_head(config, state, num_classes)
    return config, state


def resize_state_dict(config, state, img_size):
    """(config, state) for images of img_size, same patch size: the position embeddings resized with
    embeddings.resize_pos_embed, everything else as it is. Returns (new config, new state)."""
    new_config = dataclasses.replace(config, img_size=img_size)   # checks that P divides img_size
    if new_config.grid_size == config.grid_size:
        return new_config, dict(state)
    if config.pos_embed in ("sincos2d", "none"):   # no table: sincos2d is computed for whatever grid there is
        return new_config, dict(state)
    if config.pos_embed != "learned":
        raise ValueError(f"only the learned 1-D table (pos_embed='learned') is resized for another patch grid; "
                         f"this checkpoint has pos_embed={config.pos_embed!r}: train it at its own --img-size "
                         f"{config.img_size[0]}")
    state = dict(state)
    T = config.num_prefix_tokens          # the class token's and the registers' rows, kept as they are
    state["pos_embed"] = resize_pos_embed(as_numpy(state["pos_embed"]), config.grid_size, new_config.grid_size, T)
    return new_config, state


def load_checkpoint_file(path, num_heads=None, img_size=None, gelu=None, num_classes=None, verbose=True,
                         read=None):
    """Any checkpoint minivit reads -> (ViTConfig, minivit state dict): read_checkpoint_file, then
    from_google_npz or from_timm_checkpoint (their arguments have the same meaning). read: the file's
    (kind, arrays) when the caller has read it already (a large file is then not read twice)."""
    kind, arrays = read if read is not None else read_checkpoint_file(path)
    if kind == "minivit":
        return _from_minivit_checkpoint(path, arrays, num_heads, img_size, gelu, num_classes)
    convert = from_google_npz if kind == "google" else from_timm_checkpoint
    return convert(arrays, num_heads=num_heads, img_size=img_size, gelu=gelu, num_classes=num_classes,
                   verbose=verbose)


def _from_minivit_checkpoint(path, params, num_heads, img_size, gelu, num_classes):
    """A checkpoint written by minivit.checkpoint (the trainer's): its config is in its metadata."""
    what = f"the minivit checkpoint {os.fspath(path)!r}"
    meta = load_checkpoint(path)["meta"]
    check_is_vit(path, meta)
    config = ViTConfig.from_dict(meta["config"])
    if num_heads is not None and num_heads != config.num_heads:
        raise ValueError(f"num_heads={num_heads}, but {what} was saved with {config.num_heads}")
    if img_size is not None and dataclasses.replace(config, img_size=img_size).img_size != config.img_size:
        raise ValueError(f"img_size={img_size}, but {what} was saved for {config.img_size}")
    if gelu is not None:
        config = dataclasses.replace(config, gelu=gelu)
    _check_arrays(what, params, param_shapes(config))
    return _finish_head(config, params, config.num_classes, num_classes, what)


# --------------------------------------------------------------------------------------------------
# A ViT with published weights, in one call
# --------------------------------------------------------------------------------------------------


def from_pretrained(path, num_classes=None, img_size=None, num_heads=None, gelu=None, seed=0, dtype="float32",
                    checkpoint_img_size=None, verbose=True, new_head=False):
    """A ViT with the weights of a published checkpoint, in one call: the original JAX release's
    .npz, timm's .safetensors / .pth / .bin, a minivit.checkpoint .npz (told by the content), or a
    Hugging Face transformers ViT folder (config.json + weights, minivit/weights/hf.py; its id2label and the
    preprocessor's mean and std land in model.checkpoint_meta, which minivit.predict reads).

    num_classes: None keeps the checkpoint's head; another number puts a zero-initialised D -> K
        head in its place and drops any representation layer, as the paper fine-tunes (§3.1).
    img_size: None keeps the checkpoint's resolution; another one (same patch size, so another
        patch grid) resizes the position embeddings as ViT.resize_pos_embed does (§3.2).
    num_heads: needed only for a timm file whose width is not a preset's (192, 384, 768, 1024, 1280).
    gelu: "erf" or "tanh"; by default "tanh" for the JAX release (Flax's GELU), "erf" for timm.
    checkpoint_img_size: the resolution the checkpoint was trained at, needed only for a
        non-square patch grid (a square one is read from the position embeddings' length).
    new_head: True zero-initialises the head even when num_classes is the checkpoint's own.
    A DeiT distilled checkpoint (timm's VisionTransformerDistilled, or a --distill run's) gives a DistilledViT
    (minivit/deit/weights.py builds it; the same arguments, but img_size must stay the checkpoint's).
    Example: minivit.from_pretrained("ViT-B_16.npz", num_classes=10, img_size=384) for CIFAR-10.
    """
    meta = None
    if os.path.isdir(path):                      # a Hugging Face transformers folder (minivit/weights/hf.py)
        if num_heads is not None or gelu is not None or checkpoint_img_size is not None:
            raise ValueError(f"{os.fspath(path)!r} is a transformers folder: its config.json gives the heads, the "
                             f"GELU and the resolution, so num_heads, gelu and checkpoint_img_size must be None")
        config, state, K, meta = load_vit(path, verbose=verbose)
        config, state = _finish_head(config, state, K, num_classes, repr(os.fspath(path)))
        if config.num_classes != K:
            meta.pop("classes", None)            # a new head: the folder's class names are not its classes
    else:
        kind, arrays = read_checkpoint_file(path)
        if "dist_token" in arrays:               # DeiT's distilled ViT (timm's, or a --distill run's)
            return _distilled(path, num_classes, img_size, num_heads, gelu, seed, dtype, verbose, new_head,
                              checkpoint_img_size)
        config, state = load_checkpoint_file(path, num_heads=num_heads, img_size=checkpoint_img_size,
                                             gelu=gelu, num_classes=num_classes, verbose=verbose,
                                             read=(kind, arrays))
    check_finite(state, repr(os.fspath(path)), advice="a damaged file, or one saved from a diverged run: use "
                                                       "another copy of the weights")
    if img_size is not None:
        config, state = resize_state_dict(config, state, img_size)
    model = ViT(config, seed=seed, dtype=dtype).load_state_dict(state)
    if meta:
        model.checkpoint_meta = meta             # class names and normalisation, as minivit.predict reads them
    if new_head:
        for p in model.head.params.values():
            p[...] = 0                           # the paper's zero-initialised fine-tuning head
    return model


def _distilled(path, num_classes, img_size, num_heads, gelu, seed, dtype, verbose, new_head, checkpoint_img_size):
    """from_pretrained of a DeiT distilled checkpoint: handed over to minivit.deit (which builds on this
    module, so the import is made at call time)."""
    if img_size is not None or checkpoint_img_size is not None:
        raise ValueError(f"{os.fspath(path)!r} is a DeiT distilled model: loading it at another resolution "
                         f"(img_size={img_size!r}, checkpoint_img_size={checkpoint_img_size!r}) is not supported; "
                         f"leave both None")
    from ..deit.weights import from_pretrained as distilled_from_pretrained

    model = distilled_from_pretrained(path, num_classes=num_classes, num_heads=num_heads, gelu=gelu, seed=seed,
                                      dtype=dtype, verbose=verbose)
    if new_head:
        for head in (model.head, model.head_dist):
            for p in head.params.values():
                p[...] = 0                       # the zero-initialised fine-tuning heads
    return model
