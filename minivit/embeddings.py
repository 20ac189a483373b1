"""How an image becomes tokens: the layers before the blocks, and the token tables.

PatchEmbed cuts the image into patches and projects each (paper Eq. 1, first part); PosEmbed prepends the
class token (and any registers) and adds the learned position embeddings (Eq. 1, second part);
GridPosEmbed holds the other position embeddings of the paper's Appendix D.4 (learned 2-D, fixed 2-D
sin-cos, none); resize_pos_embed fits a table to another patch grid (a checkpoint at another resolution);
Embedding looks up token ids (CLIP's text tower). The convolutional stem, ConvStem, is in conv.py.
They keep the layer contract of layers.py (``params``, ``grads``, ``forward``, ``backward`` that adds
into ``grads``) and are built on its Layer and Linear.
"""

from . import functional as F
from .backend import asarray, backend_module, get_array_module, host_rng
from .layers import Layer, Linear, trunc_normal, zeros


class PatchEmbed(Layer):
    """Paper Eq. 1, first part: cut the image into P x P patches and project each to D dims:
    (B, H, W, C) -> im2patch -> (B, N, P*P*C) -> x_p E -> (B, N, D). Equal to a convolution with
    kernel = stride = P (tests/test_layers.py shows it)."""

    def __init__(self, img_size, patch_size, in_chans, embed_dim, bias=True, rng=None, dtype="float32"):
        super().__init__()
        self.img_size, self.patch_size, self.in_chans = tuple(img_size), patch_size, in_chans
        self.proj = Linear(patch_size * patch_size * in_chans, embed_dim, bias=bias, rng=rng, dtype=dtype)

    def forward(self, x):                                    # (B, H, W, C)
        patches = F.im2patch(x, self.patch_size)             # (B, N, P*P*C)
        return self.proj.forward(patches)                    # (B, N, D)

    def backward(self, dout):                                # (B, N, D)
        dpatches = self.proj.backward(dout)                  # (B, N, P*P*C)
        return F.patch2im(dpatches, self.patch_size, self.img_size)  # (B, H, W, C)


def prepend_tokens_forward(x, cls_token, reg_token):
    """z = [x_class; reg_1 .. reg_nr; x]: the learned prefix tokens, the same for every image, put before
    the patch tokens in timm's order. x: (B, N, D); cls_token (1, 1, D) or None; reg_token (1, nr, D) or
    None (no registers). Returns z (B, T + N, D), T = 1 + nr prefix tokens (nr without the class token)."""
    xp = get_array_module(x)
    B, _, D = x.shape
    prefix = [xp.broadcast_to(t, (B, t.shape[1], D)) for t in (cls_token, reg_token) if t is not None]
    z = xp.concatenate(prefix + [x], axis=1) if prefix else x    # (B, T + N, D)
    return z, (cls_token is not None, 0 if reg_token is None else reg_token.shape[1])


def prepend_tokens_backward(dz, cache):
    """dz: (B, T + N, D). Each prefix token is one vector shared by the B images, so its gradient is its
    rows of dz summed over the batch; the rest of dz is the patch tokens'. Returns dx (B, N, D),
    dcls_token (1, 1, D) or None, dreg_token (1, nr, D) or None."""
    has_cls, nr = cache
    T = int(has_cls) + nr
    dcls_token = dz[:, :1].sum(0, keepdims=True) if has_cls else None                   # (1, 1, D)
    dreg_token = dz[:, T - nr:T].sum(0, keepdims=True) if nr else None                   # (1, nr, D)
    return dz[:, T:], dcls_token, dreg_token                                             # (B, N, D)


class PosEmbed(Layer):
    """Paper Eq. 1, second part: prepend the learned class token, add learned 1-D position embeddings.
    (B, N, D) -> (B, N+1, D); with class_token=False (GAP models) (B, N, D) -> (B, N, D).

    num_registers=nr puts nr learned register tokens (Darcet et al., "Vision Transformers Need Registers",
    ICLR 2024) after the class token, timm's layout: reg_token (1, nr, D), the sequence
    [x_class; reg_1 .. reg_nr; x_p^1 E .. x_p^N E] (B, 1+nr+N, D), and E_pos with a row for every one of
    them (1, 1+nr+N, D), as timm's default no_embed_class=False. Nothing reads the registers' outputs:
    they are scratch space for the attention (Pool drops them)."""

    def __init__(self, num_patches, embed_dim, class_token=True, rng=None, dtype="float32", num_registers=0):
        super().__init__()
        rng = host_rng(0) if rng is None else rng
        self.class_token, self.num_registers = class_token, num_registers
        seq_len = (1 if class_token else 0) + num_registers + num_patches
        if class_token:
            self.params["cls_token"] = trunc_normal(rng, (1, 1, embed_dim), 1e-6, dtype)  # (1, 1, D), as timm
            self.grads["cls_token"] = zeros((1, 1, embed_dim), dtype)
        if num_registers:
            reg = rng.standard_normal((1, num_registers, embed_dim)) * 1e-6     # N(0, 1e-6^2): timm's normal_
            self.params["reg_token"] = asarray(reg, dtype=dtype)                   # (1, nr, D)
            self.grads["reg_token"] = zeros((1, num_registers, embed_dim), dtype)
        self.params["pos_embed"] = trunc_normal(rng, (1, seq_len, embed_dim), 0.02, dtype)  # (1, 1+nr+N, D)
        self.grads["pos_embed"] = zeros((1, seq_len, embed_dim), dtype)

    def forward(self, x):                                        # (B, N, D)
        cls_token = self.params["cls_token"] if self.class_token else None      # (1, 1, D)
        reg_token = self.params["reg_token"] if self.num_registers else None    # (1, nr, D)
        z, cache = prepend_tokens_forward(x, cls_token, reg_token)
        self.cache = cache if self.training else None
        return z + self.params["pos_embed"]                      # (B, 1+nr+N, D)

    def backward(self, dout):                                    # (B, 1+nr+N, D)
        cache = self._need_cache()
        self.grads["pos_embed"] += dout.sum(0, keepdims=True)    # (1, 1+nr+N, D): added to every sample
        dx, dcls_token, dreg_token = prepend_tokens_backward(dout, cache)
        if dcls_token is not None:
            self.grads["cls_token"] += dcls_token                # (1, 1, D)
        if dreg_token is not None:
            self.grads["reg_token"] += dreg_token                # (1, nr, D)
        return dx                                                # (B, N, D): the patch tokens' part


def resize_pos_embed(pos_embed, old_grid, new_grid, num_prefix_tokens=1):
    """Position embeddings for another patch grid (paper §3.2): the patch part, seen as a
    (gh, gw, D) image, is resized by bilinear interpolation with corners aligned (the JAX release's
    scipy.ndimage.zoom(order=1); timm's own loader uses align_corners=False instead); the first
    num_prefix_tokens rows (the class token's) are kept as they are.

    pos_embed: (1, T + gh*gw, D), T = num_prefix_tokens; old_grid (gh, gw), new_grid (gh', gw').
    Returns (1, T + gh'*gw', D), in pos_embed's dtype, on its device; computed in float64.
    ViT.resize_pos_embed and minivit.convert (loading a checkpoint for another size) use it.
    """
    xp = get_array_module(pos_embed)
    (gh, gw), (nh_, nw) = tuple(old_grid), tuple(new_grid)
    T = num_prefix_tokens
    if pos_embed.ndim != 3 or pos_embed.shape[0] != 1 or pos_embed.shape[1] != T + gh * gw:
        raise ValueError(f"pos_embed must be (1, {T} + {gh}*{gw}, D) for grid {(gh, gw)} with {T} prefix "
                         f"token(s), got {tuple(pos_embed.shape)}")
    if min(gh, gw, nh_, nw) < 1:
        raise ValueError(f"grids must be at least 1x1, got {old_grid} -> {new_grid}")
    D = pos_embed.shape[2]
    prefix = pos_embed[:, :T]                                           # (1, T, D): kept as is
    grid = pos_embed[0, T:].reshape(gh, gw, D).astype("float64")        # (gh, gw, D)
    grid = _linear_resize(grid, nh_, axis=0)                            # (gh', gw, D)
    grid = _linear_resize(grid, nw, axis=1)                             # (gh', gw', D)
    grid = grid.reshape(1, nh_ * nw, D).astype(pos_embed.dtype)         # (1, gh'*gw', D)
    return xp.concatenate([prefix, grid], axis=1)                       # (1, T + gh'*gw', D)


def _linear_resize(a, n_new, axis):
    """Linear interpolation of a along axis to n_new samples, the first and last samples kept
    (corners aligned): new sample j sits at old position j (n_old - 1) / (n_new - 1)."""
    xp = get_array_module(a)
    n_old = a.shape[axis]
    pos = xp.linspace(0.0, n_old - 1, n_new)                   # where each new sample sits, in old units
    lo = xp.minimum(xp.floor(pos).astype(int), n_old - 1)
    hi = xp.minimum(lo + 1, n_old - 1)
    w = (pos - lo).reshape([-1 if i == axis else 1 for i in range(a.ndim)])   # broadcast along axis
    return (1.0 - w) * xp.take(a, lo, axis=axis) + w * xp.take(a, hi, axis=axis)


POS_EMBED_KINDS = ("learned", "learned2d", "sincos2d", "none")  # PosEmbed: "learned"; GridPosEmbed: the rest


def check_pos_embed(kind, embed_dim):
    """The position-embedding rules, for GridPosEmbed and for ViTConfig.pos_embed: a known kind, and a
    width that the 2-D kinds can split (learned2d: D/2 per axis; sincos2d: sin and cos per axis, D/4 each)."""
    if kind not in POS_EMBED_KINDS:
        raise ValueError(f"pos_embed must be one of {POS_EMBED_KINDS}, got {kind!r}")
    if kind == "learned2d" and embed_dim % 2:
        raise ValueError(f"pos_embed='learned2d' needs an even embed_dim (D/2 for rows, D/2 for columns), "
                         f"got embed_dim={embed_dim}")
    if kind == "sincos2d" and embed_dim % 4:
        raise ValueError(f"pos_embed='sincos2d' needs embed_dim divisible by 4 (sin and cos of rows and "
                         f"columns), got embed_dim={embed_dim}")


def sincos2d_table(grid_size, embed_dim, temperature=10000.0, dtype="float32"):
    """The fixed 2-D sin-cos position embeddings of MAE (and big_vision), (1, gh*gw, D). The patch in row r,
    column c gets, with D/4 frequencies w_k = 1 / temperature^(k / (D/4)), k = 0 ... D/4 - 1:
        [sin(c w), cos(c w), sin(r w), cos(r w)]      (the column's half first, as in MAE's code)
    Patches in row-major order, as im2patch. (big_vision divides k by D/4 - 1 instead: a detail.)"""
    xp = backend_module()
    gh, gw = grid_size
    D4 = embed_dim // 4
    omega = 1.0 / temperature ** (xp.arange(D4, dtype="float64") / D4)            # (D/4,)
    rows, cols = xp.meshgrid(xp.arange(gh, dtype="float64"), xp.arange(gw, dtype="float64"),
                             indexing="ij")                                      # (gh, gw) each
    c = cols.reshape(-1, 1) * omega                                              # (N, D/4)
    r = rows.reshape(-1, 1) * omega                                              # (N, D/4)
    table = xp.concatenate([xp.sin(c), xp.cos(c), xp.sin(r), xp.cos(r)], axis=1)  # (N, D)
    return table[None].astype(dtype)                                             # (1, N, D)


class GridPosEmbed(Layer):
    """The other position embeddings of the paper's Appendix D.4 (Table 8), beside PosEmbed's learned 1-D one:
      "learned2d": two learned tables, pos_embed_row (1, gh, D/2) and pos_embed_col (1, gw, D/2); the patch
                   in row r, column c gets their concatenation [row_r | col_c] (D/2 + D/2 = D values).
      "sincos2d":  fixed 2-D sin-cos (sincos2d_table): no parameters, nothing to learn.
      "none":      no position information: the model sees a bag of patches.
    The class token, if any, is prepended after the embeddings are added and gets none of its own: it is
    itself a learned vector, so x_class + e_class would just be another learned x_class (MAE gives it a
    row of zeros too). (B, N, D) -> (B, N+1, D) with class_token=True, else (B, N, D).
    num_registers=nr register tokens (as PosEmbed's, reg_token (1, nr, D)) follow the class token and get
    no position embedding either: [x_class; reg_1 .. reg_nr; patches], timm's no_embed_class=True."""

    def __init__(self, grid_size, embed_dim, kind, class_token=True, rng=None, dtype="float32", num_registers=0):
        super().__init__()
        if kind == "learned":
            raise ValueError("GridPosEmbed makes the grid kinds (learned2d, sincos2d, none); the learned 1-D "
                             "table is PosEmbed")
        check_pos_embed(kind, embed_dim)
        rng = host_rng(0) if rng is None else rng
        gh, gw = grid_size
        self.grid_size, self.embed_dim, self.kind, self.class_token = (gh, gw), embed_dim, kind, class_token
        self.num_registers = num_registers
        if class_token:
            self.params["cls_token"] = trunc_normal(rng, (1, 1, embed_dim), 1e-6, dtype)     # (1, 1, D), as PosEmbed
            self.grads["cls_token"] = zeros((1, 1, embed_dim), dtype)
        if num_registers:
            reg = rng.standard_normal((1, num_registers, embed_dim)) * 1e-6               # as PosEmbed's
            self.params["reg_token"] = asarray(reg, dtype=dtype)                            # (1, nr, D)
            self.grads["reg_token"] = zeros((1, num_registers, embed_dim), dtype)
        if kind == "learned2d":
            half = embed_dim // 2
            self.params["pos_embed_row"] = trunc_normal(rng, (1, gh, half), 0.02, dtype)     # (1, gh, D/2)
            self.params["pos_embed_col"] = trunc_normal(rng, (1, gw, half), 0.02, dtype)     # (1, gw, D/2)
            self.grads["pos_embed_row"] = zeros((1, gh, half), dtype)
            self.grads["pos_embed_col"] = zeros((1, gw, half), dtype)
        self.table = sincos2d_table((gh, gw), embed_dim, dtype=dtype) if kind == "sincos2d" else None  # (1, N, D)

    def pos_table(self):
        """The (1, N, D) embeddings added to the patch tokens; None for "none"."""
        if self.kind != "learned2d":
            return self.table
        xp = get_array_module(self.params["pos_embed_row"])
        (gh, gw), half = self.grid_size, self.embed_dim // 2
        row = xp.broadcast_to(self.params["pos_embed_row"].reshape(gh, 1, half), (gh, gw, half))  # (gh, gw, D/2)
        col = xp.broadcast_to(self.params["pos_embed_col"].reshape(1, gw, half), (gh, gw, half))  # (gh, gw, D/2)
        return xp.concatenate([row, col], axis=-1).reshape(1, gh * gw, self.embed_dim)             # (1, N, D)

    def forward(self, x):                                        # (B, N, D)
        pos = self.pos_table()                                   # (1, N, D) or None
        if pos is not None:
            x = x + pos                                          # (B, N, D)
        cls_token = self.params["cls_token"] if self.class_token else None      # (1, 1, D)
        reg_token = self.params["reg_token"] if self.num_registers else None    # (1, nr, D)
        z, cache = prepend_tokens_forward(x, cls_token, reg_token)
        self.cache = cache if self.training else None
        return z                                                 # (B, 1+nr+N, D), or without the 1: GAP

    def backward(self, dout):                                    # (B, 1+nr+N, D)
        dout, dcls_token, dreg_token = prepend_tokens_backward(dout, self._need_cache())  # (B, N, D)
        if dcls_token is not None:
            self.grads["cls_token"] += dcls_token                # (1, 1, D)
        if dreg_token is not None:
            self.grads["reg_token"] += dreg_token                # (1, nr, D)
        if self.kind == "learned2d":
            (gh, gw), half = self.grid_size, self.embed_dim // 2
            dpos = dout.sum(0).reshape(gh, gw, self.embed_dim)   # (gh, gw, D): added to every sample
            self.grads["pos_embed_row"] += dpos[:, :, :half].sum(1)[None]  # (1, gh, D/2): row r sits in gw patches
            self.grads["pos_embed_col"] += dpos[:, :, half:].sum(0)[None]  # (1, gw, D/2): column c in gh patches
        return dout                                              # (B, N, D)

    def to(self, backend):
        super().to(backend)
        if self.table is not None:                               # the fixed table is no parameter: move it too
            self.table = asarray(self.table, backend=backend)
        return self

    def extra_repr(self):
        regs = f", num_registers={self.num_registers}" if self.num_registers else ""
        return f"{self.kind!r}, grid={self.grid_size}, class_token={self.class_token}{regs}"


class Embedding(Layer):
    """A lookup table: token ids (B, N) -> their rows of weight (V, D), (B, N, D). backward fills the
    weight's gradient and returns None: integer ids have no gradient."""

    def __init__(self, num_embeddings, dim, rng=None, dtype="float32", std=0.02):
        super().__init__()
        rng = host_rng(0) if rng is None else rng
        self.num_embeddings, self.dim = num_embeddings, dim
        self.params["weight"] = trunc_normal(rng, (num_embeddings, dim), std, dtype)   # (V, D)
        self.grads["weight"] = zeros((num_embeddings, dim), dtype)

    def forward(self, ids):                                  # (B, N) int -> (B, N, D)
        out, cache = F.embedding_forward(ids, self.params["weight"])
        self.cache = cache if self.training else None
        return out

    def backward(self, dout):                                # (B, N, D)
        self.grads["weight"] += F.embedding_backward(dout, self._need_cache())
        return None

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.dim}"
