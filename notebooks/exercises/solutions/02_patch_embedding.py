"""Solutions to notebooks/exercises/02_patch_embedding.ipynb. Try the exercise first: the check cell says
what is wrong with your version, which teaches more than reading these lines."""

import numpy as np  # noqa: F401  (the notebook's names, so that this file runs on its own)


def patch2im(patches, patch_size, img_size):
    B, N, PPC = patches.shape
    H, W = img_size
    P = patch_size
    gh, gw = H // P, W // P                                   # the patch grid
    C = PPC // (P * P)
    x = patches.reshape(B, gh, gw, P, P, C)                   # (B, gh, gw, P, P, C): im2patch's last reshape undone
    x = x.transpose(0, 1, 3, 2, 4, 5)                         # (B, gh, P, gw, P, C): the same swap undoes itself
    return x.reshape(B, H, W, C)                              # (B, H, W, C)


def linear_backward(dout, cache):
    x2, weight = cache
    d_in, d_out = weight.shape
    dout2 = dout.reshape(-1, d_out)                           # (rows, out): every token of every image a row
    dx = dout2 @ weight.T                                     # (rows, in)
    dweight = x2.T @ dout2                                    # (in, out): summed over all rows by the product
    dbias = dout2.sum(0)                                      # (out,)
    return dx.reshape(*dout.shape[:-1], d_in), dweight, dbias
