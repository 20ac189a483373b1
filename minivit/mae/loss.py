"""MAE's loss (He et al., CVPR 2022, §3 "Reconstruction target"): the mean squared error between the
decoder's prediction and the pixels, per patch, averaged over the REMOVED patches only:

    loss = sum_{b,n} mask[b,n] * mean_k (pred[b,n,k] - target[b,n,k])^2  /  sum_{b,n} mask[b,n]

with k over the P*P*C values of a patch. norm_pix_loss=True normalises each target patch by its own mean and
variance first, (t - mean(t)) / sqrt(var(t) + 1e-6): the paper's better target. The variance is the unbiased
one (divided by P*P*C - 1), as torch's Tensor.var in MAE's code. The target is data: it has no gradient.
"""


def normalize_patches(target, eps=1e-6):
    """Each patch by its own mean and (unbiased) variance: target (B, N, K) -> (B, N, K), K = P*P*C."""
    mean = target.mean(axis=-1, keepdims=True)                # (B, N, 1)
    var = target.var(axis=-1, ddof=1, keepdims=True)          # (B, N, 1), unbiased as torch's .var()
    return (target - mean) / (var + eps) ** 0.5               # (B, N, K)


def masked_mse_forward(pred, target, mask, norm_pix_loss=False, eps=1e-6):
    """pred, target: (B, N, K); mask: (B, N), 1 where the patch was removed. Returns the loss (a 0-d array)
    and the cache for backward."""
    if tuple(pred.shape) != tuple(target.shape) or tuple(mask.shape) != tuple(pred.shape[:2]):
        raise ValueError(f"pred and target must be (B, N, K) and mask (B, N); got pred {tuple(pred.shape)}, "
                         f"target {tuple(target.shape)}, mask {tuple(mask.shape)}")
    if norm_pix_loss:
        target = normalize_patches(target, eps)               # (B, N, K)
    diff = pred - target                                      # (B, N, K)
    per_patch = (diff ** 2).mean(axis=-1)                     # (B, N): each patch's mean squared error
    loss = (per_patch * mask).sum() / mask.sum()              # (): the mean over the removed patches
    return loss, (diff, mask)


def masked_mse_backward(cache):
    """d loss / d pred (B, N, K) = 2 (pred - target) / K, on the removed patches, divided by their count;
    zero on the kept ones."""
    diff, mask = cache
    weight = mask / mask.sum()                                # (B, N): each removed patch's share of the mean
    return 2.0 * diff / diff.shape[-1] * weight[..., None]    # (B, N, K)


def masked_mse(pred, target, mask, norm_pix_loss=False, eps=1e-6):
    """(loss, dpred) in one call, as functional.cross_entropy."""
    loss, cache = masked_mse_forward(pred, target, mask, norm_pix_loss, eps)
    return loss, masked_mse_backward(cache)
