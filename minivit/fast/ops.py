"""The dispatch: which code runs each op, the math of functional.py or its fast twin in kernels.py (minivit/fast/),
once it is known to agree.

functional.py defines every op and is written to be read and changed; kernels.py computes some of them
faster, for float32 (one fused pass instead of several). This module is the one place that chooses, by
the table below. A twin stands in for a pair only after it has been checked, in this process, against
the pair as it is now: the first time an op runs for a backend and a shape, both run on a small probe
input (seeded random values), and the twin is used from then on only if its output and every gradient
agree with the pair's to float32 precision. So:

- edit a pair in functional.py (or replace it: ``minivit.functional.gelu_forward = my_gelu``) and your
  version is what runs, in float32 as in float64. One warning (FastPathDisagrees) names the op and by how
  much the twin differed; ``report()`` lists what ran from where, and ``report(model)`` what each layer
  of the model runs: its own code, functional.py's pair, or a named kernel (minivit/fast/report.py).
- float64 always runs functional.py: the gradient checks and the parity tests see the math as written.
- ``set_fast_kernels(False)`` (or the environment variable MINIVIT_FAST_KERNELS=0) runs functional.py
  for every op, e.g. to step through it in a debugger.

The functions are looked up on the modules at call time, and a verdict is kept per state of
functional.py (every name it defines), so a pair replaced while the process runs is checked again.

    op         functional.py (the math)                   kernels.py (float32)                probe keyed on
    linear     linear_forward, linear_backward            dW in BLAS's better order;          float16 or not
                                                          matmul_dtype="float16" (amp.py)
    layernorm  layernorm_forward, layernorm_backward      one fused pass per row              D
    gelu       gelu_forward, gelu_backward                one fused pass                      erf | tanh | quick
    softmax    softmax_forward, softmax_backward          one fused pass per row              row length
    attention  attention_forward, attention_backward      chunks, log-sum-exp kept, not N x N N, D, heads,
                                                                                              masked or not
    adamw      adamw_update                               one pass per parameter (CPU: Numba; -
                                                          GPU: one ElementwiseKernel launch)
    sgd        sgd_update                                 one launch per parameter (GPU)      momentum | nesterov
                                                                                              | no momentum

Layers call these functions for the ops above, and functional.py directly for the others (patches,
dropout, tanh, the loss): those have no twin. Dropout's mask on the GPU comes from here too
(dropout_keep_mask: a random number generator, nothing to check it against), so layers.py reaches the
fast paths only through this module.
"""

import os
import sys
import time
import warnings

import numpy  # the probes' inputs are drawn on the host, then moved to the backend under test

from .. import functional as F
from ..backend import asarray, backend_of, to_numpy
from . import kernels

# --------------------------------------------------------------------------------------------------
# On or off
# --------------------------------------------------------------------------------------------------

_enabled = None  # True | False; None until first asked (then read from MINIVIT_FAST_KERNELS, default on)


def set_fast_kernels(enabled):
    """Let checked fast twins run (True, the default), or run functional.py for every op (False)."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_fast_kernels takes True or False, got {enabled!r}")
    _enabled = enabled


def fast_kernels_enabled():
    """set_fast_kernels's choice, else MINIVIT_FAST_KERNELS (0 turns the twins off)."""
    global _enabled
    if _enabled is None:
        value = os.environ.get("MINIVIT_FAST_KERNELS", "1").strip().lower()
        if value not in ("0", "1", "", "false", "true", "off", "on"):
            raise ValueError(f"MINIVIT_FAST_KERNELS must be 0 or 1, got {value!r}")
        _enabled = value not in ("0", "false", "off")
    return _enabled


# --------------------------------------------------------------------------------------------------
# The verdicts: one per (op, backend, probe key, state of functional.py)
# --------------------------------------------------------------------------------------------------

TOLERANCE = 1e-4          # float32: the twins differ from the pairs by ~1e-6 of the largest value
TOLERANCE_FLOAT16 = 1e-2  # the mixed-precision Linear rounds its inputs to float16 (2^-11 relative)


class FastPathDisagrees(UserWarning):
    """A fast twin in kernels.py disagrees with the pair in functional.py, so the pair runs instead."""


class Verdict:
    """What the probe of one op found: whether the twin runs (``fast``), the largest difference of each
    compared output relative to its largest value, why, and the probe's cost."""

    def __init__(self, op, backend, key, fast, differences, reason, seconds):
        self.op, self.backend, self.key, self.fast = op, backend, key, fast
        self.differences, self.reason, self.seconds = differences, reason, seconds
        self.calls = 0

    @property
    def source(self):
        return "kernels.py" if self.fast else "functional.py"

    def __repr__(self):
        return f"Verdict({self.op}, {self.backend}, {self.key}: {self.source}, {self.reason})"


_verdicts = {}   # (op, backend, key, functional.py's state, the twins) -> Verdict
_held = []       # every state seen, kept alive so that the ids in the keys are never reused
_plain = {}      # (op, backend, dtype, why) -> calls that ran functional.py without a probe


def _functional_state():
    """Identifies what functional.py holds now: the ids of everything it defines (a replaced or reloaded
    function gets a new id)."""
    values = tuple(vars(F).values())
    state = tuple(map(id, values))
    if state not in _seen_states:
        _seen_states.add(state)
        _held.append(values)
    return state


_seen_states = set()


def _plain_run(op, x, why):
    key = (op, backend_of(x), str(x.dtype), why)
    _plain[key] = _plain.get(key, 0) + 1
    return False


def uses_twin(op, x, key=()):
    """Whether op's twin in kernels.py runs for array x (key: the probe's key, see the table above).
    The first time for a backend, key and state of functional.py, this probes it."""
    if x.dtype != numpy.float32:
        return _plain_run(op, x, f"{x.dtype}: always the math as written")
    if not fast_kernels_enabled():
        return _plain_run(op, x, "fast kernels off (set_fast_kernels / MINIVIT_FAST_KERNELS)")
    if backend_of(x) == "numpy" and not kernels.HAVE_NUMBA:
        return _plain_run(op, x, "Numba is not installed")
    return _verdict(op, x, key).fast


def _verdict(op, x, key):
    backend = backend_of(x)
    twins = tuple(getattr(kernels, name) for name in _TWINS[op])   # a twin replaced is checked again too
    full_key = (op, backend, key, _functional_state(), twins)
    verdict = _verdicts.get(full_key)
    if verdict is None:
        verdict = _verdicts[full_key] = _probe(op, backend, key)
    verdict.calls += 1
    return verdict


def _relative_difference(twin, pair):
    """max |twin - pair| / max |pair|, on the host in float64 (inf for a NaN or a shape mismatch)."""
    a = numpy.asarray(to_numpy(twin), dtype=numpy.float64)
    b = numpy.asarray(to_numpy(pair), dtype=numpy.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    diff = float(numpy.abs(a - b).max()) / max(float(numpy.abs(b).max()), 1e-30)
    return diff if diff == diff else float("inf")          # NaN -> inf: never "agrees"


def _probe(op, backend, key):
    """Run op's pair and twin on a probe input; the twin runs from now on only if everything agrees."""
    start = time.perf_counter()
    rng = numpy.random.default_rng(12345)

    def on_device(a, dtype="float32"):
        return asarray(a, dtype=dtype, backend=backend)

    try:
        outputs_pair = outputs_twin = None
        outputs_pair = _PROBES[op](F, on_device, rng, key)
        rng = numpy.random.default_rng(12345)                 # the same inputs for the twin
        outputs_twin = _PROBES[op](kernels, on_device, rng, key)
    except Exception as err:  # the student's pair (or a twin) fails on the probe: report it, run the pair
        who = "functional" if outputs_pair is None else "kernels"
        reason = f"could not be compared: {who}.py raised {type(err).__name__}({err}) on the probe input"
        verdict = Verdict(op, backend, key, False, {}, reason, time.perf_counter() - start)
        _warn(verdict)
        return verdict
    tol = TOLERANCE_FLOAT16 if key == ("float16",) else TOLERANCE
    differences = {name: _relative_difference(outputs_twin[name], value) for name, value in outputs_pair.items()}
    worst = max(differences, key=differences.get)
    fast = differences[worst] <= tol
    reason = (f"agrees to {differences[worst]:.1e}" if fast else
              f"differs: {worst} by {100 * differences[worst]:.3g}% of its largest value (tolerance {tol:.0e})")
    verdict = Verdict(op, backend, key, fast, differences, reason, time.perf_counter() - start)
    if not fast:
        _warn(verdict)
    return verdict


def _warn(verdict):
    names = " / ".join(_TWINS[verdict.op])
    warnings.warn(
        f"minivit.ops: {verdict.op} now runs from functional.py ({names}), slower: its fast twin in kernels.py "
        f"{verdict.reason} [{verdict.backend}, probe key {verdict.key}]. If you edited functional.py, this is your "
        f"edit running, as it should. To run functional.py for every op and silence this: "
        f"minivit.ops.set_fast_kernels(False) or MINIVIT_FAST_KERNELS=0.", FastPathDisagrees, stacklevel=5)


# --------------------------------------------------------------------------------------------------
# The probes: each runs one implementation (module = functional or kernels) forward and backward on
# seeded random inputs and returns every output by name. Sizes: the real op's trailing sizes, batch 2.
# --------------------------------------------------------------------------------------------------


def _probe_linear(module, on_device, rng, key):
    outputs = {}
    mixed = {"matmul_dtype": "float16"} if key == ("float16",) and module is kernels else {}
    for d_in, d_out in ((24, 16), (16, 24)):                 # both orders of kernels' dW product
        x = on_device(rng.standard_normal((2, 5, d_in)))
        w = on_device(rng.standard_normal((d_in, d_out)) * 0.3)
        b = on_device(rng.standard_normal(d_out))
        dout = on_device(rng.standard_normal((2, 5, d_out)))
        y, cache = module.linear_forward(x, w, b, **mixed)
        dx, dw, db = module.linear_backward(dout, cache)
        outputs.update({f"y {d_in}->{d_out}": y, f"dx {d_in}->{d_out}": dx, f"dweight {d_in}->{d_out}": dw,
                        f"dbias {d_in}->{d_out}": db})
    return outputs


def _probe_layernorm(module, on_device, rng, key):
    (D,) = key
    eps = 1e-5
    x = on_device(rng.standard_normal((2, 3, D)) * 2 + 0.5)
    w = on_device(1 + 0.3 * rng.standard_normal(D))
    b = on_device(0.3 * rng.standard_normal(D))
    dout = on_device(rng.standard_normal((2, 3, D)))
    out, cache = module.layernorm_forward(x, w, b, eps)
    dx, dw, db = module.layernorm_backward(dout, cache)
    return {"out": out, "dx": dx, "dweight": dw, "dbias": db}


def _probe_gelu(module, on_device, rng, key):
    (approximate,) = key
    x = on_device(numpy.concatenate([numpy.linspace(-6, 6, 97), 2 * rng.standard_normal(159)]).reshape(2, 128))
    dout = on_device(rng.standard_normal((2, 128)))
    out, cache = module.gelu_forward(x, approximate)
    return {"out": out, "dx": module.gelu_backward(dout, cache)}


def _probe_softmax(module, on_device, rng, key):
    (n,) = key
    x = on_device(3 * rng.standard_normal((2, 3, n)))
    dout = on_device(rng.standard_normal((2, 3, n)))
    out, cache = module.softmax_forward(x)
    return {"out": out, "dx": module.softmax_backward(dout, cache)}


def _probe_attention(module, on_device, rng, key):
    N, D, num_heads, masked = key
    qkv = on_device(rng.standard_normal((2, N, 3 * D)))
    dout = on_device(rng.standard_normal((2, N, D)))
    mask = F.causal_mask(qkv) if masked else None             # a masked op is probed with the causal mask
    out, cache = module.attention_forward(qkv, num_heads, mask)
    dqkv = module.attention_backward(dout, cache)
    weights = attention_weights(cache) if module is kernels else F.attention_weights(cache)
    return {"out": out, "dqkv": dqkv, "weights": weights}


def _probe_adamw(module, on_device, rng, key):
    p, g, m, v = (on_device(rng.standard_normal(1000)) for _ in range(4))
    m, v = 0.1 * m, v * v                                     # v_t >= 0, as after any real step
    module.adamw_update(p, g, m, v, 0.01, 0.9, 0.999, 1e-8, 0.1, 3)
    return {"p": p, "exp_avg": m, "exp_avg_sq": v}


def _probe_sgd(module, on_device, rng, key):
    (kind,) = key
    momentum, nesterov = {"no momentum": (0.0, False), "momentum": (0.9, False), "nesterov": (0.9, True)}[kind]
    p = on_device(rng.standard_normal(1000))
    outputs = {}
    buf = None
    for t in (1, 2):                                          # the first step makes the buffer, the second uses it
        g = on_device(rng.standard_normal(1000))
        buf = module.sgd_update(p, g, buf, 0.01, momentum, nesterov, 0.1)
        outputs[f"p {t}"] = p.copy()
        if buf is not None:
            outputs[f"momentum_buffer {t}"] = buf.copy()
    return outputs


_TWINS = {"linear": ("linear_forward", "linear_backward"), "layernorm": ("layernorm_forward", "layernorm_backward"),
          "gelu": ("gelu_forward", "gelu_backward"), "softmax": ("softmax_forward", "softmax_backward"),
          "attention": ("attention_forward", "attention_backward"), "adamw": ("adamw_update",),
          "sgd": ("sgd_update",)}
_PROBES = {"linear": _probe_linear, "layernorm": _probe_layernorm, "gelu": _probe_gelu, "softmax": _probe_softmax,
           "attention": _probe_attention, "adamw": _probe_adamw, "sgd": _probe_sgd}


# --------------------------------------------------------------------------------------------------
# The ops: functional.py's signatures. Each asks uses_twin, then runs the twin or the pair.
# --------------------------------------------------------------------------------------------------


def linear_forward(x, weight, bias=None, matmul_dtype=None):
    """functional.linear_forward. matmul_dtype="float16" asks for the mixed-precision twin (minivit/fast/amp.py):
    checked like the others, at float16's tolerance, and taken whatever set_fast_kernels says (you asked
    for it); if it disagrees with functional.py, functional.py runs in float32."""
    if matmul_dtype is not None:
        fast = _verdict("linear", x, ("float16",)).fast
    else:
        fast = uses_twin("linear", x)
    if _recorder is not None:
        _recorder.note("linear", "forward", fast, x)
    if fast:
        return kernels.linear_forward(x, weight, bias, matmul_dtype)
    return F.linear_forward(x, weight, bias)


def linear_backward(dout, cache):
    fast = cache[0].dtype != dout.dtype or uses_twin("linear", dout)   # a float16 cache: the mixed twin made it
    if _recorder is not None:
        _recorder.note("linear", "backward", fast, dout)
    return (kernels if fast else F).linear_backward(dout, cache)


def layernorm_forward(x, weight, bias, eps=1e-6):
    fast = uses_twin("layernorm", x, (x.shape[-1],))
    if _recorder is not None:
        _recorder.note("layernorm", "forward", fast, x)
    return (kernels if fast else F).layernorm_forward(x, weight, bias, eps)


def layernorm_backward(dout, cache):
    fast = uses_twin("layernorm", dout, (dout.shape[-1],))
    if _recorder is not None:
        _recorder.note("layernorm", "backward", fast, dout)
    return (kernels if fast else F).layernorm_backward(dout, cache)


def gelu_forward(x, approximate="erf"):
    fast = uses_twin("gelu", x, (approximate,))
    if _recorder is not None:
        _recorder.note("gelu", "forward", fast, x)
    return (kernels if fast else F).gelu_forward(x, approximate)


def gelu_backward(dout, cache):
    fast = uses_twin("gelu", dout, (cache[1],))
    if _recorder is not None:
        _recorder.note("gelu", "backward", fast, dout)
    return (kernels if fast else F).gelu_backward(dout, cache)


def softmax_forward(x):
    fast = uses_twin("softmax", x, (x.shape[-1],))
    if _recorder is not None:
        _recorder.note("softmax", "forward", fast, x)
    return (kernels if fast else F).softmax_forward(x)


def softmax_backward(dout, cache):
    fast = uses_twin("softmax", dout, (dout.shape[-1],))
    if _recorder is not None:
        _recorder.note("softmax", "backward", fast, dout)
    return (kernels if fast else F).softmax_backward(dout, cache)


def attention_forward(qkv, num_heads, mask=None):
    B, N, D3 = qkv.shape
    fast = uses_twin("attention", qkv, (N, D3 // 3, num_heads, mask is not None))
    if _recorder is not None:
        _recorder.note("attention", "forward", fast, qkv)
    return (kernels if fast else F).attention_forward(qkv, num_heads, mask)   # fused: a kernels.AttentionCache


def attention_backward(dout, cache):
    """The backward that matches the forward that made cache (the fused cache holds no weights)."""
    fast = isinstance(cache, kernels.AttentionCache)
    if _recorder is not None:
        _recorder.note("attention", "backward", fast, dout)
    return (kernels if fast else F).attention_backward(dout, cache)


def attention_weights(cache):
    """The weights softmax(q k^T / sqrt(hs) + mask), (B, nh, N, N), from either forward's cache: kept by
    functional.attention_forward, recomputed from the fused one's scores as its kernel makes them (max,
    exp, sum; not exp(s_ij - lse_i), which cancels at large scores: kernels.attention_weights)."""
    if not isinstance(cache, kernels.AttentionCache):
        return F.attention_weights(cache)
    return kernels.attention_weights(cache)


def adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """functional.adamw_update, or its one-pass twin (float32: contiguous NumPy arrays, or CuPy arrays)."""
    if kernels.supports_adamw(p, g, m, v) and uses_twin("adamw", p, ()):
        return kernels.adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step)
    return F.adamw_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step)


def sgd_update(p, g, momentum_buffer, lr, momentum, nesterov, weight_decay):
    """functional.sgd_update, or its one-launch twin for float32 CuPy arrays."""
    kind = "no momentum" if momentum == 0 else ("nesterov" if nesterov else "momentum")
    if kernels.supports_sgd(p, g, momentum_buffer) and uses_twin("sgd", p, (kind,)):
        return kernels.sgd_update(p, g, momentum_buffer, lr, momentum, nesterov, weight_decay)
    return F.sgd_update(p, g, momentum_buffer, lr, momentum, nesterov, weight_decay)


def dropout_keep_mask(shape, p, seed):
    """Dropout's keep mask for a CuPy array, drawn on the GPU in one launch from seed (kernels.dropout_keep_mask).
    Not a twin of a pair, so nothing to probe: layers.Dropout draws its NumPy mask on the host itself."""
    return kernels.dropout_keep_mask(shape, p, seed)


# --------------------------------------------------------------------------------------------------
# What ran from where
# --------------------------------------------------------------------------------------------------


class Report(list):
    """Rows (op, backend, key, source, reason, calls, probe seconds); prints as a table."""

    def __str__(self):
        if not self:
            return "no op has run yet"
        lines = [f"{'op':<10} {'backend':<7} {'key':<18} {'runs from':<14} {'calls':>6} {'probe':>8}  why"]
        for op, backend, key, source, reason, calls, seconds in self:
            probe = "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
            lines.append(f"{op:<10} {backend:<7} {str(key):<18} {source:<14} {calls:>6} {probe:>8}  {reason}")
        return "\n".join(lines)

    __repr__ = __str__

    def from_functional(self):
        """The ops that ran (at least once) from functional.py."""
        return sorted({row[0] for row in self if row[3] == "functional.py"})

    def from_kernels(self):
        return sorted({row[0] for row in self if row[3] == "kernels.py"})

    @property
    def probe_seconds(self):
        return sum(row[6] or 0.0 for row in self)


# While report.py records a model's forward (and backward), _recorder is its Recording: each op above
# notes which implementation ran, for the layer running it. None otherwise: one check, no other cost.
_recorder = None


def report(model=None, x=None, training=False):
    """What runs from where. With a model: run it once on x (eval forward; training=True: a training
    forward and backward too, model state restored) and return, per layer, which ops each layer called and
    which implementation ran, including a layer of your own that calls none, and a kernel that dropped out
    because its layer changed (minivit/fast/report.py; print it). x=None: two random images of the model's
    config. Without a model: which op ran from where so far in this process, and why (a Report table)."""
    if model is not None:
        from . import report as ops_report

        return ops_report.record(sys.modules[__name__], model, x, training)
    rows = Report()
    for v in _verdicts.values():
        rows.append((v.op, v.backend, v.key, v.source, v.reason, v.calls, v.seconds))
    for (op, backend, dtype, why), calls in _plain.items():
        rows.append((op, backend, dtype, "functional.py", why, calls, None))
    return rows


def summary_lines():
    """One or two lines for the start of a run: which ops came from kernels.py and which from functional.py."""
    r = report()
    lines = []
    fast, plain = r.from_kernels(), r.from_functional()
    if fast:
        lines.append(f"ops from kernels.py (each checked against functional.py on a probe, "
                     f"{r.probe_seconds * 1e3:.0f} ms in all): {', '.join(fast)}")
    if plain:
        why = sorted({row[4] for row in r if row[3] == "functional.py"})
        lines.append(f"ops from functional.py: {', '.join(plain)} ({'; '.join(why)})")
    return lines


def reset():
    """Forget every verdict (the next call of each op probes again). For tests and lessons."""
    _verdicts.clear()
    _plain.clear()
