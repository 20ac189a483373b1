"""Solutions to notebooks/exercises/07_loss_adamw.ipynb. Try the exercises first: the check cells say what
is wrong with your version, which teaches more than reading these lines."""

import math

import numpy as np


def cross_entropy_backward(cache):
    logp, q = cache
    B = logp.shape[0]
    return (np.exp(logp) - q) / B                             # (softmax - q) / B: each row of q sums to 1


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    if weight_decay != 0:
        p *= 1 - lr * weight_decay                            # decoupled decay, first
    m *= beta1
    m += (1 - beta1) * g                                      # m_t
    v *= beta2
    v += (1 - beta2) * (g * g)                                # v_t
    denom = np.sqrt(v) / math.sqrt(1 - beta2 ** step) + eps   # sqrt(v_t / (1 - b2^t)) + eps
    p -= (lr / (1 - beta1 ** step)) * (m / denom)             # lr m_hat / denom
