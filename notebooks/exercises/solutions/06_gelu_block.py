"""Solutions to notebooks/exercises/06_gelu_block.ipynb. Try the exercises first: the check cells say what
is wrong with your version, which teaches more than reading these lines."""

import math

import numpy as np
from scipy.special import erf


def gelu_backward(dout, cache):
    x, approximate = cache
    if approximate == "erf":
        cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))           # Phi(x)
        pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)  # phi(x)
        return dout * (cdf + x * pdf)
    u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    du = math.sqrt(2.0 / math.pi) * (1.0 + 3 * 0.044715 * x * x)
    return dout * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)


def block_backward(self, dout):
    # out = x1 + drop_path2(mlp(norm2(x1))): the residual passes dout straight through, plus the branch
    dx1 = dout + self.norm2.backward(self.mlp.backward(self.drop_path2.backward(dout)))
    # x1 = x + drop_path1(attn(norm1(x)))
    return dx1 + self.norm1.backward(self.attn.backward(self.drop_path1.backward(dx1)))
