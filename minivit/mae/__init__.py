"""MAE, masked autoencoders (He et al., CVPR 2022): pre-train a ViT's encoder by reconstructing the 75% of
the patches it never saw, then fine-tune it as a classifier (lesson 19).

    masking.py   random masking by per-sample noise (gather / scatter) and the decoder's unshuffle
    loss.py      the mean squared error on the removed patches, optionally per-patch normalised
    model.py     MAEConfig, MAE, the encoder handed to a ViT (finetune_vit)
    task.py      --task mae for python -m minivit.train (imported by the trainer when asked for)
"""

from .loss import masked_mse, masked_mse_backward, masked_mse_forward, normalize_patches
from .masking import (RandomMasking, len_keep_of, random_masking_backward, random_masking_forward,
                      unshuffle_backward, unshuffle_forward)
from .model import MAE, MAEConfig, create_mae, encoder_state_dict, finetune_vit

__all__ = ["MAE", "MAEConfig", "RandomMasking", "create_mae", "encoder_state_dict",
           "finetune_vit", "len_keep_of", "masked_mse", "masked_mse_backward", "masked_mse_forward",
           "normalize_patches", "random_masking_backward", "random_masking_forward", "unshuffle_backward",
           "unshuffle_forward"]
