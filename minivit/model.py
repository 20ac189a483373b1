"""The Vision Transformer: its config, the assembled model, the shape trace and the presets.

    image (B, H, W, C)
      -> patch_embed   im2patch + linear projection E        (B, N, D)      Eq. 1
      -> pos_embed     prepend x_class, add E_pos            (B, N+1, D)    Eq. 1
     [-> norm_pre      LayerNorm                             (B, N+1, D)    only pre_norm=True: CLIP's ln_pre]
      -> blocks        depth x pre-norm (MSA, MLP) blocks    (B, N+1, D)    Eqs. 2-3
      -> norm          final LayerNorm                       (B, N+1, D)    Eq. 4
      -> pool          class token (or mean of tokens)       (B, D)         Eq. 4
     [-> pre_logits    tanh representation layer, D -> R     (B, R)         only some pre-trained models]
      -> head          linear classifier                     (B, K)

The paper's variants are options of the same stages: ``stem="conv"`` makes patch_embed the hybrid's small
CNN (minivit/conv.py, §3.1), and ``pos_embed="learned2d" | "sincos2d" | "none"`` makes pos_embed a
GridPosEmbed (layers.py, App. D.4). experiments/ and notebook 11 compare them. ``num_registers=nr`` adds
nr register tokens after the class token (Darcet et al., ICLR 2024; timm's reg_tokens): pos_embed makes
(B, 1+nr+N, D), the blocks and norm carry them, and pool drops them. CLIP's image tower
(minivit/clip/model.py) is this ViT with ``pre_norm=True, patch_bias=False, norm_eps=1e-5, head_bias=False`` and
often ``gelu="quick"``: the options timm's VisionTransformer has for its CLIP models.

Parameter names are timm's (``patch_embed.proj.weight``, ``cls_token``, ``blocks.0.attn.qkv.weight``...);
the layouts are minivit's own (linear weights (in, out), the patch projection (P*P*C, D) in (P, P, C)
order); ``param_shapes(config)`` lists them all without building anything, and ``flops(config)``
counts a forward pass. minivit.convert translates to and from timm's and the original JAX release's
layouts, and ``minivit.from_pretrained`` loads a published checkpoint in one call (loaders sit above
the model: this file imports none of them).

``Classifier`` is what the ViT and the ResNet baseline (minivit/resnet.py) share: named stages run in
order, ending in logits, and backward runs them in reverse.
"""

import copy
import dataclasses
import math
import warnings
from dataclasses import dataclass

from . import functional as F
from .backend import asarray, backend_of, host_rng, is_array, to_numpy
from .conv import ConvStem, conv_output_size
from .embeddings import GridPosEmbed, PatchEmbed, PosEmbed, check_pos_embed, resize_pos_embed
from .layers import Block, Dropout, Layer, LayerList, LayerNorm, Linear, Pool, PreLogits, check_num_heads, check_pool

DTYPES = ("float32", "float64")


class ConfigDict:
    """to_dict / from_dict for the model configs (ViTConfig, clip.CLIPConfig): the dataclass's fields as a
    dict that JSON can hold (img_size as a list), and back, refusing fields the config does not have."""

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["img_size"] = list(self.img_size)
        return d

    @classmethod
    def from_dict(cls, d):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; known: {sorted(known)}")
        d = dict(d)
        if isinstance(d.get("img_size"), list):
            d["img_size"] = tuple(d["img_size"])
        return cls(**d)


def check_img_size(img_size):
    """A config's img_size as (H, W): an int means a square image; a ValueError for anything else.
    ViTConfig and clip.CLIPConfig both read it so."""
    if isinstance(img_size, int) and not isinstance(img_size, bool):
        return (img_size, img_size)
    if isinstance(img_size, (tuple, list)) and len(img_size) == 2 and all(isinstance(v, int) for v in img_size):
        return tuple(img_size)
    raise ValueError(f"img_size must be an int or a pair (H, W) of ints, got {img_size!r}")


@dataclass(frozen=True)
class ViTConfig(ConfigDict):
    """The shape of a ViT. Defaults are ViT-B/16 at 224 (the paper's Table 1, "Base")."""

    img_size: tuple = (224, 224)   # (H, W) of the input; an int means a square image
    patch_size: int = 16           # P: 224x224 -> a 14x14 grid = 196 patches of 16x16xC
    in_chans: int = 3              # C: 3 for RGB, 1 for grey (Fashion-MNIST)
    num_classes: int = 1000        # K: outputs of the head
    embed_dim: int = 768           # D: width of every token
    depth: int = 12                # number of transformer blocks
    num_heads: int = 12            # nh: attention heads; head size hs = D / nh
    mlp_ratio: float = 4.0         # M = mlp_ratio * D hidden units in each MLP
    pool: str = "cls"              # "cls": class token (Eq. 4); "gap": mean of tokens, no class token
    qkv_bias: bool = True          # bias in the packed qkv projection (timm and the paper: yes)
    gelu: str = "erf"              # "erf": exact GELU (timm); "tanh": the approximation of the JAX models
    drop_rate: float = 0.0         # dropout after the position embedding, attention proj and MLP
    drop_path_rate: float = 0.0    # stochastic depth: rises linearly from 0 to this over the blocks
    representation_size: int | None = None  # R: a tanh layer D -> R before the head, as some pre-trained
                                            # checkpoints have ("pre_logits"); None: none (fine-tuning, timm)
    # the paper's variants (experiments/, notebook 11): position embeddings (App. D.4) and the hybrid (§3.1)
    pos_embed: str = "learned"     # "learned": 1-D table E_pos (Eq. 1); "learned2d": row + column tables of
                                   # D/2 each; "sincos2d": fixed 2-D sin-cos; "none": no position information
    stem: str = "patch"            # "patch": P x P patches, linearly projected; "conv": the hybrid, a small
                                   # CNN of total stride P whose feature map is cut into 1x1 patches
    stem_width: int = 32           # conv stem only: channels of its first conv, doubled by each stride-2 conv
    # CLIP's image tower (minivit/clip/model.py); timm has each of them for its CLIP models
    pre_norm: bool = False         # a LayerNorm (norm_pre; CLIP's ln_pre) after the position embeddings
    patch_bias: bool = True        # the patch projection's bias (CLIP has none; timm drops it with pre_norm)
    norm_eps: float = 1e-6         # every LayerNorm's eps: 1e-6 as ViT, 1e-5 as CLIP (PyTorch's default)
    head_bias: bool = True         # the head's bias (CLIP's image projection has none)
    # after the paper: register tokens (Darcet et al., "Vision Transformers Need Registers", ICLR 2024)
    num_registers: int = 0         # nr: learned tokens after the class token, [x_class; reg_1..reg_nr; patches],
                                   # read by no output (timm's reg_tokens; the paper mostly uses 4); 0: none

    def __post_init__(self):
        img = check_img_size(self.img_size)
        object.__setattr__(self, "img_size", img)
        for name in ("patch_size", "in_chans", "num_classes", "embed_dim", "depth", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        H, W = img
        if H < 1 or W < 1:
            raise ValueError(f"img_size must be positive, got {self.img_size!r}")
        P = self.patch_size
        if H % P or W % P:
            raise ValueError(f"img_size {img} must be divisible by patch_size {P} "
                             f"(the image is cut into whole {P}x{P} patches)")
        check_num_heads(self.embed_dim, self.num_heads)
        if (not isinstance(self.mlp_ratio, (int, float)) or isinstance(self.mlp_ratio, bool)
                or not 0 < self.mlp_ratio < math.inf or int(self.embed_dim * self.mlp_ratio) < 1):
            raise ValueError(f"mlp_ratio must be a positive finite number, got {self.mlp_ratio!r}")
        if not isinstance(self.qkv_bias, bool):
            raise TypeError(f"qkv_bias must be True or False, got {self.qkv_bias!r}")
        check_pool(self.pool)
        F.check_gelu(self.gelu)
        for name in ("drop_rate", "drop_path_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        R = self.representation_size
        if R is not None and (not isinstance(R, int) or isinstance(R, bool) or R < 1):
            raise ValueError(f"representation_size must be None or a positive int, got {R!r}")
        check_pos_embed(self.pos_embed, self.embed_dim)
        if self.stem not in ("patch", "conv"):
            raise ValueError(f"stem must be 'patch' or 'conv', got {self.stem!r}")
        if not isinstance(self.stem_width, int) or isinstance(self.stem_width, bool) or self.stem_width < 1:
            raise ValueError(f"stem_width must be a positive int, got {self.stem_width!r}")
        for name in ("pre_norm", "patch_bias", "head_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.norm_eps, (int, float)) or isinstance(self.norm_eps, bool) or not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be a positive number, got {self.norm_eps!r}")
        nr = self.num_registers
        if not isinstance(nr, int) or isinstance(nr, bool) or nr < 0:
            raise ValueError(f"num_registers must be an int >= 0 (0: no register tokens), got {nr!r}")
        if self.stem == "conv" and not self.patch_bias:
            raise ValueError("patch_bias=False is an option of the patch stem (stem='patch'), not of the conv stem")
        if self.stem == "conv" and P & (P - 1):
            raise ValueError(f"stem='conv' needs a power-of-two patch_size (the stem halves H and W log2(P) "
                             f"times to reach the patch grid), got patch_size={P}")

    @property
    def grid_size(self):
        """(H/P, W/P): the patch grid."""
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def num_patches(self):
        """N = HW / P^2."""
        gh, gw = self.grid_size
        return gh * gw

    @property
    def num_prefix_tokens(self):
        """The tokens before the patches (timm's name): the class token (pool="cls"), then the nr registers."""
        return (1 if self.pool == "cls" else 0) + self.num_registers

    @property
    def seq_len(self):
        """Tokens through the encoder: N + 1 with the class token, N with GAP, and nr more with registers."""
        return self.num_prefix_tokens + self.num_patches

    @property
    def mlp_dim(self):
        return int(self.embed_dim * self.mlp_ratio)

    @property
    def stem_channels(self):
        """The conv stem's channels: stem_width, then doubled by each of its log2(P) stride-2 convs."""
        return tuple(self.stem_width * 2 ** i for i in range(self.patch_size.bit_length()))

    def num_params(self):
        """The parameter count, computed from the shapes alone (nothing is allocated): see param_shapes."""
        return sum(math.prod(shape) for shape in param_shapes(self).values())



# --------------------------------------------------------------------------------------------------
# The architecture, written down once: every parameter's name and shape, and the FLOPs of a forward
# --------------------------------------------------------------------------------------------------


def param_shapes(config):
    """name -> shape of every parameter of ViT(config), in the model's order; nothing is allocated.
    ViTConfig.num_params sums it, minivit.convert checks checkpoints against it, and tests/test_model.py
    checks that ViT(config).params have exactly these names and shapes, for every preset and option."""
    c = config
    D, M, P, C = c.embed_dim, c.mlp_dim, c.patch_size, c.in_chans
    shapes = {}
    if c.stem == "conv":   # ConvStem: 3x3 convs (no bias: the GroupNorm shifts), GroupNorms, then c -> D
        chans = (C,) + c.stem_channels
        for i, (c_in, c_out) in enumerate(zip(chans[:-1], chans[1:])):
            s = f"patch_embed.stages.{i}."
            shapes.update({s + "conv.weight": (3, 3, c_in, c_out), s + "norm.weight": (c_out,),
                           s + "norm.bias": (c_out,)})
        shapes.update({"patch_embed.proj.weight": (chans[-1], D), "patch_embed.proj.bias": (D,)})
    else:                  # PatchEmbed: E (P*P*C, D) and its bias (CLIP's has none)
        shapes["patch_embed.proj.weight"] = (P * P * C, D)
        if c.patch_bias:
            shapes["patch_embed.proj.bias"] = (D,)
    if c.pool == "cls":
        shapes["cls_token"] = (1, 1, D)                               # x_class
    if c.num_registers:
        shapes["reg_token"] = (1, c.num_registers, D)                 # reg_1 .. reg_nr
    gh, gw = c.grid_size
    if c.pos_embed == "learned":
        shapes["pos_embed"] = (1, c.seq_len, D)                       # E_pos, a row for every token
    elif c.pos_embed == "learned2d":
        shapes.update({"pos_embed_row": (1, gh, D // 2), "pos_embed_col": (1, gw, D // 2)})
    if c.pre_norm:
        shapes.update({"norm_pre.weight": (D,), "norm_pre.bias": (D,)})   # CLIP's ln_pre
    for i in range(c.depth):
        shapes.update(block_shapes(f"blocks.{i}.", D, M, c.qkv_bias))
    shapes.update({"norm.weight": (D,), "norm.bias": (D,)})
    head_in = D
    if c.representation_size is not None:
        R = head_in = c.representation_size
        shapes.update({"pre_logits.fc.weight": (D, R), "pre_logits.fc.bias": (R,)})
    shapes["head.weight"] = (head_in, c.num_classes)
    if c.head_bias:                                                   # CLIP's image projection has none
        shapes["head.bias"] = (c.num_classes,)
    return shapes


def block_shapes(prefix, D, M, qkv_bias=True):
    """name -> shape of one pre-LN Block's parameters (layers.Block: width D, MLP width M), names after prefix."""
    b = prefix
    shapes = {b + "norm1.weight": (D,), b + "norm1.bias": (D,), b + "attn.qkv.weight": (D, 3 * D)}
    if qkv_bias:
        shapes[b + "attn.qkv.bias"] = (3 * D,)
    shapes.update({b + "attn.proj.weight": (D, D), b + "attn.proj.bias": (D,),
                   b + "norm2.weight": (D,), b + "norm2.bias": (D,),
                   b + "mlp.fc1.weight": (D, M), b + "mlp.fc1.bias": (M,),
                   b + "mlp.fc2.weight": (M, D), b + "mlp.fc2.bias": (D,)})
    return shapes


def flops(config):
    """FLOPs of one image's forward pass through every matrix product and convolution, a multiply-add
    counted as 2 (LayerNorm, GELU, softmax, the pool's mean and the residual additions are elementwise
    and left out, as usual). A training step costs about 3x: the backward computes dx and dW of each.

        patch stem   2 N (P^2 C) D                     x_p E, N patches
        conv stem    2 Ho Wo (9 C_in) C_out            each 3x3 conv, at its output size; then 2 N c D
        each block   2 T (3 D^2 + D^2 + 2 D M)         qkv, proj, fc1, fc2 on T = N (+1 class token, +nr registers)
                     + 2 * 2 T^2 D                     q k^T and (softmax) v, all heads together
        head         2 D K, or 2 D R + 2 R K           with a representation layer (pre_logits)
    """
    if not isinstance(config, ViTConfig):
        raise TypeError(f"flops counts a ViTConfig, got {type(config).__name__} (a ResNetConfig has .flops())")
    c = config
    N, T, D, M, K = c.num_patches, c.seq_len, c.embed_dim, c.mlp_dim, c.num_classes
    if c.stem == "conv":
        H, W = c.img_size
        chans = (c.in_chans,) + c.stem_channels
        embed = 0
        for i, (c_in, c_out) in enumerate(zip(chans[:-1], chans[1:])):
            stride = 1 if i == 0 else 2                               # as ConvStem: stride 1, then halving
            H, W = conv_output_size(H, 3, stride, 1), conv_output_size(W, 3, stride, 1)
            embed += 2 * H * W * 9 * c_in * c_out                     # (Ho Wo, 9 C_in) @ (9 C_in, C_out)
        embed += 2 * N * chans[-1] * D                                # 1x1 patches -> D
    else:
        embed = 2 * N * c.patch_size ** 2 * c.in_chans * D            # x_p E
    block = 2 * T * (3 * D * D + D * D + 2 * D * M) + 2 * 2 * T * T * D
    R = c.representation_size
    head = 2 * D * K if R is None else 2 * D * R + 2 * R * K
    return embed + c.depth * block + head


# --------------------------------------------------------------------------------------------------
# Classifier: what the ViT and the ResNet baseline share
# --------------------------------------------------------------------------------------------------


class Classifier(Layer):
    """A model made of named stages run in order, ending in logits: the ViT and the ResNet baseline.
    A subclass defines ``stages()`` -> [(name, layer)], ``check_input(x)``, ``config.num_classes``,
    ``dtype`` and a ``head``; forward runs the stages in order and backward runs them in reverse."""

    def forward(self, x):
        """x: float images (B, H, W, C), channels last. Returns logits (B, K)."""
        self.check_input(x)
        if x.shape[0] == 0:
            raise ValueError(f"got an empty batch, shape {tuple(x.shape)}: give at least one image")
        self.batch_size = x.shape[0] if self.training else None    # backward checks dlogits against it
        for _, layer in self.stages():
            x = layer.forward(x)
        return x

    def backward(self, dlogits):
        """dlogits: (B, K), e.g. from minivit.cross_entropy. Returns dx (B, H, W, C)."""
        K = self.config.num_classes
        if not hasattr(dlogits, "ndim") or dlogits.ndim != 2 or dlogits.shape[1] != K:
            raise ValueError(f"dlogits must be an array (B, {K}), got {getattr(dlogits, 'shape', type(dlogits))}")
        B = getattr(self, "batch_size", None)
        if B is not None and dlogits.shape[0] != B:
            raise ValueError(f"dlogits has {dlogits.shape[0]} rows but the last forward had a batch of {B}: "
                             f"backward takes the gradient of that forward's logits, shape ({B}, {K})")
        dx = dlogits
        for _, layer in reversed(self.stages()):
            dx = layer.backward(dx)
        return dx

    def __call__(self, x):
        return self.forward(x)

    def num_params(self):
        """The number of parameters, counted from the allocated arrays."""
        return sum(int(p.size) for p in self.params.values())

    @property
    def backend(self):
        """'numpy' or 'cupy': where the parameters live."""
        return backend_of(self.params["head.weight"])   # every classifier has a head

    def state_dict(self):
        """Every parameter as a host NumPy copy, keyed by its name (minivit's layouts)."""
        return {name: to_numpy(p).copy() for name, p in self.params.items()}

    def load_state_dict(self, state):
        """Copy parameters in from a dict of arrays. Strict: a missing, unexpected, mis-shaped or non-numeric
        entry is named in the error, and a refused load changes nothing (every array is checked and cast
        to the parameter's dtype before the first is copied in)."""
        missing = sorted(set(self.params) - set(state))
        unexpected = sorted(set(state) - set(self.params))
        wrong, not_numeric, cast = [], [], {}
        for k, p in self.params.items():
            if k not in state:
                continue
            value = state[k]
            kind = value.dtype.kind if is_array(value) else None
            if kind not in ("f", "i", "u"):                   # strings, objects, bools, complex, lists
                what = f"dtype {value.dtype}" if is_array(value) else type(value).__name__
                not_numeric.append(f"{k}: {what}")
            elif tuple(value.shape) != tuple(p.shape):
                wrong.append(f"{k}: expected {tuple(p.shape)}, got {tuple(value.shape)}")
            else:
                cast[k] = asarray(value, dtype=p.dtype, backend=backend_of(p))   # a new array, p untouched
        if missing or unexpected or wrong or not_numeric:
            parts = []
            if missing:
                parts.append(f"missing keys {missing}")
            if unexpected:
                parts.append(f"unexpected keys {unexpected}")
            if wrong:
                parts.append("mis-shaped: " + "; ".join(wrong))
            if not_numeric:
                parts.append("not numeric arrays: " + "; ".join(not_numeric))
            raise ValueError("load_state_dict refused (nothing was changed): " + ", ".join(parts))
        for k, p in self.params.items():
            p[...] = cast[k]
        return self

    def set_matmul_dtype(self, matmul_dtype):
        """Mixed precision (minivit/fast/amp.py): "float16" makes every Linear layer multiply in float16, the
        parameters, gradients and everything else staying float32; None (or "float32") undoes it.
        Train with an amp.LossScaler, so that small gradients do not round to zero in float16."""
        if matmul_dtype == "float32":
            matmul_dtype = None
        if matmul_dtype == "bfloat16":
            raise ValueError("matmul_dtype 'bfloat16' is not available: neither NumPy nor CuPy has a bfloat16 "
                             "dtype; use 'float16' (with a LossScaler) or None")
        if matmul_dtype not in (None, "float16"):
            raise ValueError(f"matmul_dtype must be 'float16', 'float32' or None, got {matmul_dtype!r}")
        if matmul_dtype is not None and self.dtype != "float32":
            raise ValueError(f"mixed precision needs a float32 model (float32 master weights), "
                             f"this one is {self.dtype}")
        if matmul_dtype is not None and self.backend == "numpy":
            warnings.warn("float16 matrix products on NumPy run without BLAS, a few hundred times slower than "
                          "float32: mixed precision pays on the GPU (CuPy, tensor cores); on the CPU it is for "
                          "tests and lessons", RuntimeWarning, stacklevel=2)
        for layer in self.sublayers():
            if isinstance(layer, Linear):
                layer.matmul_dtype = matmul_dtype
        return self

    @property
    def matmul_dtype(self):
        """None, or "float16" when set_matmul_dtype made the Linear layers multiply in float16."""
        return self.head.matmul_dtype


class ViT(Classifier):
    """The Vision Transformer. ``forward(x)`` maps images (B, H, W, C) to logits (B, K);
    ``backward(dlogits)`` returns dx (B, H, W, C) and adds every parameter's gradient into ``grads``."""

    def __init__(self, config, seed=0, dtype="float32"):
        super().__init__()
        if not isinstance(config, ViTConfig):
            raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.config, self.dtype, self.seed = config, dtype, seed
        c = config
        rng = host_rng(seed)
        if c.stem == "conv":   # the hybrid (§3.1): a CNN's feature map, cut into 1x1 patches
            self.patch_embed = ConvStem(c.in_chans, c.stem_channels, c.embed_dim, rng=rng, dtype=dtype)
        else:
            self.patch_embed = PatchEmbed(c.img_size, c.patch_size, c.in_chans, c.embed_dim, bias=c.patch_bias,
                                          rng=rng, dtype=dtype)
        # cls_token, reg_token and pos_embed are top-level names in timm: registered with an empty prefix
        if c.pos_embed == "learned":
            self.pos_embed = self.add("", PosEmbed(c.num_patches, c.embed_dim, class_token=c.pool == "cls",
                                                   rng=rng, dtype=dtype, num_registers=c.num_registers))
        else:                  # learned2d, sincos2d or none (App. D.4)
            self.pos_embed = self.add("", GridPosEmbed(c.grid_size, c.embed_dim, c.pos_embed,
                                                       class_token=c.pool == "cls", rng=rng, dtype=dtype,
                                                       num_registers=c.num_registers))
        self.pos_drop = Dropout(c.drop_rate, seed=seed * 1000 + 999)
        self.norm_pre = None
        if c.pre_norm:
            self.norm_pre = LayerNorm(c.embed_dim, eps=c.norm_eps, dtype=dtype)
        self.blocks = LayerList(self, "blocks")    # "blocks.0", "blocks.1", ...: replace one with blocks[i] = ...
        for i in range(c.depth):
            drop_path = c.drop_path_rate * i / max(c.depth - 1, 1)   # linear rule of stochastic depth
            self.blocks.append(Block(c.embed_dim, c.num_heads, c.mlp_ratio, c.qkv_bias, c.gelu, c.drop_rate,
                                     drop_path, rng=rng, dtype=dtype, seed=seed * 1000 + 10 * i, eps=c.norm_eps))
        self.norm = LayerNorm(c.embed_dim, eps=c.norm_eps, dtype=dtype)
        self.pool = Pool(c.pool, num_prefix_tokens=c.num_prefix_tokens)   # drops the registers
        self.pre_logits = None
        if c.representation_size is not None:
            self.pre_logits = PreLogits(c.embed_dim, c.representation_size, rng=rng, dtype=dtype)
        head_in = c.embed_dim if c.representation_size is None else c.representation_size
        self.head = Linear(head_in, c.num_classes, bias=c.head_bias, rng=rng, dtype=dtype)

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """ViT.from_pretrained(path, num_classes=None, img_size=None, ...), the spelling transformers users
        know: the same call as minivit.from_pretrained (minivit/weights/convert.py; see it for every argument), which
        returns a ViT. The loaders sit above the model, so convert is imported here, when the method runs."""
        from .weights.convert import from_pretrained    # at call time: convert imports this module
        return from_pretrained(path, **kwargs)

    def stages(self):
        """(name, layer) in forward order; backward runs them in reverse."""
        stages = [("patch_embed", self.patch_embed), ("pos_embed", self.pos_embed)]
        if self.config.drop_rate > 0:
            stages.append(("pos_drop", self.pos_drop))
        if self.norm_pre is not None:
            stages.append(("norm_pre", self.norm_pre))
        stages += [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]
        stages += [("norm", self.norm), ("pool", self.pool)]
        if self.pre_logits is not None:
            stages.append(("pre_logits", self.pre_logits))
        return stages + [("head", self.head)]

    def check_input(self, x):
        """Refuse, before any work, what a student is likely to get wrong, saying what was expected."""
        c = self.config
        H, W = c.img_size
        C = c.in_chans
        expected = f"(B, {H}, {W}, {C})"
        if not is_array(x):
            raise TypeError(f"expected an image batch as a numpy or cupy array {expected}, got {type(x).__name__}")
        if backend_of(x) != self.backend:
            raise TypeError(f"the input is a {backend_of(x)} array but the model lives on {self.backend}: "
                            f"move one of them (minivit.asarray(x, backend={self.backend!r}) or model.to(...))")
        if x.ndim == 3 and tuple(x.shape) == (H, W, C):
            raise ValueError(f"got one image {tuple(x.shape)}; the model takes a batch {expected}: use x[None]")
        if x.ndim != 4:
            raise ValueError(f"expected a 4-D image batch {expected}, got shape {tuple(x.shape)}")
        if x.shape[1] == C and x.shape[3] != C:
            raise ValueError(f"got shape {tuple(x.shape)}, which looks channels-first (B, C, H, W); minivit is "
                             f"channels-last {expected}, as the paper and Pillow: use x.transpose(0, 2, 3, 1)")
        if x.shape[3] != C:
            raise ValueError(f"expected {C} channels {expected}, got shape {tuple(x.shape)}")
        if tuple(x.shape[1:3]) != (H, W):
            raise ValueError(f"expected images of {H}x{W} {expected}, got shape {tuple(x.shape)}; the model was "
                             f"built for img_size={c.img_size} (resize the images or the position embeddings)")
        if x.dtype.kind != "f":
            raise TypeError(f"expected floating-point images, got dtype {x.dtype}: convert first, e.g. "
                            f"x.astype('{self.dtype}') / 255, or minivit.augment.normalize(x, mean, std)")
        if x.dtype != self.dtype:
            raise TypeError(f"the input is {x.dtype} but the model is {self.dtype}: use x.astype('{self.dtype}')")

    # ---- fine-tuning at another resolution (paper §3.2) --------------------------------------------

    def resize_pos_embed(self, img_size):
        """A NEW model for images of img_size: the same weights, with the position embeddings of the
        patch grid resized by bilinear interpolation (embeddings.resize_pos_embed: corners aligned, as the
        JAX release's scipy.ndimage.zoom(order=1)) and the class token's embedding kept as it is.

        The patch size stays, so 224 -> 384 with P = 16 turns a 14x14 grid (196 patches) into 24x24
        (576). This model is left unchanged (it still takes only its own size); the new one is on the
        same backend, in the same train/eval mode, and needs its own optimizer.
        """
        if self.config.pos_embed != "learned":
            raise ValueError(f"resize_pos_embed resizes the learned 1-D table (pos_embed='learned'); this model "
                             f"has pos_embed={self.config.pos_embed!r}")
        config = dataclasses.replace(self.config, img_size=img_size)   # checks that P divides img_size
        T = config.num_prefix_tokens                                   # the class token's and registers' rows, kept
        resized = resize_pos_embed(to_numpy(self.params["pos_embed"]), self.config.grid_size, config.grid_size, T)
        model = copy.deepcopy(self)              # every array copied: the two models share nothing
        model.config = config
        model.patch_embed.img_size = config.img_size     # its backward folds patches back to this size
        pos = PosEmbed(config.num_patches, config.embed_dim, config.pool == "cls", dtype=self.dtype,
                       num_registers=config.num_registers).to(self.backend)
        pos.params["pos_embed"][...] = asarray(resized, backend=self.backend)             # (1, T+N', D)
        for name in ("cls_token", "reg_token"):
            if name in pos.params:
                pos.params[name][...] = self.params[name]                     # (1, 1, D), (1, nr, D) as they were
        model.pos_embed = pos                    # takes the old one's place, the "" prefix
        model.to(self.backend)                   # drops any copied caches
        return model.train(self.training)

    def extra_repr(self):
        c = self.config
        return (f"img_size={c.img_size}, patch_size={c.patch_size}, embed_dim={c.embed_dim}, depth={c.depth}, "
                f"num_heads={c.num_heads}, num_classes={c.num_classes}, pool={c.pool!r}, dtype={self.dtype!r}, "
                f"params={self.num_params():,}")


# --------------------------------------------------------------------------------------------------
# The shape trace
# --------------------------------------------------------------------------------------------------

_NOTES = {
    "input": "x in R^{H x W x C}",
    "patches": "x_p: N = HW/P^2 patches of P*P*C values (Eq. 1)",
    "patch_embed": "x_p E, E in R^{(P^2 C) x D} (Eq. 1)",
    "feature map": "the CNN's feature map: its H/P x W/P positions are 1x1 patches (hybrid, §3.1)",
    "patch_embed conv": "each 1x1 patch projected to D: x_p E (hybrid, §3.1)",
    "pos_embed learned2d": "z_0 = [x_class; x_p E + [E_row | E_col]] (App. D.4)",
    "pos_embed sincos2d": "z_0 = [x_class; x_p E + fixed 2-D sin-cos]",
    "pos_embed none": "z_0 = [x_class; x_p E]: no position information",
    "pos_embed": "z_0 = [x_class; x_p E] + E_pos (Eq. 1)",
    "pos_embed registers cls": "z_0 = [x_class; reg_1 .. reg_nr; x_p E] + E_pos: nr register tokens after x_class",
    "pos_embed registers gap": "z_0 = [reg_1 .. reg_nr; x_p E] + E_pos: nr register tokens before the patches",
    "norm_pre": "LN(z_0): CLIP's ln_pre, before the blocks",
    "norm": "LN(z_L) (Eq. 4)",
    "pool": "y = LN(z_L)^0, the class token (Eq. 4)",
    "pre_logits": "tanh(y W_r + b_r), the representation layer of pre-training",
    "head": "logits = y W_head + b",
}


class Trace(list):
    """A list of (stage, shape, note) rows; prints as a table. Shapes are per image (no batch axis)."""

    def __str__(self):
        width = max(len(r[0]) for r in self)
        swidth = max(len(str(r[1])) for r in self)
        return "\n".join(f"{name:<{width}}  {str(shape):<{swidth}}  {note}".rstrip() for name, shape, note in self)

    def shapes(self):
        return [shape for _, shape, _ in self]


def trace(model, x, verbose=True):
    """Run one forward stage by stage and return (and print) each stage's output shape, per image.

    x: one image (H, W, C) or a batch (B, H, W, C), float. On ViT-B/16 with a 224x224x3 image:
    (224, 224, 3) -> patches (196, 768) -> (196, 768) -> (197, 768) -> ... -> (1000,).
    Runs in eval mode (no caches) and restores the model's mode afterwards.
    """
    if is_array(x) and x.ndim == 3:
        x = x[None]
    model.check_input(x)
    was_training = model.training
    model.eval()
    try:
        rows = Trace([("input", tuple(x.shape[1:]), _NOTES["input"]),
                      ("patches", tuple(F.im2patch(x, model.config.patch_size).shape[1:]), _NOTES["patches"])])
        if model.config.stem == "conv":
            rows[1] = ("feature map", tuple(model.patch_embed.features(x).shape[1:]), _NOTES["feature map"])
        for name, layer in model.stages():
            x = layer.forward(x)
            note = _NOTES.get(name, "")
            if name == "patch_embed" and model.config.stem == "conv":
                note = _NOTES["patch_embed conv"]
            if name == "pos_embed" and model.config.pos_embed != "learned":
                note = _NOTES["pos_embed " + model.config.pos_embed]
            if name == "blocks.0":
                note = "z'_l = MSA(LN(z_{l-1})) + z_{l-1};  z_l = MLP(LN(z'_l)) + z'_l (Eqs. 2-3)"
            elif name.startswith("blocks."):
                note = "the same block, its own weights"
            if name == "pool" and model.config.pool == "gap":
                note = "y = mean over the patch tokens of LN(z_L) (global average pooling)"
            if model.config.num_registers and name == "pos_embed":   # Darcet et al., ICLR 2024
                if model.config.pos_embed != "learned":
                    note += "; nr register tokens before the patches, with no position embedding"
                else:
                    note = _NOTES["pos_embed registers " + model.config.pool]
            if model.config.num_registers and name == "pool":
                note += "; the registers' outputs are dropped"
            rows.append((name, tuple(x.shape[1:]), note))
    finally:
        model.train(was_training)
    if verbose:
        print(rows)
    return rows


# --------------------------------------------------------------------------------------------------
# Presets: timm's names and exactly timm's parameter counts (1000 classes), plus small CIFAR-10 models
# --------------------------------------------------------------------------------------------------

presets = {
    "vit_tiny_patch16_224": ViTConfig(patch_size=16, embed_dim=192, depth=12, num_heads=3),     # 5,717,416
    "vit_small_patch16_224": ViTConfig(patch_size=16, embed_dim=384, depth=12, num_heads=6),    # 22,050,664
    "vit_base_patch16_224": ViTConfig(patch_size=16, embed_dim=768, depth=12, num_heads=12),    # 86,567,656
    "vit_base_patch32_224": ViTConfig(patch_size=32, embed_dim=768, depth=12, num_heads=12),    # 88,224,232
    "vit_large_patch16_224": ViTConfig(patch_size=16, embed_dim=1024, depth=24, num_heads=16),  # 304,326,632
    "vit_huge_patch14_224": ViTConfig(patch_size=14, embed_dim=1280, depth=32, num_heads=16),   # 632,045,800
    # CIFAR-10 from scratch: 32x32 images, patch 4 -> an 8x8 grid = 64 patches (+1 class token)
    "vit_cifar_tiny": ViTConfig(img_size=32, patch_size=4, num_classes=10, embed_dim=192, depth=6,
                                num_heads=3, mlp_ratio=2.0),
    "vit_cifar_small": ViTConfig(img_size=32, patch_size=4, num_classes=10, embed_dim=384, depth=7,
                                 num_heads=6, mlp_ratio=2.0),
}


def create_model(name, seed=0, dtype="float32", **overrides):
    """A ViT from a preset name, with any ViTConfig field overridden: create_model("vit_cifar_tiny", depth=4)."""
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
    return ViT(dataclasses.replace(presets[name], **overrides), seed=seed, dtype=dtype)
