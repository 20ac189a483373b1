"""MAE's task for the trainer: ``python -m minivit.train --task mae`` (or ``--recipe mae-fashion``), and the
fine-tuning that follows it: ``python -m minivit.train --init RUN/checkpoint.npz`` on labels.

minivit/train/loop.py runs it with its own loop, run folder, checkpoints and resume; this file gives what
differs from training a classifier, behind the task interface of minivit/train/tasks.py. One step:

    x, noise = batch(step)                      # (B, H, W, C) images (their labels unused), (B, N) noise
    pred = model.forward(x, noise)              # (B, N, P*P*C): the pixels of every patch
    loss, dpred = model.forward_loss(x, pred)   # the mean squared error on the removed patches
    model.zero_grad(); model.backward(dpred)
    clip_grad_norm(model, max_norm)             # optional
    optimizer.step()

An evaluation: val_loss is the reconstruction loss on the test images, each with its own fixed noise (the
same mask at every evaluation, so they compare); val_acc is a k-nearest-neighbour accuracy of the encoder's
class-token features (all patches visible), the test images against the first 2,000 training images
(cosine similarity, k = 20, the labels read only here): a common probe of a self-supervised encoder,
which needs no training. The train "accuracy" the trainer prints (correct / B) is 0: there is none.
"""

import dataclasses
import math
import os

from .. import backend
from ..weights.checkpoint import load_checkpoint
from ..data import augment as A
from ..data import load_dataset
from ..optim import clip_grad_norm
from .model import MAE, MAEConfig, finetune_vit

# The presets --model names with --task mae; img_size and in_chans become the data set's. The encoder is the
# shape of the fashion-cpu and demo recipes' ViT (D 64, 4 blocks, 4 heads, MLP x2), so that fine-tuning it
# compares with that ViT trained from scratch.
presets = {
    "mae_tiny": MAEConfig(img_size=32, patch_size=4, in_chans=3, embed_dim=64, depth=4, num_heads=4,
                          decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=4, mlp_ratio=2.0),
}

# The trainer's options an MAE run has no use for, with the one value each may take (None: not given).
UNUSED = {"img_size": None, "patch_size": None, "embed_dim": None, "depth": None, "num_heads": None,
          "mlp_ratio": None, "pool": None, "drop_rate": None, "drop_path_rate": None, "pos_embed": None,
          "stem": None, "num_registers": None, "mixup": 0.0, "cutmix": 0.0, "label_smoothing": 0.0, "init": None,
          "init_gelu": None, "precision": "float32", "grad_accum": 1, "log_stats": None}

KNN_BANK, KNN_K = 2000, 20          # the k-NN probe: training images in its memory, neighbours that vote


def check_config(cfg):
    """Refuse, by flag, what an MAE run cannot do (cfg: a TrainConfig with its recipe applied)."""
    given = [f"--{k.replace('_', '-')} {getattr(cfg, k)!r}" for k, neutral in UNUSED.items()
             if getattr(cfg, k) is not None and getattr(cfg, k) != neutral]
    if given:
        raise ValueError(f"--task mae has no use for {'; '.join(given)} (options of the classifier); "
                         f"the model is a --model preset of minivit.mae.task.presets: {sorted(presets)}")
    if cfg.model not in presets:
        raise ValueError(f"--task mae needs an MAE preset, got --model {cfg.model!r}; choose one of {sorted(presets)}")


def build_model(cfg, data, resumed=None):
    """The MAE of cfg.model, its image size and channels the data's; resumed: the checkpoint's own config."""
    if resumed is not None:
        try:
            config = MAEConfig.from_dict(resumed["meta"]["config"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{resumed['path']!r}: the saved MAE config is not valid ({err})") from None
    else:
        H, W, C = data.image_shape
        config = dataclasses.replace(presets[cfg.model], img_size=(H, W), in_chans=C)
    return MAE(config, seed=cfg.seed, dtype=cfg.dtype)


def finetune_from_checkpoint(path, num_classes, img_size=None, seed=0, dtype="float32"):
    """A ViT with the encoder of the MAE run checkpoint at path and a new zero head of num_classes (for --init);
    None when path is not an MAE checkpoint (then the trainer reads it as any other)."""
    path = os.fspath(path)
    file = os.path.join(path, "checkpoint.npz") if os.path.isdir(path) else path
    if not (file.endswith(".npz") and os.path.isfile(file)):
        return None
    try:
        saved = load_checkpoint(file)
    except ValueError:                     # not a minivit checkpoint (a JAX release .npz): not ours to read
        return None
    if "decoder_embed_dim" not in saved["meta"]["config"]:
        return None
    config = MAEConfig.from_dict(saved["meta"]["config"])
    if img_size is not None and tuple(img_size) != config.img_size:
        raise ValueError(f"{path!r} is an MAE pre-trained at {config.img_size}; fine-tune it at that size, "
                         f"got img_size {tuple(img_size)}")
    return finetune_vit(config, saved["params"], num_classes, seed=seed, dtype=dtype)


class MAETask:
    """The task of a Run of --task mae (the interface of minivit/train/tasks.py). run: train.loop.Run, its data
    on the backend already."""

    SUMMARY = ("reconstruction_loss", "knn_accuracy")
    ACCURACY = f"{KNN_K}-NN (encoder features)"      # what val_acc is, in the command line's last line

    @staticmethod
    def load_data(cfg):
        """(the Dataset, cfg unchanged): shapes, Fashion-MNIST, CIFAR-10 or a folder, as it is on disk."""
        return load_dataset(cfg.dataset, cfg.data_dir), cfg

    @staticmethod
    def check_data(cfg, data):
        """Nothing to refuse: any images will do (their labels are read only by the k-NN probe)."""

    @staticmethod
    def build_model(cfg, data, resumed=None):
        return build_model(cfg, data, resumed)

    @staticmethod
    def label_classes(model):
        return None

    def __init__(self, run, resumed=None):
        if run.world is not None:
            raise ValueError("--task mae runs in one process (its step does not average gradients over ranks)")
        self.run = run
        N = run.model.config.num_patches
        self.eval_noise = backend.asarray(backend.host_rng([run.cfg.seed, 4_000_037]).random((run.x_test.shape[0], N)),
                                          dtype=run.cfg.dtype, backend=run.model.backend)   # (N_test, N) fixed

    def announce_ops(self):
        return []

    def batch(self, step):
        """Images (B, H, W, C), augmented as cfg.augment says, and the noise (B, N) that masks them: both a
        function of (seed, step), so a resumed run draws the same."""
        run, data, cfg = self.run, self.run.data, self.run.cfg
        epoch, i = divmod(step, run.steps_per_epoch)
        order = backend.host_rng([cfg.seed, epoch]).permutation(run.x_train.shape[0])       # (N_train,)
        idx = backend.asarray(order[i * cfg.batch_size:(i + 1) * cfg.batch_size], backend=run.model.backend)
        rng = backend.host_rng([cfg.seed, 1_000_003, step])
        x = A.augment_batch(run.x_train[idx], rng, cfg.augment, data.mean, data.std, cfg.dtype)   # (B, H, W, C)
        if cfg.random_erasing:
            x = A.random_erasing(x, rng, p=cfg.random_erasing)
        noise = backend.host_rng([run.cfg.seed, 2_000_003, step]).random((x.shape[0], run.model.config.num_patches))
        return x, backend.asarray(noise, dtype=run.cfg.dtype, backend=run.model.backend)   # (B, N)

    def train_step(self, x, noise):
        run, model = self.run, self.run.model
        model.zero_grad()
        pred = model.forward(x, noise)                             # (B, N, P*P*C)
        loss, dpred = model.forward_loss(x, pred)
        model.backward(dpred)
        loss = float(loss)
        grad_norm = float(clip_grad_norm(model, run.cfg.clip_grad)) if run.cfg.clip_grad else None
        if not math.isfinite(loss):
            return loss, None, float("nan")
        run.optimizer.step()
        return loss, None, grad_norm                                # None: no training accuracy to show

    def evaluate(self):
        run, model, data = self.run, self.run.model, self.run.data
        bs = run.cfg.eval_batch_size
        was = model.training
        model.eval()
        try:
            total, n = 0.0, run.x_test.shape[0]
            for s in range(0, n, bs):
                x = A.normalize(run.x_test[s:s + bs], data.mean, data.std, run.cfg.dtype)    # (b, H, W, C)
                loss, _ = model.forward_loss(x, model.forward(x, self.eval_noise[s:s + bs]))
                total += float(loss) * x.shape[0]                    # each batch's mean, weighted by its size
            knn = knn_accuracy(model, run.x_train[:KNN_BANK], run.y_train[:KNN_BANK], run.x_test, run.y_test,
                               data.mean, data.std, run.cfg.dtype, bs)
        finally:
            model.train(was)
        return total / n, knn, {"reconstruction_loss": total / n, "knn_accuracy": knn}

    def checkpoint_extra(self):
        return {}


def encode(model, images, mean, std, dtype, batch_size=500):
    """The encoder's class-token features of every image, all patches visible: (n, D), L2-normalised."""
    xp = backend.get_array_module(images)
    feats = []
    for s in range(0, images.shape[0], batch_size):
        x = A.normalize(images[s:s + batch_size], mean, std, dtype)                  # (b, H, W, C)
        feats.append(model.features(x))                                              # (b, D)
    f = xp.concatenate(feats)
    return f / xp.linalg.norm(f, axis=1, keepdims=True)


def knn_accuracy(model, x_bank, y_bank, x_test, y_test, mean, std, dtype, batch_size=500, k=KNN_K):
    """The share of test images whose k nearest bank images (cosine) vote, by majority, for their label."""
    xp = backend.get_array_module(x_bank)
    bank = encode(model, x_bank, mean, std, dtype, batch_size)       # (N_bank, D)
    test = encode(model, x_test, mean, std, dtype, batch_size)       # (N_test, D)
    K = int(max(int(y_bank.max()), int(y_test.max()))) + 1
    right = 0
    for s in range(0, test.shape[0], batch_size):
        sim = test[s:s + batch_size] @ bank.T                                        # (b, n_bank)
        nearest = xp.argsort(-sim, axis=1)[:, :k]                                     # (b, k)
        votes = xp.zeros((sim.shape[0], K))
        for j in range(nearest.shape[1]):
            votes[xp.arange(sim.shape[0]), y_bank[nearest[:, j]]] += 1
        right += int((votes.argmax(1) == y_test[s:s + batch_size]).sum())
    return right / test.shape[0]

