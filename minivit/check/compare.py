"""The comparisons every check of minivit.check is made of: a forward against the expected array, a
functional pair against its fast kernel, every gradient against central differences; and the textbook
forwards, composed by hand from the functional pairs, that say what each layer class should compute."""

import math
import traceback
from pathlib import Path

import numpy as np

from .. import functional as F
from ..fast import kernels
from .. import layers as L
from ..backend import asarray, backend_of, get_array_module, host_rng, to_numpy
from ..gradcheck import gradcheck
from .report import DIFFERS, FIT, TOL_GRAD, TOL_KERNEL, TOL_SAME, Row, _rel, diagnose

# --------------------------------------------------------------------------------------------------
# The comparisons every op is made of
# --------------------------------------------------------------------------------------------------


TOKENS = ("B", "N", "D")     # the axes of a batch of token sequences, (B, N, D)


def _random(rng, shape, scale=1.0, shift=0.0):
    return asarray(rng.standard_normal(shape) * scale + shift, dtype="float64")


def _randomise(layer, rng, scale=0.5):
    """Parameters moved off their initial values (a LayerNorm gamma of 1 hides a forgotten gamma, lesson 4)."""
    for p in layer.params.values():
        p[...] += asarray(rng.standard_normal(p.shape) * scale, dtype=p.dtype, backend=backend_of(p))
    return layer


def _forward_row(op, what, got, expected, axes=None, factors=None, tol=TOL_SAME, why="differs"):
    got, expected = to_numpy(got), to_numpy(expected)
    if got.shape != expected.shape:
        return Row(op, what, math.inf, tol, f"shape {got.shape}, expected {expected.shape}")
    row = Row(op, what, _rel(got, expected), tol, got=got, expected=expected)
    if not row.ok:
        row.note = diagnose(got, expected, axes, factors=factors) or why
    return row


def _have_kernels(x, numba=True):
    return backend_of(x) == "cupy" or kernels.HAVE_NUMBA or not numba


def _kernel_rows(op, pair, inputs, forward, backward, axes=None, factors=None, seed=1, numba=True):
    """functional.<pair> (float64) against kernels.<pair> (float32 copies of the inputs), forward and backward.
    forward(module, *inputs) -> (out, cache); backward(module, dout, cache) -> {gradient name: array}.
    numba=False: the kernel is plain NumPy (linear's), there even without Numba."""
    if not _have_kernels(inputs[0], numba):
        return [Row(op, f"kernels.{pair}_*", math.nan, TOL_KERNEL, "Numba is not installed here", skipped=True)]
    out64, cache64 = forward(F, *inputs)
    dout = _random(host_rng(seed), out64.shape)
    grads64 = backward(F, dout, cache64)
    f32 = [a.astype("float32") if getattr(a, "dtype", None) == "float64" else a for a in inputs]
    out32, cache32 = forward(kernels, *f32)
    grads32 = backward(kernels, dout.astype("float32"), cache32)
    rows = []
    for what, got, expected, name in [(f"forward vs kernels.{pair}_forward, float32", out64, out32, "forward")] + \
            [(f"{g} vs kernels.{pair}_backward, float32", grads64[g], grads32[g], g) for g in grads64]:
        got, expected = to_numpy(got), to_numpy(expected).astype(np.float64)
        row = Row(op, what, _rel(got, expected), TOL_KERNEL, got=got, expected=expected)
        row.kernel_of = name
        if not row.ok:
            why = diagnose(got, expected, (axes or {}).get(name), factors=factors)
            row.note = (f"functional.{pair}_{'forward' if name == 'forward' else 'backward'} differs from the fast "
                        f"kernel{': ' + why if why else ''}. (New math on purpose? Then this is expected: "
                        "check.run(..., use_kernels=False) in Python, --no-kernels on the command line, "
                        "leaves these rows out)")
        rows.append(row)
    return rows


def _gradient_rows(op, layer, x, axes=None, refs=None, factors=None, max_checks=None, split_input=None, seed=2,
                   check_input=True, alternatives=None):
    """One row per input and parameter gradient of layer at x, against central differences (float64).
    axes: {row name: axis names}; refs: {row name: {label: array}}; split_input(array) -> {name: part}
    shows the input gradient in named parts (attention's dq, dk, dv); alternatives(dout) -> {row name:
    [(array, what it means)]}: a likely wrong formula, named when the gradient equals it."""
    axes, refs = axes or {}, refs or {}
    rng = host_rng(seed)
    if hasattr(layer, "train"):
        layer.train()
    dout = _random(rng, layer.forward(x).shape)
    report = gradcheck(layer, x, dout=dout, tol=TOL_GRAD, max_checks=max_checks, seed=seed, check_input=check_input)
    rows = []
    for name, err, checked, total in report.rows:
        _, a, n, shape = report.samples[name]
        full = checked == total
        label = "dx" if name == "input" else "d" + name
        if full:
            a, n = a.reshape(shape), n.reshape(shape)
        parts = [(label, a, n)]
        if name == "input" and split_input is not None and full:
            pa, pn = split_input(a), split_input(n)
            parts = [(k, pa[k], pn[k]) for k in pa]
        for what, pa, pn in parts:
            row = Row(op, what, _rel(pa, pn), TOL_GRAD, got=pa, expected=pn, tensor=name)
            if not row.ok:
                row.note = diagnose(pa, pn, axes.get(what) if full else (), refs.get(what) if full else None,
                                    factors)
                for array, meaning in (alternatives(dout).get(what, []) if alternatives and full else []):
                    if _rel(pa, to_numpy(array)) <= FIT:
                        row.note = meaning
                if name != "input" and full and (not row.note or " only at " in row.note):
                    row.note = _one_sample(layer, x, dout, name, pa, max_checks, seed) or row.note
            rows.append(row)
    return rows


def _one_sample(layer, x, dout, name, got, max_checks, seed):
    """For a parameter gradient: is it one sample's gradient alone (the sum over the batch missing)?"""
    B = x.shape[0]
    if not 1 < B <= 4:
        return ""
    xp = get_array_module(x)
    for b in range(B):
        mask = xp.zeros((B,) + (1,) * (dout.ndim - 1), dtype=dout.dtype)
        mask[b] = 1
        report = gradcheck(layer, x, dout=dout * mask, tol=TOL_GRAD, max_checks=max_checks, seed=seed,
                           check_input=False, names=[name])
        numeric = report.samples[name][2].reshape(got.shape)
        if _rel(got, numeric) <= FIT:
            return f"sample {b}'s gradient alone: the sum over the batch (B = {B}) is missing"
    return ""


def _first_wrong_in_backward(rows):
    """For a layer made of layers: where the backward (run from the output back) first goes wrong."""
    params = [r for r in rows if r.tensor not in (None, "input")]
    wrong = [r for r in params if not r.ok]
    dx = [r for r in rows if r.tensor == "input"]
    if not wrong:
        return ("every parameter gradient is right and dx is not: the error enters after the last of them was "
                "computed (the first layer's dx, or a residual's identity path)") if dx and not dx[-1].ok else ""
    first = wrong[-1].tensor                                    # rows are in forward order
    if "." in first:
        layer = first.rsplit(".", 1)[0]
    else:                                                       # a top-level array: PosEmbed's, or the model's own
        layer = "the position embedding" if first in ("cls_token", "reg_token", "pos_embed") else "the model"
    hint = (f"the backward, run from the output back, first goes wrong at d{first}: look in {layer}'s backward "
            f"and in what hands it its dout (the layer after it in the forward, or a residual adding into it)")
    if first.startswith("qkv."):
        hint += "; in layers.Attention, qkv's dout comes from functional.attention_backward (the 'attention' rows)"
    if first.startswith("attn.") or ".attn." in first:
        hint += ("; in a Block, attn's dout is dx1 = dout + norm2.backward(mlp.backward(dout)): is the residual's "
                 "`dout +` there, and is norm2's dx right (the 'layernorm' rows)?")
    return hint


class _Stages(L.Layer):
    """Layers run one after another (the model's last stages, for the "head" check)."""

    def __init__(self, stages):
        super().__init__()
        for name, layer in stages:
            self.add(name, layer)

    def forward(self, x):
        for layer in self.children.values():
            x = layer.forward(x)
        return x

    def backward(self, dout):
        for layer in reversed(list(self.children.values())):
            dout = layer.backward(dout)
        return dout


def _sub(params, prefix):
    return {k[len(prefix):]: v for k, v in params.items() if k.startswith(prefix)}


# The forwards composed from the functional pairs, float64: what each layer class should compute.

def _linear(p, x):
    return F.linear_forward(x, p["weight"], p.get("bias"))[0]


def _mlp(p, x, gelu):
    return _linear(_sub(p, "fc2."), F.gelu_forward(_linear(_sub(p, "fc1."), x), gelu)[0])


def _attention(p, x, num_heads):
    return _linear(_sub(p, "proj."), F.attention_forward(_linear(_sub(p, "qkv."), x), num_heads)[0])


def _layernorm(p, x):
    return F.layernorm_forward(x, p["weight"], p["bias"], 1e-6)[0]


def _block(p, x, num_heads, gelu):
    x1 = x + _attention(_sub(p, "attn."), _layernorm(_sub(p, "norm1."), x), num_heads)   # Eq. 2
    return x1 + _mlp(_sub(p, "mlp."), _layernorm(_sub(p, "norm2."), x1), gelu)          # Eq. 3


def _pos_embed(p, x):
    xp = get_array_module(x)
    B, _, D = x.shape
    cls = xp.broadcast_to(p["cls_token"], (B, 1, D))
    return xp.concatenate([cls, x], axis=1) + p["pos_embed"]


def _vit(model, x):
    c, p = model.config, model.params
    tokens = _linear(_sub(p, "patch_embed.proj."), F.im2patch(x, c.patch_size))          # Eq. 1
    tokens = _pos_embed(p, tokens)
    for i in range(c.depth):
        tokens = _block(_sub(p, f"blocks.{i}."), tokens, c.num_heads, c.gelu)
    return _linear(_sub(p, "head."), _layernorm(_sub(p, "norm."), tokens)[:, 0])           # Eq. 4


def _textbook_differs(op, err):
    """A "differs" row where minivit.check's own textbook code raised on a layer class whose arrays are not the
    textbook's (a LayerNorm made an RMSNorm: KeyError 'bias'); None where the error came from the layer's
    code or functional.py (a student's bug, reported as raised)."""
    if not isinstance(err, (KeyError, AttributeError, IndexError)):
        return None
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not (f.filename.endswith("layers.py") and f.name in ("__getitem__", "_locate"))]
    if not frames or Path(frames[-1].filename).parent != Path(__file__).parent:     # not minivit/check/'s own
        return None
    return Row(op, "forward vs textbook", math.nan, TOL_SAME,
               f"forward differs from the textbook {op} (its class's arrays are not the textbook's: "
               f"{type(err).__name__} {err}): checked by numerical gradients only, in the model walk "
               "(python -m minivit.check with no NAME, or check.run_model(model))", status=DIFFERS)


def _raised(op, err):
    frame = traceback.extract_tb(err.__traceback__)[-1]
    where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
    return Row(op, f"raised {type(err).__name__}", math.inf, 0.0, f"{err} ({where})")
