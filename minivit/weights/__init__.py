"""minivit.weights: parameters kept on disk and brought in from elsewhere.

    checkpoint.py  the trainer's own .npz (model, optimizer, RNG states, step), written atomically; load_model
                   (``minivit.checkpoint``)
    hf.py          Hugging Face transformers folders, ViT and CLIP: config.json + model.safetensors, both ways;
                   it sits just above model.py so that clip.CLIP.from_pretrained can call it (``minivit.hf``)
    files.py       checkpoint files told apart by their content (JAX .npz, timm .safetensors / .pth, minivit's)
    convert.py     published layouts (timm, Google's JAX release) <-> minivit's, and from_pretrained, which
                   reads any of them, resizing position embeddings or replacing the head on the way
                   (``minivit.convert``)

The model itself never needs this room: a ViT is built from a ViTConfig (minivit/model.py); these files
only move its numbers to and from files. The names most used are here too:
``minivit.weights.from_pretrained``, ``.load_model``, ``.save_checkpoint``, ``.save_pretrained``.
"""

from .checkpoint import load_checkpoint, load_model, save_checkpoint
from .convert import from_pretrained
from .hf import save_pretrained

__all__ = ["load_checkpoint", "load_model", "save_checkpoint", "from_pretrained", "save_pretrained"]
