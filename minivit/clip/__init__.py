"""CLIP from scratch (Radford et al., ICML 2021, "Learning Transferable Visual Models From Natural
Language Supervision"): an image tower, a text tower and a contrastive loss, every backward by hand.

    images (B, H, W, C) -> visual: minivit's ViT with CLIP's options -> (B, E) -> L2 normalise -> I (B, E)
    tokens (B, L)       -> text: a causal Transformer, <end>'s features -> (B, E) -> L2 normalise -> T (B, E)
    logits = exp(logit_scale) I T^T                                                      (B, B)
    loss   = (CE(logits, arange B) over rows + CE(logits^T, arange B) over columns) / 2  symmetric InfoNCE

Image i and text i are a pair; every other text in the batch is a negative for image i and every other
image a negative for text i. After training, a class is recognised from its name alone: each class
name is written into prompts ("a photo of a {}"), encoded, and an image goes to the class whose text
embedding is the most similar (zero_shot_classifier).

Glossary (with functional.py's): E joint embedding width, L context length (tokens per caption),
V vocabulary size, W text width, K zero-shot classes.

The rooms:
    loss.py       the joint space: L2 normalisation, the logits with a learned temperature, the symmetric
                  InfoNCE loss, and one rank's share of it over a global batch (contrastive_loss_rows)
    model.py      the text tower, CLIPConfig, CLIP, presets, open_clip's names and layouts
    zero_shot.py  features in eval mode, zero-shot classification, retrieval recall
    captions.py   the tokenizers and the captioned data sets (minivit.clip.captions; old name minivit.captions)
    task.py       CLIP's task for the trainer (--task clip): its data, batches, step on R ranks too, evaluation
                  (minivit.clip.task, loaded when first named; old name minivit.clip_train)
Every public name of loss, model and zero_shot is here too: ``minivit.clip.CLIP``, ``minivit.clip.contrastive_loss``.
"""

import importlib

from .loss import (L2Normalize, Similarity, contrastive_loss, contrastive_loss_rows, l2_normalize_backward,
                   l2_normalize_forward, similarity_backward, similarity_forward)
from .model import CLIP, CLIPConfig, TextTransformer, from_open_clip, open_clip_config, presets, to_open_clip
from .zero_shot import encode_images, encode_texts, retrieval_recall, zero_shot_classifier, zero_shot_predict

__all__ = ["L2Normalize", "Similarity", "contrastive_loss", "contrastive_loss_rows", "l2_normalize_backward",
           "l2_normalize_forward", "similarity_backward", "similarity_forward", "CLIP", "CLIPConfig",
           "TextTransformer", "from_open_clip", "open_clip_config", "presets", "to_open_clip", "encode_images",
           "encode_texts", "retrieval_recall", "zero_shot_classifier", "zero_shot_predict"]


def __getattr__(name):
    """``minivit.clip.task`` (the trainer's part, which loads the data sets and distributed): imported when
    first named, so that ``import minivit.clip`` stays a model and its loss."""
    if name == "task":
        return importlib.import_module(".task", __name__)
    raise AttributeError(f"module 'minivit.clip' has no attribute {name!r}")
