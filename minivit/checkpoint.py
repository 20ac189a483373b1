"""Checkpoints: one ``.npz`` file holding a model, and optionally its optimizer and training state.

Layout inside the file (plain NumPy arrays, nothing pickled):
    meta                       a JSON string: format, ViTConfig, dtype, step, optimizer hyperparameters,
                               dropout RNG states, class names, normalisation, anything the trainer adds
    param/<name>               each model parameter, minivit's layout (e.g. param/blocks.0.attn.qkv.weight)
    optim/<kind>/<name>        each optimizer buffer (e.g. optim/exp_avg/head.weight)

Files are written atomically: to a temporary file in the same folder, flushed to disk, then renamed
over the target, so a crash or Ctrl-C mid-write never leaves a half-written checkpoint.
"""

import json
import os
import tempfile
import zipfile

import numpy

from .layers import Dropout
from .model import ViT, ViTConfig

FORMAT = "minivit-checkpoint-1"


def dropout_layers(model):
    """(name, Dropout) for every dropout/drop-path layer inside ``model``, in a fixed order."""
    return [(name, layer) for name, layer in model.named_sublayers() if isinstance(layer, Dropout)]


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def save_checkpoint(path, model, optimizer=None, extra=None):
    """Write model (+ optimizer state, dropout RNG states, and any JSON-able ``extra``) to path, atomically."""
    arrays = {f"param/{k}": v for k, v in model.state_dict().items()}
    meta = {"format": FORMAT, "config": model.config.to_dict(), "dtype": model.dtype,
            "dropout_rng": {name: d.rng.bit_generator.state for name, d in dropout_layers(model)},
            "extra": _jsonable(extra or {})}
    if optimizer is not None:
        state = optimizer.state_dict()
        meta["optimizer"] = {"type": state["type"], "step": state["step"],
                             "hyperparams": _jsonable(state["hyperparams"])}
        for kind, buffers in state["buffers"].items():
            meta["optimizer"].setdefault("kinds", []).append(kind)
            for name, buf in buffers.items():
                arrays[f"optim/{kind}/{name}"] = buf
    arrays["meta"] = numpy.array(json.dumps(meta))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".npz.tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            numpy.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def load_checkpoint(path):
    """Read a checkpoint: returns {"meta": dict, "params": {name: array}, "optimizer": state dict or None}.
    A missing, truncated or foreign file gets an error that names it."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path!r} is not a readable minivit checkpoint (truncated or another kind of file: "
                         "a checkpoint is an .npz archive)")
    try:
        with numpy.load(path, allow_pickle=False) as npz:
            if "meta" not in npz.files:
                raise ValueError(f"{path!r} is an .npz file but not a minivit checkpoint (it has no 'meta' entry)")
            meta = json.loads(str(npz["meta"]))
            arrays = {k: npz[k] for k in npz.files if k != "meta"}
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise ValueError(f"{path!r} is not a readable minivit checkpoint (truncated or another kind of file: "
                         f"{err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path!r}: its metadata is not valid JSON ({err})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
    params = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    optimizer = None
    if "optimizer" in meta:
        o = meta["optimizer"]
        buffers = {kind: {} for kind in o.get("kinds", [])}
        for k, v in arrays.items():
            if k.startswith("optim/"):
                _, kind, name = k.split("/", 2)
                buffers.setdefault(kind, {})[name] = v
        hp = dict(o["hyperparams"])
        if isinstance(hp.get("betas"), list):
            hp["betas"] = tuple(hp["betas"])
        optimizer = {"type": o["type"], "step": o["step"], "hyperparams": hp, "buffers": buffers}
    return {"meta": meta, "params": params, "optimizer": optimizer}


def restore_dropout_rngs(model, states):
    """Put saved dropout RNG states back, so a resumed run draws the same masks as an uninterrupted one."""
    for name, layer in dropout_layers(model):
        if name in states:
            layer.rng.bit_generator.state = states[name]


def load_model(path, backend=None):
    """The ViT saved in a checkpoint, with its weights (on the current backend unless one is named)."""
    ckpt = load_checkpoint(path)
    meta = ckpt["meta"]
    try:
        config = ViTConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{os.fspath(path)!r}: the saved model config is not valid ({err})") from None
    model = ViT(config, dtype=meta.get("dtype", "float32"))
    if backend is not None:
        model.to(backend)
    model.load_state_dict(ckpt["params"])
    restore_dropout_rngs(model, meta.get("dropout_rng", {}))
    model.checkpoint_meta = meta.get("extra", {})
    return model
