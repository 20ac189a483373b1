"""MAE's token shuffling (He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022):
keep a random 25% of the patch tokens for the encoder, and put mask tokens back in their places for the
decoder. Both are pure moves of rows, so their backwards are moves back:

    random_masking    x (B, N, D) -> x_masked (B, L, D)    gather the kept rows;  backward: scatter into zeros
    unshuffle         (B, 1+L, Dd) -> (B, 1+N, Dd)         append N-L mask tokens, gather with ids_restore;
                                                           backward: scatter back, the mask tokens' rows summed

Glossary (with functional.py's): L = len_keep, the visible tokens; Dd the decoder's width.
Names as in MAE's models_mae.py: noise, ids_shuffle, ids_restore, ids_keep, len_keep, mask (1 = removed).
"""

from ..backend import get_array_module
from ..layers import Layer


def len_keep_of(num_patches, mask_ratio):
    """L = int(N (1 - mask_ratio)), as MAE: 64 patches at 0.75 keep 16."""
    return int(num_patches * (1 - mask_ratio))


def random_masking_forward(x, noise, len_keep):
    """Per-sample random masking by sorting noise: the len_keep patches with the smallest noise stay.
    x: (B, N, D); noise: (B, N) floats (uniform in [0, 1) in training; given by tests to fix the mask).
    Returns x_masked (B, L, D), mask (B, N) in x's dtype (0 kept, 1 removed, in the patches' original
    order), ids_restore (B, N) int (where each original patch sits in the shuffled order), and the cache."""
    xp = get_array_module(x)
    B, N, D = x.shape
    ids_shuffle = xp.argsort(noise, axis=1)                   # (B, N): ascending, small noise is kept
    ids_restore = xp.argsort(ids_shuffle, axis=1)             # (B, N): the inverse permutation
    ids_keep = ids_shuffle[:, :len_keep]                      # (B, L)
    b = xp.arange(B)[:, None]                                 # (B, 1): row b picks from image b
    x_masked = x[b, ids_keep]                                 # (B, L, D)
    mask = xp.ones((B, N), dtype=x.dtype)                     # (B, N) in shuffled order: L zeros, then ones
    mask[:, :len_keep] = 0
    mask = mask[b, ids_restore]                               # (B, N) back in the original order
    return x_masked, mask, ids_restore, (ids_keep, N)


def random_masking_backward(dx_masked, cache):
    """dx_masked: (B, L, D). The gather sent row ids_keep[b, j] of x to row j; its gradient goes back
    there, and the removed rows, which reached nothing, get zeros. Returns dx (B, N, D)."""
    ids_keep, N = cache
    xp = get_array_module(dx_masked)
    B, L, D = dx_masked.shape
    dx = xp.zeros((B, N, D), dtype=dx_masked.dtype)           # (B, N, D): removed patches get no gradient
    dx[xp.arange(B)[:, None], ids_keep] = dx_masked           # scatter: ids_keep holds no index twice
    return dx


def unshuffle_forward(x, mask_token, ids_restore):
    """The decoder's full set of tokens: the class token, then each patch's encoded token where it was kept
    and the shared mask token where it was removed, in the original patch order.
    x: (B, 1+L, Dd), the class token first; mask_token: (1, 1, Dd); ids_restore: (B, N).
    Returns out (B, 1+N, Dd) and the cache."""
    xp = get_array_module(x)
    B, T, Dd = x.shape
    N = ids_restore.shape[1]
    L = T - 1
    tokens = xp.concatenate([x[:, 1:], xp.broadcast_to(mask_token, (B, N - L, Dd))], axis=1)  # (B, N, Dd) shuffled
    tokens = tokens[xp.arange(B)[:, None], ids_restore]      # (B, N, Dd) in the original order
    return xp.concatenate([x[:, :1], tokens], axis=1), (ids_restore, L)   # (B, 1+N, Dd)


def unshuffle_backward(dout, cache):
    """dout: (B, 1+N, Dd). Undo the gather (scatter with ids_restore, a permutation), then split: the first
    L rows are the kept tokens', the N-L others all came from the one mask token, so they are summed.
    Returns dx (B, 1+L, Dd) and dmask_token (1, 1, Dd)."""
    ids_restore, L = cache
    xp = get_array_module(dout)
    B, T, Dd = dout.shape
    dtokens = xp.zeros((B, T - 1, Dd), dtype=dout.dtype)                 # (B, N, Dd) in shuffled order
    dtokens[xp.arange(B)[:, None], ids_restore] = dout[:, 1:]            # row ids_restore[b, n] came from n
    dx = xp.concatenate([dout[:, :1], dtokens[:, :L]], axis=1)           # (B, 1+L, Dd)
    dmask_token = dtokens[:, L:].sum(axis=(0, 1)).reshape(1, 1, Dd)      # (1, 1, Dd): used N-L times per image
    return dx, dmask_token


class RandomMasking(Layer):
    """Keep a random (1 - mask_ratio) of the tokens: forward(x, noise) (B, N, D) -> (B, L, D). No
    parameters. After forward, ``mask`` (B, N) and ``ids_restore`` (B, N) are the decoder's (and the loss's)
    to read, kept in eval mode too: they are outputs, not a cache."""

    def __init__(self, mask_ratio):
        super().__init__()
        if not isinstance(mask_ratio, (int, float)) or isinstance(mask_ratio, bool) or not 0 <= mask_ratio < 1:
            raise ValueError(f"mask_ratio must be a number in [0, 1), got {mask_ratio!r}")
        self.mask_ratio = mask_ratio
        self.mask = self.ids_restore = None

    def forward(self, x, noise):                                 # (B, N, D), (B, N)
        if tuple(noise.shape) != tuple(x.shape[:2]):
            raise ValueError(f"noise must be (B, N) = {tuple(x.shape[:2])}, one value per patch, "
                             f"got {tuple(noise.shape)}")
        len_keep = len_keep_of(x.shape[1], self.mask_ratio)
        x_masked, self.mask, self.ids_restore, cache = random_masking_forward(x, noise, len_keep)
        self.cache = cache if self.training else None
        return x_masked                                          # (B, L, D)

    def backward(self, dout):                                    # (B, L, D)
        return random_masking_backward(dout, self._need_cache())  # (B, N, D)

    def extra_repr(self):
        return f"mask_ratio={self.mask_ratio}"
