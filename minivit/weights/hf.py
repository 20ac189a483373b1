"""Hugging Face transformers folders <-> minivit: ViT (ViTModel, ViTForImageClassification) and CLIP (CLIPModel).

A folder written by transformers' ``save_pretrained()`` holds config.json (the sizes) and the weights:
model.safetensors, or model.safetensors.index.json and its shards, or the older pytorch_model.bin. This
file reads such a folder into minivit's names and layouts, and writes a minivit ViT or CLIP back as one.
It is its own file, not a part of convert.py (the timm and JAX layouts, 600 lines already): a folder
brings its config and class names, and both towers of CLIP are read here. It sits just above model.py, so
that convert.from_pretrained (a ViT) and clip.CLIP.from_pretrained can both call it; that is also why
it has its own small atomic writer and file readers rather than checkpoint.py's and convert.py's.

    what                    transformers (published names; 5.x in memory)            minivit
    patch projection        embeddings.patch_embeddings.projection (D, C, P, P)       patch_embed.proj (P*P*C, D)
    class token, positions  embeddings.cls_token (1, 1, D), position_embeddings      cls_token, pos_embed
    q, k, v                 encoder.layer.N.attention.attention.{query,key,value}     blocks.N.attn.qkv (D, 3D),
                            (layers.N.attention.{q,k,v}_proj), each (D, D) (out, in)  columns [q | k | v]
    attention output        ...attention.output.dense (layers.N.attention.o_proj)    blocks.N.attn.proj
    LayerNorms              ...layernorm_before / layernorm_after, layernorm          norm1 / norm2, norm
    MLP                     ...intermediate.dense, ...output.dense (mlp.fc1, mlp.fc2) mlp.fc1, mlp.fc2
    head                    classifier (K, D)                                         head (D, K)

Linear weights are (out, in) there and (in, out) here; LayerNorm eps is config.json's layer_norm_eps
(1e-12 for ViT, not timm's 1e-6). CLIPModel: vision_model.* is minivit's CLIP image tower (pre_layrnorm is
norm_pre, post_layernorm is norm, visual_projection the bias-free head), text_model.* its text tower.

Reading needs no torch: safetensors files are read with the safetensors package (a dependency already);
a pytorch_model.bin is a pickle that only torch can read safely, so without torch it is refused with the
command that converts it.
"""

import json
import os
import re
import secrets
import types

import numpy

from ..model import ViT, ViTConfig

CONFIG = "config.json"
PREPROCESSOR = "preprocessor_config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
TORCH_BIN, TORCH_BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"

# hidden_act in config.json -> minivit's gelu
GELU_BY_ACT = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
               "quick_gelu": "quick"}
ACT_BY_GELU = {"erf": "gelu", "tanh": "gelu_pytorch_tanh", "quick": "quick_gelu"}

# model types refused by name: what they are, so the error can say why
OTHER_ARCHITECTURES = {"deit": "DeiT (a distillation token and a second head)", "swin": "Swin (windowed attention)",
                       "beit": "BEiT (relative position bias, layer scale)", "dinov2": "DINOv2 (layer scale)",
                       "convnext": "ConvNeXt (a CNN)", "bert": "BERT (a text model)", "gpt2": "GPT-2 (a text model)",
                       "vit_mae": "ViT-MAE (a masked autoencoder)", "clip_vision_model": "CLIP's vision tower alone",
                       "siglip": "SigLIP (a sigmoid loss and a pooling head)"}


# --------------------------------------------------------------------------------------------------
# Reading a folder: config.json and the weights, one file or shards
# --------------------------------------------------------------------------------------------------


def _read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path!r}: {what} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path!r}: {what} must be a JSON object, got {type(value).__name__}")
    return value


def read_folder(folder):
    """A transformers folder -> (config dict, {name: host NumPy array}, preprocessor dict or None).
    Raises FileNotFoundError / ValueError naming the file that is missing, damaged or of another kind."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"no Hugging Face model folder at {folder!r}")
    config_path = os.path.join(folder, CONFIG)
    if not os.path.exists(config_path):
        raise ValueError(f"{folder!r} has no {CONFIG}: a transformers folder (save_pretrained) has one beside "
                         f"the weights, and without it the model's sizes are unknown; files: "
                         f"{sorted(os.listdir(folder))[:8]}")
    config = _read_json(config_path, CONFIG)
    preprocessor = None
    if os.path.exists(os.path.join(folder, PREPROCESSOR)):
        preprocessor = _read_json(os.path.join(folder, PREPROCESSOR), PREPROCESSOR)
    arrays = read_weights(folder)
    bad = [k for k, v in arrays.items() if v.dtype.kind == "f" and not numpy.isfinite(v).all()]
    if bad:
        raise ValueError(f"{folder!r}: {len(bad)} weights hold NaN or infinite values ({', '.join(bad[:4])}): a "
                         f"damaged file, or one saved from a diverged run: use another copy of the weights")
    return config, arrays, preprocessor


SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1", "BOOL": "?"}


def _read_safetensors_by_hand(path):
    """The safetensors format, read without the package: an 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets: [start, end]}}, then the raw little-endian bytes. Used for
    bfloat16 (many newer checkpoints), which NumPy has no type for: widened to float32, exactly (a bfloat16
    is the top 16 bits of a float32)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    arrays = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw, shape = data[start:end], tuple(info["shape"])
        if info["dtype"] == "BF16":
            bits = numpy.frombuffer(raw, "<u2").astype(numpy.uint32) << 16        # bfloat16 -> float32 bits
            arrays[name] = bits.view(numpy.float32).reshape(shape)
        elif info["dtype"] in SAFETENSORS_DTYPES:
            arrays[name] = numpy.frombuffer(raw, SAFETENSORS_DTYPES[info["dtype"]]).reshape(shape).copy()
        else:
            raise ValueError(f"{path!r}: {name} has dtype {info['dtype']}, expected one of "
                             f"{sorted(SAFETENSORS_DTYPES) + ['BF16']}")
    return arrays


def _read_safetensors(path):
    from safetensors.numpy import load_file
    try:
        return load_file(path)
    except TypeError as e:                                # NumPy has no bfloat16
        if "bfloat16" not in str(e):
            raise
        return _read_safetensors_by_hand(path)
    except Exception as e:  # safetensors raises its own SafetensorError; truncated files land here too
        raise ValueError(f"{path!r}: a .safetensors file that cannot be read, truncated or corrupt? "
                         f"({type(e).__name__}: {e})") from None


def read_weights(folder):
    """Every weight of a transformers folder, from model.safetensors, its sharded index, or pytorch_model.bin."""
    def path(name):
        return os.path.join(folder, name)

    for index, read in ((SAFETENSORS_INDEX, _read_safetensors), (TORCH_BIN_INDEX, _read_bin)):
        if os.path.exists(path(index)):
            weight_map = _read_json(path(index), index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{path(index)!r} has no weight_map {{name: shard file}}")
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not os.path.exists(path(s))]
            if missing:
                raise ValueError(f"{path(index)!r} names {len(shards)} shards, but {missing[:3]} "
                                 f"{'is' if len(missing) == 1 else 'are'} not in the folder: an interrupted download?")
            arrays = {}
            for shard in shards:
                arrays.update(read(path(shard)))
            absent = [k for k in weight_map if k not in arrays]
            if absent:
                raise ValueError(f"{path(index)!r}: {absent[:3]} are in the index but in no shard")
            return arrays
    if os.path.exists(path(SAFETENSORS)):
        return _read_safetensors(path(SAFETENSORS))
    if os.path.exists(path(TORCH_BIN)):
        return _read_bin(path(TORCH_BIN))
    raise ValueError(f"{folder!r} has a {CONFIG} but no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX} "
                     f"with its shards, or {TORCH_BIN}; files: {sorted(os.listdir(folder))[:8]}")


def _read_bin(path):
    """pytorch_model.bin: a torch.save pickle. Unpickling one safely takes torch's restricted loader, so
    without torch it is refused: reimplementing that loader here would be a security risk, not a lesson."""
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path!r} is a PyTorch pickle (pytorch_model.bin), which only torch can read safely, and "
                         f"torch is not installed (minivit never needs it). Convert it once where torch is: "
                         f"python -c \"import transformers as t; t.AutoModel.from_pretrained('FOLDER')"
                         f".save_pretrained('FOLDER', safe_serialization=True)\" writes model.safetensors") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path!r}: a PyTorch file that cannot be read ({type(e).__name__}: {e})") from None
    return {k: v.float().numpy() if v.dtype in (torch.float16, torch.bfloat16) else v.numpy()
            for k, v in state.items() if isinstance(v, torch.Tensor)}


def _model_type(config, folder, expected):
    kind = config.get("model_type")
    if kind in expected:
        return kind
    what = OTHER_ARCHITECTURES.get(kind, "")
    raise ValueError(f"{os.path.join(os.fspath(folder), CONFIG)!r} has model_type={kind!r}"
                     f"{f', {what}' if what else ''}; expected {' or '.join(map(repr, expected))}")


def _get(config, key, where, kinds=(int,)):
    value = config.get(key)
    if not isinstance(value, kinds) or isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def _gelu(config, where):
    act = config.get("hidden_act", "gelu")
    if act not in GELU_BY_ACT:
        raise ValueError(f"{where}: hidden_act={act!r} is not a GELU minivit has; "
                         f"expected one of {sorted(GELU_BY_ACT)}")
    return GELU_BY_ACT[act]


def _check_shapes(where, arrays, shapes):
    """config.json against the weights: every expected name there, with its shape; nothing else."""
    missing = [k for k in shapes if k not in arrays]
    unexpected = [k for k in arrays if k not in shapes]
    wrong = [f"{k} {tuple(arrays[k].shape)}, expected {tuple(s)}" for k, s in shapes.items()
             if k in arrays and tuple(arrays[k].shape) != tuple(s)]
    if missing or unexpected or wrong:
        parts = [f"{label} {items[:4]}" for label, items in (("missing", missing), ("unexpected", unexpected),
                                                                ("mis-shaped", wrong)) if items]
        raise ValueError(f"{where}: the weights do not match config.json: " + "; ".join(parts))


# --------------------------------------------------------------------------------------------------
# ViT
# --------------------------------------------------------------------------------------------------

# transformers 5.x's in-memory names -> the published ones (which save_pretrained still writes)
_NEW_TO_OLD = [(r"^layers\.(\d+)\.attention\.q_proj\.", r"encoder.layer.\1.attention.attention.query."),
               (r"^layers\.(\d+)\.attention\.k_proj\.", r"encoder.layer.\1.attention.attention.key."),
               (r"^layers\.(\d+)\.attention\.v_proj\.", r"encoder.layer.\1.attention.attention.value."),
               (r"^layers\.(\d+)\.attention\.o_proj\.", r"encoder.layer.\1.attention.output.dense."),
               (r"^layers\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
               (r"^layers\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
               (r"^layers\.(\d+)\.", r"encoder.layer.\1.")]


def _published_names(arrays):
    """Both naming schemes, and ViTModel's bare names, -> the published ones with the 'vit.' prefix."""
    out = {}
    for name, value in arrays.items():
        if not name.startswith(("vit.", "classifier.")):
            name = "vit." + name                     # a ViTModel folder: no prefix
        if name.startswith("vit."):
            inner = name[4:]
            for pattern, repl in _NEW_TO_OLD:
                inner, n = re.subn(pattern, repl, inner)
                if n:
                    break
            name = "vit." + inner
        out[name] = value
    return out


def hf_vit_shapes(c, K):
    """name -> shape of every array of a transformers ViT (published names) for a minivit ViTConfig;
    K the classifier's outputs (None: a ViTModel without one)."""
    D, M, P, C = c.embed_dim, c.mlp_dim, c.patch_size, c.in_chans
    e = "vit.embeddings."
    shapes = {e + "cls_token": (1, 1, D), e + "position_embeddings": (1, c.seq_len, D),
              e + "patch_embeddings.projection.weight": (D, C, P, P), e + "patch_embeddings.projection.bias": (D,)}
    for i in range(c.depth):
        b = f"vit.encoder.layer.{i}."
        for n in ("query", "key", "value"):
            shapes[f"{b}attention.attention.{n}.weight"] = (D, D)
            if c.qkv_bias:
                shapes[f"{b}attention.attention.{n}.bias"] = (D,)
        shapes.update({b + "attention.output.dense.weight": (D, D), b + "attention.output.dense.bias": (D,),
                       b + "intermediate.dense.weight": (M, D), b + "intermediate.dense.bias": (M,),
                       b + "output.dense.weight": (D, M), b + "output.dense.bias": (D,)})
        for n in ("layernorm_before", "layernorm_after"):
            shapes.update({f"{b}{n}.weight": (D,), f"{b}{n}.bias": (D,)})
    shapes.update({"vit.layernorm.weight": (D,), "vit.layernorm.bias": (D,)})
    if K is not None:
        shapes.update({"classifier.weight": (K, D), "classifier.bias": (K,)})
    return shapes


def vit_config_from_hf(config, where, num_labels=None):
    """A transformers ViTConfig dict -> minivit's ViTConfig (num_classes: its labels, or 1 for none yet)."""
    size = config.get("image_size", 224)
    if isinstance(size, list):
        size = tuple(size)
    D, M = _get(config, "hidden_size", where), _get(config, "intermediate_size", where)
    eps = _get(config, "layer_norm_eps", where, (float, int))
    return ViTConfig(img_size=size, patch_size=_get(config, "patch_size", where),
                     in_chans=config.get("num_channels", 3), num_classes=num_labels or 1, embed_dim=D,
                     depth=_get(config, "num_hidden_layers", where),
                     num_heads=_get(config, "num_attention_heads", where),
                     mlp_ratio=M / D, qkv_bias=bool(config.get("qkv_bias", True)), gelu=_gelu(config, where),
                     norm_eps=float(eps))


def from_hf_vit(config, arrays, where="the transformers ViT"):
    """A transformers ViT's config dict and weights -> (minivit ViTConfig, state dict, K or None)."""
    _model_type(config, where, ("vit",))
    arrays = {k: v for k, v in _published_names(arrays).items() if not k.startswith("vit.pooler.")}
    K = tuple(arrays["classifier.weight"].shape)[0] if "classifier.weight" in arrays else None
    c = vit_config_from_hf(config, where, K)
    if int(c.embed_dim * c.mlp_ratio) != c.mlp_dim or c.mlp_dim != config["intermediate_size"]:
        raise ValueError(f"{where}: intermediate_size {config['intermediate_size']} is not int(mlp_ratio * "
                         f"{c.embed_dim}) for any float mlp_ratio")
    _check_shapes(where, arrays, hf_vit_shapes(c, K))
    a = {k: numpy.asarray(v) for k, v in arrays.items()}
    D, P, C = c.embed_dim, c.patch_size, c.in_chans
    e = "vit.embeddings."
    state = {"patch_embed.proj.weight": a[e + "patch_embeddings.projection.weight"].transpose(2, 3, 1, 0)
             .reshape(P * P * C, D),                                   # (D, C, P, P) -> (P, P, C, D) -> (P*P*C, D)
             "patch_embed.proj.bias": a[e + "patch_embeddings.projection.bias"],
             "cls_token": a[e + "cls_token"], "pos_embed": a[e + "position_embeddings"],
             "norm.weight": a["vit.layernorm.weight"], "norm.bias": a["vit.layernorm.bias"]}
    for i in range(c.depth):
        b, m = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        att = b + "attention.attention."
        state[m + "attn.qkv.weight"] = numpy.concatenate([a[f"{att}{n}.weight"].T for n in ("query", "key", "value")],
                                                         axis=1)       # 3 x (out, in) -> (D, 3D), columns [q | k | v]
        if c.qkv_bias:
            state[m + "attn.qkv.bias"] = numpy.concatenate([a[f"{att}{n}.bias"] for n in ("query", "key", "value")])
        for ours, theirs in (("attn.proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
                             ("mlp.fc2", "output.dense")):
            state[f"{m}{ours}.weight"] = a[f"{b}{theirs}.weight"].T     # (out, in) -> (in, out)
            state[f"{m}{ours}.bias"] = a[f"{b}{theirs}.bias"]
        for ours, theirs in (("norm1", "layernorm_before"), ("norm2", "layernorm_after")):
            state[f"{m}{ours}.weight"], state[f"{m}{ours}.bias"] = a[f"{b}{theirs}.weight"], a[f"{b}{theirs}.bias"]
    if K is not None:
        state["head.weight"], state["head.bias"] = a["classifier.weight"].T, a["classifier.bias"]
    state = {k: numpy.ascontiguousarray(v) for k, v in state.items()}
    return c, state, K


def to_hf_vit(state_dict, config):
    """minivit's ViT state dict (or its grads) -> a transformers ViTForImageClassification's arrays
    (published names, (out, in) layouts); the inverse of from_hf_vit."""
    c = config
    if c.stem != "patch" or c.pos_embed != "learned" or c.pool != "cls":
        raise ValueError(f"a transformers ViT has the patch stem, learned 1-D positions and the class token; got "
                         f"stem={c.stem!r}, pos_embed={c.pos_embed!r}, pool={c.pool!r}")
    for name, value, ok in (("num_registers", c.num_registers, 0), ("representation_size", c.representation_size, None),
                            ("pre_norm", c.pre_norm, False), ("patch_bias", c.patch_bias, True),
                            ("head_bias", c.head_bias, True)):
        if value != ok:
            raise ValueError(f"transformers' ViT has no equivalent of {name}={value!r} (it needs {ok!r})")
    s = {k: numpy.asarray(v) for k, v in state_dict.items()}
    D, P, C = c.embed_dim, c.patch_size, c.in_chans
    e = "vit.embeddings."
    out = {e + "patch_embeddings.projection.weight": s["patch_embed.proj.weight"].reshape(P, P, C, D)
           .transpose(3, 2, 0, 1),                                     # (P*P*C, D) -> (D, C, P, P)
           e + "patch_embeddings.projection.bias": s["patch_embed.proj.bias"],
           e + "cls_token": s["cls_token"], e + "position_embeddings": s["pos_embed"],
           "vit.layernorm.weight": s["norm.weight"], "vit.layernorm.bias": s["norm.bias"],
           "classifier.weight": s["head.weight"].T, "classifier.bias": s["head.bias"]}
    for i in range(c.depth):
        b, m = f"vit.encoder.layer.{i}.", f"blocks.{i}."
        att = b + "attention.attention."
        for j, n in enumerate(("query", "key", "value")):
            out[f"{att}{n}.weight"] = s[m + "attn.qkv.weight"][:, j * D:(j + 1) * D].T   # (D, D) (out, in)
            if c.qkv_bias:
                out[f"{att}{n}.bias"] = s[m + "attn.qkv.bias"][j * D:(j + 1) * D]
        for ours, theirs in (("attn.proj", "attention.output.dense"), ("mlp.fc1", "intermediate.dense"),
                             ("mlp.fc2", "output.dense")):
            out[f"{b}{theirs}.weight"] = s[f"{m}{ours}.weight"].T
            out[f"{b}{theirs}.bias"] = s[f"{m}{ours}.bias"]
        for ours, theirs in (("norm1", "layernorm_before"), ("norm2", "layernorm_after")):
            out[f"{b}{theirs}.weight"], out[f"{b}{theirs}.bias"] = s[f"{m}{ours}.weight"], s[f"{m}{ours}.bias"]
    return {k: numpy.ascontiguousarray(v) for k, v in out.items()}


def hf_vit_config(config, class_names=None):
    """The config.json of a transformers ViTForImageClassification for a minivit ViTConfig."""
    c = config
    H, W = c.img_size
    names = list(class_names) if class_names is not None else [f"LABEL_{k}" for k in range(c.num_classes)]
    if len(names) != c.num_classes:
        raise ValueError(f"class_names has {len(names)} names but the model has {c.num_classes} classes")
    return {"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": c.embed_dim,
            "num_hidden_layers": c.depth, "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_dim,
            "hidden_act": ACT_BY_GELU[c.gelu], "layer_norm_eps": c.norm_eps, "image_size": H if H == W else [H, W],
            "patch_size": c.patch_size, "num_channels": c.in_chans, "qkv_bias": c.qkv_bias,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "encoder_stride": c.patch_size,
            "id2label": {str(k): n for k, n in enumerate(names)}, "label2id": {n: k for k, n in enumerate(names)}}


def load_vit(folder, verbose=True):
    """A transformers ViT folder -> (ViTConfig, state, K, meta): K the classifier's outputs (None for a
    ViTModel); meta the class names (id2label) and the preprocessor's mean and std when the folder has
    them, in the form minivit.predict reads. convert.from_pretrained puts the head on."""
    config, arrays, pre = read_folder(folder)
    where = repr(os.fspath(folder))
    c, state, K = from_hf_vit(config, arrays, where)
    meta = {}
    labels = config.get("id2label")
    if K is not None and isinstance(labels, dict) and len(labels) == K:
        meta["classes"] = [str(labels.get(str(k), labels.get(k, k))) for k in range(K)]
    if pre and "image_mean" in pre and "image_std" in pre:
        meta["mean"], meta["std"] = list(pre["image_mean"]), list(pre["image_std"])
    if verbose and K is None:
        print(f"minivit.hf: {where} is a ViTModel (no classifier); its pooler, if any, is not used")
    return c, state, K, meta


# --------------------------------------------------------------------------------------------------
# Writing a folder
# --------------------------------------------------------------------------------------------------


def _write_atomic(path, data):
    """data (bytes) into path through a temporary file in the same folder, renamed over it: a reader
    never sees half a file, and an interrupted write leaves the old one (checkpoint.write_atomic's rule)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_folder(folder, config, arrays):
    """config.json and model.safetensors (safetensors' own format, with transformers' {"format": "pt"}
    metadata), each written atomically: a reader never sees half a file."""
    from safetensors.numpy import save

    folder = os.fspath(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{folder!r} is a file: save_pretrained writes a folder")
    bad = [k for k, v in arrays.items() if not numpy.isfinite(v).all()]
    if bad:
        raise ValueError(f"refusing to save {folder!r}: {bad[:4]} hold NaN or infinite values")
    os.makedirs(folder, exist_ok=True)
    data = save({k: numpy.array(v, order="C") for k, v in arrays.items()}, metadata={"format": "pt"})
    _write_atomic(os.path.join(folder, SAFETENSORS), data)
    _write_atomic(os.path.join(folder, CONFIG), json.dumps(config, indent=2, sort_keys=True).encode())
    return folder


def save_pretrained(model, folder, class_names=None, dtype="float32"):
    """Write a minivit ViT (or CLIP) as a transformers folder: ViTForImageClassification.from_pretrained
    (CLIPModel.from_pretrained) loads it and gives the same outputs. dtype: of the saved weights."""
    if dtype not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    if hasattr(getattr(model, "config", None), "text_width"):      # a minivit.clip.CLIP (clip/ sits above)
        config, arrays = hf_clip_config(model.config), to_hf_clip(model.state_dict(), model.config)
    elif isinstance(model, ViT):
        if class_names is None:
            class_names = getattr(model, "checkpoint_meta", {}).get("classes")
        config, arrays = hf_vit_config(model.config, class_names), to_hf_vit(model.state_dict(), model.config)
    else:
        raise TypeError(f"model must be a minivit ViT or CLIP, got {type(model).__name__}")
    config["torch_dtype"] = config["dtype"] = dtype
    return write_folder(folder, config, {k: v.astype(dtype) for k, v in arrays.items()})


# --------------------------------------------------------------------------------------------------
# CLIP
# --------------------------------------------------------------------------------------------------

_CLIP_BLOCK = [("norm1", "layer_norm1"), ("norm2", "layer_norm2"), ("attn.proj", "self_attn.out_proj"),
               ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2")]


def _tower_shapes(prefix, D, M, depth):
    shapes = {}
    for i in range(depth):
        b = f"{prefix}encoder.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes.update({f"{b}self_attn.{n}.weight": (D, D), f"{b}self_attn.{n}.bias": (D,)})
        shapes.update({b + "mlp.fc1.weight": (M, D), b + "mlp.fc1.bias": (M,), b + "mlp.fc2.weight": (D, M),
                       b + "mlp.fc2.bias": (D,)})
        for n in ("layer_norm1", "layer_norm2"):
            shapes.update({f"{b}{n}.weight": (D,), f"{b}{n}.bias": (D,)})
    return shapes


def hf_clip_shapes(c):
    """name -> shape of every array of a transformers CLIPModel for a minivit CLIPConfig."""
    W, TW, E, P = c.vision_width, c.text_width, c.embed_dim, c.patch_size
    N = (c.img_size[0] // P) * (c.img_size[1] // P)
    v, t = "vision_model.", "text_model."
    shapes = {v + "embeddings.class_embedding": (W,), v + "embeddings.patch_embedding.weight": (W, c.in_chans, P, P),
              v + "embeddings.position_embedding.weight": (N + 1, W), "visual_projection.weight": (E, W),
              t + "embeddings.token_embedding.weight": (c.vocab_size, TW),
              t + "embeddings.position_embedding.weight": (c.context_length, TW), "text_projection.weight": (E, TW),
              "logit_scale": ()}
    for n in (v + "pre_layrnorm", v + "post_layernorm", t + "final_layer_norm"):
        D = TW if n.startswith(t) else W
        shapes.update({n + ".weight": (D,), n + ".bias": (D,)})
    shapes.update(_tower_shapes(v, W, int(W * c.mlp_ratio), c.vision_layers))
    shapes.update(_tower_shapes(t, TW, int(TW * c.mlp_ratio), c.text_layers))
    return shapes


def _block_from_hf(a, theirs, ours):
    """One encoder layer, transformers' CLIP names -> minivit's Block names."""
    out = {ours + "attn.qkv.weight": numpy.concatenate([a[f"{theirs}self_attn.{n}_proj.weight"].T for n in "qkv"], 1),
           ours + "attn.qkv.bias": numpy.concatenate([a[f"{theirs}self_attn.{n}_proj.bias"] for n in "qkv"])}
    for m, h in _CLIP_BLOCK:
        w = a[f"{theirs}{h}.weight"]
        out[f"{ours}{m}.weight"] = w.T if w.ndim == 2 else w              # (out, in) -> (in, out)
        out[f"{ours}{m}.bias"] = a[f"{theirs}{h}.bias"]
    return out


def _block_to_hf(s, ours, theirs, D):
    out = {}
    for j, n in enumerate("qkv"):
        out[f"{theirs}self_attn.{n}_proj.weight"] = s[ours + "attn.qkv.weight"][:, j * D:(j + 1) * D].T
        out[f"{theirs}self_attn.{n}_proj.bias"] = s[ours + "attn.qkv.bias"][j * D:(j + 1) * D]
    for m, h in _CLIP_BLOCK:
        w = s[f"{ours}{m}.weight"]
        out[f"{theirs}{h}.weight"] = w.T if w.ndim == 2 else w
        out[f"{theirs}{h}.bias"] = s[f"{ours}{m}.bias"]
    return out


def clip_config_from_hf(config, where):
    """A transformers CLIPConfig dict -> the keyword arguments of minivit's CLIPConfig (the text tower's
    <end> rule included)."""
    vc, tc = config.get("vision_config"), config.get("text_config")
    if not isinstance(vc, dict) or not isinstance(tc, dict):
        raise ValueError(f"{where}: a CLIPModel's config.json has vision_config and text_config objects")
    vw, tw = where + " vision_config", where + " text_config"
    gelus = {_gelu(vc, vw), _gelu(tc, tw)}
    if len(gelus) != 1 or gelus - {"erf", "quick"}:
        raise ValueError(f"{where}: minivit's CLIP has one GELU, 'erf' or 'quick', for both towers; got "
                         f"hidden_act {vc.get('hidden_act')!r} and {tc.get('hidden_act')!r}")
    VD, TD = _get(vc, "hidden_size", vw), _get(tc, "hidden_size", tw)
    ratios = {_get(vc, "intermediate_size", vw) / VD, _get(tc, "intermediate_size", tw) / TD}
    if len(ratios) != 1:
        raise ValueError(f"{where}: minivit's CLIP has one mlp_ratio for both towers; got intermediate_size "
                         f"{vc['intermediate_size']}/{VD} and {tc['intermediate_size']}/{TD}")
    for cfg, w in ((vc, vw), (tc, tw)):
        if float(cfg.get("layer_norm_eps", 1e-5)) != 1e-5:
            raise ValueError(f"{w}: layer_norm_eps={cfg['layer_norm_eps']}, but minivit's CLIP uses 1e-5")
    eos = tc.get("eos_token_id", 2)
    return dict(embed_dim=_get(config, "projection_dim", where), img_size=_get(vc, "image_size", vw),
                   patch_size=_get(vc, "patch_size", vw), in_chans=vc.get("num_channels", 3), vision_width=VD,
                   vision_layers=_get(vc, "num_hidden_layers", vw), vision_heads=_get(vc, "num_attention_heads", vw),
                   context_length=_get(tc, "max_position_embeddings", tw), vocab_size=_get(tc, "vocab_size", tw),
                   text_width=TD, text_layers=_get(tc, "num_hidden_layers", tw),
                   text_heads=_get(tc, "num_attention_heads", tw), mlp_ratio=ratios.pop(), gelu=gelus.pop(),
                   eot_token=None if eos == 2 else eos)   # transformers: argmax of the ids when eos_token_id == 2


def from_hf_clip(config, arrays, where="the transformers CLIP"):
    """A transformers CLIPModel's config dict and weights -> (CLIPConfig's keyword arguments, state dict)."""
    _model_type(config, where, ("clip",))
    kwargs = clip_config_from_hf(config, where)
    size = kwargs["img_size"]
    c = types.SimpleNamespace(**dict(kwargs, img_size=(size, size)))
    arrays = {k: v for k, v in arrays.items() if not k.endswith("position_ids")}   # an old buffer, not a weight
    _check_shapes(where, arrays, hf_clip_shapes(c))
    a = {k: numpy.asarray(v) for k, v in arrays.items()}
    v, t = "vision_model.", "text_model."
    W, P, C = c.vision_width, c.patch_size, c.in_chans
    state = {"visual.patch_embed.proj.weight": a[v + "embeddings.patch_embedding.weight"].transpose(2, 3, 1, 0)
             .reshape(P * P * C, W),                                   # (W, C, P, P) -> (P*P*C, W)
             "visual.cls_token": a[v + "embeddings.class_embedding"].reshape(1, 1, W),
             "visual.pos_embed": a[v + "embeddings.position_embedding.weight"][None],
             "visual.norm_pre.weight": a[v + "pre_layrnorm.weight"], "visual.norm_pre.bias": a[v + "pre_layrnorm.bias"],
             "visual.norm.weight": a[v + "post_layernorm.weight"], "visual.norm.bias": a[v + "post_layernorm.bias"],
             "visual.head.weight": a["visual_projection.weight"].T,
             "text.token_embedding.weight": a[t + "embeddings.token_embedding.weight"],
             "text.pos_embed": a[t + "embeddings.position_embedding.weight"][None],
             "text.norm.weight": a[t + "final_layer_norm.weight"], "text.norm.bias": a[t + "final_layer_norm.bias"],
             "text.proj.weight": a["text_projection.weight"].T, "logit_scale": a["logit_scale"].reshape(())}
    for i in range(c.vision_layers):
        state.update(_block_from_hf(a, f"{v}encoder.layers.{i}.", f"visual.blocks.{i}."))
    for i in range(c.text_layers):
        state.update(_block_from_hf(a, f"{t}encoder.layers.{i}.", f"text.blocks.{i}."))
    return kwargs, {k: numpy.array(x, order="C") for k, x in state.items()}


def to_hf_clip(state_dict, config):
    """minivit's CLIP state dict (or grads) -> a transformers CLIPModel's arrays; the inverse of from_hf_clip."""
    c = config
    s = {k: numpy.asarray(x) for k, x in state_dict.items()}
    v, t = "vision_model.", "text_model."
    W, P, C = c.vision_width, c.patch_size, c.in_chans
    out = {v + "embeddings.patch_embedding.weight": s["visual.patch_embed.proj.weight"].reshape(P, P, C, W)
           .transpose(3, 2, 0, 1),                                     # (P*P*C, W) -> (W, C, P, P)
           v + "embeddings.class_embedding": s["visual.cls_token"].reshape(W),
           v + "embeddings.position_embedding.weight": s["visual.pos_embed"][0],
           v + "pre_layrnorm.weight": s["visual.norm_pre.weight"], v + "pre_layrnorm.bias": s["visual.norm_pre.bias"],
           v + "post_layernorm.weight": s["visual.norm.weight"], v + "post_layernorm.bias": s["visual.norm.bias"],
           "visual_projection.weight": s["visual.head.weight"].T,
           t + "embeddings.token_embedding.weight": s["text.token_embedding.weight"],
           t + "embeddings.position_embedding.weight": s["text.pos_embed"][0],
           t + "final_layer_norm.weight": s["text.norm.weight"], t + "final_layer_norm.bias": s["text.norm.bias"],
           "text_projection.weight": s["text.proj.weight"].T, "logit_scale": s["logit_scale"].reshape(())}
    for i in range(c.vision_layers):
        out.update(_block_to_hf(s, f"visual.blocks.{i}.", f"{v}encoder.layers.{i}.", W))
    for i in range(c.text_layers):
        out.update(_block_to_hf(s, f"text.blocks.{i}.", f"{t}encoder.layers.{i}.", c.text_width))
    return {k: numpy.array(x, order="C") for k, x in out.items()}   # (ascontiguousarray makes 0-d 1-d)


def hf_clip_config(c):
    """The config.json of a transformers CLIPModel for a minivit CLIPConfig."""
    H, W = c.img_size
    if H != W:
        raise ValueError(f"transformers' CLIPVisionConfig has one image_size; this model takes {H}x{W} images")
    act = ACT_BY_GELU[c.gelu]
    eos = 2 if c.eot_token is None else c.eot_token      # 2: transformers' flag for "the argmax of the ids"
    text = {"model_type": "clip_text_model", "vocab_size": c.vocab_size, "hidden_size": c.text_width,
            "intermediate_size": int(c.text_width * c.mlp_ratio), "num_hidden_layers": c.text_layers,
            "num_attention_heads": c.text_heads, "max_position_embeddings": c.context_length, "hidden_act": act,
            "layer_norm_eps": 1e-5, "projection_dim": c.embed_dim, "eos_token_id": eos,
            "bos_token_id": min(1, c.vocab_size - 1), "pad_token_id": 0}
    vision = {"model_type": "clip_vision_model", "hidden_size": c.vision_width,
              "intermediate_size": int(c.vision_width * c.mlp_ratio), "num_hidden_layers": c.vision_layers,
              "num_attention_heads": c.vision_heads, "image_size": H, "patch_size": c.patch_size,
              "num_channels": c.in_chans, "hidden_act": act, "layer_norm_eps": 1e-5, "projection_dim": c.embed_dim}
    return {"architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": c.embed_dim,
            "logit_scale_init_value": c.init_logit_scale, "text_config": text, "vision_config": vision}


def load_clip(folder):
    """A transformers CLIPModel folder -> (CLIPConfig's keyword arguments, minivit state dict, meta); meta
    holds the preprocessor's mean and std when the folder has them. clip.CLIP.from_pretrained builds the model."""
    config, arrays, pre = read_folder(folder)
    kwargs, state = from_hf_clip(config, arrays, repr(os.fspath(folder)))
    meta = {}
    if pre and "image_mean" in pre and "image_std" in pre:
        meta = {"mean": list(pre["image_mean"]), "std": list(pre["image_std"])}
    return kwargs, state, meta
