"""The masked autoencoder (He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022): its
config, the model, and the encoder handed on to a ViT for fine-tuning.

    imgs (B, H, W, C), noise (B, N)
    encoder
      -> patch_embed       im2patch + x_p E                         (B, N, D)      the ViT's PatchEmbed
      -> pos_embed         + fixed 2-D sin-cos                      (B, N, D)      the ViT's GridPosEmbed
      -> masking           keep the L = N/4 of smallest noise       (B, L, D)      masking.random_masking
      -> cls               prepend x_class                          (B, 1+L, D)
      -> blocks, norm      the ViT's pre-norm Blocks, LayerNorm     (B, 1+L, D)    on the visible tokens only
    decoder
      -> decoder_embed     Linear D -> Dd                           (B, 1+L, Dd)
      -> unshuffle         mask_token in the removed places         (B, 1+N, Dd)   masking.unshuffle
      -> decoder_pos_embed + fixed 2-D sin-cos (0 for x_class)      (B, 1+N, Dd)
      -> decoder_blocks, decoder_norm                               (B, 1+N, Dd)
      -> decoder_pred      Linear Dd -> P*P*C, class token dropped  (B, N, P*P*C)  the pixels of every patch
    loss (loss.py)         mean squared error on the removed patches: model.forward_loss(imgs, pred)

Parameter names are MAE's models_mae.py (cls_token, patch_embed.proj, blocks.i..., norm, mask_token,
decoder_embed, decoder_blocks.i..., decoder_norm, decoder_pred); its pos_embed and decoder_pos_embed are
fixed sin-cos tables (requires_grad=False there), so here they are no parameters. The encoder's names are
the ViT's with pos_embed="sincos2d": encoder_state_dict and finetune_vit make that ViT for fine-tuning.
Initialisation differs from MAE's (xavier_uniform for its Linear layers; here the ViT's truncated normal).
"""

import dataclasses
import math
from dataclasses import dataclass

from ..backend import asarray, backend_of, get_array_module, host_rng
from ..embeddings import GridPosEmbed, PatchEmbed, prepend_tokens_backward, prepend_tokens_forward, sincos2d_table
from ..functional import check_gelu, im2patch, patch2im
from ..layers import Block, Layer, LayerList, LayerNorm, Linear, check_num_heads, trunc_normal
from ..model import DTYPES, ConfigDict, ViT, ViTConfig, check_img_size
from .loss import masked_mse
from .masking import RandomMasking, len_keep_of, unshuffle_backward, unshuffle_forward


@dataclass(frozen=True)
class MAEConfig(ConfigDict):
    """The shape of an MAE. Defaults are MAE's ViT-B/16 (mae_vit_base_patch16_dec512d8b)."""

    img_size: tuple = (224, 224)    # (H, W); an int means a square image
    patch_size: int = 16            # P
    in_chans: int = 3               # C
    embed_dim: int = 768            # D: the encoder's width
    depth: int = 12                 # the encoder's blocks
    num_heads: int = 12             # the encoder's heads
    decoder_embed_dim: int = 512    # Dd: the decoder's width (MAE: light, 512 for every encoder size)
    decoder_depth: int = 8          # the decoder's blocks
    decoder_num_heads: int = 16     # the decoder's heads
    mlp_ratio: float = 4.0          # both MLPs' hidden width, as a multiple of their D
    mask_ratio: float = 0.75        # the share of patches removed (MAE: 75%)
    norm_pix_loss: bool = False     # normalise each target patch by its own mean and variance (MAE's best)
    qkv_bias: bool = True
    gelu: str = "erf"
    norm_eps: float = 1e-6          # every LayerNorm's eps (MAE: 1e-6)

    def __post_init__(self):
        object.__setattr__(self, "img_size", check_img_size(self.img_size))
        for name in ("patch_size", "in_chans", "embed_dim", "depth", "num_heads", "decoder_embed_dim",
                     "decoder_depth", "decoder_num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        H, W = self.img_size
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"img_size {self.img_size} must be divisible by patch_size {self.patch_size}")
        check_num_heads(self.embed_dim, self.num_heads)
        check_num_heads(self.decoder_embed_dim, self.decoder_num_heads)
        for name in ("embed_dim", "decoder_embed_dim"):
            if getattr(self, name) % 4:
                raise ValueError(f"{name} must be divisible by 4 (the 2-D sin-cos position embeddings), "
                                 f"got {getattr(self, name)}")
        r = self.mask_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 < r < 1:
            raise ValueError(f"mask_ratio must be in (0, 1), got {r!r}")
        if not 1 <= self.len_keep < self.num_patches:
            raise ValueError(f"mask_ratio {r} keeps {self.len_keep} of {self.num_patches} patches: it must keep "
                             f"at least one and remove at least one")
        if not isinstance(self.norm_pix_loss, bool) or not isinstance(self.qkv_bias, bool):
            raise TypeError(f"norm_pix_loss and qkv_bias must be True or False, got {self.norm_pix_loss!r}, "
                            f"{self.qkv_bias!r}")
        check_gelu(self.gelu)
        if not 0 < self.mlp_ratio < math.inf or not self.norm_eps > 0:
            raise ValueError(f"mlp_ratio and norm_eps must be positive, got {self.mlp_ratio!r}, {self.norm_eps!r}")

    @property
    def grid_size(self):
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def num_patches(self):
        gh, gw = self.grid_size
        return gh * gw

    @property
    def len_keep(self):
        """L: the patches the encoder sees."""
        return len_keep_of(self.num_patches, self.mask_ratio)

    def encoder_config(self, num_classes):
        """The ViTConfig whose parameters, less the head, are the encoder's: the model fine-tuning starts from."""
        return ViTConfig(img_size=self.img_size, patch_size=self.patch_size, in_chans=self.in_chans,
                         num_classes=num_classes, embed_dim=self.embed_dim, depth=self.depth,
                         num_heads=self.num_heads, mlp_ratio=self.mlp_ratio, qkv_bias=self.qkv_bias, gelu=self.gelu,
                         norm_eps=self.norm_eps, pos_embed="sincos2d")


class MAE(Layer):
    """``forward(imgs, noise=None)`` -> pred (B, N, P*P*C), the pixels predicted for every patch;
    ``forward_loss(imgs, pred)`` -> (loss, dpred) on the removed patches; ``backward(dpred)`` -> dimgs, the
    parameters' gradients added into ``grads``. noise (B, N) fixes the mask (None: drawn from the model's own
    generator); after a forward, ``mask`` (B, N) says which patches were removed (1)."""

    def __init__(self, config, seed=0, dtype="float32"):
        super().__init__()
        if not isinstance(config, MAEConfig):
            raise TypeError(f"config must be an MAEConfig, got {type(config).__name__}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.config, self.dtype, self.seed = config, dtype, seed
        c = config
        D, Dd, P, C = c.embed_dim, c.decoder_embed_dim, c.patch_size, c.in_chans
        rng = host_rng(seed)
        self.noise_rng = host_rng([seed, 75])                    # the masks' noise, when none is given
        # the encoder
        self.patch_embed = PatchEmbed(c.img_size, P, C, D, rng=rng, dtype=dtype)
        self.pos_embed = GridPosEmbed(c.grid_size, D, "sincos2d", class_token=False, dtype=dtype)   # fixed
        self.masking = RandomMasking(c.mask_ratio)
        # the two learned tokens are the model's own arrays, top-level names as in MAE (normal, std 0.02)
        self.params["cls_token"] = trunc_normal(rng, (1, 1, D), 0.02, dtype)      # (1, 1, D)
        self.params["mask_token"] = trunc_normal(rng, (1, 1, Dd), 0.02, dtype)    # (1, 1, Dd)
        self.blocks = LayerList(self, "blocks")
        for i in range(c.depth):
            self.blocks.append(Block(D, c.num_heads, c.mlp_ratio, c.qkv_bias, c.gelu, rng=rng, dtype=dtype,
                                     seed=seed * 1000 + 10 * i, eps=c.norm_eps))
        self.norm = LayerNorm(D, eps=c.norm_eps, dtype=dtype)
        # the decoder
        self.decoder_embed = Linear(D, Dd, rng=rng, dtype=dtype)
        table = sincos2d_table(c.grid_size, Dd, dtype=dtype)       # (1, N, Dd)
        xp = get_array_module(table)
        self.decoder_pos_embed = xp.concatenate([xp.zeros((1, 1, Dd), dtype=dtype), table], axis=1)  # (1, 1+N, Dd)
        self.decoder_blocks = LayerList(self, "decoder_blocks")
        for i in range(c.decoder_depth):
            self.decoder_blocks.append(Block(Dd, c.decoder_num_heads, c.mlp_ratio, c.qkv_bias, c.gelu, rng=rng,
                                             dtype=dtype, seed=seed * 1000 + 500 + 10 * i, eps=c.norm_eps))
        self.decoder_norm = LayerNorm(Dd, eps=c.norm_eps, dtype=dtype)
        self.decoder_pred = Linear(Dd, P * P * C, rng=rng, dtype=dtype)

    # ---- the pixels as patches, the target --------------------------------------------------------

    def patchify(self, imgs):
        """(B, H, W, C) -> (B, N, P*P*C), each patch in (P, P, C) order: the ViT's im2patch."""
        return im2patch(imgs, self.config.patch_size)

    def unpatchify(self, x):
        """(B, N, P*P*C) -> (B, H, W, C): the inverse of patchify (a prediction shown as images)."""
        return patch2im(x, self.config.patch_size, self.config.img_size)

    @property
    def mask(self):
        """(B, N) of the last forward: 1 where the patch was removed."""
        return self.masking.mask

    # ---- forward and backward ---------------------------------------------------------------------

    def forward(self, imgs, noise=None):
        """imgs (B, H, W, C), noise (B, N) or None. Returns pred (B, N, P*P*C)."""
        self.check_input(imgs)
        B, N = imgs.shape[0], self.config.num_patches
        if noise is None:
            noise = asarray(self.noise_rng.random((B, N)), dtype=self.dtype, backend=self.backend)   # (B, N)
        latent = self.forward_encoder(imgs, noise)               # (B, 1+L, D)
        return self.forward_decoder(latent)                      # (B, N, P*P*C)

    def forward_encoder(self, imgs, noise):
        x = self.patch_embed.forward(imgs)                       # (B, N, D)
        x = self.pos_embed.forward(x)                            # (B, N, D)  before the masking, as MAE
        x = self.masking.forward(x, noise)                       # (B, L, D)  the visible patches
        x, cls_cache = prepend_tokens_forward(x, self.params["cls_token"], None)    # (B, 1+L, D)  x_class first
        self.cache = {"cls": cls_cache} if self.training else None
        for blk in self.blocks:
            x = blk.forward(x)                                   # (B, 1+L, D)
        return self.norm.forward(x)                              # (B, 1+L, D)

    def forward_decoder(self, latent):                           # (B, 1+L, D)
        x = self.decoder_embed.forward(latent)                   # (B, 1+L, Dd)
        x, cache = unshuffle_forward(x, self.params["mask_token"], self.masking.ids_restore)   # (B, 1+N, Dd)
        if self.training:                                        # beside the encoder's (forward_decoder may
            self.cache = {**(self.cache or {}), "unshuffle": cache}   # also run alone: tests check it so)
        x = x + self.decoder_pos_embed                           # (B, 1+N, Dd)  fixed: no gradient of its own
        for blk in self.decoder_blocks:
            x = blk.forward(x)                                   # (B, 1+N, Dd)
        x = self.decoder_pred.forward(self.decoder_norm.forward(x))   # (B, 1+N, P*P*C)
        return x[:, 1:]                                          # (B, N, P*P*C)  the class token's row dropped

    def features(self, imgs):
        """The encoder on ALL the patches (no masking), its class token after the final norm: (B, D), what the
        fine-tuned ViT's head reads. For probing in eval mode (the k-NN of mae/task.py); it has no backward."""
        x = self.pos_embed.forward(self.patch_embed.forward(imgs))              # (B, N, D)
        x, _ = prepend_tokens_forward(x, self.params["cls_token"], None)       # (B, 1+N, D)
        for blk in self.blocks:
            x = blk.forward(x)
        return self.norm.forward(x)[:, 0]                                      # (B, D)

    def backward(self, dpred):
        """dpred: (B, N, P*P*C), e.g. from forward_loss. Returns dimgs (B, H, W, C)."""
        return self.backward_encoder(self.backward_decoder(dpred))

    def backward_decoder(self, dpred):                           # (B, N, P*P*C)
        xp = get_array_module(dpred)
        B, N, K = dpred.shape
        dx = xp.concatenate([xp.zeros((B, 1, K), dtype=dpred.dtype), dpred], axis=1)   # (B, 1+N, K)
        dx = self.decoder_norm.backward(self.decoder_pred.backward(dx))               # (B, 1+N, Dd)
        for blk in reversed(self.decoder_blocks):
            dx = blk.backward(dx)                                # (B, 1+N, Dd)
        dx, dmask_token = unshuffle_backward(dx, self._need_cache()["unshuffle"])  # (B, 1+L, Dd): the pos
        self.grads["mask_token"] += dmask_token                  # (1, 1, Dd)        table passed dx through
        return self.decoder_embed.backward(dx)                   # (B, 1+L, D)

    def backward_encoder(self, dlatent):                         # (B, 1+L, D)
        dx = self.norm.backward(dlatent)
        for blk in reversed(self.blocks):
            dx = blk.backward(dx)                                # (B, 1+L, D)
        dx, dcls_token, _ = prepend_tokens_backward(dx, self._need_cache()["cls"])   # (B, L, D)
        self.grads["cls_token"] += dcls_token                    # (1, 1, D): summed over the batch
        dx = self.masking.backward(dx)                           # (B, N, D)  zeros in the removed places
        dx = self.pos_embed.backward(dx)                         # (B, N, D)
        return self.patch_embed.backward(dx)                     # (B, H, W, C)

    def forward_loss(self, imgs, pred):
        """(loss, dpred): the mean squared error on the patches the last forward removed (loss.masked_mse),
        against imgs' own pixels, normalised per patch when config.norm_pix_loss."""
        return masked_mse(pred, self.patchify(imgs), self.mask, self.config.norm_pix_loss)

    def __call__(self, imgs, noise=None):
        return self.forward(imgs, noise)

    # ---- the model's bookkeeping, as the ViT's ----------------------------------------------------

    check_input = ViT.check_input
    state_dict = ViT.state_dict
    load_state_dict = ViT.load_state_dict
    set_matmul_dtype = ViT.set_matmul_dtype

    def num_params(self):
        return sum(int(p.size) for p in self.params.values())

    @property
    def backend(self):
        return backend_of(self.params["decoder_pred.weight"])

    def to(self, backend):
        super().to(backend)
        self.decoder_pos_embed = asarray(self.decoder_pos_embed, backend=backend)   # no parameter: moved by hand
        return self

    def encoder_state_dict(self):
        """The encoder's parameters (host NumPy copies), under the ViT's names: see finetune_vit."""
        return encoder_state_dict(self.state_dict())

    def extra_repr(self):
        c = self.config
        return (f"img_size={c.img_size}, patch_size={c.patch_size}, embed_dim={c.embed_dim}, depth={c.depth}, "
                f"decoder_embed_dim={c.decoder_embed_dim}, decoder_depth={c.decoder_depth}, "
                f"mask_ratio={c.mask_ratio}, norm_pix_loss={c.norm_pix_loss}, dtype={self.dtype!r}, "
                f"params={self.num_params():,}")


DECODER_NAMES = ("mask_token", "decoder_")


def encoder_state_dict(state):
    """An MAE state dict's encoder part: every entry but mask_token and decoder_*. Its names are those of
    ViT(config.encoder_config(K)) less the head (patch_embed, cls_token, blocks, norm)."""
    return {k: v for k, v in state.items() if not k.startswith(DECODER_NAMES)}


def finetune_vit(config, state, num_classes, seed=0, dtype="float32"):
    """A ViT for fine-tuning: the MAE encoder's weights (state: an MAE state dict, or its encoder part) and a
    new zero-initialised head of num_classes (as the ViT paper fine-tunes, §3.1)."""
    if not isinstance(config, MAEConfig):
        raise TypeError(f"config must be the MAE's MAEConfig, got {type(config).__name__}")
    model = ViT(config.encoder_config(num_classes), seed=seed, dtype=dtype)
    encoder = encoder_state_dict(state)
    expected = set(model.params) - {"head.weight", "head.bias"}
    if set(encoder) != expected:
        raise ValueError(f"not an MAE encoder of this config: missing {sorted(expected - set(encoder))}, "
                         f"unexpected {sorted(set(encoder) - expected)}")
    head = {k: model.params[k] * 0 for k in ("head.weight", "head.bias")}
    return model.load_state_dict({**encoder, **head})


def create_mae(seed=0, dtype="float32", **fields):
    """An MAE of MAEConfig(**fields): create_mae(img_size=28, patch_size=4, in_chans=1, embed_dim=32, ...)."""
    return MAE(dataclasses.replace(MAEConfig(), **fields), seed=seed, dtype=dtype)
