"""DeiT's task for the trainer: ``python -m minivit.train --distill TEACHER_CHECKPOINT`` (--task distill).

The classifier's task (minivit/train/tasks.py: its data, batches, evaluation) with a DistilledViT for the
model, a trained classifier for the teacher and the distillation loss for the step. The loop runs it as it runs
any task (minivit/train/loop.py does not know which). One optimizer step (DistillTask.train_step):

    teacher_logits = teacher.forward(x)              # (B, K), eval mode: no caches, no backward through it
    logits, logits_dist = model.forward(x)           # (B, K) each: the class and distillation heads
    loss, dlogits, dlogits_dist = distillation_loss(logits, logits_dist, y, teacher_logits, kind, tau, alpha)
    model.zero_grad(); model.backward((dlogits, dlogits_dist))
    clip_grad_norm(model, max_norm); optimizer.step()

The teacher sees the student's batch, augmentation included (as in DeiT). It is a checkpoint written by the
trainer: a ResNet (minivit/resnet.py) trained with ``train(cfg, model=ResNet(...))``, or a ViT; its classes must
be the data set's. The evaluation is the classifier's: the distilled model in eval mode answers with the mean
of its two heads.
"""

import dataclasses
import math
import os

from ..weights.checkpoint import check_finite, load_checkpoint
from ..model import ViT, ViTConfig, presets
from ..optim import clip_grad_norm
from ..resnet import ResNet, ResNetConfig
from ..train.config import MODEL_FIELDS
from ..train.tasks import ClassificationTask
from .loss import distillation_loss
from .model import DistilledViT

# What a distilled run cannot do (yet), with the value each must keep: the step is one batch in float32, on one
# process, from scratch
UNSUPPORTED = {"grad_accum": 1, "precision": "float32", "init": None, "log_stats": None}


def load_teacher(path, data, dtype=None):
    """The trained classifier at path (a checkpoint file or a run folder) in eval mode, checked against the
    data set: a ValueError naming the path when it cannot be read or when its classes are not the data's."""
    try:
        ckpt = load_checkpoint(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--distill {os.fspath(path)!r}: the teacher checkpoint cannot be read: {err}") from None
    meta, params = ckpt["meta"], ckpt["params"]
    config = meta.get("config") or {}
    try:
        if "widths" in config:                      # a ResNet (minivit/resnet.py), the CNN teacher of DeiT
            teacher = ResNet(ResNetConfig(**config), dtype=meta.get("dtype", "float32"))
        else:                                       # a ViT (or a distilled one)
            kind = DistilledViT if "dist_token" in params else ViT
            teacher = kind(ViTConfig.from_dict(config), dtype=meta.get("dtype", "float32"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"--distill {ckpt['path']!r}: not a classifier minivit can build as a teacher (a ResNet "
                         f"or a ViT checkpoint written by the trainer): {err}") from None
    K = teacher.config.num_classes
    names = (meta.get("extra") or {}).get("classes")
    if K != data.num_classes or (names is not None and list(names) != list(data.classes)):
        said = f" {list(names)}" if names is not None else ""
        raise ValueError(f"--distill {ckpt['path']!r}: the teacher has {K} classes{said}, but {data.name} has "
                         f"{data.num_classes} {list(data.classes)}: a teacher must be trained on the same classes")
    check_finite(params, repr(ckpt["path"]))
    try:
        teacher.load_state_dict(params)
    except ValueError as err:
        raise ValueError(f"--distill {ckpt['path']!r}: {err}") from None
    return teacher.eval()


def build_model(cfg, data, resumed=None):
    """The DistilledViT of cfg's preset and overrides, sized to the data (as the classifier's build_model);
    resumed: the checkpoint's own config."""
    if resumed is not None:
        try:
            config = ViTConfig.from_dict(resumed["meta"]["config"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{resumed['path']!r}: the saved model config is not valid ({err})") from None
    else:
        H, W, C = data.image_shape
        overrides = {k: getattr(cfg, k) for k in MODEL_FIELDS if getattr(cfg, k) is not None}
        overrides.setdefault("img_size", (H, W))
        overrides.update(in_chans=C, num_classes=data.num_classes)
        config = dataclasses.replace(presets[cfg.model], **overrides)
    return DistilledViT(config, seed=cfg.seed, dtype=cfg.dtype)


class DistillTask(ClassificationTask):
    """The task of a Run of --distill (the interface of minivit/train/tasks.py): the classifier's data, batches
    and evaluation, a DistilledViT, and a step that learns from the teacher too."""

    @staticmethod
    def check_data(cfg, data):
        """The classifier's checks, what the step cannot do, and the teacher: readable, of the data's classes."""
        ClassificationTask.check_data(cfg, data)
        given = [f"--{k.replace('_', '-')} {getattr(cfg, k)!r}" for k, keep in UNSUPPORTED.items()
                 if getattr(cfg, k) != keep]
        if given:
            raise ValueError(f"--distill does not support {'; '.join(given)} (a distilled run trains from scratch, "
                             f"in float32, one batch per step, in one process)")
        load_teacher(cfg.distill, data)

    @staticmethod
    def build_model(cfg, data, resumed=None):
        return build_model(cfg, data, resumed)

    def __init__(self, run, resumed=None):
        super().__init__(run, resumed)
        if run.world is not None:
            raise ValueError("--distill runs in one process (not under mpiexec)")
        self.teacher = load_teacher(run.cfg.distill, run.data).to(run.model.backend)

    def train_step(self, x, y):
        """One optimizer step on the batch (x, y). Returns (loss, correct, grad_norm); correct counts the
        images whose mean of the two heads' logits is highest at the label."""
        model, optimizer, cfg = self.run.model, self.run.optimizer, self.run.cfg
        teacher_logits = self.teacher.forward(x.astype(self.teacher.dtype, copy=False))   # (B, K), no caches
        model.distilled_training = True
        model.zero_grad()
        logits, logits_dist = model.forward(x)                                          # (B, K) each
        loss, dlogits, dlogits_dist = distillation_loss(logits, logits_dist, y, teacher_logits.astype(logits.dtype),
                                                        cfg.distill_kind, cfg.distill_tau, cfg.distill_alpha,
                                                        cfg.label_smoothing)
        model.backward((dlogits, dlogits_dist))
        labels = y if y.ndim == 1 else y.argmax(-1)
        correct = int(((logits + logits_dist).argmax(-1) == labels).sum())
        grad_norm = float(clip_grad_norm(model, cfg.clip_grad)) if cfg.clip_grad else None
        if not math.isfinite(loss):
            return loss, 0, float("nan")
        optimizer.step()
        return loss, correct, grad_norm

    def announce_ops(self):
        """The classifier's (its probe backward takes the gradient of the heads' mean)."""
        self.run.model.distilled_training = False
        return super().announce_ops()

    def checkpoint_extra(self):
        cfg = self.run.cfg
        return {"distill": {"teacher": os.fspath(cfg.distill), "kind": cfg.distill_kind, "tau": cfg.distill_tau,
                            "alpha": cfg.distill_alpha}}
