"""The overfit test of minivit.check: a tiny ViT trained on one batch, and what its loss curve can and
cannot show about the gradients."""

import math

from .. import functional as F
from ..data.augment import normalize
from ..backend import asarray
from ..data import make_shapes
from ..model import ViT, ViTConfig
from ..optim import SGD, AdamW


def overfit(steps=40, lr=1e-2, optimizer="adamw", seed=0):
    """Train a tiny float64 ViT on one batch of 20 `shapes` images; return the loss before each step (a list,
    Losses, whose ``summary(reference)`` says what the curve does and does not show).
    With every backward right the loss falls from about log(10) = 2.3 towards 0. A bug may show as a loss
    that stalls, creeps or blows up, but it need not: a wrong gradient can still train, even to a lower loss
    than the right one (a gradient too large by a factor acts as a larger learning rate). So a falling or
    lower loss proves nothing about the gradients; check.run() and check.run_model() compare them.
    float64 runs functional.py as it stands, so an edited function is what trains.
    optimizer: "adamw" (no weight decay) or "sgd" (momentum 0.9)."""
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer must be 'adamw' or 'sgd', got {optimizer!r}")
    (images, labels), _ = make_shapes(num_train=20, num_test=0, seed=seed, img_size=16)
    x, y = asarray(normalize(images, 0.5, 0.25, dtype="float64")), asarray(labels)          # (20, 16, 16, 3)
    model = ViT(ViTConfig(img_size=16, patch_size=4, num_classes=10, embed_dim=32, depth=1, num_heads=2,
                          mlp_ratio=2.0), seed=seed, dtype="float64")
    opt = AdamW(model, lr=lr, weight_decay=0.0) if optimizer == "adamw" else SGD(model, lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        loss, dlogits = F.cross_entropy(model.forward(x), y)
        model.zero_grad()
        model.backward(dlogits)
        opt.step()
        losses.append(loss)
    return Losses(losses)


class Losses(list):
    """overfit's losses, a list; ``summary(reference)`` puts them in words, and says what they cannot show."""

    def summary(self, reference=None):
        """The first and last loss, against a reference run's (minivit's own backward) if given."""
        text = f"loss {self[0]:.3f} -> {self[-1]:.3f} in {len(self)} steps"
        if not all(math.isfinite(v) for v in self):
            return text + ": it blew up (NaN or inf), so some gradient or update is wrong"
        if reference is not None:
            ref = reference[-1]
            if abs(self[-1] - ref) <= 1e-9 * max(1.0, abs(ref)):
                text += f"; the reference ends at {ref:.3f} too: the same curve"
            else:
                text += (f"; the reference ends at {ref:.3f}: {'lower' if self[-1] < ref else 'higher'} than it. "
                         "A different curve means a different gradient or update, and a lower loss does not make it "
                         "right")
        return (text + ". A falling loss does not prove the gradients right (a wrong one can train, even faster); "
                "check.run() compares them")
