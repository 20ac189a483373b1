"""CLIP's joint space and its loss: L2 normalisation, the logits with a learned temperature, the symmetric
InfoNCE loss over a batch (contrastive_loss), and one rank's share of it over a global batch spread on R ranks
(contrastive_loss_rows; minivit.distributed gathers the features it needs).

    I = x_img / ||x_img||, T = x_txt / ||x_txt||                                        (B, E) each
    logits = exp(logit_scale) I T^T                                                      (B, B)
    loss   = (CE(logits, arange B) over rows + CE(logits^T, arange B) over columns) / 2  symmetric InfoNCE

Glossary (with functional.py's): E joint embedding width, R ranks, b = B / R pairs on one rank.
"""

import math

from .. import functional as F
from ..backend import backend_module, get_array_module, is_array
from ..functional import cross_entropy
from ..layers import Layer, zeros


def l2_normalize_forward(x, eps=1e-12):
    """y = x / max(||x||, eps), over the last axis (PyTorch's F.normalize). x: (..., E).
    Returns y (..., E) and the cache (y, the clamped norm)."""
    xp = get_array_module(x)
    norm = xp.sqrt((x * x).sum(-1, keepdims=True))           # (..., 1)
    norm = xp.maximum(norm, eps)                             # a zero vector stays zero, no 0 / 0
    return x / norm, (x / norm, norm, eps)


def l2_normalize_backward(dout, cache):
    """dx = (dy - y (y . dy)) / ||x||: only the part of dy across the sphere passes (the radial part,
    along y, would change the length, which y forgets). Where ||x|| < eps, y = x / eps and dx = dy / eps."""
    y, norm, eps = cache
    xp = get_array_module(y)
    radial = y * (y * dout).sum(-1, keepdims=True)            # (..., E)  the part of dout along y
    return xp.where(norm > eps, (dout - radial) / norm, dout / eps)  # (..., E)


def similarity_forward(img, txt, logit_scale):
    """logits = exp(logit_scale) * img @ txt^T. img: (B, E), txt: (B', E), logit_scale: a 0-d array
    (the log of the inverse temperature). Returns logits (B, B') and the cache."""
    xp = get_array_module(img)
    scale = xp.exp(logit_scale)                               # () 1 / temperature
    logits = scale * (img @ txt.T)                            # (B, B')
    return logits, (img, txt, scale, logits)


def similarity_backward(dlogits, cache):
    """d img = s dlogits txt,  d txt = s dlogits^T img,  d logit_scale = sum(dlogits * logits), s = exp(logit_scale):
    d/dt (e^t cos) = e^t cos = logits, so the temperature's gradient is the logits weighted by dlogits."""
    img, txt, scale, logits = cache
    dimg = scale * (dlogits @ txt)                            # (B, E)
    dtxt = scale * (dlogits.T @ img)                          # (B', E)
    dlogit_scale = (dlogits * logits).sum()                   # ()
    return dimg, dtxt, dlogit_scale


def contrastive_loss(logits):
    """CLIP's symmetric InfoNCE loss: the mean of the cross-entropy over rows (each image picks its text)
    and over columns (each text picks its image), the right pair on the diagonal:
        loss = (CE(logits, arange B) + CE(logits^T, arange B)) / 2
        dlogits = ((softmax over each row - I) + (softmax over each column - I)) / (2 B)
    logits: float (B, B), image i against text j. Returns (loss as a float, dlogits (B, B))."""
    if not is_array(logits) or logits.ndim != 2 or logits.shape[0] != logits.shape[1]:
        raise ValueError(f"logits must be a square (B, B) array of images against texts, got "
                         f"{getattr(logits, 'shape', type(logits).__name__)}")
    if logits.dtype.kind != "f":
        raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")
    xp = get_array_module(logits)
    B = logits.shape[0]
    labels = xp.arange(B)                                     # (B,) the pair of row i is column i
    loss_img, cache_img = F.cross_entropy_forward(logits, labels)       # image -> text, over each row
    loss_txt, cache_txt = F.cross_entropy_forward(logits.T, labels)     # text -> image, over each column
    dlogits = (F.cross_entropy_backward(cache_img) + F.cross_entropy_backward(cache_txt).T) / 2  # (B, B)
    return float(loss_img + loss_txt) / 2, dlogits


def contrastive_loss_rows(logits_img, logits_txt, rank):
    """CLIP's symmetric loss for this rank's b pairs against the whole global batch of B = R b:
        logits_img = s I_r T^T (b, B): this rank's images against every text
        logits_txt = s T_r I^T (b, B): this rank's texts against every image
        L_r = (CE(logits_img, labels) + CE(logits_txt, labels)) / 2,   labels = r b + arange(b)
    (pair i of rank r is row r b + i of the gathered features). The mean of L_r over the ranks is
    clip.contrastive_loss of the whole batch's (B, B) logits. Returns (L_r as a float, dlogits_img,
    dlogits_txt), each (b, B)."""
    xp = get_array_module(logits_img)
    b = logits_img.shape[0]
    labels = rank * b + xp.arange(b)                                          # (b,) the right column of each row
    loss_img, dlogits_img = cross_entropy(logits_img, labels)                 # image -> text
    loss_txt, dlogits_txt = cross_entropy(logits_txt, labels)                 # text -> image
    return (loss_img + loss_txt) / 2, dlogits_img / 2, dlogits_txt / 2


class L2Normalize(Layer):
    """y = x / ||x|| over the last axis; no parameters."""

    def forward(self, x):                                     # (B, E)
        y, cache = l2_normalize_forward(x)
        self.cache = cache if self.training else None
        return y

    def backward(self, dout):                                 # (B, E)
        return l2_normalize_backward(dout, self._need_cache())


class Similarity(Layer):
    """logits = exp(logit_scale) I T^T, with logit_scale learned: the temperature of the softmax.
    CLIP starts it at log(1 / 0.07) (logits up to 14.3 apart) and clamps it to [0, log 100] after every
    step (``clamp``): a larger scale makes the loss sharper but lets it grow without bound on easy batches."""

    MAX = math.log(100.0)

    def __init__(self, init=math.log(1 / 0.07), dtype="float32"):
        super().__init__()
        self.params["logit_scale"] = backend_module().full((), init, dtype=dtype)   # () a 0-d array
        self.grads["logit_scale"] = zeros((), dtype)

    def forward(self, img, txt):                              # (B, E), (B', E) -> (B, B')
        logits, cache = similarity_forward(img, txt, self.params["logit_scale"])
        self.cache = cache if self.training else None
        return logits

    def backward(self, dlogits):                              # (B, B') -> (B, E), (B', E)
        dimg, dtxt, dlogit_scale = similarity_backward(dlogits, self._need_cache())
        self.grads["logit_scale"] += dlogit_scale
        return dimg, dtxt

    def clamp(self):
        """logit_scale clipped to [0, log 100] in place: the temperature stays between 0.01 and 1."""
        xp = get_array_module(self.params["logit_scale"])
        xp.clip(self.params["logit_scale"], 0.0, self.MAX, out=self.params["logit_scale"])
