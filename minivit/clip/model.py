"""CLIP's two towers and the model that joins them: the text tower (a causal Transformer of minivit's Blocks),
CLIPConfig, CLIP, the presets, and the translation to and from open_clip's names and layouts.

Parameter names: ``visual.`` + the ViT's (timm's) names, ``text.`` + the text tower's (its blocks are
minivit's Block, so ``text.blocks.0.attn.qkv.weight``...), and ``logit_scale``. ``to_open_clip`` and
``CLIP.from_open_clip`` translate to and from open_clip's names and layouts:

    minivit                              open_clip                                  layout change
    visual.patch_embed.proj.weight       visual.conv1.weight (W, 3, P, P)           (P*P*3, W) <-> conv
    visual.cls_token (1, 1, W)           visual.class_embedding (W,)                reshape
    visual.pos_embed (1, N+1, W)         visual.positional_embedding (N+1, W)       reshape
    visual.norm_pre                      visual.ln_pre
    visual.blocks.i.norm1 / norm2        visual.transformer.resblocks.i.ln_1 / ln_2
    visual.blocks.i.attn.qkv             ...resblocks.i.attn.in_proj_weight, in_proj_bias   (in, out) <-> (out, in)
    visual.blocks.i.attn.proj            ...resblocks.i.attn.out_proj               (in, out) <-> (out, in)
    visual.blocks.i.mlp.fc1 / fc2        ...resblocks.i.mlp.c_fc / c_proj           (in, out) <-> (out, in)
    visual.norm / visual.head.weight     visual.ln_post / visual.proj (W, E)        none
    text.token_embedding.weight (V, W)   token_embedding.weight (V, W)              none
    text.pos_embed (1, L, W)             positional_embedding (L, W)                reshape
    text.blocks.i...                     transformer.resblocks.i...                 as the visual blocks
    text.norm / text.proj.weight         ln_final / text_projection (W, E)          none
    logit_scale ()                       logit_scale ()                             none

Glossary (with functional.py's): E joint embedding width, L context length (tokens per caption),
V vocabulary size, W text width.
"""

import math
from dataclasses import dataclass

from .. import functional as F
from ..backend import as_numpy, backend_of, get_array_module, host_rng, is_array
from ..embeddings import Embedding, PosEmbed
from ..layers import Block, Layer, LayerList, LayerNorm, Linear
from ..model import DTYPES, ConfigDict, ViT, ViTConfig, block_shapes, check_img_size
from .loss import L2Normalize, Similarity

# --------------------------------------------------------------------------------------------------
# The text tower
# --------------------------------------------------------------------------------------------------


class TextTransformer(Layer):
    """tokens (B, L) -> (B, E):
        token_embedding   x = Emb[tokens]                                 (B, L, W)
        pos_embed         x + E_pos, learned                              (B, L, W)
        blocks            depth x minivit's pre-norm Block, causal mask   (B, L, W)
        norm              final LayerNorm                                 (B, L, W)
        pool              the features at <end> (argmax of the ids)       (B, W)
        proj              x W_proj, no bias                               (B, E)
    The causal mask lets token i attend to tokens 0..i only (CLIP's text encoder is a GPT-style one), so
    <end>, the last real token, is the one that has read the whole caption."""

    def __init__(self, vocab_size, context_length, width, depth, num_heads, embed_dim, mlp_ratio=4.0, gelu="erf",
                 eps=1e-5, rng=None, dtype="float32", seed=0, eot_token=None):
        super().__init__()
        self.eot_token = eot_token                            # None: <end> is the highest id; else its id
        rng = host_rng(seed) if rng is None else rng
        self.vocab_size, self.context_length = vocab_size, context_length
        self.token_embedding = Embedding(vocab_size, width, rng=rng, dtype=dtype)
        self.pos_embed = self.add("", PosEmbed(context_length, width, class_token=False, rng=rng, dtype=dtype))
        self.blocks = LayerList(self, "blocks")
        for i in range(depth):
            self.blocks.append(Block(width, num_heads, mlp_ratio, qkv_bias=True, gelu=gelu, eps=eps, rng=rng,
                                     dtype=dtype, seed=seed * 1000 + 10 * i))
        self.norm = LayerNorm(width, eps=eps, dtype=dtype)
        self.proj = Linear(width, embed_dim, bias=False, rng=rng, dtype=dtype, std=width ** -0.5)

    def forward(self, tokens):                                # (B, L) int
        B, L = tokens.shape
        xp = get_array_module(tokens)
        x = self.token_embedding.forward(tokens)              # (B, L, W)
        x = self.pos_embed.forward(x)                         # (B, L, W)
        mask = F.causal_mask(x)                               # (L, L): 0 where j <= i, -inf above
        for block in self.blocks:
            x = block.forward(x, mask)                        # (B, L, W)
        x = self.norm.forward(x)                              # (B, L, W)
        if self.eot_token is None:
            eot = tokens.argmax(-1)                           # (B,) where <end> is: it has the highest id
        else:                                                 # (B,) its first position (0 if absent, as transformers)
            eot = (tokens == self.eot_token).astype("int32").argmax(-1)
        pooled = x[xp.arange(B), eot]                         # (B, W)
        self.cache = (eot, x.shape) if self.training else None
        return self.proj.forward(pooled)                      # (B, E)

    def backward(self, dout):                                 # (B, E)
        eot, shape = self._need_cache()
        xp = get_array_module(dout)
        dpooled = self.proj.backward(dout)                    # (B, W)
        dx = xp.zeros(shape, dtype=dpooled.dtype)             # (B, L, W): only <end>'s features were read
        dx[xp.arange(shape[0]), eot] = dpooled
        dx = self.norm.backward(dx)
        for block in reversed(self.blocks):
            dx = block.backward(dx)                           # (B, L, W)
        dx = self.pos_embed.backward(dx)
        self.token_embedding.backward(dx)                     # fills the embedding's gradient; ids have none
        return None


# --------------------------------------------------------------------------------------------------
# The config and the model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CLIPConfig(ConfigDict):
    """The shape of a CLIP. Defaults are OpenAI's ViT-B/32 (embed 512; 224 px, patch 32, width 768, 12
    layers, 12 heads; text: 77 tokens, 49408 words, width 512, 12 layers, 8 heads)."""

    embed_dim: int = 512            # E: width of the joint image-text space
    # the image tower: a ViT (minivit.model) with pre_norm, no patch bias, LayerNorm eps 1e-5, a bias-free head
    img_size: tuple = (224, 224)    # (H, W); an int means a square image
    patch_size: int = 32            # P: 224 x 224 -> a 7 x 7 grid, 49 patches + the class token
    in_chans: int = 3               # C
    vision_width: int = 768         # the ViT's D
    vision_layers: int = 12         # the ViT's depth
    vision_heads: int = 12          # its nh (open_clip gives head_width = width / heads instead)
    # the text tower
    context_length: int = 77        # L: tokens per caption, <start> and <end> included
    vocab_size: int = 49408         # V (minivit's word-level Tokenizer: its vocab_size)
    text_width: int = 512           # W
    text_layers: int = 12
    text_heads: int = 8
    # both
    mlp_ratio: float = 4.0          # MLP hidden = mlp_ratio * width, in both towers
    gelu: str = "erf"               # "erf" (open_clip's default), or "quick": x sigmoid(1.702 x), OpenAI's models
    init_logit_scale: float = math.log(1 / 0.07)   # the temperature 0.07 to start
    eot_token: int | None = None    # where the text is read: None, at the highest id (<end> has it, OpenAI's and
                                    # minivit's tokenizers); an id: its first position (newer transformers configs)

    def __post_init__(self):
        object.__setattr__(self, "img_size", check_img_size(self.img_size))   # (H, W), as the ViT's
        for name in ("embed_dim", "patch_size", "in_chans", "vision_width", "vision_layers", "vision_heads",
                     "context_length", "vocab_size", "text_width", "text_layers", "text_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for width, heads in (("vision_width", "vision_heads"), ("text_width", "text_heads")):
            if getattr(self, width) % getattr(self, heads):
                raise ValueError(f"{width} {getattr(self, width)} must be divisible by {heads} {getattr(self, heads)}")
        if self.context_length < 3:
            raise ValueError(f"context_length must be >= 3 (<start>, a word, <end>), got {self.context_length}")
        if self.vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4 (<pad>, <unk>, <start>, <end>), got {self.vocab_size}")
        if self.gelu not in ("erf", "quick"):
            raise ValueError(f"CLIP's gelu must be 'erf' or 'quick', got {self.gelu!r}")
        if not isinstance(self.init_logit_scale, (int, float)) or not 0 <= self.init_logit_scale <= Similarity.MAX:
            raise ValueError(f"init_logit_scale must be a number in [0, log 100 = {Similarity.MAX:.4f}], "
                             f"got {self.init_logit_scale!r}")
        if self.eot_token is not None and (not isinstance(self.eot_token, int) or isinstance(self.eot_token, bool)
                                           or not 0 <= self.eot_token < self.vocab_size):
            raise ValueError(f"eot_token must be None or an id in [0, {self.vocab_size}), got {self.eot_token!r}")
        self.vision_config()                       # the ViT's own checks (image size against patch size...)

    def vision_config(self):
        """The image tower as a ViTConfig: CLIP's options of minivit's ViT, the head projecting to E."""
        return ViTConfig(img_size=self.img_size, patch_size=self.patch_size, in_chans=self.in_chans,
                         num_classes=self.embed_dim, embed_dim=self.vision_width, depth=self.vision_layers,
                         num_heads=self.vision_heads, mlp_ratio=self.mlp_ratio, gelu=self.gelu, pre_norm=True,
                         patch_bias=False, norm_eps=1e-5, head_bias=False)

    def num_params(self):
        """The parameter count, from the shapes alone."""
        W, M, E = self.text_width, int(self.text_width * self.mlp_ratio), self.embed_dim
        block = sum(math.prod(shape) for shape in block_shapes("", W, M, qkv_bias=True).values())
        text = self.vocab_size * W + self.context_length * W + self.text_layers * block + 2 * W + W * E
        return self.vision_config().num_params() + text + 1          # + logit_scale


class CLIP(Layer):
    """Image and text towers in one joint space. ``forward(images, tokens)`` -> the (B, B) logits;
    ``backward(dlogits)`` adds every parameter's gradient (logit_scale's too) into ``grads`` and returns
    d images (B, H, W, C)."""

    def __init__(self, config, seed=0, dtype="float32"):
        super().__init__()
        if not isinstance(config, CLIPConfig):
            raise TypeError(f"config must be a CLIPConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.config, self.dtype, self.seed = config, dtype, seed
        c = config
        self.visual = ViT(c.vision_config(), seed=seed, dtype=dtype)
        self.text = TextTransformer(c.vocab_size, c.context_length, c.text_width, c.text_layers,
                                    c.text_heads, c.embed_dim, c.mlp_ratio, c.gelu, eps=1e-5,
                                    rng=host_rng([seed, 1]), dtype=dtype, seed=seed + 1, eot_token=c.eot_token)
        self.image_l2 = L2Normalize()
        self.text_l2 = L2Normalize()
        self.similarity = self.add("", Similarity(c.init_logit_scale, dtype=dtype))   # "logit_scale" at the top

    def check_tokens(self, tokens):
        """Refuse, before any work, tokens that are not int (B, L) ids below V."""
        L, V = self.config.context_length, self.config.vocab_size
        if not is_array(tokens):
            raise TypeError(f"expected tokens as an int array (B, {L}), got {type(tokens).__name__}: use a "
                            f"minivit.captions.Tokenizer")
        if backend_of(tokens) != self.backend:
            raise TypeError(f"the tokens are a {backend_of(tokens)} array but the model lives on {self.backend}")
        if tokens.ndim != 2 or tokens.shape[1] != L:
            raise ValueError(f"expected tokens (B, {L}) (the context length), got shape {tuple(tokens.shape)}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be integer ids, got dtype {tokens.dtype}")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= V):
            raise ValueError(f"token ids must be in [0, {V}) for vocab_size {V}, got values from "
                             f"{int(tokens.min())} to {int(tokens.max())}")

    def encode_image(self, images):
        """images (B, H, W, C) float -> image features (B, E), not normalised."""
        return self.visual.forward(images)

    def encode_text(self, tokens):
        """tokens (B, L) int -> text features (B, E), not normalised."""
        self.check_tokens(tokens)
        return self.text.forward(tokens)

    def forward(self, images, tokens):
        """images (B, H, W, C), tokens (B, L): pair i is image i with text i. Returns logits (B, B)."""
        img, txt = self.features(images, tokens)                       # (B, E) each
        return self.similarity.forward(img, txt)                       # (B, B)

    def backward(self, dlogits):
        """dlogits: (B, B), e.g. from contrastive_loss. Returns d images (B, H, W, C)."""
        if not is_array(dlogits) or dlogits.ndim != 2 or dlogits.shape[0] != dlogits.shape[1]:
            raise ValueError(f"dlogits must be a square array (B, B), got {getattr(dlogits, 'shape', type(dlogits))}")
        dimg, dtxt = self.similarity.backward(dlogits)                 # (B, E) each
        return self.features_backward(dimg, dtxt)                      # (B, H, W, C)

    def features(self, images, tokens):
        """The normalised features of B pairs, I (B, E) and T (B, E), both towers' caches kept: forward
        without the logits (several ranks make their logits against every rank's features)."""
        self.check_tokens(tokens)
        if is_array(images) and images.ndim == 4 and images.shape[0] != tokens.shape[0]:
            raise ValueError(f"got {images.shape[0]} images but {tokens.shape[0]} captions: pair i is image i "
                             f"with caption i")
        img = self.image_l2.forward(self.encode_image(images))        # (B, E) on the unit sphere
        txt = self.text_l2.forward(self.text.forward(tokens))          # (B, E)
        return img, txt

    def features_backward(self, dimg, dtxt):
        """dimg, dtxt: (B, E), the loss's gradient for I and T. Adds the towers' gradients; returns d images."""
        self.text.backward(self.text_l2.backward(dtxt))
        return self.visual.backward(self.image_l2.backward(dimg))     # (B, H, W, C)

    def __call__(self, images, tokens):
        return self.forward(images, tokens)

    def clamp_logit_scale(self):
        """logit_scale into [0, log 100], in place: call after every optimizer step, as CLIP does."""
        self.similarity.clamp()

    @property
    def logit_scale(self):
        return float(self.params["logit_scale"])

    def num_params(self):
        return sum(int(p.size) for p in self.params.values())

    @property
    def backend(self):
        return backend_of(self.params["logit_scale"])

    # the ViT's, unchanged: host NumPy copies under the model's names / a strict, all-or-nothing load /
    state_dict = ViT.state_dict
    load_state_dict = ViT.load_state_dict
    set_matmul_dtype = ViT.set_matmul_dtype       # float16 products in every Linear (amp.py), or None

    @classmethod
    def from_open_clip(cls, state, vision_heads, text_heads, dtype="float32", quick_gelu=False):
        """A CLIP with the weights of an open_clip CLIP's ``model.state_dict()`` (NumPy arrays or tensors).
        The head counts cannot be read from the weights (one packed in_proj matrix); every other size is
        inferred from the shapes. quick_gelu: the models were trained with QuickGELU (OpenAI's)."""
        state = {k: as_numpy(v) for k, v in state.items()}
        config = open_clip_config(state, vision_heads, text_heads, quick_gelu)
        return cls(config, dtype=dtype).load_state_dict(from_open_clip(state))

    @classmethod
    def from_pretrained(cls, folder, dtype="float32"):
        """A CLIP with the weights of a Hugging Face transformers CLIPModel folder (save_pretrained's:
        config.json and model.safetensors, sharded or not); see minivit.hf. Saving: minivit.hf.save_pretrained."""
        from ..weights.hf import load_clip
        kwargs, state, meta = load_clip(folder)
        model = cls(CLIPConfig(**kwargs), dtype=dtype).load_state_dict(state)
        if meta:
            model.checkpoint_meta = meta          # the preprocessor's mean and std
        return model

    def extra_repr(self):
        c = self.config
        return (f"embed_dim={c.embed_dim}, vision {c.vision_width}x{c.vision_layers}, text {c.text_width}x"
                f"{c.text_layers}, context {c.context_length}, vocab {c.vocab_size}, dtype={self.dtype!r}, "
                f"params={self.num_params():,}")


# a small CLIP for the captioned shapes: 32 x 32 images, patch 4; 16-token captions (ample for them)
presets = {
    "clip_shapes_tiny": CLIPConfig(embed_dim=64, img_size=32, patch_size=4, vision_width=64, vision_layers=3,
                                   vision_heads=4, context_length=16, vocab_size=64, text_width=64, text_layers=2,
                                   text_heads=4, mlp_ratio=2.0),
}


# --------------------------------------------------------------------------------------------------
# open_clip <-> minivit
# --------------------------------------------------------------------------------------------------


_BLOCK_NAMES = [("norm1", "ln_1"), ("attn.qkv.weight", "attn.in_proj_weight"), ("attn.qkv.bias", "attn.in_proj_bias"),
                ("attn.proj", "attn.out_proj"), ("norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")]
_TOP_NAMES = [("visual.norm_pre", "visual.ln_pre"), ("visual.norm.", "visual.ln_post."),
              ("visual.head.weight", "visual.proj"), ("visual.blocks.", "visual.transformer.resblocks."),
              ("text.token_embedding", "token_embedding"), ("text.blocks.", "transformer.resblocks."),
              ("text.norm", "ln_final"), ("text.proj.weight", "text_projection")]


def _rename(name, pairs):
    """name with the first matching prefix (or inner part, for block names) of pairs replaced."""
    for a, b in pairs:
        if name.startswith(a):
            return b + name[len(a):]
    return name


def to_open_clip(params_or_grads):
    """minivit's CLIP state dict (or grads) -> open_clip's names and layouts, host NumPy arrays.
    The patch size is read from the patch projection's rows, P*P*3 (open_clip's images are RGB)."""
    out = {}
    for name, value in params_or_grads.items():
        value = as_numpy(value)
        new = _rename(name, _TOP_NAMES)
        if ".resblocks." in new:
            head, rest = new.split(".resblocks.", 1)
            index, inner = rest.split(".", 1)
            new = f"{head}.resblocks.{index}.{_rename(inner, _BLOCK_NAMES)}"
            if inner.endswith(".weight") and value.ndim == 2:
                value = value.T                                           # (in, out) -> (out, in)
        if name == "visual.patch_embed.proj.weight":
            rows, width = value.shape
            P = math.isqrt(rows // 3)
            if P * P * 3 != rows:
                raise ValueError(f"{name}: {rows} rows are not P*P*3 for any P (open_clip's images have 3 channels)")
            new = "visual.conv1.weight"
            value = value.reshape(P, P, 3, width).transpose(3, 2, 0, 1)   # (P, P, C, W) -> (W, C, P, P)
        elif name == "visual.cls_token":
            new, value = "visual.class_embedding", value.reshape(-1)      # (1, 1, W) -> (W,)
        elif name == "visual.pos_embed":
            new, value = "visual.positional_embedding", value[0]          # (1, N+1, W) -> (N+1, W)
        elif name == "text.pos_embed":
            new, value = "positional_embedding", value[0]                 # (1, L, W) -> (L, W)
        elif name.startswith("visual.patch_embed"):
            raise ValueError(f"{name}: open_clip's patch projection has no bias (a CLIP ViT has patch_bias=False)")
        out[new] = value.copy()                                           # C-contiguous
    return out


def from_open_clip(state):
    """open_clip's state dict (NumPy arrays) -> minivit's names and layouts; the inverse of to_open_clip."""
    inverse_top = [(b, a) for a, b in _TOP_NAMES]
    inverse_block = [(b, a) for a, b in _BLOCK_NAMES]
    out = {}
    for name, value in state.items():
        value = as_numpy(value)
        if name == "attn_mask" or name.endswith("attn_mask"):                # a buffer, not a parameter
            continue
        if name == "visual.conv1.weight":
            W, C, P, _ = value.shape
            out["visual.patch_embed.proj.weight"] = value.transpose(2, 3, 1, 0).reshape(P * P * C, W).copy()
            #                                                                   (W, C, P, P) -> (P*P*C, W)
            continue
        if name == "visual.class_embedding":
            out["visual.cls_token"] = value.reshape(1, 1, -1)
            continue
        if name == "visual.positional_embedding":
            out["visual.pos_embed"] = value[None]
            continue
        if name == "positional_embedding":
            out["text.pos_embed"] = value[None]
            continue
        new = _rename(name, inverse_top)
        if ".resblocks." in name:
            head, rest = name.split(".resblocks.", 1)
            index, inner = rest.split(".", 1)
            prefix = "visual.blocks." if head == "visual.transformer" else "text.blocks."
            new = f"{prefix}{index}.{_rename(inner, inverse_block)}"
            if inner.endswith("weight") and value.ndim == 2:
                value = value.T                                           # (out, in) -> (in, out)
        out[new] = value.copy()
    return out


def open_clip_config(state, vision_heads, text_heads, quick_gelu=False):
    """The CLIPConfig of an open_clip state dict (NumPy arrays), every size read from the shapes."""
    need = ["visual.conv1.weight", "visual.positional_embedding", "visual.proj", "token_embedding.weight",
            "positional_embedding", "text_projection", "logit_scale", "visual.ln_pre.weight"]
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"not an open_clip CLIP ViT state dict: missing {missing}")
    W, C, P, _ = state["visual.conv1.weight"].shape
    grid = math.isqrt(state["visual.positional_embedding"].shape[0] - 1)
    if grid * grid + 1 != state["visual.positional_embedding"].shape[0]:
        raise ValueError("visual.positional_embedding: not a square grid of patches plus the class token")

    def layers(prefix):                                   # how many resblocks.<i>. there are
        return len({k[len(prefix):].split(".")[0] for k in state if k.startswith(prefix)})

    mlp = state["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0] / W
    V, TW = state["token_embedding.weight"].shape
    return CLIPConfig(embed_dim=state["visual.proj"].shape[1], img_size=grid * P, patch_size=P, in_chans=C,
                      vision_width=W, vision_layers=layers("visual.transformer.resblocks."),
                      vision_heads=vision_heads, context_length=state["positional_embedding"].shape[0],
                      vocab_size=V, text_width=TW, text_layers=layers("transformer.resblocks."),
                      text_heads=text_heads, mlp_ratio=mlp, gelu="quick" if quick_gelu else "erf")
