"""Checkpoints: one ``.npz`` file holding a model, and optionally its optimizer and training state.

Layout inside the file (plain NumPy arrays, nothing pickled):
    meta                       a JSON string: format, ViTConfig, dtype, step, optimizer hyperparameters,
                               dropout RNG states, class names, normalisation, anything the trainer adds
    param/<name>               each model parameter, minivit's layout (e.g. param/blocks.0.attn.qkv.weight)
    optim/<kind>/<name>        each optimizer buffer (e.g. optim/exp_avg/head.weight)

Files are written atomically (write_atomic): to a temporary file in the same folder, flushed to disk,
then renamed over the target, so a crash or Ctrl-C mid-write never leaves a half-written checkpoint. A
temporary file that a SIGKILL left behind is named like ``.checkpoint-1a2b3c4d.npz.tmp``;
remove_stale_temporaries(folder) deletes them (the trainer does at the start of each run).
"""

import dataclasses
import glob
import json
import math
import os
import secrets
import zipfile

import numpy

from ..layers import Dropout
from ..memory import check_fits, size_text
from ..model import DTYPES, ViT, ViTConfig, param_shapes

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


def _temporary_name(path):
    """.<stem>-<random>.<ext>.tmp beside path: checkpoint.npz -> .checkpoint-1a2b3c4d.npz.tmp"""
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    return os.path.join(folder, f".{stem}-{secrets.token_hex(4)}{ext}.tmp")


def write_atomic(path, write):
    """Create path through a temporary file: write(f) fills the binary file f, which is flushed to disk
    and renamed over path. On any error (Ctrl-C included) the temporary is removed and path is untouched.
    The file gets the mode open() would give it (0666 less the umask), like every other output."""
    tmp = _temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def remove_stale_temporaries(folder, names=("checkpoint.npz", "summary.json", "metrics.jsonl")):
    """Delete the temporary files that an interrupted write_atomic of these names left in folder (a
    SIGKILL mid-write skips the clean-up). Returns the paths removed."""
    removed = []
    for name in names:
        stem, ext = os.path.splitext(name)
        for path in glob.glob(os.path.join(glob.escape(folder), f".{stem}-*{ext}.tmp")):
            os.remove(path)
            removed.append(path)
    return removed


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
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return write_atomic(path, lambda f: numpy.savez(f, **arrays))


def read_npz(path):
    """Every array of the .npz at path, {name: array}, each .npy header checked before its array is
    allocated: a header that claims more bytes than its member holds (an edited or damaged file would
    otherwise allocate whatever it claims), an object array (it would need pickle), or arrays larger than
    the memory available are refused in one line naming the file and the array."""
    declared = {}
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            name = info.filename[:-len(".npy")] if info.filename.endswith(".npy") else info.filename
            with z.open(info) as f:
                try:
                    version = numpy.lib.format.read_magic(f)
                    read_header = (numpy.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else numpy.lib.format.read_array_header_2_0)
                    shape, _, dtype = read_header(f)
                except (ValueError, OSError, EOFError) as err:
                    raise ValueError(f"{path!r}: the array {name!r} has no readable .npy header ({err}): a "
                                     f"damaged or foreign file") from None
                header_len = f.tell()
            if dtype.hasobject:
                raise ValueError(f"{path!r}: the array {name!r} holds Python objects (dtype object), which "
                                 f"would need pickle to load: an edited or foreign file, not loaded")
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > info.file_size - header_len:
                held = size_text(max(info.file_size - header_len, 0))
                raise ValueError(f"{path!r}: the header of {name!r} declares {shape} {dtype} "
                                 f"({size_text(nbytes)}), and the file holds {held} for it: a damaged or edited "
                                 f"file (nothing was allocated)")
            declared[name] = nbytes
    check_fits(sum(declared.values()), f"{path!r} (its arrays)", "free memory, or use a smaller checkpoint")
    with numpy.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def load_checkpoint(path):
    """Read a checkpoint: returns {"meta": dict, "params": {name: array}, "optimizer": state dict or None}.
    path: the .npz file, or a run folder (the --out of minivit.train) holding checkpoint.npz.
    A missing, truncated or foreign file gets an error that names it."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "checkpoint.npz")):
            raise FileNotFoundError(f"{path!r} is a folder without a checkpoint.npz (give the checkpoint file, "
                                    "or the --out folder of a training run)")
        path = os.path.join(path, "checkpoint.npz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path!r} is not a readable minivit checkpoint (truncated or another kind of file: "
                         "a checkpoint is an .npz archive)")
    try:
        arrays = read_npz(path)
        if "meta" not in arrays:
            raise ValueError(f"{path!r} is an .npz file but not a minivit checkpoint (it has no 'meta' entry)")
        meta = json.loads(str(arrays.pop("meta")))
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise ValueError(f"{path!r} is not a readable minivit checkpoint (truncated or another kind of file: "
                         f"{err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path!r}: its metadata is not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path!r} has format {found!r}, expected {FORMAT!r}")
    params = {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    check_meta(path, meta, params, arrays)
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
    return {"meta": meta, "params": params, "optimizer": optimizer, "path": path}


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and numpy.isfinite(value)


def check_meta(path, meta, params, arrays):
    """Every part of a checkpoint's metadata, and the kind of each array, checked before any of it is used
    (nothing is built, allocated or written from an unchecked value): a ValueError naming the file, the
    entry and what was expected. A ViT's config must describe exactly the parameter arrays the file holds,
    so that a config edited to a huge model is refused before the model is allocated."""
    def bad(what, expected, value):
        shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
        return ValueError(f"{path!r}: {what} must be {expected}, got {shown} (an edited or damaged file: use "
                          f"another checkpoint)")

    for key, value in arrays.items():
        if key != "meta" and value.dtype.kind != "f":
            raise ValueError(f"{path!r}: the array {key!r} holds {value.dtype} values, expected floating-point "
                             f"numbers (an edited or damaged file: use another checkpoint)")
    config = meta.get("config")
    if not isinstance(config, dict):
        raise bad("the metadata's 'config'", "a dict", config)
    if "dtype" in meta and meta["dtype"] not in DTYPES:
        raise bad("the metadata's 'dtype'", f"one of {DTYPES}", meta["dtype"])
    for key in ("extra", "dropout_rng", "optimizer"):
        if key in meta and not isinstance(meta[key], dict):
            raise bad(f"the metadata's {key!r}", "a dict", meta[key])
    extra = meta.get("extra") or {}
    if "step" in extra and not (_is_int(extra["step"]) and extra["step"] >= 0):
        raise bad("extra['step'] (the optimizer steps done)", "an int >= 0", extra["step"])
    if "best_val_accuracy" in extra and not (_is_number(extra["best_val_accuracy"])
                                             and 0 <= extra["best_val_accuracy"] <= 1):
        raise bad("extra['best_val_accuracy']", "a number in [0, 1]", extra["best_val_accuracy"])
    for key in ("train_config", "loss_scaler"):
        if key in extra and not isinstance(extra[key], dict):
            raise bad(f"extra[{key!r}]", "a dict", extra[key])
    if "dataset" in extra and not isinstance(extra["dataset"], str):
        raise bad("extra['dataset']", "a str", extra["dataset"])
    classes = extra.get("classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise bad("extra['classes']", "a list of class names (str)", classes)
    if "num_classes" in extra and not (_is_int(extra["num_classes"]) and extra["num_classes"] >= 1):
        raise bad("extra['num_classes']", "an int >= 1", extra["num_classes"])
    for key in ("mean", "std"):
        if key in extra and not (isinstance(extra[key], list) and all(_is_number(v) for v in extra[key])):
            raise bad(f"extra[{key!r}]", "a list of numbers", extra[key])
    if "optimizer" in meta:
        o = meta["optimizer"]
        missing = [k for k in ("type", "step", "hyperparams") if k not in o]
        if missing:
            raise ValueError(f"{path!r}: the optimizer state in its metadata lacks {missing} (an edited file?)")
        if not isinstance(o["type"], str):
            raise bad("the optimizer's 'type'", "a str", o["type"])
        if not (_is_int(o["step"]) and o["step"] >= 0):
            raise bad("the optimizer's 'step'", "an int >= 0", o["step"])
        if not isinstance(o["hyperparams"], dict):
            raise bad("the optimizer's 'hyperparams'", "a dict", o["hyperparams"])
        if not (isinstance(o.get("kinds", []), list) and all(isinstance(k, str) for k in o.get("kinds", []))):
            raise bad("the optimizer's 'kinds'", "a list of str", o.get("kinds"))
        for key in arrays:
            if key.startswith("optim/") and key.count("/") < 2:
                raise ValueError(f"{path!r}: the array {key!r} is named like no optimizer buffer (optim/<kind>/<name>)")
    if not set(config) <= {f.name for f in dataclasses.fields(ViTConfig)}:
        return                                       # another model's config (a CLIP, a ResNet): its class checks it
    try:
        vit = ViTConfig.from_dict(config)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path!r}: the saved model config is not valid ({err})") from None
    # The config must not describe a model far larger than the arrays the file holds (an edited config would
    # allocate it before load_state_dict compares them). Larger, not different: a student's model may add or
    # drop a parameter and still be saved and loaded. The qkv and proj weights alone first, in closed form.
    stored = sum(int(v.size) for v in params.values())
    limit = 2 * stored + 1_000_000
    claimed = vit.depth * 4 * vit.embed_dim ** 2
    if claimed <= limit:
        claimed = sum(math.prod(shape) for shape in param_shapes(vit).values())
    if claimed > limit:
        raise ValueError(f"{path!r}: the saved model config describes a model of at least {claimed:,} parameters, "
                         f"and the file holds {stored:,} (an edited or damaged file: use another checkpoint)")
    if classes is not None and len(classes) != vit.num_classes:
        raise ValueError(f"{path!r}: extra['classes'] names {len(classes)} classes, and the model has "
                         f"{vit.num_classes} outputs (an edited or damaged file: use another checkpoint)")


DIVERGED = "the run that wrote it had diverged. Use an earlier checkpoint, or train again with a lower --lr"


def check_finite(params, where, what="parameters", advice=DIVERGED):
    """Refuse arrays holding NaN or infinity (a diverged run, a damaged file), naming them: a ValueError.
    what: what the arrays are; advice: what to do, said after."""
    bad = [name for name, value in params.items() if not numpy.isfinite(value).all()]
    if bad:
        shown = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise ValueError(f"{where}: {len(bad)} {what} hold NaN or infinite values ({shown}); {advice}")


def restore_dropout_rngs(model, states):
    """Put saved dropout RNG states back, so a resumed run draws the same masks as an uninterrupted one."""
    for name, layer in dropout_layers(model):
        if name in states:
            layer.rng.bit_generator.state = states[name]


def check_is_vit(path, meta):
    """Refuse, by what it is, a checkpoint of another model than a ViT classifier (--task clip's, --task mae's),
    where a ViT is needed (predict, load_model, --init): its config would otherwise be called invalid."""
    config = meta.get("config")
    if isinstance(config, dict) and "vision_width" in config:
        raise ValueError(f"{os.fspath(path)!r} is a CLIP checkpoint (an image and a text encoder, written by "
                         f"--task clip), not a ViT classifier: continue it with `python -m minivit.train --resume "
                         f"--out <its run folder>`, or load it with minivit.clip.task's build_model")
    if isinstance(config, dict) and "mask_ratio" in config:
        raise ValueError(f"{os.fspath(path)!r} is an MAE checkpoint (an encoder and a pixel decoder, written by "
                         f"--task mae), not a ViT classifier: fine-tune its encoder as one with `python -m "
                         f"minivit.train --init {os.fspath(path)}` (lesson 19), or continue its pre-training with "
                         f"`--resume`")


def load_model(path, backend=None):
    """The ViT saved in a checkpoint (a file, or a run folder holding checkpoint.npz), with its weights, on
    the current backend unless one is named. Non-finite weights (a diverged run) are refused by name. A
    --distill run's checkpoint gives its DistilledViT (minivit/deit/weights.py), in eval mode."""
    ckpt = load_checkpoint(path)
    path, meta = ckpt["path"], ckpt["meta"]
    check_is_vit(path, meta)
    if "dist_token" in ckpt["params"]:           # a --distill run's DistilledViT (DeiT): its own loader builds it
        from ..deit.weights import load_model as load_distilled
        return load_distilled(path, backend=backend)
    check_finite(ckpt["params"], repr(path))
    try:
        config = ViTConfig.from_dict(meta["config"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{os.fspath(path)!r}: the saved model config is not valid ({err})") from None
    model = ViT(config, dtype=meta.get("dtype", "float32"))
    if backend is not None:
        model.to(backend)
    try:
        model.load_state_dict(ckpt["params"])
    except (TypeError, ValueError) as err:
        hint = ""
        if "unexpected keys" in str(err) or "missing keys" in str(err) or "mis-shaped" in str(err):
            hint = (f"; a plain ViT of the saved config does not hold these parameters, so the checkpoint was "
                    f"saved from a changed model: build that model as you did, then "
                    f"model.load_state_dict(load_checkpoint({os.fspath(path)!r})['params'])")
        raise ValueError(f"{path!r}: {err}{hint}") from None
    restore_dropout_rngs(model, meta.get("dropout_rng") or {})
    model.checkpoint_meta = meta.get("extra") or {}
    return model
