"""Solutions to notebooks/exercises/19_random_masking.ipynb. Try the exercises first: the check cells say what
is wrong with your version, which teaches more than reading these lines."""

import numpy as np


def random_masking_backward(dx_masked, cache):
    ids_keep, N = cache
    B, L, D = dx_masked.shape
    dx = np.zeros((B, N, D))                                     # removed patches reached nothing: zero
    dx[np.arange(B)[:, None], ids_keep] = dx_masked              # each kept row's gradient back where it came from
    return dx


def masked_mse_backward(cache):
    diff, mask = cache
    weight = mask / mask.sum()                                   # (B, N): each removed patch's share of the mean
    return 2 * diff / diff.shape[-1] * weight[..., None]         # zero on the kept patches
