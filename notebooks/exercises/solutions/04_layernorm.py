"""Solution to notebooks/exercises/04_layernorm.ipynb. Try the exercise first: the check cell says what is
wrong with your version, which teaches more than reading these lines."""

import numpy as np  # noqa: F401  (the notebook's names, so that this file runs on its own)


def layernorm_backward(dout, cache):
    xhat, rstd, weight = cache
    D = xhat.shape[-1]
    dweight = (dout * xhat).reshape(-1, D).sum(0)             # (D,): every token of every image uses weight
    dbias = dout.reshape(-1, D).sum(0)                        # (D,)
    dxhat = dout * weight                                     # (..., D)
    dx = rstd * (dxhat                                        # term 1: the direct path
                 - dxhat.mean(-1, keepdims=True)              # term 2: through the mean
                 - xhat * (dxhat * xhat).mean(-1, keepdims=True))  # term 3: through the variance
    return dx, dweight, dbias
