"""Mixed precision, the fast paths' float16 room: float16 matrix products, float32 for everything else,
and dynamic loss scaling.

The recipe of Micikevicius et al., "Mixed Precision Training" (ICLR 2018), which PyTorch's autocast and
GradScaler also follow. What changes:

- ``model.set_matmul_dtype("float16")``: every Linear layer rounds its input and its weight to float16
  for the product (kernels.linear_forward, the twin of functional.linear_forward that ops.py checks at
  float16's tolerance), and its backward products run in float16 too. The Linear
  layers do almost all of a ViT's arithmetic (ViT-B/16: 96% of the FLOPs; attention's own N x N products
  the rest), and a GPU's tensor cores multiply float16 many times faster than float32. The sums inside
  each product are kept in float32 (cuBLAS does so, and so does NumPy's float16 loop), and the caches
  hold the float16 copies: half the bytes.
- What stays float32: the parameters ("master weights": an update of 1e-4 relative vanishes when added to
  a float16 weight, whose values near 1 are 1e-3 apart), the gradients, the optimizer, LayerNorm, GELU,
  softmax, attention's products and the loss.
- Why the loss is scaled: float16 holds magnitudes from 6e-8 (6.1e-5 at full precision) to 65504. Many
  gradients of a network's activations are smaller than that, and would round to zero in the float16
  backward products. So dL/dlogits is multiplied by S (2^16 to start) before the backward, which shifts
  every gradient up into float16's range, and the parameter gradients are divided by S before the step.
  S is a power of two, so both multiplications are exact. When S is too large some product overflows to
  inf: then that step is skipped and S halved. After ``growth_interval`` good steps in a row S doubles,
  so it stays near the largest value that does not overflow.

One step, as minivit.train runs it with ``--precision float16``:

    scaler = LossScaler()
    logits = model.forward(x)
    loss, dlogits = cross_entropy(logits, y)
    model.zero_grad(); model.backward(scaler.scale(dlogits))    # every gradient times S
    finite = scaler.unscale(model)                              # gradients / S; False if one is inf/nan
    if finite:
        optimizer.step()                                        # else: skip this step's update
    scaler.update(finite)                                       # S / 2 after an overflow, S * 2 after a run

bfloat16 (float32's range, fewer digits: no loss scaling needed) is not offered: neither NumPy nor CuPy
has the dtype. On NumPy float16 products run without BLAS, hundreds of times slower than float32: this
path pays on the GPU, and runs on the CPU for the tests and the lessons.
"""

import math
import numbers

from ..backend import get_array_module


class LossScaler:
    """Dynamic loss scaling for float16 training (see the module docstring).

    init_scale: S at the start (2^16, as PyTorch). growth_factor / backoff_factor: S is multiplied by
    these after growth_interval finite steps in a row / after a step with an inf or nan gradient.
    min_scale: if S would fall below it, the gradients are not finite even when barely scaled, which is
    divergence, not float16's range: update raises FloatingPointError instead of halving on forever."""

    def __init__(self, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 min_scale=2.0 ** -24):
        self.scale_value = _positive("init_scale", init_scale)
        self.growth_factor = _positive("growth_factor", growth_factor, above=1.0)
        self.backoff_factor = _positive("backoff_factor", backoff_factor)
        if self.backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if (isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral)
                or growth_interval < 1):
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        self.growth_interval = int(growth_interval)
        self.min_scale = _positive("min_scale", min_scale)
        self.good_steps = 0        # finite steps in a row since S last changed
        self.skipped_steps = 0     # steps skipped for an overflow, over the whole run

    def scale(self, dlogits):
        """dL/dlogits (B, K) times S: the gradient to pass to model.backward."""
        return dlogits * dlogits.dtype.type(self.scale_value)

    def unscale(self, model):
        """Divide every gradient in model.grads by S, in place, when all are finite. Returns whether they
        are, as a boolean where the gradients are (numpy.bool_ on the CPU, a 0-d CuPy array on the GPU,
        so the host does not wait for the GPU here: the trainer reads it with the step's loss, in one
        transfer). When one is not finite, none is changed: the step is skipped and zero_grad clears them."""
        grads = list(model.grads.values())
        if not grads:
            return True
        xp = get_array_module(*grads)
        finite = xp.stack([xp.isfinite(g).all() for g in grads]).all()   # 0-d, on the gradients' device
        inv = xp.where(finite, 1.0 / self.scale_value, 1.0)            # 1 / S, or 1: nothing changes
        for g in grads:
            g *= inv.astype(g.dtype)
        return finite

    def update(self, finite):
        """After a step: halve S if its gradients overflowed (finite=False), double it after a run of
        growth_interval finite steps. Returns the new S."""
        if finite:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0
            return self.scale_value
        self.skipped_steps += 1
        self.good_steps = 0
        new = self.scale_value * self.backoff_factor
        if new < self.min_scale:
            raise FloatingPointError(f"the gradients are inf or nan even with the loss scale at "
                                     f"{self.scale_value:.3g}: the model diverged (try a lower learning rate or "
                                     "gradient clipping)")
        self.scale_value = new
        return new

    def state_dict(self):
        """JSON-able: what a checkpoint needs to resume with the same S."""
        return {"scale": self.scale_value, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale}

    def load_state_dict(self, d):
        missing = {"scale", "good_steps", "skipped_steps"} - set(d)
        if missing:
            raise ValueError(f"a LossScaler state needs {sorted(missing)}, got keys {sorted(d)}")
        self.scale_value = _positive("scale", d["scale"])
        self.good_steps, self.skipped_steps = int(d["good_steps"]), int(d["skipped_steps"])
        for key in ("growth_factor", "backoff_factor", "growth_interval", "min_scale"):
            if key in d:
                setattr(self, key, type(getattr(self, key))(d[key]))

    def __repr__(self):
        return (f"LossScaler(scale={self.scale_value:g}, good_steps={self.good_steps}, "
                f"skipped_steps={self.skipped_steps})")


def _positive(name, value, above=0.0):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= above:
        raise ValueError(f"{name} must be a finite number > {above:g}, got {value!r}")
    return float(value)
