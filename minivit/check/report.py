"""The report of minivit.check: its rows (Row), the table they print as (Report), the diagnoses that
say what is wrong with a WRONG array (diagnose), and replaced(), which puts a student's function in place."""

import contextlib

import numpy as np

from ..backend import to_numpy

TOL_SAME = 1e-10    # two float64 computations of the same math (they differ by rounding, ~1e-16)
TOL_KERNEL = 1e-4   # a float32 kernel against the float64 pair: ~1e-7 when right, 1e-2 and up when not
TOL_GRAD = 1e-6     # float64 central differences: ~1e-9 for a right backward, 1e-2 and up for a wrong one
FIT = 1e-5          # a diagnosis is given only when, with it, the two arrays agree to this
DIFFERS = "differs"     # a row's status where a layer is no longer the textbook op (not WRONG)


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
            lines.append(f"{len(wrong)} WRONG of {len(self.rows)} checks in {n_ops} ops "
                         f"({self.seconds:.1f} s): {names}")
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
                if symbol.isidentifier():
                    return f"{text} (= {name}, {symbol} = {value:g} here)"
                return f"{text} (= {name})"
    return text


def diagnose(got, expected, axes=None, refs=None, factors=None):
    """The likeliest simple cause of ``got`` differing from ``expected`` (two arrays of one shape, or 1-D
    samples of them, where only the shape-free tests run), in words; "" when none fits.

    axes: a name per axis, e.g. ("B", "N", "D"), default "axis 0", ...; () for samples; refs: {name: array of
    got's shape} that the error may be proportional to along the last axis, row by row (e.g. LayerNorm's
    xhat); factors: {symbol: value} to name
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
