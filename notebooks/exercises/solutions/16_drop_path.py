"""Solutions to notebooks/exercises/16_drop_path.ipynb. Try the exercises first: the check cells say what
is wrong with your version, which teaches more than reading these lines."""


def drop_path_forward(self, x):
    if not self.training or self.p == 0.0:      # eval mode: the identity
        self.cache = None
        return x
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)                  # (B, 1, 1): one number per sample
    keep = self.rng.random(shape) >= self.p                      # True with probability 1 - p
    self.cache = (keep / (1.0 - self.p)).astype(x.dtype)        # 0 or 1/(1-p), broadcast over N and D
    return x * self.cache


def drop_path_backward(self, dout):
    if self.p == 0.0 or not self.training:      # eval mode: the identity
        return dout
    return dout * self.cache                                     # the forward's mask and scale, not a new draw
