"""DeiT's distillation losses, each a forward/backward pair: the student's two heads against the labels and
a teacher's logits (Touvron et al., ICML 2021, §4; the DeiT repository's DistillationLoss).

Glossary (with functional.py's): B batch, K classes; Z_s the class head's logits, Z_d the distillation head's,
Z_t the teacher's (fixed: no gradient goes to the teacher); psi the softmax; y the labels.

Hard distillation (the paper's choice, and ours by default): the teacher's argmax is a second label,
    y_t = argmax_k Z_t
    L = 1/2 CE(psi(Z_s), y) + 1/2 CE(psi(Z_d), y_t)
    dL/dZ_s = 1/2 (psi(Z_s) - onehot(y)) / B,   dL/dZ_d = 1/2 (psi(Z_d) - onehot(y_t)) / B
Soft distillation, with temperature tau and weight alpha (the paper's lambda; tau = 3, alpha = 0.1 there):
    p_t = psi(Z_t / tau),  p_d = psi(Z_d / tau)
    L = (1 - alpha) CE(psi(Z_s), y) + alpha tau^2 KL(p_t || p_d)
    KL(p_t || p_d) = 1/B sum_b sum_k p_t log(p_t / p_d)        (a mean over the batch, as the CE's)
    dKL/dZ_d = (p_d - p_t) / (tau B)   (the softmax-CE gradient, divided by tau for the Z_d / tau inside)
    so d(alpha tau^2 KL)/dZ_d = alpha tau (p_d - p_t) / B: the tau^2 keeps the gradient's size as tau grows.
The DeiT repository's soft loss divides the KL's sum by B K (outputs_kd.numel()) instead of B: its alpha is
then K times smaller than written here. The paper's formula is the one kept.
"""

from ..backend import get_array_module
from ..functional import cross_entropy_backward, cross_entropy_forward

DISTILL_KINDS = ("hard", "soft")


def log_softmax(z):
    """log psi(z) over the last axis, shifted by the row's max for stability. z: (B, K)."""
    xp = get_array_module(z)
    shifted = z - z.max(-1, keepdims=True)                            # (B, K)
    return shifted - xp.log(xp.exp(shifted).sum(-1, keepdims=True))  # (B, K)


def kl_distillation_forward(logits_dist, teacher_logits, tau):
    """tau^2 KL(psi(Z_t / tau) || psi(Z_d / tau)), averaged over the batch.
    logits_dist: (B, K) the student's Z_d; teacher_logits: (B, K) Z_t; tau > 0. Returns (loss 0-d, cache)."""
    xp = get_array_module(logits_dist)
    B = logits_dist.shape[0]
    logp_t = log_softmax(teacher_logits / tau)                        # (B, K) log p_t
    logp_d = log_softmax(logits_dist / tau)                           # (B, K) log p_d
    p_t = xp.exp(logp_t)                                              # (B, K)
    kl = (p_t * (logp_t - logp_d)).sum() / B                          # 0-d
    return tau * tau * kl, (xp.exp(logp_d), p_t, tau)


def kl_distillation_backward(cache):
    """d loss / d Z_d = tau^2 (p_d - p_t) / (tau B) = tau (p_d - p_t) / B: (B, K). (Z_t gets none.)"""
    p_d, p_t, tau = cache
    B = p_d.shape[0]
    return tau * (p_d - p_t) / B                                      # (B, K)


def hard_distillation_forward(logits, logits_dist, labels, teacher_logits, label_smoothing=0.0):
    """L = 1/2 CE(Z_s, y) + 1/2 CE(Z_d, argmax Z_t). logits, logits_dist, teacher_logits: (B, K); labels:
    (B,) ints, or (B, K) soft targets (mixup). label_smoothing applies to the labels' CE only (as DeiT's).
    Returns (loss 0-d, cache)."""
    y_t = teacher_logits.argmax(-1)                                   # (B,) the teacher's hard label
    loss_cls, cache_cls = cross_entropy_forward(logits, labels, label_smoothing)
    loss_dist, cache_dist = cross_entropy_forward(logits_dist, y_t)
    return 0.5 * loss_cls + 0.5 * loss_dist, (cache_cls, cache_dist)


def hard_distillation_backward(cache):
    """Returns (dlogits, dlogits_dist), each (B, K): half of each cross-entropy's gradient."""
    cache_cls, cache_dist = cache
    return 0.5 * cross_entropy_backward(cache_cls), 0.5 * cross_entropy_backward(cache_dist)


def soft_distillation_forward(logits, logits_dist, labels, teacher_logits, tau=3.0, alpha=0.1, label_smoothing=0.0):
    """L = (1 - alpha) CE(Z_s, y) + alpha tau^2 KL(psi(Z_t / tau) || psi(Z_d / tau)). Shapes as
    hard_distillation_forward. Returns (loss 0-d, cache)."""
    loss_cls, cache_cls = cross_entropy_forward(logits, labels, label_smoothing)
    loss_kl, cache_kl = kl_distillation_forward(logits_dist, teacher_logits, tau)
    return (1.0 - alpha) * loss_cls + alpha * loss_kl, (cache_cls, cache_kl, alpha)


def soft_distillation_backward(cache):
    """Returns (dlogits, dlogits_dist), each (B, K)."""
    cache_cls, cache_kl, alpha = cache
    return (1.0 - alpha) * cross_entropy_backward(cache_cls), alpha * kl_distillation_backward(cache_kl)


def distillation_loss(logits, logits_dist, labels, teacher_logits, kind="hard", tau=3.0, alpha=0.1,
                      label_smoothing=0.0):
    """The distillation loss of a batch, checked: returns (loss as a float, dlogits (B, K), dlogits_dist (B, K)).
    kind: "hard" (1/2 and 1/2, the teacher's argmax; tau and alpha unused) or "soft" (tau, alpha)."""
    if kind not in DISTILL_KINDS:
        raise ValueError(f"kind must be 'hard' or 'soft', got {kind!r}")
    for name, value in (("logits_dist", logits_dist), ("teacher_logits", teacher_logits)):
        if getattr(value, "shape", None) != getattr(logits, "shape", None) or getattr(value, "ndim", 0) != 2:
            raise ValueError(f"{name} must have the class head's logits' shape (B, K) = "
                             f"{getattr(logits, 'shape', None)}, got {getattr(value, 'shape', type(value).__name__)}")
    if kind == "soft":
        if not 0.0 < tau < float("inf"):
            raise ValueError(f"tau must be a positive finite temperature, got {tau!r}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha weighs the teacher's term against the labels': it must be in [0, 1], "
                             f"got {alpha!r}")
        loss, cache = soft_distillation_forward(logits, logits_dist, labels, teacher_logits, tau, alpha,
                                                label_smoothing)
        return (float(loss),) + soft_distillation_backward(cache)
    loss, cache = hard_distillation_forward(logits, logits_dist, labels, teacher_logits, label_smoothing)
    return (float(loss),) + hard_distillation_backward(cache)
