"""Pictures for the lessons: the patch grid, attention maps and rollout, mean attention distance, the
position-embedding similarity grid and the principal components of the patch-embedding filters
(the paper's Figure 7).

Two kinds of functions: ones that compute (they return host NumPy arrays and never draw), and
``plot_*`` ones that draw with matplotlib and return the Figure. Inputs may be NumPy or CuPy arrays;
everything is brought to the host first. matplotlib is imported only by the ``plot_*`` functions.

Letters as in functional.py: B batch, H, W, C image, P patch size, N tokens, D embed dim, nh heads;
gh, gw the patch grid (H/P, W/P); Np = gh * gw patches; depth the number of blocks.
"""

import numpy

from .backend import to_numpy
from .layers import Dropout

# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------


def _host(x, what="x"):
    """x as a host float64 NumPy array, or a TypeError naming what it was."""
    if not hasattr(x, "shape"):
        raise TypeError(f"{what} must be a NumPy or CuPy array, got {type(x).__name__}")
    return numpy.asarray(to_numpy(x), dtype=numpy.float64)


def to_display(image):
    """An image (H, W, C) or (H, W) as float values in [0, 1] for imshow, C = 1 squeezed.

    uint8 is divided by 255; a float image already in [0, 1] is kept; any other float image (e.g.
    normalised to mean 0) is min-max rescaled."""
    if not hasattr(image, "shape") or image.ndim not in (2, 3):
        raise ValueError(f"image must be (H, W, C) or (H, W), got {getattr(image, 'shape', type(image).__name__)}")
    img = to_numpy(image)
    if img.dtype == numpy.uint8:
        img = img.astype(numpy.float64) / 255.0
    else:
        img = img.astype(numpy.float64)
        lo, hi = float(img.min()), float(img.max())
        if lo < 0.0 or hi > 1.0:
            img = (img - lo) / (hi - lo) if hi > lo else numpy.zeros_like(img)
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[..., 0]
    return img


# --------------------------------------------------------------------------------------------------
# patches
# --------------------------------------------------------------------------------------------------


def patch_mosaic(image, patch_size, gap=2, fill=1.0):
    """The image with a gap of `fill` pixels between its P x P patches, so the grid can be seen.

    image: (H, W, C) or (H, W), H and W multiples of P. Returns a float array in [0, 1] of shape
    (gh * (P + gap) - gap, gw * (P + gap) - gap[, C])."""
    img = to_display(image)
    H, W = img.shape[:2]
    P = patch_size
    if H % P or W % P:
        raise ValueError(f"image of {H}x{W} is not a whole number of {P}x{P} patches")
    gh, gw = H // P, W // P
    step = P + gap
    out = numpy.full((gh * step - gap, gw * step - gap) + img.shape[2:], fill, dtype=numpy.float64)
    for i in range(gh):
        for j in range(gw):
            out[i * step:i * step + P, j * step:j * step + P] = img[i * P:(i + 1) * P, j * P:(j + 1) * P]
    return out


def plot_patch_grid(image, patch_size, gap=2, numbers=False, title=None, size=4.0):
    """Figure: the image cut into its grid of P x P patches (white gaps), optionally numbered in
    the order the model reads them (row-major, 0 ... N-1). numbers=True numbers the first row, the first
    column and the last patch (enough to see the order); numbers="all" numbers every patch."""
    import matplotlib.pyplot as plt

    mosaic = patch_mosaic(image, patch_size, gap)
    fig, ax = plt.subplots(figsize=(size, size))
    ax.imshow(mosaic, cmap="gray" if mosaic.ndim == 2 else None, vmin=0, vmax=1)
    if numbers:
        H, W = to_display(image).shape[:2]
        gh, gw = H // patch_size, W // patch_size
        step = patch_size + gap
        for i in range(gh):
            for j in range(gw):
                if numbers == "all" or i == 0 or j == 0 or (i, j) == (gh - 1, gw - 1):
                    ax.text(j * step + 1, i * step + 1, str(i * gw + j), fontsize=7, color="white", va="top",
                            ha="left", bbox=dict(boxstyle="square,pad=0.1", fc="black", ec="none", alpha=0.6))
    gh, gw = (numpy.array(mosaic.shape[:2]) + gap) // (patch_size + gap)
    ax.set_title(title or f"{gh} x {gw} = {gh * gw} patches of {patch_size}x{patch_size}", fontsize=9)
    ax.axis("off")
    fig.tight_layout()
    return fig


def plot_patch_sequence(patches, patch_size, count=16, title=None):
    """Figure: the first `count` flattened patches x_p^1, x_p^2, ... unflattened back to P x P x C,
    in a row, as the token sequence the encoder reads, titled by their index 0, 1, ... in the code.
    patches: (N, P*P*C) in (P, P, C) order."""
    import matplotlib.pyplot as plt

    p = _host(patches, "patches")
    if p.ndim != 2 or p.shape[1] % (patch_size * patch_size):
        raise ValueError(f"patches must be (N, P*P*C) with P={patch_size}, got {p.shape}")
    C = p.shape[1] // (patch_size * patch_size)
    count = min(count, p.shape[0])
    fig, axes = plt.subplots(1, count, figsize=(0.55 * count, 1.0))
    for n, ax in enumerate(numpy.atleast_1d(axes)):
        ax.imshow(to_display(p[n].reshape(patch_size, patch_size, C)), cmap="gray" if C == 1 else None)
        ax.set_title(str(n), fontsize=7)          # 0-based, as the code indexes them
        ax.axis("off")
    fig.suptitle(title or f"the first {count} of {p.shape[0]} patches, in reading order", fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# attention: the weights of every block, rollout, mean attention distance
# --------------------------------------------------------------------------------------------------


def _dropouts(layer):
    return [sub for sub in layer.sublayers() if isinstance(sub, Dropout)]


def attention_weights(model, x, batch_size=64):
    """The attention weights of every block for the images x: a list of depth arrays (B, nh, N, N),
    float32 on the host; row i of a head is where token i looks (each row sums to 1).

    model: a ViT (its blocks' ``attn`` layers keep their weights in training mode, so the model is run
    in training mode with every dropout switched off; its own mode is restored afterwards).
    x: float images (B, H, W, C) on the model's backend. batch_size: images per forward."""
    if not hasattr(x, "ndim") or x.ndim != 4:
        raise ValueError(f"x must be an image batch (B, H, W, C), got {getattr(x, 'shape', type(x).__name__)}")
    was_training = model.training
    maps = [[] for _ in model.blocks]
    try:
        model.train()
        for d in _dropouts(model):
            d.training = False                     # deterministic: no dropout while we look
        for start in range(0, x.shape[0], batch_size):
            model.forward(x[start:start + batch_size])
            for i, block in enumerate(model.blocks):
                maps[i].append(to_numpy(block.attn.attn).astype(numpy.float32))  # (b, nh, N, N)
    finally:
        model.eval()                               # drops every cache
        model.train(was_training)
    return [numpy.concatenate(m) for m in maps]


def attention_rollout(attentions, residual=True):
    """Attention rollout (Abnar & Zuidema 2020): how much each input token flows into each output
    token through all the blocks, heads averaged:

        A_l = mean over heads of attention l;  with residual: A_l <- (A_l + I) / 2  (the skip path)
        R   = A_L A_{L-1} ... A_1

    attentions: a list of depth arrays (B, nh, N, N), as attention_weights returns.
    Returns R (B, N, N); each row sums to 1."""
    if not attentions:
        raise ValueError("attentions is empty: need one (B, nh, N, N) array per block")
    rollout = None
    for a in attentions:
        a = _host(a, "attention").mean(1)                        # (B, N, N)  heads averaged
        if residual:
            a = 0.5 * (a + numpy.eye(a.shape[-1]))               # (B, N, N)  the residual connection
        rollout = a if rollout is None else a @ rollout          # (B, N, N)
    return rollout


def rollout_map(rollout, grid_size, num_prefix_tokens=1, class_token=True):
    """What the model's output reads from each patch, as a (B, gh, gw) map scaled to max 1:
    the class token's row of the rollout over the patch columns, or for a GAP model (class_token=False, or
    num_prefix_tokens=0) the mean of the patch tokens' rows, which is what the pool averages.

    The tokens are [cls, reg_1..reg_nr, patches] (timm's layout): num_prefix_tokens = model.config.num_prefix_tokens
    counts the class token and the registers; with pool="gap" and registers there is no class token, so pass
    class_token=False (the row 0 is then a register's, not the output's)."""
    r = _host(rollout, "rollout")
    gh, gw = grid_size
    k = num_prefix_tokens
    if r.ndim != 3 or r.shape[1] != r.shape[2] or r.shape[2] != gh * gw + k:
        raise ValueError(f"rollout must be (B, N, N) with N = {gh}*{gw} + {k}, got {r.shape}")
    if class_token and k:
        rows = r[:, 0, k:]                                       # (B, Np) the class token's row
    else:
        rows = r[:, k:, k:].mean(1)                              # (B, Np) the mean of the patch rows
    rows = rows / rows.max(-1, keepdims=True)
    return rows.reshape(-1, gh, gw)                              # (B, gh, gw)


def patch_distances(grid_size, patch_size):
    """(Np, Np) distances in pixels between the centres of every pair of patches."""
    gh, gw = grid_size
    rows, cols = numpy.divmod(numpy.arange(gh * gw), gw)         # (Np,) grid coordinates
    dr = rows[:, None] - rows[None, :]                           # (Np, Np)
    dc = cols[:, None] - cols[None, :]
    return patch_size * numpy.sqrt(dr * dr + dc * dc)            # (Np, Np) pixels


def mean_attention_distance(attentions, grid_size, patch_size, num_prefix_tokens=1):
    """The paper's "attention distance" (Fig. 7, right): for each block and head, the distance in
    pixels between a query patch and the patches it attends to, weighted by the attention and averaged
    over query patches and images:

        dist_h = mean_{b, i} sum_j a_bhij ||pos_i - pos_j||,   i, j patches

    The class token is left out (it has no position); each row is renormalised over the patches.
    attentions: a list of depth arrays (B, nh, N, N). Returns (depth, nh) in pixels."""
    dist = patch_distances(grid_size, patch_size)                # (Np, Np)
    k = num_prefix_tokens
    out = []
    for a in attentions:
        a = _host(a, "attention")[:, :, k:, k:]                  # (B, nh, Np, Np) patch to patch
        if a.shape[-1] != dist.shape[0]:
            raise ValueError(f"attention has {a.shape[-1] + k} tokens, expected {dist.shape[0]} patches + {k}")
        a = a / a.sum(-1, keepdims=True)                         # rows sum to 1 over the patches
        out.append((a * dist).sum(-1).mean((0, 2)))              # (nh,)
    return numpy.stack(out)                                      # (depth, nh)


def plot_attention_maps(image, maps, titles=None, marks=None, ncols=4, size=2.0, style="spotlight", alpha=0.55,
                        cmap="inferno"):
    """Figure: each (gh, gw) map upsampled (nearest) to the image and shown on it.

    image: (H, W, C). maps: a list (or array) of (gh, gw) non-negative maps. titles: one per map.
    marks: one (row, col) patch per map (or None) to outline, e.g. the query patch.
    style: "spotlight" dims the image where the map is low (brightness 0.15 + 0.85 * map / max);
    "heat" lays the map over the image in colour (cmap, alpha)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if style not in ("spotlight", "heat"):
        raise ValueError(f"style must be 'spotlight' or 'heat', got {style!r}")
    img = to_display(image)
    maps = [_host(m, "map") for m in maps]
    H, W = img.shape[:2]
    n = len(maps)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows + 0.15), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for idx, m in enumerate(maps):
        gh, gw = m.shape
        ph, pw = H // gh, W // gw
        up = numpy.kron(m, numpy.ones((ph, pw)))                 # (H, W) nearest upsampling
        ax = axes.ravel()[idx]
        if style == "spotlight":
            light = 0.15 + 0.85 * up / max(float(up.max()), 1e-12)  # (H, W) in [0.15, 1]
            ax.imshow(img * (light if img.ndim == 2 else light[..., None]), cmap="gray" if img.ndim == 2 else None,
                      vmin=0, vmax=1)
        else:
            ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
            ax.imshow(up, cmap=cmap, alpha=alpha, extent=(-0.5, W - 0.5, H - 0.5, -0.5))
        if marks is not None and marks[idx] is not None:
            r, c = marks[idx]
            ax.add_patch(Rectangle((c * pw - 0.5, r * ph - 0.5), pw, ph, fill=False, ec="cyan", lw=1.5))
        if titles is not None:
            ax.set_title(titles[idx], fontsize=8)
    fig.tight_layout()
    return fig


def plot_images_and_maps(images, maps, titles=None, size=1.2, cmap="inferno"):
    """Figure: images in the top row, a map of each (e.g. its attention rollout, (gh, gw) scaled to
    [0, 1]) below it. Clearer than an overlay for small or dark images (Fashion-MNIST)."""
    import matplotlib.pyplot as plt

    n = len(images)
    if len(maps) != n:
        raise ValueError(f"got {n} images but {len(maps)} maps")
    fig, axes = plt.subplots(2, n, figsize=(size * n, 2 * size + 0.4), squeeze=False)
    for col in range(n):
        img = to_display(images[col])
        axes[0, col].imshow(img, cmap="gray" if img.ndim == 2 else None)
        axes[1, col].imshow(_host(maps[col], "map"), cmap=cmap, vmin=0, vmax=1)
        if titles is not None:
            axes[0, col].set_title(titles[col], fontsize=7)
    for ax in axes.ravel():
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_mean_attention_distance(distances, reference=None, title=None, size=(4.0, 3.0)):
    """Figure: mean attention distance (pixels) of every head against the block it is in, as the
    paper's Fig. 7 (right). distances: (depth, nh). reference: a value to draw as a dashed line
    (e.g. the distance of uniform attention)."""
    import matplotlib.pyplot as plt

    d = _host(distances, "distances")
    depth, nh = d.shape
    fig, ax = plt.subplots(figsize=size)
    for h in range(nh):
        ax.scatter(numpy.arange(1, depth + 1), d[:, h], s=14, label=f"head {h + 1}" if nh <= 16 else None)
    if reference is not None:
        ax.axhline(reference, ls="--", c="gray", lw=1, label="uniform attention")
    ax.set_xlabel("network depth (block)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(numpy.arange(1, depth + 1))
    ax.set_ylim(bottom=0)
    if nh <= 16:
        ax.legend(fontsize=6, ncol=2)
    ax.set_title(title or "mean attention distance per head", fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# position embeddings: cosine similarity of each patch's embedding with every other's
# --------------------------------------------------------------------------------------------------


def pos_embed_similarity(pos_embed, grid_size, num_prefix_tokens=1):
    """cos(E_pos[i], E_pos[j]) for every pair of patches, arranged (gh, gw, gh, gw): entry [r, c]
    is the (gh, gw) map of patch (r, c)'s similarity with all patches (the paper's Fig. 7, centre).

    pos_embed: (1, N, D) or (N, D), N = num_prefix_tokens + gh * gw (the class token's row is dropped)."""
    pe = _host(pos_embed, "pos_embed")
    pe = pe.reshape(-1, pe.shape[-1])[num_prefix_tokens:]        # (Np, D)
    gh, gw = grid_size
    if pe.shape[0] != gh * gw:
        raise ValueError(f"pos_embed has {pe.shape[0]} patch rows (after {num_prefix_tokens} prefix token(s)), "
                         f"expected {gh}*{gw} = {gh * gw}")
    unit = pe / numpy.linalg.norm(pe, axis=1, keepdims=True)     # (Np, D)
    return (unit @ unit.T).reshape(gh, gw, gh, gw)               # (gh, gw, gh, gw)


def similarity_by_distance(sim):
    """The mean of the (gh, gw, gh, gw) similarities over all pairs of patches at each grid distance,
    the Euclidean distance in patches rounded to the nearest whole patch. Returns (distances, means),
    both (n,), distances 0, 1, 2, ...: a curve that falls with distance means that nearby patches have
    similar embeddings."""
    s = _host(sim, "sim")
    gh, gw = s.shape[:2]
    if s.shape != (gh, gw, gh, gw):
        raise ValueError(f"sim must be (gh, gw, gh, gw), got {s.shape}")
    dist = numpy.rint(patch_distances((gh, gw), 1)).ravel()       # (Np*Np,) whole patches
    values = s.reshape(gh * gw, gh * gw).ravel()
    distances = numpy.unique(dist)
    return distances, numpy.array([values[dist == d].mean() for d in distances])


def similarity_mosaic(sim, gap=1, step=1):
    """The (gh, gw, gh, gw) similarities as one picture: a grid of (gh, gw) maps, one per query patch
    (every step-th row and column of them), separated by NaN gaps."""
    gh, gw = sim.shape[:2]
    rows, cols = range(0, gh, step), range(0, gw, step)
    step_r, step_c = gh + gap, gw + gap
    out = numpy.full((len(rows) * step_r - gap, len(cols) * step_c - gap), numpy.nan)
    for a, r in enumerate(rows):
        for b, c in enumerate(cols):
            out[a * step_r:a * step_r + gh, b * step_c:b * step_c + gw] = sim[r, c]
    return out


def plot_pos_embed_similarity(sim, title=None, step=1, size=None, vmin=-1.0, vmax=1.0):
    """Figure: the grid of similarity maps from pos_embed_similarity (one small map per query patch,
    placed at that patch's position), with a colour bar, as in the paper's Fig. 7 (centre).
    step: show every step-th query row and column (step=2 keeps a 14 x 14 grid legible at a small
    size). vmin, vmax: the colour range (None: the data's)."""
    import matplotlib.pyplot as plt

    s = _host(sim, "sim")
    gh, gw = s.shape[:2]
    mosaic = similarity_mosaic(s, step=step)
    if size is None:   # about two screen pixels per cell at dpi 80, so no row of cells is dropped
        size = max(3.5, 2.0 * mosaic.shape[0] / 80 + 0.8)
    rows, cols = list(range(0, gh, step)), list(range(0, gw, step))
    fig, ax = plt.subplots(figsize=(size * 1.15, size))
    im = ax.imshow(mosaic, cmap="viridis", vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_xticks([(gw + 1) * b + gw / 2 - 0.5 for b in range(len(cols))], [str(c + 1) for c in cols], fontsize=6)
    ax.set_yticks([(gh + 1) * a + gh / 2 - 0.5 for a in range(len(rows))], [str(r + 1) for r in rows], fontsize=6)
    ax.set_xlabel("input patch column", fontsize=8)
    ax.set_ylabel("input patch row", fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="cosine similarity")
    ax.set_title(title or "position embedding similarity", fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# the patch-embedding filters: principal components
# --------------------------------------------------------------------------------------------------


def patch_embed_pca(weight, patch_size, in_chans, n_components=28):
    """Principal components of the D embedding filters (the paper's Fig. 7, left).

    The projection E (P*P*C, D) has one filter per output feature: its column d, a P x P x C patch.
    Centre the D filters, take the SVD, and return the first n_components directions as patches:
    components (n, P, P, C) (unit length each) and the fraction of the variance each explains (n,)."""
    w = _host(weight, "weight")
    P, C = patch_size, in_chans
    if w.ndim != 2 or w.shape[0] != P * P * C:
        raise ValueError(f"weight must be (P*P*C, D) = ({P * P * C}, D), got {w.shape}")
    filters = w.T - w.T.mean(0, keepdims=True)                   # (D, P*P*C) centred
    _, s, vt = numpy.linalg.svd(filters, full_matrices=False)    # vt: (r, P*P*C), rows orthonormal
    n = min(n_components, vt.shape[0])
    ratio = s ** 2 / (s ** 2).sum()
    return vt[:n].reshape(n, P, P, C), ratio[:n]


def plot_embedding_filters(components, ncols=7, title=None, size=0.8):
    """Figure: each component (P, P, C) min-max scaled to [0, 1] and shown as a small image."""
    import matplotlib.pyplot as plt

    comp = _host(components, "components")
    n = comp.shape[0]
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(size * ncols, size * nrows + 0.4), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for i in range(n):
        c = comp[i]
        c = (c - c.min()) / (c.max() - c.min() + 1e-12)
        axes.ravel()[i].imshow(c[..., 0] if c.shape[-1] == 1 else c, cmap="gray" if c.shape[-1] == 1 else None,
                               interpolation="nearest")
    fig.suptitle(title or f"first {n} principal components of the embedding filters", fontsize=8)
    fig.tight_layout()
    return fig


def show_jpeg(fig, quality=85):
    """Show fig in a notebook as a JPEG, and close it (so that the inline backend does not show it again as a PNG).
    A figure of photographs is several times smaller as a JPEG than as a PNG: the lessons keep figures wide
    enough to read (700 px and more) and the committed notebooks under 500 KB. Returns the IPython Image."""
    import io

    import matplotlib.pyplot as plt
    from IPython.display import Image, display

    if not 1 <= quality <= 95:
        raise ValueError(f"JPEG quality must be in [1, 95], got {quality!r}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="jpeg", dpi=fig.dpi, bbox_inches="tight", facecolor="white",
                pil_kwargs={"quality": quality})
    plt.close(fig)
    image = Image(data=buffer.getvalue(), format="jpeg")
    display(image)
    return image
