"""python -m minivit.check [NAME ...]: the one command to run after you edit a layer.

For each op (or only the named ones) it checks, on small random inputs:
  forward    the layer class as it stands against the functional pairs composed by hand (float64), and
             the functional pair against its fast kernel in minivit/fast/kernels.py where there is one: an
             independent second implementation, float32, so compared on float32 copies at float32 tolerance;
  gradients  every input and parameter gradient against central differences (minivit.gradcheck, float64);
and prints a table (op, what was compared, relative error, ok / WRONG), exiting 1 on any WRONG. A WRONG row
says which tensor, and where a simple diagnosis fits, what is wrong with it: off by a constant factor
("x0.5"), the wrong sign, two heads swapped or axes transposed, an error that is the same along the
normalised axis (a missing mean term), zero where it should not be, one sample's gradient where the sum
over the batch belongs.

Everything is looked up when the check runs: the functions on their modules (an edited or monkeypatched
functional.layernorm_backward is what is checked) and the layers built from their classes as they stand
(an edited layers.Block.backward too). From Python or a notebook:

    from minivit import check
    report = check.run(["layernorm", "attention"])
    print(report); report.ok; report.wrong()          # rows: .op, .what, .error, .note, .got, .expected
    with check.replaced(F, "gelu_backward", my_gelu_backward):   # yours in place of minivit's, then restored
        print(check.run(["gelu"]).verdict())

The model walk (run with no NAME, with --clip, with --model FILE.py:FUNC, or check.run_model(model)) checks
a model as its classes stand, so a layer check.py has never seen needs no reference: one float64 forward in
training mode records each layer's input (its forward wrapped, then restored), and every layer is checked
on its own input by central differences, children before parents (depth first, post-order). A layer called
with more than its input (an attention mask) is checked with the rest held fixed; one whose backward
returns several gradients (CLIP's similarity) is "not checked: takes N inputs". Rows are named by the
layer's path ("blocks.1.attn") and the tensor ("dgamma"; "blocks.1.gamma" in the summary). A layer with a
WRONG layer inside is "skipped: fix <path> first"; one whose layers are right but which is wrong is WRONG
under its own path. The textbook compositions below (_layernorm, _attention, _block ...) serve diagnosis
only: a layer of their class that no longer computes them is "differs" ("forward differs from the textbook
<op>: checked by numerical gradients only"), never WRONG.

    report = check.run_model(model)                   # a copy of model, float64; x: a batch of 3 images
"""

import argparse
import contextlib
import copy
import importlib.util
import inspect
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

from . import functional as F
from .fast import kernels
from . import layers as L
from .augment import normalize
from .backend import asarray, backend_of, get_array_module, host_rng, is_array, to_numpy
from .data import make_shapes
from .gradcheck import PairLayer, gradcheck
from .model import ViT, ViTConfig
from .optim import SGD, AdamW

TOL_SAME = 1e-10    # two float64 computations of the same math (they differ by rounding, ~1e-16)
TOL_KERNEL = 1e-4   # a float32 kernel against the float64 pair: ~1e-7 when right, 1e-2 and up when not
TOL_GRAD = 1e-6     # float64 central differences: ~1e-9 for a right backward, 1e-2 and up for a wrong one
FIT = 1e-5          # a diagnosis is given only when, with it, the two arrays agree to this


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


class Row:
    """One comparison: ``op``, ``what`` ("forward ...", or the gradient's name "dx", "dweight"), ``error``
    (relative, ||a - b|| / (||a|| + ||b||)), ``tol``, ``note`` (the diagnosis of a WRONG row, or why a row
    was skipped), and the two arrays compared as host NumPy arrays (``got``, ``expected``) for a closer look."""

    def __init__(self, op, what, error, tol, note="", got=None, expected=None, skipped=False, tensor=None,
                 status=None):
        self.op, self.what, self.error, self.tol, self.note = op, what, float(error), tol, note
        self.got, self.expected, self.skipped = got, expected, skipped or status is not None
        self.tensor = tensor  # for a gradient row: "input" or the parameter's name; None for the others
        self._status = status  # a status other than ok/WRONG/skipped: "differs", "skipped: fix ... first"
        self.label = f"{op} {what}"   # how the summary line names it (a model walk: "blocks.1.gamma")

    @property
    def ok(self):
        return self.skipped or self.error <= self.tol  # a NaN error is not ok

    @property
    def status(self):
        if self._status:
            return self._status
        return "skipped" if self.skipped else ("ok" if self.ok else "WRONG")

    def __repr__(self):
        return f"Row({self.op!r}, {self.what!r}, {self.error:.2e}, {self.status})"


class Report:
    """The rows of a check, in order; ``ok`` when none is WRONG. ``print(report)`` shows the table (composite
    ops fold their right parameter gradients into one line; ``report.table(verbose=True)`` shows all)."""

    def __init__(self, rows, hints, seconds, fold_ok=False):
        self.rows, self.hints, self.seconds = rows, hints, seconds
        self.fold_ok = fold_ok   # a model walk: a layer whose rows are all ok is shown on one line

    @property
    def ok(self):
        return all(r.ok for r in self.rows)

    def wrong(self):
        """The WRONG rows."""
        return [r for r in self.rows if not r.ok]

    def row(self, op, what):
        """The row of one op and one comparison, e.g. report.row("attention", "dq")."""
        for r in self.rows:
            if r.op == op and r.what == what:
                return r
        raise KeyError(f"no row {what!r} for op {op!r}; it has {[r.what for r in self.rows if r.op == op]}")

    def table(self, verbose=False):
        ops = list(dict.fromkeys(r.op for r in self.rows))
        shown = []
        for op in ops:
            rows = [r for r in self.rows if r.op == op]
            if self.fold_ok and not verbose and all(r.status == "ok" for r in rows):
                grads = [r.what for r in rows if r.tensor is not None]
                what = ", ".join(grads[:3]) + (f" and {len(grads) - 3} more" if len(grads) > 3 else "")
                if len(rows) > len(grads):
                    what = "forward = textbook, " + what
                shown.append(Row(op, what, max(r.error for r in rows), max(r.tol for r in rows)))
                continue
            params = [r for r in rows if r.tensor not in (None, "input")]
            if verbose or len(params) <= 6:
                shown += rows
                continue
            wrong = [r for r in params if not r.ok]
            folded_wrong, folded_ok = wrong[:-2], [r for r in params if r.ok]   # the backward meets wrong[-1] first
            shown += [r for r in rows if r not in folded_wrong and r not in folded_ok]
            for folded, what in ((folded_wrong, "parameters before them in the forward"), (folded_ok, "parameters")):
                if folded:
                    worst = max(folded, key=lambda r: r.error)
                    shown.append(Row(op, f"d(the other {len(folded)} {what})", worst.error, worst.tol))
        wop = max([len("op")] + [len(r.op) for r in shown])
        wwhat = max([len("compared")] + [len(r.what) for r in shown])
        lines = [f"{'op':<{wop}}  {'compared':<{wwhat}}  {'rel. error':>10}  status"]
        previous = None
        for r in shown:
            op = r.op if r.op != previous else ""
            previous = r.op
            err = "" if r.skipped else f"{r.error:10.2e}"
            lines.append(f"{op:<{wop}}  {r.what:<{wwhat}}  {err:>10}  {r.status}")
            if r.note and (not r.ok or r.skipped):
                lines.append(f"{'':<{wop}}    -> {r.note}")
            last_of_op = r is [s for s in shown if s.op == r.op][-1]
            if last_of_op and r.op in self.hints:
                lines.append(f"{'':<{wop}}    => {self.hints[r.op]}")
        wrong = self.wrong()
        n_ops = len(ops)
        if wrong:
            names = ", ".join(r.label for r in wrong[:8]) + (" ..." if len(wrong) > 8 else "")
            lines.append(f"{len(wrong)} WRONG of {len(self.rows)} checks in {n_ops} ops ({self.seconds:.1f} s): {names}")
        else:
            lines.append(f"all {len(self.rows)} checks in {n_ops} ops ok ({self.seconds:.1f} s)")
        return "\n".join(lines)

    def verdict(self, hint=""):
        """For an exercise: RIGHT with the worst error, or WRONG with each wrong row, its diagnosis and the hint."""
        checked = [r for r in self.rows if not r.skipped]
        if self.ok and checked:
            worst = max(checked, key=lambda r: r.error)
            return (f"RIGHT: all {len(checked)} checks agree (worst relative error {worst.error:.1e}: "
                    f"{worst.op} {worst.what})")
        if self.ok:
            return "nothing was checked: every row was skipped"
        wrong = self.wrong()
        lines = [f"WRONG: {len(wrong)} of {len(self.rows)} checks disagree"]
        groups = {}                                   # rows sharing one note are listed on one line
        for r in wrong:
            groups.setdefault(r.note, []).append(r)
        for note, rs in list(groups.items())[:6]:
            names = ", ".join(r.label for r in rs[:4]) + (f" and {len(rs) - 4} more" if len(rs) > 4 else "")
            worst = max(r.error for r in rs)
            lines.append(f"  {names}: relative error {worst:.1e}" + (f"; {note}" if note else ""))
        if len(groups) > 6:
            lines.append(f"  ... and {len(groups) - 6} more (print the report for the table)")
        lines += [f"  {op_hint}" for op_hint in self.hints.values()]
        if hint:
            lines.append(f"Hint: {hint}")
        return "\n".join(lines)

    def __str__(self):
        return self.table()

    __repr__ = __str__


@contextlib.contextmanager
def replaced(owner, name, new):
    """Inside the with block, owner.name is new (a function on a module, a method on a class); restored on
    leaving, even after an error. For exercises and planted bugs:
        with replaced(F, "layernorm_backward", mine): print(run(["layernorm"]))"""
    if not hasattr(owner, name):
        raise AttributeError(f"{getattr(owner, '__name__', owner)!r} has no attribute {name!r} to replace")
    inherited = isinstance(owner, type) and name not in owner.__dict__
    old = getattr(owner, name) if not isinstance(owner, type) else owner.__dict__.get(name)
    setattr(owner, name, new)
    try:
        yield new
    finally:
        if inherited:
            delattr(owner, name)                     # it came from a base class: inherit it again
        else:
            setattr(owner, name, old)


# --------------------------------------------------------------------------------------------------
# What is wrong with an array: the diagnoses
# --------------------------------------------------------------------------------------------------


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.linalg.norm(a) + np.linalg.norm(b)
    return 0.0 if scale == 0 else float(np.linalg.norm(a - b) / scale)


def _indices(idx, size):
    idx = [int(i) for i in idx]
    shown = ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")
    return f"{shown} (of 0..{size - 1})"


def _factor(c, factors):
    text = f"x{c:.4g}"
    for symbol, value in factors.items():
        for v, name in ((value, symbol), (1 / value, f"1/{symbol}")):
            if abs(c - v) <= 1e-4 * abs(v):
                return f"{text} (= {name}, {symbol} = {value:g} here)" if symbol.isidentifier() else f"{text} (= {name})"
    return text


def diagnose(got, expected, axes=None, refs=None, factors=None):
    """The likeliest simple cause of ``got`` differing from ``expected`` (two arrays of one shape, or 1-D
    samples of them, where only the shape-free tests run), in words; "" when none fits.

    axes: a name per axis, e.g. ("B", "N", "D"), default "axis 0", ...; () for samples; refs: {name: array of got's shape} that the error may be
    proportional to along the last axis, row by row (e.g. LayerNorm's xhat); factors: {symbol: value} to name
    a constant factor by (e.g. {"B": 3}: "x0.3333 (= 1/B)")."""
    a, n = np.asarray(got, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    sampled = axes == ()
    axes = tuple(axes) if axes is not None else tuple(f"axis {i}" for i in range(a.ndim))
    refs, factors = refs or {}, factors or {}
    na, nn = np.linalg.norm(a), np.linalg.norm(n)
    if nn == 0 and na == 0:
        return ""
    if na <= 1e-12 * nn:
        return ("zero everywhere, where it should not be: never computed or never written (for a gradient: not "
                "added into grads, or handed a zero gradient)")
    if nn <= 1e-12 * na:
        return "should be zero everywhere (nothing depends on it here), and is not"
    c = float((a * n).sum() / (n * n).sum())
    if _rel(a, c * n) <= FIT:
        if abs(c + 1) <= 1e-4:
            return "the wrong sign (x-1)"
        if c < 0:
            return f"the wrong sign and off by a constant factor: {_factor(c, factors)}"
        return f"off by a constant factor: {_factor(c, factors)}"
    if sampled or a.ndim == 0 or a.shape != n.shape or len(axes) != a.ndim:
        return ""
    r = a - n
    for ax, name in enumerate(axes):                           # a permutation along one axis
        size = a.shape[ax]
        if not 1 < size <= 64:
            continue
        A, Nn = np.moveaxis(a, ax, 0).reshape(size, -1), np.moveaxis(n, ax, 0).reshape(size, -1)
        perm = ((A[:, None] - Nn[None]) ** 2).sum(-1).argmin(1)  # slice i of got is closest to slice perm[i]
        if sorted(perm.tolist()) == list(range(size)) and (perm != np.arange(size)).any() \
                and _rel(A, Nn[perm]) <= FIT:
            moved = [(i, int(j)) for i, j in enumerate(perm) if i != j]
            if len(moved) == 2:
                return f"{name} {moved[0][0]} and {name} {moved[0][1]} swapped"
            return f"permuted along {name}: " + ", ".join(f"{name} {i} holds {name} {j}'s" for i, j in moved[:4])
    for i in range(a.ndim):                                    # two axes transposed
        for j in range(i + 1, a.ndim):
            if a.shape[i] == a.shape[j] > 1 and _rel(a, np.swapaxes(n, i, j)) <= FIT:
                return f"{axes[i]} and {axes[j]} transposed"
    if _rel(np.sort(a, axis=None), np.sort(n, axis=None)) <= FIT:  # a layout bug: the values moved around
        return ("the right values in the wrong places: a reshape, transpose or index puts them out of order "
                "(is the backward's reshape the forward's, undone in reverse order?)")
    for ax, name in enumerate(axes):                           # an error that does not change along an axis
        if a.ndim > 1 and a.shape[ax] > 1 and _rel(r, np.broadcast_to(r.mean(ax, keepdims=True), r.shape)) <= FIT:
            return (f"the error is the same all along {name}: a term that does not change along {name}, "
                    f"like one through a mean over {name}, is missing or wrong")
    for label, z in refs.items():                              # an error proportional to a known array
        z = np.asarray(to_numpy(z), dtype=np.float64)
        alpha = (r * z).sum(-1, keepdims=True) / np.maximum((z * z).sum(-1, keepdims=True), 1e-300)
        if _rel(r, alpha * z) <= FIT:
            return (f"the error is proportional to {label} along {axes[-1]}, row by row: a term "
                    f"{label} * (one number per row) is missing or wrong")
    best = None                                                # the error confined to a few slices
    for ax, name in enumerate(axes):
        size = a.shape[ax]
        if size < 2:
            continue
        other = tuple(k for k in range(a.ndim) if k != ax)
        err = np.sqrt((r * r).sum(other))
        scale = np.sqrt((a * a).sum(other)) + np.sqrt((n * n).sum(other))
        bad = np.nonzero(err > FIT * np.maximum(scale, 1e-300))[0]
        if 0 < len(bad) < size and (best is None or len(bad) / size < best[0]):
            zero = not np.take(a, bad, ax).any()
            best = (len(bad) / size, name, bad, size, zero)
    if best:
        _, name, bad, size, zero = best
        return f"{'zero' if zero else 'wrong'} only at {name} = {_indices(bad, size)}" + \
            (", where it should not be" if zero else "; right elsewhere")
    return ""


# --------------------------------------------------------------------------------------------------
# The comparisons every op is made of
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# The ops: each returns its rows. Small shapes (B = 3 samples, so 1/B is not 0.5) keep the default set fast.
# --------------------------------------------------------------------------------------------------

B, N = 3, 5
TOKENS = ("B", "N", "D")


def check_patch_embed(rng, use_kernels):
    layer = _randomise(L.PatchEmbed((8, 12), 4, 3, 6, dtype="float64"), rng)
    x = _random(rng, (B, 8, 12, 3))                                             # (B, H, W, C)
    rows = [_forward_row("patch_embed", "forward: layers.PatchEmbed vs functional", layer.forward(x),
                         _linear(_sub(layer.params, "proj."), F.im2patch(x, 4)))]
    return rows + _gradient_rows("patch_embed", layer, x, factors={"B": B},
                                 axes={"dx": ("B", "H", "W", "C"), "dproj.weight": ("P*P*C", "D"),
                                       "dproj.bias": ("D",)})


def check_linear(rng, use_kernels):
    layer = _randomise(L.Linear(6, 6, dtype="float64"), rng)                   # square: a transposed dW shows
    x = _random(rng, (B, N, 6))
    rows = [_forward_row("linear", "forward: layers.Linear vs functional", layer.forward(x), _linear(layer.params, x))]
    if use_kernels:
        w, b = layer.params["weight"], layer.params["bias"]
        rows += _kernel_rows("linear", "linear", [x, w, b], lambda m, x, w, b: m.linear_forward(x, w, b),
                             lambda m, d, c: dict(zip(("dx", "dweight", "dbias"), m.linear_backward(d, c))),
                             axes={"forward": ("B", "N", "out"), "dx": ("B", "N", "in"), "dweight": ("in", "out")},
                             numba=False)
    return rows + _gradient_rows("linear", layer, x, factors={"B": B, "B*N": B * N},
                                 axes={"dx": ("B", "N", "in"), "dweight": ("in", "out"), "dbias": ("out",)})


def check_layernorm(rng, use_kernels):
    D = 8
    layer = L.LayerNorm(D, dtype="float64")
    layer.params["weight"][...] = _random(rng, D)                               # gamma far from 1
    layer.params["bias"][...] = _random(rng, D)
    x = _random(rng, (B, N, D), scale=2.0, shift=1.0)
    w, b = layer.params["weight"], layer.params["bias"]
    rows = [_forward_row("layernorm", "forward: layers.LayerNorm vs functional", layer.forward(x), _layernorm(layer.params, x))]
    if use_kernels:
        rows += _kernel_rows("layernorm", "layernorm", [x, w, b],
                             lambda m, x, w, b: m.layernorm_forward(x, w, b, 1e-6),
                             lambda m, d, c: dict(zip(("dx", "dweight", "dbias"), m.layernorm_backward(d, c))),
                             axes={"forward": TOKENS, "dx": TOKENS})
    xhat = (x - x.mean(-1, keepdims=True)) / (x.var(-1, keepdims=True) + 1e-6) ** 0.5    # for the diagnosis
    return rows + _gradient_rows("layernorm", layer, x, factors={"D": D, "B": B},
                                 axes={"dx": TOKENS, "dweight": ("D",), "dbias": ("D",)},
                                 refs={"dx": {"xhat": xhat}})


def _check_gelu(approximate, rng, use_kernels):
    op = f"gelu_{approximate}"
    layer = L.GELU(approximate)
    x = _random(rng, (B, N, 8), scale=2.0)
    rows = [_forward_row(op, "forward: layers.GELU vs functional", layer.forward(x),
                         F.gelu_forward(x, approximate)[0])]
    if use_kernels:
        rows += _kernel_rows(op, "gelu", [x], lambda m, x: m.gelu_forward(x, approximate),
                             lambda m, d, c: {"dx": m.gelu_backward(d, c)})
    return rows + _gradient_rows(op, layer, x, axes={"dx": TOKENS})


def check_gelu_erf(rng, use_kernels):
    return _check_gelu("erf", rng, use_kernels)


def check_gelu_tanh(rng, use_kernels):
    return _check_gelu("tanh", rng, use_kernels)


def check_softmax(rng, use_kernels):
    x = _random(rng, (B, 4, 7), scale=2.0)
    rows = []
    if use_kernels:
        rows += _kernel_rows("softmax", "softmax", [x], lambda m, x: m.softmax_forward(x),
                             lambda m, d, c: {"dx": m.softmax_backward(d, c)})
    pair = PairLayer(lambda x: F.softmax_forward(x), lambda dout, cache: F.softmax_backward(dout, cache))
    s = F.softmax_forward(x)[0]
    return rows + _gradient_rows("softmax", pair, x, axes={"dx": ("B", "row", "j")}, refs={"dx": {"s": s}})


NH, HS = 2, 16                                                                  # sqrt(hs) = 4: not 2 or 3
ATTENTION_FACTORS = {"sqrt(hs)": math.sqrt(HS), "B": B, "N": N}


def check_attention(rng, use_kernels):
    """The core softmax(q k^T / sqrt(hs)) v of functional.py, its input gradient shown as dq, dk, dv."""
    nh, hs = NH, HS
    D = nh * hs
    factors = ATTENTION_FACTORS
    qkv = _random(rng, (B, N, 3 * D))                                           # (B, N, 3D)
    heads = ("B", "N", "head", "hs")

    def split(dqkv):                                                            # (B, N, 3D) -> dq, dk, dv
        parts = to_numpy(dqkv).reshape(B, N, 3, nh, hs)
        return {"dq": parts[:, :, 0], "dk": parts[:, :, 1], "dv": parts[:, :, 2]}

    rows = []
    if use_kernels:
        rows += _kernel_rows("attention", "attention", [qkv, nh], lambda m, qkv, nh: m.attention_forward(qkv, nh),
                             lambda m, d, c: split(m.attention_backward(d, c)), factors=factors,
                             axes={"forward": ("B", "N", "D"), "dq": heads, "dk": heads, "dv": heads})
    core = PairLayer(lambda qkv: F.attention_forward(qkv, nh), lambda dout, cache: F.attention_backward(dout, cache))

    def alternatives(dout):                                                     # dv without P's transpose
        q, k, _ = (to_numpy(qkv).reshape(B, N, 3, nh, hs)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        scores = q @ k.swapaxes(-1, -2) / math.sqrt(hs)                         # (B, nh, N, N)
        P = np.exp(scores - scores.max(-1, keepdims=True))
        P /= P.sum(-1, keepdims=True)
        dctx = to_numpy(dout).reshape(B, N, nh, hs).transpose(0, 2, 1, 3)      # (B, nh, N, hs)
        return {"dv": [((P @ dctx).transpose(0, 2, 1, 3),
                        "dv = P @ dout: the transpose of P is missing. ctx = P v, so dv = P^T @ dout (row j of v "
                        "is read by every query i, weighted by P[i, j]), not P @ dout")]}

    return rows + _gradient_rows("attention", core, qkv, split_input=split, factors=factors,
                                 axes={"dq": heads, "dk": heads, "dv": heads}, alternatives=alternatives)


def check_attention_layer(rng, use_kernels):
    """layers.Attention: the packed qkv projection, the core, the output projection."""
    layer = _randomise(L.Attention(NH * HS, NH, dtype="float64"), rng, 0.2)
    x = _random(rng, (B, N, NH * HS))
    rows = [_forward_row("attention_layer", "forward: layers.Attention vs functional", layer.forward(x),
                         _attention(layer.params, x, NH))]
    return rows + _gradient_rows("attention_layer", layer, x, max_checks=40, factors=ATTENTION_FACTORS,
                                 axes={"dx": TOKENS, "dproj.weight": ("D", "D")})


def check_mlp(rng, use_kernels):
    layer = _randomise(L.MLP(8, 16, dtype="float64"), rng)
    x = _random(rng, (B, N, 8))
    rows = [_forward_row("mlp", "forward: layers.MLP vs functional", layer.forward(x), _mlp(layer.params, x, "erf"))]
    return rows + _gradient_rows("mlp", layer, x, max_checks=60, axes={"dx": TOKENS}, factors={"B": B})


def check_block(rng, use_kernels):
    layer = _randomise(L.Block(16, 2, mlp_ratio=2.0, dtype="float64"), rng, 0.3)
    x = _random(rng, (B, N, 16))
    rows = [_forward_row("block", "forward: layers.Block vs functional", layer.forward(x),
                         _block(layer.params, x, 2, "erf"))]
    return rows + _gradient_rows("block", layer, x, max_checks=30, axes={"dx": TOKENS}, factors={"B": B})


def check_pos_embed(rng, use_kernels):
    layer = _randomise(L.PosEmbed(6, 8, class_token=True, dtype="float64"), rng)
    x = _random(rng, (B, 6, 8))
    rows = [_forward_row("pos_embed", "forward: layers.PosEmbed vs functional", layer.forward(x), _pos_embed(layer.params, x))]
    return rows + _gradient_rows("pos_embed", layer, x, factors={"B": B},
                                 axes={"dx": TOKENS, "dcls_token": ("1", "1", "D"), "dpos_embed": ("1", "N+1", "D")})


def check_pool(rng, use_kernels):
    x = _random(rng, (B, N, 8))
    rows = []
    for mode, expected in (("cls", x[:, 0]), ("gap", x.mean(1))):
        layer = L.Pool(mode)
        rows.append(_forward_row("pool", f"{mode}: forward vs x[:, 0]" if mode == "cls" else "gap: forward vs mean",
                                 layer.forward(x), expected))
        for r in _gradient_rows("pool", layer, x, axes={"dx": TOKENS}, factors={"N": N, "B": B}):
            r.what = f"{mode}: {r.what}"
            rows.append(r)
    return rows


def check_head(rng, use_kernels):
    """The stages after the blocks: the final LayerNorm, the class token, the tanh layer, the linear head."""
    D, R, K = 8, 6, 4
    norm, pool = L.LayerNorm(D, dtype="float64"), L.Pool("cls")
    pre_logits, head = L.PreLogits(D, R, dtype="float64"), L.Linear(R, K, dtype="float64")
    layer = _randomise(_Stages([("norm", norm), ("pool", pool), ("pre_logits", pre_logits), ("head", head)]), rng)
    x = _random(rng, (B, N, D))
    y = F.tanh_forward(_linear(_sub(layer.params, "pre_logits.fc."), _layernorm(_sub(layer.params, "norm."), x)[:, 0]))[0]
    rows = [_forward_row("head", "forward: norm, pool, pre_logits, head vs functional", layer.forward(x),
                         _linear(_sub(layer.params, "head."), y))]
    return rows + _gradient_rows("head", layer, x, axes={"dx": TOKENS}, factors={"B": B})


def check_cross_entropy(rng, use_kernels):
    Bc, K, smoothing = 5, 4, 0.1
    logits = _random(rng, (Bc, K), scale=2.0)
    labels = asarray(np.array([1, 0, 3, 3, 2]))
    xp = get_array_module(logits)
    q = (1 - smoothing) * xp.eye(K)[labels] + smoothing / K                     # (B, K) the smoothed target
    shifted = logits - logits.max(-1, keepdims=True)
    expected = -(q * (shifted - xp.log(xp.exp(shifted).sum(-1, keepdims=True)))).sum() / Bc
    rows = [_forward_row("cross_entropy", "forward: loss vs -mean(sum q log softmax)",
                         F.cross_entropy_forward(logits, labels, smoothing)[0], expected, factors={"B": Bc})]
    pair = PairLayer(lambda z: _loss_as_vector(F.cross_entropy_forward(z, labels, smoothing)),
                     lambda dout, cache: F.cross_entropy_backward(cache) * dout[0])
    for r in _gradient_rows("cross_entropy", pair, logits, axes={"dx": ("B", "K")}, factors={"B": Bc, "K": K}):
        r.what = "dlogits" if r.what == "dx" else r.what
        rows.append(r)
    return rows


def _loss_as_vector(loss_and_cache):
    loss, cache = loss_and_cache
    return loss.reshape(1), cache                                                # (1,): gradcheck takes arrays


def check_model(rng, use_kernels):
    config = ViTConfig(img_size=8, patch_size=2, in_chans=3, num_classes=5, embed_dim=16, depth=2, num_heads=2,
                       mlp_ratio=2.0)
    model = _randomise(ViT(config, seed=0, dtype="float64"), rng, 0.1)
    x = _random(rng, (B, 8, 8, 3))
    rows = [_forward_row("model", "forward: ViT vs functional", model.forward(x), _vit(model, x))]
    rows = _Rows(rows + _gradient_rows("model", model, x, max_checks=16, axes={"dx": ("B", "H", "W", "C")},
                                       factors={"B": B}))
    if not rows[-1].ok or any(not r.ok for r in rows[1:]):          # which layer: its own check says
        rows.first_wrong_layer = walk_rows(model, x)[1]
    return rows


class _Rows(list):
    """An op's rows, and for the model the first layer (by path) whose own check fails."""
    first_wrong_layer = None


def check_adamw(rng, use_kernels):
    """functional.adamw_update against what its formula implies, against kernels.adamw_update, and inside
    optim.AdamW.step. m and v are zero before the first step."""
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-8, 0.05
    factors = {"1 - b1": 1 - b1, "1/sqrt(1 - b2)": 1 / math.sqrt(1 - b2),
               "(1 - b1) / sqrt(1 - b2)": (1 - b1) / math.sqrt(1 - b2), "lr": lr}
    shape = (4, 6)
    p0, grads = _random(rng, shape), [_random(rng, shape) for _ in range(3)]
    xp = get_array_module(p0)
    p, m, v = p0.copy(), xp.zeros(shape), xp.zeros(shape)         # step 1 with eps = wd = 0: m_hat = g and
    F.adamw_update(p, grads[0], m, v, lr, b1, b2, 0.0, 0.0, 1)    # sqrt(v_hat) = |g|, so p moves by lr
    rows = [_forward_row("adamw", "step 1: m = (1 - b1) g", m, (1 - b1) * grads[0], factors=factors),
            _forward_row("adamw", "step 1: v = (1 - b2) g^2", v, (1 - b2) * grads[0] ** 2, factors=factors),
            _forward_row("adamw", "step 1 (eps = wd = 0): p moves by -lr sign(g)", p - p0, -lr * xp.sign(grads[0]),
                         factors=factors)]
    for row, name, before, after in zip(rows, ("m", "v", "p"), (xp.zeros(shape), xp.zeros(shape), p0), (m, v, p)):
        _rebound(row, name, before, after, "adamw_update")
    p = p0.copy()                                                 # g = 0: only the decoupled decay moves p
    F.adamw_update(p, xp.zeros(shape), xp.zeros(shape), xp.zeros(shape), lr, b1, b2, eps, wd, 1)
    rows.append(_forward_row("adamw", "g = 0: p <- p (1 - lr wd)", p, p0 * (1 - lr * wd),
                             why="with a zero gradient only the decay moves p: is it decoupled, p *= 1 - lr wd "
                                 "before the Adam step, and not added to the gradient (that is Adam with L2)?"))
    if use_kernels and not (kernels.HAVE_NUMBA and backend_of(p0) == "numpy"):
        rows.append(Row("adamw", "kernels.adamw_update", math.nan, TOL_KERNEL,
                        "the CPU kernel needs Numba and NumPy arrays", skipped=True))
    elif use_kernels:
        p64, m64, v64 = p0.copy(), xp.zeros(shape), xp.zeros(shape)
        p32, m32, v32 = p64.astype("float32"), m64.astype("float32"), v64.astype("float32")
        for t, g in enumerate(grads, start=1):
            F.adamw_update(p64, g, m64, v64, lr, b1, b2, eps, wd, t)
            kernels.adamw_update(p32, g.astype("float32"), m32, v32, lr, b1, b2, eps, wd, t)
        for name, a64, a32 in (("p", p64, p32), ("m", m64, m32), ("v", v64, v32)):
            rows.append(_forward_row("adamw", f"3 steps: {name} vs kernels.adamw_update, float32", a64,
                                     a32.astype("float64"), factors=factors, tol=TOL_KERNEL,
                                     why="differs after 3 steps (the step count t in the bias corrections?)"))

    def by_hand(p, g, state, t, decay):                           # state: (m, v), updated in place
        F.adamw_update(p, g, *state, lr, b1, b2, eps, decay, t)
        return state

    make = lambda layer: AdamW(layer, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, no_decay=("bias",))
    return rows + _optimizer_rows("adamw", make, by_hand, lambda p: (p * 0, p * 0), wd, rng)


def check_sgd(rng, use_kernels):
    """functional.sgd_update against torch.optim.SGD's rule written out, and inside optim.SGD.step."""
    lr, mu, wd = 0.1, 0.9, 0.05
    p0, grads = _random(rng, (4, 6)), [_random(rng, (4, 6)) for _ in range(3)]
    rows = []
    for nesterov in (False, True):
        p, buf, expected, b = p0.copy(), None, p0.copy(), None
        for g in grads:
            buf = F.sgd_update(p, g, buf, lr, mu, nesterov, wd)
            g_t = g + wd * expected                               # the rule, as torch.optim.SGD documents it
            b = g_t if b is None else mu * b + g_t
            expected = expected - lr * (g_t + mu * b if nesterov else b)
        kind = "nesterov" if nesterov else "momentum"
        rows += [_forward_row("sgd", f"{kind}, 3 steps: p vs the rule written out", p, expected, factors={"lr": lr}),
                 _forward_row("sgd", f"{kind}, 3 steps: the momentum buffer", buf, b, factors={"mu": mu})]
    p = p0.copy()
    F.sgd_update(p, grads[0], None, lr, 0.0, False, 0.0)
    rows.append(_forward_row("sgd", "no momentum: p <- p - lr g", p, p0 - lr * grads[0], factors={"lr": lr}))
    _rebound(rows[-1], "p", p0, p, "sgd_update")

    def by_hand(p, g, buf, t, decay):                             # the momentum buffer: None before step 1
        return F.sgd_update(p, g, buf, lr, mu, False, decay)

    make = lambda layer: SGD(layer, lr=lr, momentum=mu, weight_decay=wd, no_decay=("bias",))
    return rows + _optimizer_rows("sgd", make, by_hand, lambda p: None, wd, rng)


def _optimizer_rows(op, make, by_hand, new_state, wd, rng):
    """optim's class (as it stands) for 3 steps on a Linear layer, against the update rule called by hand,
    bias exempt from weight decay: do the class's step count, buffers and no_decay fit the rule?
    by_hand(p, g, state, t, weight_decay) -> state."""
    layer = L.Linear(4, 6, dtype="float64")
    layer.params["bias"][...] = _random(rng, 6)
    opt = make(layer)
    hand = {name: [p.copy(), new_state(p)] for name, p in layer.params.items()}
    arrays = dict(layer.params.items())                           # the arrays the model holds, by identity
    for t in range(1, 4):
        for name, g in layer.grads.items():
            g[...] = _random(rng, g.shape)
            p, state = hand[name]
            hand[name][1] = by_hand(p, g, state, t, 0.0 if name == "bias" else wd)
        opt.step()
    rows = []
    for name in layer.params:
        what = f"optim.{type(opt).__name__}.step, 3 steps: {name} vs functional.{op}_update by hand"
        if layer.params[name] is not arrays[name]:
            rows.append(Row(op, what, math.inf, TOL_SAME,
                            f"the parameter array was replaced (a new array put into params) instead of updated in "
                            f"place: whatever holds the old array (data parallel's flat buffers, a caller's "
                            f"reference) no longer sees the model's {name}; update it in place (p -= ..., p[...] = ...)"))
        else:
            rows.append(_forward_row(op, what, layer.params[name], hand[name][0]))
    return rows


def _rebound(row, name, before, after, fn):
    """A WRONG row whose array did not change at all: the update rebound its name to a new array."""
    if not row.ok and get_array_module(after).array_equal(after, before):
        row.note = ("the parameter array was rebound, not updated in place: the model's array did not change "
                    if name == "p" else f"{name} was rebound, not updated in place: the optimizer's {name} did "
                    f"not change ") + (f"(`{name} = {name} - ...` in {fn} makes a new array, lost on return; write "
                                       f"`{name} -= ...` or `{name}[...] = ...`)")


# name -> (check, what it covers); `python -m minivit.check --help` prints this table
OPS = {
    "patch_embed": (check_patch_embed, "layers.PatchEmbed: functional.im2patch / patch2im, the linear projection E"),
    "linear": (check_linear, "layers.Linear: functional.linear_forward / linear_backward"),
    "layernorm": (check_layernorm, "layers.LayerNorm: functional.layernorm_* (and kernels.layernorm_*)"),
    "gelu_erf": (check_gelu_erf, "layers.GELU('erf'): functional.gelu_* (and kernels.gelu_*)"),
    "gelu_tanh": (check_gelu_tanh, "layers.GELU('tanh'): functional.gelu_* (and kernels.gelu_*)"),
    "softmax": (check_softmax, "functional.softmax_* (and kernels.softmax_*)"),
    "attention": (check_attention, "functional.attention_*: softmax(q k^T / sqrt(hs)) v, its dq, dk, dv "
                                   "(and kernels.attention_*)"),
    "attention_layer": (check_attention_layer, "layers.Attention: qkv projection, the core, proj"),
    "mlp": (check_mlp, "layers.MLP: fc1, GELU, fc2"),
    "block": (check_block, "layers.Block: the pre-norm residual block, Eqs. 2-3"),
    "pos_embed": (check_pos_embed, "layers.PosEmbed: the class token and the position embeddings"),
    "pool": (check_pool, "layers.Pool: 'cls' and 'gap'"),
    "head": (check_head, "the last stages: norm, pool, pre_logits (functional.tanh_*), head"),
    "cross_entropy": (check_cross_entropy, "functional.cross_entropy_*, with label smoothing 0.1"),
    "model": (check_model, "the whole ViT (2 blocks), every parameter"),
    "adamw": (check_adamw, "functional.adamw_update (and kernels.adamw_update), optim.AdamW"),
    "sgd": (check_sgd, "functional.sgd_update, optim.SGD"),
}
COMPOSITE = ("attention_layer", "mlp", "block", "head", "model")


def select(names=None):
    """The op names to check: all (None or empty), or those named; a name also selects every op it begins
    with before an underscore ("gelu": gelu_erf and gelu_tanh). Unknown names raise a ValueError listing
    the valid ones."""
    if not names:
        return list(OPS)
    if isinstance(names, str):
        names = [names]
    chosen, unknown = [], []
    for name in names:
        found = [op for op in OPS if op == name or op.startswith(name + "_")]
        if not found:
            unknown.append(name)
        chosen += [op for op in found if op not in chosen]
    if unknown:
        raise ValueError(f"unknown op name(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(OPS)}")
    return chosen


def _textbook_differs(op, err):
    """A "differs" row where check.py's own textbook code raised on a layer class whose arrays are not the
    textbook's (a LayerNorm made an RMSNorm: KeyError 'bias'); None where the error came from the layer's
    code or functional.py (a student's bug, reported as raised)."""
    if not isinstance(err, (KeyError, AttributeError, IndexError)):
        return None
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not (f.filename.endswith("layers.py") and f.name in ("__getitem__", "_locate"))]
    if not frames or not frames[-1].filename.endswith("check.py"):
        return None
    return Row(op, "forward vs textbook", math.nan, TOL_SAME,
               f"forward differs from the textbook {op} (its class's arrays are not the textbook's: "
               f"{type(err).__name__} {err}): checked by numerical gradients only, in the model walk "
               "(python -m minivit.check with no NAME, or check.run_model(model))", status=DIFFERS)


def _raised(op, err):
    frame = traceback.extract_tb(err.__traceback__)[-1]
    where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}"
    return Row(op, f"raised {type(err).__name__}", math.inf, 0.0, f"{err} ({where})")


def run(names=None, use_kernels=True, seed=0):
    """Check the named ops (default: all of OPS) and return a Report: ``print`` it, read ``.ok``, ``.wrong()``.
    use_kernels=False leaves out the comparisons with kernels.py (for math changed on purpose)."""
    start = time.perf_counter()
    rows, hints = [], {}
    for op in select(names):
        check, _ = OPS[op]
        try:
            op_rows = check(host_rng(seed), use_kernels)
        except Exception as err:                    # a student's edit that raises: say where, and go on
            op_rows = [_textbook_differs(op, err) or _raised(op, err)]
        _point_kernel_rows_at_gradient_rows(op_rows)
        rows += op_rows
        if op in COMPOSITE and any(not r.ok for r in op_rows):
            hint = _first_wrong_in_backward(op_rows)
            walk = getattr(op_rows, "first_wrong_layer", None)     # the model: by a walk of its layers
            if walk is not None:
                hint = _walk_hint(walk, hint)
            if hint:
                hints[op] = hint
    return Report(rows, hints, time.perf_counter() - start)


def _point_kernel_rows_at_gradient_rows(rows):
    """A kernel row of a gradient that its own gradient row already calls WRONG says so, and no more: the
    diagnosis is the gradient row's (told once)."""
    wrong = {r.what for r in rows if r.tensor is not None and not r.ok}
    for r in rows:
        name = getattr(r, "kernel_of", None)
        if name in wrong and not r.ok:
            r.note = f"the gradient row {name} is WRONG too: fix that first (this row follows from it)"


def overfit(steps=40, lr=1e-2, optimizer="adamw", seed=0):
    """Train a tiny float64 ViT on one batch of 20 `shapes` images; return the loss before each step (a list,
    Losses, whose ``summary(reference)`` says what the curve does and does not show).
    With every backward right the loss falls from about log(10) = 2.3 towards 0. A bug may show as a loss
    that stalls, creeps or blows up, but it need not: a wrong gradient can still train, even to a lower loss
    than the right one (a gradient too large by a factor acts as a larger learning rate). So a falling or
    lower loss proves nothing about the gradients; check.run() and check.run_model() compare them.
    float64 runs functional.py as it stands, so an edited function is what trains.
    optimizer: "adamw" (no weight decay) or "sgd" (momentum 0.9)."""
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    (images, labels), _ = make_shapes(num_train=20, num_test=0, seed=seed, img_size=16)
    x, y = asarray(normalize(images, 0.5, 0.25, dtype="float64")), asarray(labels)          # (20, 16, 16, 3)
    model = ViT(ViTConfig(img_size=16, patch_size=4, num_classes=10, embed_dim=32, depth=1, num_heads=2,
                          mlp_ratio=2.0), seed=seed, dtype="float64")
    opt = AdamW(model, lr=lr, weight_decay=0.0) if optimizer == "adamw" else SGD(model, lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss, dlogits = F.cross_entropy(model.forward(x), y)
        model.zero_grad()
        model.backward(dlogits)
        opt.step()
        losses.append(loss)
    return Losses(losses)


class Losses(list):
    """overfit's losses, a list; ``summary(reference)`` puts them in words, and says what they cannot show."""

    def summary(self, reference=None):
        """The first and last loss, against a reference run's (minivit's own backward) if given."""
        text = f"loss {self[0]:.3f} -> {self[-1]:.3f} in {len(self)} steps"
        if not all(math.isfinite(v) for v in self):
            return text + ": it blew up (NaN or inf), so some gradient or update is wrong"
        if reference is not None:
            ref = reference[-1]
            if abs(self[-1] - ref) <= 1e-9 * max(1.0, abs(ref)):
                text += f"; the reference ends at {ref:.3f} too: the same curve"
            else:
                text += (f"; the reference ends at {ref:.3f}: {'lower' if self[-1] < ref else 'higher'} than it. "
                         "A different curve means a different gradient or update, and a lower loss does not make it "
                         "right")
        return (text + ". A falling loss does not prove the gradients right (a wrong one can train, even faster); "
                "check.run() compares them")

# --------------------------------------------------------------------------------------------------
# The model walk: every layer of a model as its classes stand, each on its own input
# --------------------------------------------------------------------------------------------------

DIFFERS = "differs"
WALK_MAX_CHECKS = 16      # elements sampled per array of a composite layer (a leaf's are all checked if few)
LEAF_ALL = 1500           # a leaf whose arrays hold at most this many elements in all is checked element by element


class _SeveralInputs(Exception):
    """A backward that returns the gradients of several inputs: not checked on its own."""


class _Bound:
    """A layer called as forward(x, *rest) seen as one taking x only, rest held fixed (an attention mask),
    or, where x is not float (token ids), as one taking a float placeholder, checked on its parameters."""

    def __init__(self, layer, x, rest, kwargs):
        self.layer, self.x, self.rest, self.kwargs = layer, x, rest, kwargs
        self.float_input = is_array(x) and x.dtype.kind == "f"
        self.params, self.grads = layer.params, layer.grads

    def forward(self, x):
        return self.layer.forward(x if self.float_input else self.x, *self.rest, **self.kwargs)

    def backward(self, dout):
        dx = self.layer.backward(dout)
        if isinstance(dx, tuple):
            raise _SeveralInputs(len(dx))
        return dx if self.float_input else None

    def sublayers(self):
        return self.layer.sublayers()

    def train(self, mode=True):
        self.layer.train(mode)
        return self

    def zero_grad(self):
        self.layer.zero_grad()


def _record_inputs(model, x):
    """One forward of model (training mode) on x (an array, or a tuple of the model's inputs), each
    layer's forward wrapped to keep the arguments of its first call: {id(layer): (args, kwargs)}."""
    seen, wrapped = {}, []
    for _, layer in model.named_sublayers():
        if any(layer is w for w, _ in wrapped):
            continue
        own = layer.__dict__.get("forward")

        def recording(*args, _layer=layer, _forward=layer.forward, **kwargs):
            if id(_layer) not in seen:
                seen[id(_layer)] = (tuple(a.copy() if is_array(a) else a for a in args), dict(kwargs))
            return _forward(*args, **kwargs)

        object.__setattr__(layer, "forward", recording)
        wrapped.append((layer, own))
    try:
        model.train()
        model.forward(*(x if isinstance(x, tuple) else (x,)))
    finally:
        for layer, own in wrapped:                       # restored, even after an error
            if own is None:
                del layer.__dict__["forward"]
            else:
                object.__setattr__(layer, "forward", own)
    return seen


def _layers_post_order(model):
    """(path, layer) children before parents. A layer registered under "" (the ViT's PosEmbed, whose
    arrays are top-level names) is shown by the attribute that holds it; the model itself as "model"."""
    def walk(layer, prefix, shown):
        for name, child in layer.children.items():
            if not name:
                name_shown = next((a for a, v in layer.__dict__.items() if v is child), type(child).__name__)
            else:
                name_shown = name
            sub = ".".join(p for p in (prefix, name) if p)
            yield from walk(child, sub, ".".join(p for p in (shown, name_shown) if p))
        yield prefix, shown, layer
    for prefix, shown, layer in walk(model, "", ""):
        yield prefix, shown or "model", layer


def _textbook(layer, x):
    """(op, the textbook forward of layer at x) for a layer of a class whose math check.py knows (its
    subclasses too); None for any other. Raises where the layer's arrays are not the textbook's."""
    def block():
        p = layer.params
        x1 = x + _attention(_sub(p, "attn."), F.layernorm_forward(x, p["norm1.weight"], p["norm1.bias"],
                                                                  layer.norm1.eps)[0], layer.attn.num_heads)
        h = F.layernorm_forward(x1, p["norm2.weight"], p["norm2.bias"], layer.norm2.eps)[0]
        return x1 + _mlp(_sub(p, "mlp."), h, layer.mlp.act.approximate)

    kinds = ((L.Block, "Block", block),
             (L.Attention, "Attention", lambda: _attention(layer.params, x, layer.num_heads)),
             (L.MLP, "MLP", lambda: _mlp(layer.params, x, layer.act.approximate)),
             (L.LayerNorm, "LayerNorm", lambda: F.layernorm_forward(x, layer.params["weight"],
                                                                    layer.params["bias"], layer.eps)[0]),
             (L.Linear, "Linear", lambda: _linear(layer.params, x)),
             (L.GELU, "GELU", lambda: F.gelu_forward(x, layer.approximate)[0]),
             (L.PatchEmbed, "PatchEmbed", lambda: _linear(_sub(layer.params, "proj."),
                                                          F.im2patch(x, layer.patch_size))))
    for cls, op, forward in kinds:
        if isinstance(layer, cls):
            return op, forward
    return None


def _textbook_row(path, layer, x):
    """The layer's forward against the textbook op: "ok" where it still is that op (the op rows' diagnoses
    then apply to it), "differs" where it is not or the textbook cannot even run on its arrays."""
    found = _textbook(layer, x)
    if found is None:
        return None
    op, forward = found
    differs = f"forward differs from the textbook {op}: checked by numerical gradients only"
    try:
        expected = forward()
        got = layer.forward(x)
    except (KeyError, AttributeError, ValueError, TypeError, IndexError) as err:
        return Row(path, f"forward vs textbook {op}", math.nan, TOL_SAME,
                   f"{differs} (the textbook raises {type(err).__name__}: {err})", status=DIFFERS)
    got, expected = to_numpy(got), to_numpy(expected)
    if got.shape != expected.shape or _rel(got, expected) > TOL_SAME:
        error = math.inf if got.shape != expected.shape else _rel(got, expected)
        return Row(path, f"forward vs textbook {op}", error, TOL_SAME, differs, status=DIFFERS)
    return Row(path, f"forward vs textbook {op}", _rel(got, expected), TOL_SAME)


def _axes_for(x):
    return {3: TOKENS, 4: ("B", "H", "W", "C"), 2: ("B", "D")}.get(getattr(x, "ndim", 0))


def walk_rows(model, x):
    """The rows of the model walk: each layer of model (depth first, children before parents) checked on
    the input it had in one forward on x, by float64 central differences for its input and every
    parameter. A composite with a WRONG layer inside is skipped ("fix <path> first"); one whose layers are
    all right but which is WRONG itself is WRONG under its own path. Returns (rows, the first WRONG layer's
    path in the backward's order or None)."""
    seen = _record_inputs(model, x)
    rows, bad = [], {}                      # bad: path -> the WRONG layers inside it or it (root causes)
    order = list(_layers_post_order(model))
    for prefix, path, layer in order:
        if isinstance(layer, L.Dropout) and not layer.params:
            continue                        # identity here (rates are 0 in the check): nothing to check
        inside = [c for p, c in bad.items() if p != path and (path == "model" or p.startswith(path + "."))]
        causes = list(dict.fromkeys(c for cs in inside for c in cs))
        if causes:
            bad[path] = causes
            rows.append(Row(path, "all", math.nan, TOL_GRAD, status=f"skipped: fix {', '.join(causes[:3])} first"))
            continue
        if id(layer) not in seen:
            rows.append(Row(path, "all", math.nan, TOL_GRAD, "the model's forward did not call it", skipped=True))
            continue
        args, kwargs = seen[id(layer)]
        if not args:
            rows.append(Row(path, "all", math.nan, TOL_GRAD, "not checked: called with no positional input",
                            skipped=True))
            continue
        xin = args[0]
        bound = _Bound(layer, xin, args[1:], kwargs)
        textbook = _textbook_row(path, layer, xin) if bound.float_input and not args[1:] and not kwargs else None
        if textbook is not None:
            rows.append(textbook)
        out = bound.forward(xin)
        if not is_array(out):
            rows.append(Row(path, "all", math.nan, TOL_GRAD, f"not checked: returns {type(out).__name__}",
                            skipped=True))
            continue
        leaf = not layer.children
        size = sum(int(p.size) for p in layer.params.values()) + int(xin.size)
        max_checks = None if leaf and size <= LEAF_ALL else WALK_MAX_CHECKS
        probe = xin if bound.float_input else asarray(np.zeros(1), dtype="float64")
        axes = {"dx": _axes_for(xin)}
        refs = {"dx": {}}                               # what an error in dx may be proportional to, row by row
        if textbook is not None and textbook.status == "ok" and isinstance(layer, L.LayerNorm):
            refs["dx"]["xhat"] = (xin - xin.mean(-1, keepdims=True)) / (xin.var(-1, keepdims=True) + layer.eps) ** 0.5
        if bound.float_input:
            refs["dx"]["x"] = xin                       # a norm's term through x (RMSNorm's mean of x^2)
        try:
            grad_rows = _gradient_rows(path, bound, probe, axes=axes, refs=refs, factors={"B": xin.shape[0]},
                                       max_checks=max_checks, check_input=bound.float_input)
        except _SeveralInputs as err:
            rows.append(Row(path, "all", math.nan, TOL_GRAD, f"not checked: takes {err.args[0]} inputs "
                            "(its layers and the model around it are checked)", skipped=True))
            continue
        except Exception as err:                        # a student's layer that raises: say where, go on
            grad_rows = [_raised(path, err)]
        for r in grad_rows:
            if r.tensor == "input":
                if not bound.float_input:
                    continue
                r.label = f"{path} dx"
            elif r.tensor is not None:
                r.tensor = ".".join(p for p in (prefix, r.tensor) if p)        # the full dotted name
                r.label = r.tensor
            rows.append(r)
        wrong = [r for r in grad_rows if not r.ok and (r.tensor != "input" or bound.float_input)]
        if wrong:
            bad[path] = [path]
            if isinstance(layer, L.Attention) and textbook is not None and textbook.status == "ok":
                for r in wrong:
                    r.note = r.note or ("its qkv and proj are right, so the core is not: see the 'attention' "
                                        "rows (python -m minivit.check attention)")
    first = _first_in_backward([p for p, cs in bad.items() if cs == [p]], [p for _, p, _ in order])
    return rows, first


def _first_in_backward(paths, order):
    """Of the layers with WRONG rows of their own, the one the backward reaches first: the last in the
    forward (post-order puts a later stage's layers after an earlier one's)."""
    return max(paths, key=order.index) if paths else None


def _walk_hint(path, hint):
    text = (f"the first layer, from the output back, whose own check fails (the layers inside it pass) is {path}: "
            f"look in its backward")
    if hint and path != "model" and f"d{path}." in hint:
        return text + "; " + hint
    return text


def _default_model(clip=False, seed=0):
    """The small float64 model the walk checks: the ViT of the "model" row, or a tiny CLIP."""
    if clip:
        from .clip import CLIP, CLIPConfig
        config = CLIPConfig(embed_dim=8, img_size=8, patch_size=4, vision_width=12, vision_layers=1,
                            vision_heads=3, context_length=6, vocab_size=20, text_width=8, text_layers=1,
                            text_heads=2, mlp_ratio=2.0)
        return CLIP(config, seed=seed, dtype="float64")
    config = ViTConfig(img_size=8, patch_size=2, in_chans=3, num_classes=5, embed_dim=16, depth=2, num_heads=2,
                       mlp_ratio=2.0)
    return ViT(config, seed=seed, dtype="float64")


def default_input(model, batch=3, seed=0):
    """A small random batch of the model's input: images (B, H, W, C) from its config's img_size and
    in_chans; for a CLIP, (images, tokens) with <end> the highest id."""
    rng = host_rng(seed)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "img_size") or not hasattr(config, "in_chans"):
        raise ValueError(f"{type(model).__name__} has no config with img_size and in_chans: pass x, "
                         "a batch of its input (float64), to run_model(model, x)")
    H, W = (config.img_size, config.img_size) if isinstance(config.img_size, int) else config.img_size
    images = _random(rng, (batch, H, W, config.in_chans))
    if hasattr(config, "context_length"):
        Lc, V = config.context_length, config.vocab_size
        tokens = rng.integers(4, V - 1, size=(batch, Lc))
        tokens[:, -1] = V - 1                                       # <end>: the highest id, read by the text tower
        return images, asarray(tokens)
    return images


def run_model(model, x=None, seed=0):
    """Check every layer of ``model`` as its classes stand (a student's own layers too), each on its own
    input, by float64 central differences; returns a Report (``print`` it, ``.ok``, ``.wrong()``,
    ``.verdict()``). The model is not changed: its copy is checked, parameters moved off their initial
    values and dropout rates set to 0. x: its input (default: a batch of 3 random images of its config's
    shape)."""
    start = time.perf_counter()
    if not isinstance(model, L.Layer):
        raise TypeError(f"run_model takes a minivit model (a Layer), got {type(model).__name__}")
    low = sorted({str(p.dtype) for p in model.params.values() if p.dtype != "float64"})
    if low:
        raise TypeError(f"the model's parameters are {', '.join(low)}: the check needs float64 (float32 rounding "
                        "swamps the finite differences). Build it with dtype='float64'")
    model = copy.deepcopy(model)
    for layer in model.sublayers():
        if isinstance(layer, L.Dropout):
            layer.p = 0.0
    _randomise(model, host_rng(seed), 0.1)
    x = default_input(model, seed=seed) if x is None else x     # B = 3: 1/B is not 0.5
    rows, first = walk_rows(model, x)
    hints = {first: _walk_hint(first, "")} if first else {}
    return Report(rows, hints, time.perf_counter() - start, fold_ok=True)


def load_model(spec):
    """FILE.py:FUNC -> the model FUNC builds (FUNC(dtype="float64") if it takes dtype, else FUNC()).
    Raises ValueError, saying what is wrong, for a missing file or function or something not a model."""
    path, sep, func = spec.rpartition(":")
    if not sep or not path or not func:
        raise ValueError(f"--model takes FILE.py:FUNC, got {spec!r}")
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--model: no file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"_minivit_check_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    build = getattr(module, func, None)
    if not callable(build):
        raise ValueError(f"--model: {path} has no function {func!r}")
    takes_dtype = "dtype" in inspect.signature(build).parameters
    model = build(dtype="float64") if takes_dtype else build()
    if not isinstance(model, L.Layer):
        raise ValueError(f"--model: {func}() returned {type(model).__name__}, not a minivit model (a Layer)")
    low = sorted({str(p.dtype) for p in model.params.values() if p.dtype != "float64"})
    if low:
        raise ValueError(f"--model: {func}() built a {', '.join(low)} model; the check needs float64. "
                         + ("Pass dtype to every layer it builds." if takes_dtype else
                            f"Give it a dtype argument (def {func}(dtype='float64')) and build with it."))
    return model



def main(argv=None):
    listing = "\n".join(f"  {name:<14} {what}" for name, (_, what) in OPS.items())
    parser = argparse.ArgumentParser(
        prog="python -m minivit.check", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check each layer op after an edit: its forward against the functional pairs (and the fast "
                    "kernels), every gradient against central differences. Prints a table; exits 1 on any WRONG.",
        epilog=f"ops (default: all; 'gelu' selects gelu_erf and gelu_tanh):\n{listing}")
    parser.add_argument("names", nargs="*", metavar="NAME", help="ops to check (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every gradient row of the composite ops")
    parser.add_argument("--no-kernels", action="store_true",
                        help="leave out the comparison with minivit/fast/kernels.py (when you changed the math on purpose)")
    parser.add_argument("--model", metavar="FILE.py:FUNC",
                        help="check every layer of the model FUNC() builds (FUNC(dtype='float64') if it takes dtype), "
                             "instead of the ops")
    parser.add_argument("--clip", action="store_true", help="walk a tiny CLIP's layers instead of the ViT's")
    args = parser.parse_args(argv)
    if args.model:
        try:
            model = load_model(args.model)
        except ValueError as err:
            parser.error(str(err))
        report = run_model(model)
        print(report.table(verbose=args.verbose))
        return 0 if report.ok else 1
    try:
        names = select(args.names)
    except ValueError as err:
        parser.error(str(err))
    reports = []
    if not args.clip:
        reports.append(run(names, use_kernels=not args.no_kernels))
        print(reports[-1].table(verbose=args.verbose))
    if not args.names:                              # the whole model, layer by layer, as its classes stand
        model = _default_model(clip=args.clip)
        print(f"\nevery layer of the {type(model).__name__} ({model.num_params()} parameters), each on its own input:")
        reports.append(run_model(model))
        print(reports[-1].table(verbose=args.verbose))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
