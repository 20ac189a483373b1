"""DeiT from scratch (Touvron et al., ICML 2021, "Training data-efficient image transformers & distillation
through attention"): a ViT that learns from a CNN teacher through a second token, every backward by hand.

    images (B, H, W, C) -> [x_class; x_dist; patches] + E_pos -> the ViT's blocks and norm -> (B, 2+N, D)
    token 0 -> head      -> logits       (B, K)   pulled towards the labels
    token 1 -> head_dist -> logits_dist  (B, K)   pulled towards the teacher's answer
    hard:  L = 1/2 CE(logits, y) + 1/2 CE(logits_dist, argmax teacher_logits)
    soft:  L = (1 - alpha) CE(logits, y) + alpha tau^2 KL(psi(teacher_logits / tau) || psi(logits_dist / tau))
    inference: (logits + logits_dist) / 2

The rooms:
    model.py    DistTokenEmbed (the two tokens and E_pos over N + 2 rows), DistilledViT
    loss.py     the hard and soft distillation losses, forward/backward pairs (and the KL pair)
    weights.py  timm's VisionTransformerDistilled state dicts and files, from_pretrained, load_model
    task.py     the trainer's task: python -m minivit.train --distill TEACHER_CHECKPOINT (the teacher: a ResNet)
Lesson: notebooks/18_deit_distillation.ipynb.
"""

from .loss import (DISTILL_KINDS, distillation_loss, hard_distillation_backward, hard_distillation_forward,
                   kl_distillation_backward, kl_distillation_forward, soft_distillation_backward,
                   soft_distillation_forward)
from .model import DistilledViT, DistTokenEmbed, check_distilled_config
from .weights import from_pretrained, from_timm_distilled, load_model, to_timm_distilled

__all__ = ["DISTILL_KINDS", "distillation_loss", "hard_distillation_backward", "hard_distillation_forward",
           "kl_distillation_backward", "kl_distillation_forward", "soft_distillation_backward",
           "soft_distillation_forward", "DistilledViT", "DistTokenEmbed", "check_distilled_config", "from_pretrained",
           "from_timm_distilled", "load_model", "to_timm_distilled"]
