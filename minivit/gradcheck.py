"""Check a backward pass against central differences, in float64.

    report = minivit.gradcheck(layer, x)   # any object with forward(x) and backward(dout)
    print(report)                          # relative error per input and per parameter
    report.assert_ok()                     # raises with the table if any error is above tol

The scalar checked is f = sum(forward(x) * dout) for a fixed random upstream gradient dout, so that
every output element counts (a dout of ones would hide errors that cancel). For each checked element
of the input and of every parameter,

    numeric = (f(theta + eps) - f(theta - eps)) / (2 eps)       (error O(eps^2))

and the relative error of a whole array is ||analytic - numeric|| / (||analytic|| + ||numeric||):
about 1e-10 for a right backward in float64, 1e-2 or worse for a wrong one.
"""

from .backend import asarray, backend_of, get_array_module, host_rng, is_array, to_numpy
from .layers import Dropout, Layer


class GradcheckReport:
    """Rows of (name, relative error, elements checked, elements total); ``ok`` when all are below tol.
    ``samples[name]`` = (flat indices checked, analytic values, numeric values, the array's shape), as host
    NumPy arrays: what minivit.check reads to say what is wrong with a gradient."""

    def __init__(self, rows, tol, samples=None):
        self.rows, self.tol = rows, tol
        self.samples = {} if samples is None else samples

    @property
    def worst(self):
        return max(r[1] for r in self.rows) if self.rows else 0.0

    @property
    def ok(self):
        return self.worst <= self.tol

    def errors(self):
        """{name: relative error}."""
        return {name: err for name, err, _, _ in self.rows}

    def __str__(self):
        width = max([len("name")] + [len(r[0]) for r in self.rows])
        lines = [f"{'name':<{width}}  {'rel. error':>10}  {'checked':>13}  status"]
        for name, err, checked, total in self.rows:
            status = "ok" if err <= self.tol else "WRONG"
            lines.append(f"{name:<{width}}  {err:10.2e}  {f'{checked}/{total}':>13}  {status}")
        verdict = "all gradients agree" if self.ok else "some gradients are WRONG"
        lines.append(f"worst {self.worst:.2e} (tol {self.tol:.0e}): {verdict}")
        return "\n".join(lines)

    __repr__ = __str__

    def assert_ok(self):
        if not self.ok:
            raise AssertionError("gradient check failed:\n" + str(self))
        return self


def _relative_error(a, n):
    diff = float(((a - n) ** 2).sum()) ** 0.5
    scale = float((a ** 2).sum()) ** 0.5 + float((n ** 2).sum()) ** 0.5
    return 0.0 if scale == 0.0 else diff / scale


def _stochastic_parts(layer):
    """Dropout layers with p > 0 anywhere inside ``layer`` (they make forward random); none inside an
    object that is not a minivit Layer."""
    parts = layer.sublayers() if isinstance(layer, Layer) else []
    return [sub for sub in parts if isinstance(sub, Dropout) and sub.p > 0]


def gradcheck(layer, x, dout=None, eps=1e-5, tol=1e-6, max_checks=200, seed=0, check_input=True, verbose=False,
              names=None):
    """Compare layer.backward with central differences of layer.forward, per input and per parameter.

    layer: an object with forward(x) -> out and backward(dout) -> dx; if it has ``params``/``grads``
        dicts (every minivit layer and the ViT do), each parameter is checked too.
    x: the float64 input, e.g. (B, N, D) for a block or (B, H, W, C) for the model.
    dout: the upstream gradient, out's shape (default: random normal, seeded).
    eps: the finite-difference step; tol: the largest relative error accepted.
    max_checks: at most this many randomly chosen elements are checked per array (None: all).
    names: check only these parameters (default: all).
    Returns a GradcheckReport; ``print`` it, or call ``.assert_ok()``.
    """
    if not is_array(x):
        raise TypeError(f"gradcheck needs x as a numpy or cupy array, got {type(x).__name__}")
    params = getattr(layer, "params", {})
    grads = getattr(layer, "grads", {})
    low = [f"x ({x.dtype})"] if x.dtype != "float64" else []
    low += [f"{k} ({p.dtype})" for k, p in params.items() if p.dtype != "float64"]
    if low:
        raise TypeError("gradcheck needs float64 (float32 rounding swamps the finite differences); got "
                        + ", ".join(low) + ". Build the layer/model with dtype='float64' and use x.astype('float64').")
    if names is not None and set(names) - set(params):
        raise ValueError(f"names {sorted(set(names) - set(params))} are not parameters of this layer; "
                         f"it has {list(params)}")
    random_parts = _stochastic_parts(layer)
    if random_parts:
        raise ValueError(f"gradcheck needs a deterministic forward, but {len(random_parts)} dropout/drop-path "
                         f"layer(s) have p > 0; check with the rates set to 0")
    if hasattr(layer, "train"):
        layer.train()
    xp = get_array_module(x)
    rng = host_rng(seed)
    x = x.copy()

    # the analytic gradients
    if hasattr(layer, "zero_grad"):
        layer.zero_grad()
    out = layer.forward(x)
    if dout is None:
        dout = asarray(rng.standard_normal(out.shape), dtype="float64", backend=backend_of(x))
    elif tuple(dout.shape) != tuple(out.shape):
        raise ValueError(f"dout must have the output's shape {tuple(out.shape)}, got {tuple(dout.shape)}")
    dx = layer.backward(dout)
    analytic = {k: grads[k].copy() for k in params}

    def f():  # the scalar whose gradient backward computes
        return float((layer.forward(x) * dout).sum())

    def numeric_at(array, flat_index):
        flat = array.reshape(-1)  # a view: parameters and our copy of x are contiguous
        old = float(flat[flat_index])
        flat[flat_index] = old + eps
        f_plus = f()
        flat[flat_index] = old - eps
        f_minus = f()
        flat[flat_index] = old
        return (f_plus - f_minus) / (2 * eps)

    def check(name, array, grad):
        size = int(array.size)
        if max_checks is None or size <= max_checks:
            chosen = range(size)
        else:
            chosen = sorted(rng.choice(size, max_checks, replace=False).tolist())
        chosen = list(chosen)
        a = to_numpy(grad).reshape(-1)[chosen]
        n = to_numpy(xp.asarray([numeric_at(array, i) for i in chosen]) if chosen else xp.zeros(0))
        rows.append((name, _relative_error(a, n), len(chosen), size))
        samples[name] = (chosen, a, n, tuple(array.shape))

    rows, samples = [], {}
    if check_input:
        if dx is None or tuple(dx.shape) != tuple(x.shape):
            raise ValueError(f"backward must return dx of the input's shape {tuple(x.shape)}, "
                             f"got {None if dx is None else tuple(dx.shape)}")
        check("input", x, dx)
    for name, p in params.items():
        if names is None or name in names:
            check(name, p, analytic[name])
    report = GradcheckReport(rows, tol, samples)
    if verbose:
        print(report)
    return report


class PairLayer:
    """A forward/backward pair of functions as a layer that gradcheck can check, inputs other than x
    taken as parameters:

        forward(x, *params) -> (out, cache)
        backward(dout, cache) -> dx, or (dx, dparam_1, ...) in the order of ``params``

    e.g. PairLayer(F.layernorm_forward, F.layernorm_backward, {"weight": w, "bias": b}). Give functions that
    look the pair up when called (``lambda x: F.softmax_forward(x)``) to check the pair as it stands then."""

    def __init__(self, forward, backward, params=None):
        self.forward_fn, self.backward_fn = forward, backward
        self.params = dict(params or {})
        self.grads = {name: p * 0 for name, p in self.params.items()}
        self.cache = None

    def forward(self, x):
        out, self.cache = self.forward_fn(x, *self.params.values())
        return out

    def backward(self, dout):
        if not self.params:
            return self.backward_fn(dout, self.cache)
        dx, *dparams = self.backward_fn(dout, self.cache)
        if len(dparams) != len(self.grads):
            raise ValueError(f"backward must return dx and {len(self.grads)} parameter gradients "
                             f"({', '.join(self.grads)}), got {1 + len(dparams)} arrays")
        for g, d in zip(self.grads.values(), dparams):
            g[...] = d
        return dx
