"""The report room of the fast paths: what each layer of a model runs, recorded while it runs:
``minivit.ops.report(model, x, training)`` (the dispatch, minivit/fast/ops.py, calls record() here).

ops.py picks, per op, functional.py's pair or a checked kernel. Which ops a model uses depends on its
layers, and a student swaps layers: an RMSNorm in place of a LayerNorm calls no ops.layernorm_*, an
Attention subclass that computes attention itself never reaches the fused kernel. So the report is not
inferred from the classes: the model runs once (eval forward; or a training forward and backward, the
model's gradients, caches and random generators put back afterwards) with every sublayer's forward and
backward wrapped so that each ops.* call is noted under the path of the layer that made it.

    r = minivit.ops.report(model)           # two random images of model.config
    print(r)                                # per layer group: what ran, from where
    r.summary_lines()                       # the trainer's first lines

A layer whose class is not minivit's own and that calls no ops.* is "your code"; if minivit's model has
a layer with a kernel in that place (a norm where LayerNorm stands, an Attention subclass), the report
says the kernel dropped out there and why. Nothing here runs unless asked: outside a recording the ops
check one module variable (ops._recorder is None).
"""

import re

import numpy

from . import kernels
from ..backend import asarray, backend_of, is_array

# ops.py sits above this file (it calls record() from ops.report) and layers.py above ops.py, so neither
# is imported here: record() is handed the ops module, and minivit's layer classes are known by name.

# minivit.layers' classes that have a fast twin, the op each calls, and the kernel's name in the lines
KERNEL_LAYERS = (("Attention", "attention", "the fused attention kernel"),
                 ("LayerNorm", "layernorm", "the LayerNorm kernel"),
                 ("GELU", "gelu", "the GELU kernel"),
                 ("Linear", "linear", "the Linear kernel"))

# Where minivit's ViT (and CLIP's towers) put those layers, by attribute name: a layer of another class
# found under one of these names stands where a kernel layer stood
KERNEL_SLOTS = {"norm1": "LayerNorm", "norm2": "LayerNorm", "norm": "LayerNorm", "norm_pre": "LayerNorm",
                "attn": "Attention", "act": "GELU",
                "qkv": "Linear", "proj": "Linear", "fc1": "Linear", "fc2": "Linear", "head": "Linear"}


def _minivit_base(layer, name):
    """Whether minivit.layers' class `name` is layer's class or one of its bases; "own" when it is the class."""
    mro = type(layer).__mro__
    found = [c for c in mro if c.__name__ == name and c.__module__ == "minivit.layers"]
    if not found:
        return None
    return "own" if found[0] is mro[0] else "base"


class Recording:
    """Set as ops._recorder while the model runs: the stack of layer paths running, and per path the ops
    it called itself (not through a sublayer), each with the implementations that ran."""

    def __init__(self):
        self.stack = [""]
        self.calls = {}      # path -> {op: {"forward": set of sources, "backward": ...}}
        self.why = {}        # op -> why functional.py ran (when it did)

    def note(self, op, direction, fast, x):
        ran = self.calls.setdefault(self.stack[-1], {}).setdefault(op, {})
        ran.setdefault(direction, set()).add("kernels" if fast else "functional")
        if not fast:
            self.why[op] = _why_functional(op, x)


def _why_functional(op, x):
    if x.dtype != numpy.float32:
        return f"{x.dtype}: always the math as written"
    if not _ops.fast_kernels_enabled():
        return "fast kernels off"
    if backend_of(x) == "numpy" and not kernels.HAVE_NUMBA:
        return "Numba is not installed"
    return "its twin disagrees with functional.py as it stands"


def _wrap(recording, path, method):
    def wrapped(*args, **kwargs):
        recording.stack.append(path)
        try:
            return method(*args, **kwargs)
        finally:
            recording.stack.pop()
    return wrapped


def _random_input(model):
    config = model.config
    size = config.img_size
    H, W = (size, size) if isinstance(size, int) else size
    rng = numpy.random.default_rng(0)
    return asarray(rng.standard_normal((2, H, W, config.in_chans)), dtype=model.dtype, backend=model.backend)


_ops = None   # minivit.ops, handed over by ops.report


def record(ops, model, x=None, training=False):
    """Run model once on x with every sublayer's forward/backward noted (see the module docstring);
    returns an OpsReport. The model's mode, gradients, caches and random generators are as before.
    ops: the minivit.ops module (ops.report passes itself)."""
    global _ops
    _ops = ops
    if x is None:
        x = _random_input(model)
    named = list(model.named_sublayers())
    recording = Recording()
    wrapped, seen = [], set()
    for path, layer in named:
        if id(layer) in seen:                         # a layer used twice is wrapped once, under its first path
            continue
        seen.add(id(layer))
        for name in ("forward", "backward"):
            before = layer.__dict__.get(name)         # an instance attribute (a patched forward) is kept
            object.__setattr__(layer, name, _wrap(recording, path, getattr(layer, name)))
            wrapped.append((layer, name, before))
    was_training = model.training
    caches = [(layer, layer.cache) for _, layer in named]
    rngs = [(g, g.bit_generator.state) for _, layer in named
            for g in [getattr(layer, "rng", None)] if isinstance(g, numpy.random.Generator)]
    grads = {k: g.copy() for k, g in model.grads.items()} if training else None
    ops._recorder = recording
    try:
        model.train(training)
        out = model.forward(x)
        if training and is_array(out):
            model.backward(out * 0 + 1.0 / out.size)  # any upstream gradient: only the ops matter
    finally:
        ops._recorder = None
        for layer, name, before in wrapped:
            if before is None:
                del layer.__dict__[name]
            else:
                object.__setattr__(layer, name, before)
        model.train(was_training)
        for layer, cache in caches:
            layer.cache = cache
        for g, state in rngs:
            g.bit_generator.state = state
        if grads is not None:
            for k, g in model.grads.items():
                g[...] = grads[k]
    return OpsReport(model, named, recording, training)


def _group_key(path):
    """("blocks.#.attn", 3) for "blocks.3.attn": the path with its first index taken out."""
    m = re.search(r"(^|\.)(\d+)(\.|$)", path)
    if not m:
        return path, None
    return path[:m.start(2)] + "#" + path[m.end(2):], int(m.group(2))


def _ranges(indices):
    indices = sorted(indices)
    parts, start = [], indices[0]
    for a, b in zip(indices, indices[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


def _sources(op, ran):
    """"kernels.attention_forward/backward", or one per direction when they differ."""
    by_source = {}
    for direction in ("forward", "backward"):
        for source in sorted(ran.get(direction, ())):
            by_source.setdefault(source, []).append(direction)
    return ", ".join(f"{source}.{op}_{'/'.join(d)}" for source, d in by_source.items())


class OpsReport:
    """Per layer group (identical blocks collapsed: "blocks.0-5.attn"), what ran: rows of
    (group path, class name, {op: {"forward"|"backward": {"kernels"|"functional"}}}, note).
    note: "" for minivit's own layers, else what your class means for the kernels."""

    def __init__(self, model, named, recording, training):
        self.training, self.why = training, recording.why
        self.optimizer = {}                      # op -> fast (set by the trainer for the optimizer's update)
        per_layer = []
        for path, layer in named:
            calls = recording.calls.get(path, {})
            module = type(layer).__module__            # layer_examples.py's classes are written as a student's
            own = module.startswith("minivit.") and module != "minivit.layer_examples"
            note = self._note(path or type(model).__name__, layer, calls, own)
            if own and not calls and not note:
                continue                         # minivit's containers and layers without a twin
            per_layer.append((path, type(layer).__name__, calls, note))
        self.rows = []                           # collapse identical consecutive-index groups
        groups = {}
        for path, cls, calls, note in per_layer:
            key, index = _group_key(path)
            ran = sorted((op, sorted((d, sorted(s)) for d, s in r.items())) for op, r in calls.items())
            sig = (key, cls, repr(ran), note.replace(path, "{path}") if path else note)
            if index is not None and sig in groups:
                groups[sig][1].append(index)
                continue
            groups[sig] = entry = [key, [] if index is None else [index], cls, calls, note, path]
            self.rows.append(entry)
        self.rows = [(key.replace("#", _ranges(idx)) if idx else (key or "(model)"), cls, calls,
                      note.replace(path, key.replace("#", _ranges(idx))) if idx and path else note)
                     for key, idx, cls, calls, note, path in self.rows]

    @staticmethod
    def _note(path, layer, calls, own):
        """"" for a minivit layer that runs as written; else what the layer's class (or its patched
        forward) means for the kernel that minivit's layer in its place would run."""
        cls = type(layer).__name__
        slot = KERNEL_SLOTS.get(path.rsplit(".", 1)[-1])
        for base, op, kernel in KERNEL_LAYERS:
            kind = _minivit_base(layer, base)
            if kind or (not own and slot == base):
                if kind == "own":
                    where = "minivit's own, its forward replaced" if "forward" in layer.__dict__ else ""
                elif kind == "base":
                    where = f"a subclass of {base}"
                else:
                    where = f"in the place of minivit's {base}"
                if op in calls:
                    if own:
                        return ""
                    return f"{path} is {cls} ({where}), which calls ops.{op}_forward: {kernel} stays in use"
                return (f"{path} is {cls}" + (f" ({where})" if where else "") +
                        f", which does not call ops.{op}_forward: {kernel} is not used there")
        if not own and not calls:
            return f"your code (no fast path): {cls}"
        return ""

    def note_optimizer(self, op, fast, p):
        """The optimizer's update (op "adamw"), checked by ops.uses_twin on parameter p, joins the lines."""
        self.optimizer[op] = fast
        if not fast:
            self.why[op] = _why_functional(op, p)

    def ops_from(self, source):
        """The ops that ran (at least once, anywhere) from "kernels" or "functional", sorted."""
        found = {op for _, _, calls, _ in self.rows for op, ran in calls.items()
                 if any(source in s for s in ran.values())}
        found |= {op for op, fast in self.optimizer.items() if fast == (source == "kernels")}
        return sorted(found)

    def uses_kernel(self, path, op):
        """Whether the layer(s) of this row path ran op's kernel (path as printed, e.g. "blocks.0-5.attn")."""
        for p, _, calls, _ in self.rows:
            if p == path:
                return any("kernels" in s for s in calls.get(op, {}).values())
        raise KeyError(f"no row {path!r}; rows: {[r[0] for r in self.rows]}")

    def changed_lines(self):
        """One line per group of layers that are not minivit's own: your code, a kernel dropped or kept."""
        lines = []
        for path, cls, calls, note in self.rows:
            if not note:
                continue
            if note.startswith("your code"):
                lines.append(f"{path}: {note}")
            elif "is not used there" in note:
                lines.append(f"kernel dropped out: {note} (your code runs instead)")
            else:
                lines.append(f"kernel kept: {note}")
        return lines

    def summary_lines(self, probe_seconds=None):
        """A few lines for the start of a run: the ops from kernels.py, those from functional.py and why,
        then one line per changed layer group."""
        lines = []
        fast, plain = self.ops_from("kernels"), self.ops_from("functional")
        if fast:
            cost = "" if probe_seconds is None else f", {probe_seconds * 1e3:.0f} ms in all"
            lines.append(f"ops from kernels.py (each checked against functional.py on a probe{cost}): "
                         f"{', '.join(fast)}")
        if plain:
            why = sorted({self.why[op] for op in plain if op in self.why})
            lines.append(f"ops from functional.py: {', '.join(plain)}" + (f" ({'; '.join(why)})" if why else ""))
        return lines + self.changed_lines()

    def __str__(self):
        kind = "a training forward and backward" if self.training else "an eval forward"
        lines = [f"what each layer ran, recorded during {kind}:"]
        for path, cls, calls, note in self.rows:
            if calls:
                what = "; ".join(f"{op} ({_sources(op, ran)})" for op, ran in sorted(calls.items()))
                plain = sorted({self.why[op] for op, ran in calls.items()
                                if op in self.why and any("functional" in s for s in ran.values())})
                what += f" [functional.py: {'; '.join(plain)}]" if plain else ""
            else:
                what = f"your code (no fast path): {cls}"
            lines.append(f"  {path}: {what}" + (f"   <- {note}" if note and calls else ""))
            if note and not calls and not note.startswith("your code"):
                lines.append(f"    {note}")
        for op, fast in self.optimizer.items():
            lines.append(f"  optimizer: {op} ({'kernels' if fast else 'functional'}.{op}_update)")
        return "\n".join(lines)

    __repr__ = __str__
