"""Checkpoint files, told apart by their content, not by their names: the original JAX release's .npz,
timm's .safetensors and .pth / .bin (a zip written by torch.save), and minivit's own .npz.

    read_checkpoint_file(path) -> (kind, arrays)    kind: "google", "timm" or "minivit"; arrays: host NumPy

A .safetensors file is read by its header (8 bytes of length, a JSON table of dtypes, shapes and offsets),
each entry checked against the file's size before it is read; BF16 is widened to float32. A .pth / .bin file
needs torch (imported only then). convert.py turns what this file reads into a ViT's parameters.
"""

import json
import math
import os
import zipfile

import numpy

from .checkpoint import read_npz

PATCH_KEY = "patch_embed.proj.weight"      # timm's patch projection: what tells a timm file apart


def read_checkpoint_file(path):
    """Read a checkpoint's arrays, the format told by the file's first bytes. Returns (kind, arrays):
    kind "google" (an .npz in the JAX release's layout), "timm" (.safetensors, a PyTorch .pth/.bin, or
    an .npz with timm's names) or "minivit" (minivit.checkpoint's .npz; arrays: its parameters), arrays
    a dict of host NumPy arrays. Raises FileNotFoundError for a missing file and ValueError for a file
    of another kind or a truncated one."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint file at {path!r}")
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory: pass the checkpoint file inside it (e.g. model.safetensors, "
                         f"pytorch_model.bin or the .npz), or give a Hugging Face folder to minivit.from_pretrained")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(16)
    if size == 0:
        raise ValueError(f"{path!r} is empty (0 bytes): an interrupted download?")
    if head.startswith(b"PK"):                            # a zip: numpy's .npz or torch.save's format
        return _read_zip(path, size)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):  # a pickle: old torch.save
        return "timm", _read_torch(path)
    if head.startswith(b"\x93NUMPY"):
        raise ValueError(f"{path!r} is a single NumPy array (.npy), not a checkpoint of named arrays")
    if len(head) >= 9 and head[8:9] == b"{":              # safetensors: u64 header length, JSON header
        header_len = int.from_bytes(head[:8], "little")
        if 8 + header_len > size:
            raise ValueError(f"{path!r} looks like a .safetensors file but is truncated: its header alone "
                             f"needs {8 + header_len} bytes and the file has {size}")
        return "timm", _read_safetensors(path)
    raise ValueError(f"{path!r} is not a checkpoint minivit can read (the JAX release's .npz, timm's "
                     f".safetensors, .pth or .bin): it starts with {head[:12]!r}{_what_it_looks_like(head)}")


def _what_it_looks_like(head):
    if head.startswith(b"\x1f\x8b"):
        return ", a gzip file (extract it first)"
    if head.startswith(b"\x89HDF"):
        return ", an HDF5 file (Keras .h5?)"
    if head.startswith((b"<", b"{", b"[")) or all(32 <= c < 127 or c in (9, 10, 13) for c in head):
        return ", which looks like text (an HTML error page or a Git LFS pointer instead of the weights?)"
    return ""


def _read_zip(path, size):
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path!r} is a zip archive (.npz or PyTorch) that cannot be opened, probably "
                         f"truncated ({size} bytes): {e}") from None
    if any(n.endswith("data.pkl") for n in names):
        return "timm", _read_torch(path)
    if not names or not all(n.endswith(".npy") for n in names):
        raise ValueError(f"{path!r} is a zip archive but neither an .npz nor a PyTorch checkpoint "
                         f"(members: {names[:5]})")
    try:
        arrays = read_npz(path)               # each header checked before its array is allocated
    except (OSError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path!r}: an .npz whose arrays cannot be read, truncated or corrupt? ({e})") from None
    if "meta" in arrays and any(k.startswith("param/") for k in arrays):   # minivit.checkpoint's own files
        return "minivit", {k[len("param/"):]: v for k, v in arrays.items() if k.startswith("param/")}
    bad = [f"{k} ({v.dtype})" for k, v in arrays.items() if v.dtype.kind != "f"]
    if bad:
        raise ValueError(f"{path!r}: expected floating-point arrays, got {bad[:3]} (bfloat16 is stored as "
                         f"raw V2 bytes: convert it to float32 first)")
    keys = list(arrays)
    if any(k.endswith("embedding/kernel") or k.startswith("Transformer/") for k in keys):
        return "google", arrays
    if PATCH_KEY in arrays and arrays[PATCH_KEY].ndim == 4:
        return "timm", arrays
    raise ValueError(f"{path!r} is an .npz, but its arrays are neither the JAX release's ViT "
                     f"(embedding/kernel, Transformer/...) nor timm's (a 4-D {PATCH_KEY}); keys: {sorted(keys)[:5]}")


SAFETENSORS_FLOATS = ("F16", "BF16", "F32", "F64")   # the dtypes weights may have; BF16 is widened to float32


def _read_safetensors(path):
    """{name: array} of a .safetensors file: its JSON header read first, so that integer (quantised) or
    boolean tensors are refused by name, and BF16 ones (NumPy has no bfloat16) are widened to float32."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            dtypes = {name: entry["dtype"] for name, entry in header.items()}
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"{path!r}: a .safetensors file whose header cannot be read ({e})") from None
    other = [f"{name} ({dtype})" for name, dtype in dtypes.items() if dtype not in SAFETENSORS_FLOATS]
    if other:
        raise ValueError(f"{path!r}: {len(other)} tensors are not floating-point ({', '.join(other[:3])}): weights "
                         f"must be F16, BF16, F32 or F64 (a quantised or foreign file: convert it to float first)")
    if "BF16" in dtypes.values():
        return _read_bf16_safetensors(path, header, 8 + header_len, size)
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise ImportError(f"{path!r} is a .safetensors file: reading it needs the safetensors package "
                          f"(pip install safetensors; no torch needed)") from None
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own SafetensorError; truncated data lands here too
        raise ValueError(f"{path!r}: a .safetensors file that cannot be read, truncated or corrupt? "
                         f"({type(e).__name__}: {e})") from None


def _read_bf16_safetensors(path, header, start, size):
    """_read_safetensors for a file holding BF16 tensors: each read at its offsets (checked against its shape
    and the file's size first), BF16 widened to float32 exactly (its 16 bits are float32's upper half)."""
    kinds = {"F16": numpy.float16, "BF16": numpy.uint16, "F32": numpy.float32, "F64": numpy.float64}
    arrays = {}
    with open(path, "rb") as f:
        for name, entry in header.items():
            dtype = numpy.dtype(kinds[entry["dtype"]]).newbyteorder("<")
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if not 0 <= begin <= end <= size - start or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{path!r}: the tensor {name!r} ({entry['dtype']} {list(shape)}) has offsets "
                                 f"{begin}..{end} that do not fit its shape or the file: truncated or corrupt")
            f.seek(start + begin)
            value = numpy.frombuffer(f.read(end - begin), dtype).reshape(shape)
            if entry["dtype"] == "BF16":
                value = (value.astype(numpy.uint32) << 16).view(numpy.float32)
            arrays[name] = value.astype(value.dtype.newbyteorder("="))
    return arrays


def _read_torch(path):
    try:
        import torch
    except ImportError:
        raise ImportError(f"{path!r} is a PyTorch checkpoint: reading it needs torch, or convert it to "
                          f".safetensors where torch is installed") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path!r}: a PyTorch checkpoint that cannot be read, truncated or not a plain "
                         f"state dict? ({type(e).__name__}: {e})") from None
    for key in ("model", "state_dict", "model_state_dict"):   # training checkpoints nest the weights
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise ValueError(f"{path!r} holds a {type(obj).__name__}, not a state dict of tensors")
    arrays = {k: (v.float() if v.dtype in (torch.bfloat16, torch.float16) else v).detach().numpy()
              for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not arrays:
        raise ValueError(f"{path!r} holds a dict without tensors (keys {list(obj)[:5]})")
    return arrays
