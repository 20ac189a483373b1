"""The distilled ViT of DeiT (Touvron et al., ICML 2021, "Training data-efficient image transformers &
distillation through attention"): the ViT of minivit/model.py with a second learned token and a second head.

    image (B, H, W, C)
      -> patch_embed    x_p E                                          (B, N, D)
      -> pos_embed      [x_class; x_dist; x_p E] + E_pos               (B, 2+N, D)   E_pos has N + 2 rows
      -> blocks, norm   as the ViT's                                   (B, 2+N, D)
      -> head           z^0 (the class token)        -> W_head         (B, K)        learns the labels
      -> head_dist      z^1 (the distillation token) -> W_head_dist    (B, K)        learns the teacher
    training (distilled_training=True):  (logits, logits_dist), for the loss of minivit/deit/loss.py
    otherwise (inference, and the check):  (logits + logits_dist) / 2

The distillation token is a learned vector like the class token. Nothing in the blocks tells the two apart;
only the loss does: the class head is pulled towards the label, the distillation head towards the teacher.
Names and the forward are timm's VisionTransformerDistilled (``dist_token``, ``head_dist``, a ``pos_embed``
over both tokens and the patches; its ``distilled_training`` flag).

Everything but the two new pieces is the ViT's own: DistilledViT builds a ViT, then puts DistTokenEmbed in
PosEmbed's place and head_dist beside the head (the class token's pool is not needed: the heads read
tokens 0 and 1 themselves). The stages are the ViT's up to the final norm; forward and backward add the heads.
"""

from ..backend import get_array_module, host_rng, is_array
from ..embeddings import prepend_tokens_backward, prepend_tokens_forward
from ..layers import Layer, Linear, trunc_normal, zeros
from ..model import ViT, ViTConfig


def check_distilled_config(config):
    """A ViTConfig that DistilledViT can build: the class token, the learned 1-D table, no registers, no
    representation layer (timm's VisionTransformerDistilled has none of them either)."""
    if not isinstance(config, ViTConfig):
        raise TypeError(f"config must be a ViTConfig, got {type(config).__name__}")
    wrong = {"pool": ("cls", "the heads read the class token"),
             "pos_embed": ("learned", "E_pos has a row for each of the two tokens"),
             "num_registers": (0, "the distillation token sits where a register would"),
             "representation_size": (None, "the two heads read the tokens directly")}
    for name, (expected, why) in wrong.items():
        if getattr(config, name) != expected:
            raise ValueError(f"a DistilledViT needs {name}={expected!r} ({why}), got {name}={getattr(config, name)!r}")


class DistTokenEmbed(Layer):
    """Prepend the class and distillation tokens, add the learned position embeddings (DeiT's Eq. 1):
        z_0 = [x_class; x_dist; x_p^1 E; ...; x_p^N E] + E_pos          E_pos: (1, N+2, D)
    (B, N, D) -> (B, N+2, D). The two tokens are learned vectors shared by every image, so each one's
    gradient is its row of dz summed over the batch (embeddings.prepend_tokens_backward)."""

    def __init__(self, num_patches, embed_dim, rng=None, dtype="float32"):
        super().__init__()
        rng = host_rng(0) if rng is None else rng
        D = embed_dim
        self.params["cls_token"] = trunc_normal(rng, (1, 1, D), 1e-6, dtype)     # (1, 1, D), as PosEmbed's
        self.params["dist_token"] = trunc_normal(rng, (1, 1, D), 0.02, dtype)    # (1, 1, D), timm: std .02
        self.params["pos_embed"] = trunc_normal(rng, (1, num_patches + 2, D), 0.02, dtype)  # (1, N+2, D)
        for name, p in self.params.items():
            self.grads[name] = zeros(p.shape, dtype)

    def forward(self, x):                                        # (B, N, D)
        p = self.params
        z, cache = prepend_tokens_forward(x, p["cls_token"], p["dist_token"])   # (B, 2+N, D): class, dist, patches
        self.cache = cache if self.training else None
        return z + p["pos_embed"]                                # (B, 2+N, D)

    def backward(self, dout):                                    # (B, 2+N, D)
        cache = self._need_cache()
        self.grads["pos_embed"] += dout.sum(0, keepdims=True)    # (1, 2+N, D): added to every image
        dx, dcls_token, ddist_token = prepend_tokens_backward(dout, cache)
        self.grads["cls_token"] += dcls_token                    # (1, 1, D): row 0, summed over the batch
        self.grads["dist_token"] += ddist_token                  # (1, 1, D): row 1, summed over the batch
        return dx                                                # (B, N, D): the patch tokens' part


class DistilledViT(ViT):
    """DeiT's distilled ViT. ``forward(x)`` maps images (B, H, W, C) to logits (B, K), the mean of the two
    heads; with ``distilled_training = True`` and in training mode, to the pair (logits, logits_dist).
    ``backward`` takes what forward returned the gradient of: dlogits (B, K), or the pair
    (dlogits, dlogits_dist). Everything else (params, state_dict, the optimizers, minivit.check) is the ViT's."""

    def __init__(self, config, seed=0, dtype="float32"):
        check_distilled_config(config)
        super().__init__(config, seed=seed, dtype=dtype)
        c = config
        rng = host_rng([seed, 2021])                 # the new parts' own stream: the ViT's weights are kept
        self.pos_embed = self.add("", DistTokenEmbed(c.num_patches, c.embed_dim, rng=rng, dtype=dtype))
        self.pool = None                             # the heads read tokens 0 and 1 themselves
        self.head_dist = Linear(c.embed_dim, c.num_classes, rng=rng, dtype=dtype)   # W_head_dist (D, K)
        self.distilled_training = False              # timm's flag: True while training with a teacher

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """DistilledViT.from_pretrained(path, num_classes=None, ...): a timm DeiT distilled checkpoint, or a
        minivit one written by --distill (minivit/deit/weights.py; imported when called: it sits above)."""
        from .weights import from_pretrained    # at call time: weights imports this module
        return from_pretrained(path, **kwargs)

    def stages(self):
        """The ViT's stages up to the final norm: (B, H, W, C) -> (B, 2+N, D). The heads follow in forward."""
        return [(name, layer) for name, layer in super().stages() if name not in ("pool", "head")]

    def forward(self, x):
        """x: float images (B, H, W, C). Returns (logits + logits_dist) / 2 (B, K), or the pair in distilled
        training."""
        z = super().forward(x)                       # (B, 2+N, D): Classifier.forward runs the stages above
        self.tokens_shape = z.shape if self.training else None
        logits = self.head.forward(z[:, 0])          # (B, K): the class token's head
        logits_dist = self.head_dist.forward(z[:, 1])   # (B, K): the distillation token's head
        if self.distilled_training and self.training:
            return logits, logits_dist
        return (logits + logits_dist) / 2            # (B, K): timm's inference, the two heads' mean

    def backward(self, dlogits):
        """dlogits: (B, K), the gradient of the mean (each head gets half of it), or the pair (dlogits,
        dlogits_dist) of distilled training. Returns dx (B, H, W, C)."""
        K, B = self.config.num_classes, getattr(self, "batch_size", None)
        pair = dlogits if isinstance(dlogits, tuple) else (dlogits / 2, dlogits / 2) if is_array(dlogits) else None
        if pair is None or len(pair) != 2 or not all(is_array(d) and d.shape == (B, K) for d in pair):
            raise ValueError(f"backward takes dlogits ({B}, {K}) or the pair (dlogits, dlogits_dist), each ({B}, {K}), "
                             f"the gradient of the last forward's output; got {_shapes(dlogits)}")
        dlogits_cls, dlogits_dist = pair
        xp = get_array_module(dlogits_cls)
        dz = xp.zeros(self.tokens_shape, dtype=dlogits_cls.dtype)   # (B, 2+N, D): patch tokens read by no head
        dz[:, 0] = self.head.backward(dlogits_cls)                  # (B, D)
        dz[:, 1] = self.head_dist.backward(dlogits_dist)            # (B, D)
        for _, layer in reversed(self.stages()):
            dz = layer.backward(dz)
        return dz                                                   # (B, H, W, C)

    def resize_pos_embed(self, img_size):
        raise NotImplementedError("DistilledViT.resize_pos_embed is not written: ViT.resize_pos_embed keeps one "
                                  "prefix token's row, this model has two (class and distillation)")

    def extra_repr(self):
        return super().extra_repr() + f", distilled_training={self.distilled_training}"


def _shapes(value):
    if isinstance(value, tuple):
        return "(" + ", ".join(_shapes(v) for v in value) + ")"
    return str(tuple(value.shape)) if is_array(value) else type(value).__name__
