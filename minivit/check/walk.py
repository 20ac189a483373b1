"""The model walk of minivit.check: every layer of a model as its classes stand, each checked on its own
input by central differences, children before parents (run_model, walk_rows, load_model for --model)."""

import copy
import importlib.util
import inspect
import math
import time
from pathlib import Path

import numpy as np

from .. import embeddings as E
from .. import functional as F
from .. import layers as L
from ..backend import asarray, host_rng, is_array, to_numpy
from ..model import ViT, ViTConfig
from .compare import TOKENS, _attention, _gradient_rows, _linear, _mlp, _raised, _random, _randomise, _sub
from .report import DIFFERS, TOL_GRAD, TOL_SAME, Report, Row, _rel

# --------------------------------------------------------------------------------------------------
# The model walk: every layer of a model as its classes stand, each on its own input
# --------------------------------------------------------------------------------------------------

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
    """(op, the textbook forward of layer at x) for a layer of a class whose math minivit.check knows (its
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
             (E.PatchEmbed, "PatchEmbed", lambda: _linear(_sub(layer.params, "proj."),
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
        from ..clip import CLIP, CLIPConfig
        config = CLIPConfig(embed_dim=8, img_size=8, patch_size=4, vision_width=12, vision_layers=1,
                            vision_heads=3, context_length=6, vocab_size=20, text_width=8, text_layers=1,
                            text_heads=2, mlp_ratio=2.0)
        return CLIP(config, seed=seed, dtype="float64")
    config = ViTConfig(img_size=8, patch_size=2, in_chans=3, num_classes=5, embed_dim=16, depth=2, num_heads=2,
                       mlp_ratio=2.0)
    return ViT(config, seed=seed, dtype="float64")


def default_input(model, batch=3, seed=0):
    """A small random batch of the model's input: images (B, H, W, C) from its config's img_size and
    in_chans; for a CLIP, (images, tokens) with <end> the highest id; for an MAE (minivit.mae), (images,
    noise), the noise fixing which patches are removed."""
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
    if hasattr(config, "mask_ratio"):                               # an MAE: (images, noise), the noise (B, N)
        return images, asarray(rng.random((batch, config.num_patches)))   # held fixed, so the mask is too
    return images


FIX_OWN_LAYER = ("A layer you wrote likely creates its parameters in its own dtype: give it a dtype argument, "
                 "create them with it (np.ones(shape, dtype=dtype)) as minivit's layers do, and build it with "
                 "the model's dtype.")


def not_float64(model):
    """'' when every parameter of model is float64; else what is not, by name: "all 42 parameters are float32",
    or "parameter blocks.0.mlp.act.alpha (float32) is not float64 (1 of 21)" (three named, then how many more)."""
    params = model.params
    low = {name: str(p.dtype) for name, p in params.items() if p.dtype != "float64"}
    if not low:
        return ""
    if len(low) == len(params):
        return f"all {len(params)} parameters are {', '.join(sorted(set(low.values())))}"
    named = ", ".join(f"{name} ({dtype})" for name, dtype in list(low.items())[:3])
    more = f" and {len(low) - 3} more" if len(low) > 3 else ""
    verb = "parameter {} is" if len(low) == 1 else "parameters {} are"
    return f"{verb.format(named + more)} not float64 ({len(low)} of {len(params)})"


def run_model(model, x=None, seed=0):
    """Check every layer of ``model`` as its classes stand (a student's own layers too), each on its own
    input, by float64 central differences; returns a Report (``print`` it, ``.ok``, ``.wrong()``,
    ``.verdict()``). The model is not changed: its copy is checked, parameters moved off their initial
    values and dropout rates set to 0. x: its input (default: a batch of 3 random images of its config's
    shape)."""
    start = time.perf_counter()
    if not isinstance(model, L.Layer):
        raise TypeError(f"run_model takes a minivit model (a Layer), got {type(model).__name__}")
    problem = not_float64(model)
    if problem:
        raise TypeError(f"{problem}; the check needs float64 (float32 rounding swamps the finite differences). "
                        + ("Build it with dtype='float64'." if problem.startswith("all") else FIX_OWN_LAYER))
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
    problem = not_float64(model)
    if problem:
        if not problem.startswith("all"):                   # a float64 model with a few other arrays
            fix = FIX_OWN_LAYER
        elif takes_dtype:
            fix = "Pass dtype to every layer it builds."
        else:
            fix = f"Give it a dtype argument (def {func}(dtype='float64')) and build with it."
        raise ValueError(f"--model: {func}() built a model whose {problem}; the check needs float64. {fix}")
    return model
