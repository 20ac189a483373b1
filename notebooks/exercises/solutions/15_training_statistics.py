"""Solutions to notebooks/exercises/15_training_statistics.ipynb. Try the exercises first: the check cells say what
is wrong with your version, which teaches more than reading these lines."""

import math

import numpy as np


def attention_entropy(a):
    B, nh, N, _ = a.shape
    H = -(a * np.log(np.maximum(a, 1e-30))).sum(-1)             # (B, nh, N): each row's entropy, 0 ln 0 taken as 0
    return float(H.mean() / math.log(N))                        # 1: uniform rows, 0: one-hot rows


def update_ratio(before, after):
    size = np.linalg.norm(before)                               # ||theta||, all entries
    if size == 0:
        return None                                             # a zero parameter (a bias at initialisation)
    return float(np.linalg.norm(after - before) / size)         # the norm of the difference, not a difference of norms
