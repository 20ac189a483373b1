"""The lessons' pictures: each computing function against a case whose answer is known by hand, and
each plot drawn once with the Agg backend."""

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import minivit  # noqa: E402
from minivit import functional as F  # noqa: E402
from minivit import viz  # noqa: E402

TINY = minivit.ViTConfig(img_size=8, patch_size=2, in_chans=3, num_classes=4, embed_dim=12, depth=2, num_heads=3)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _images(rng, n=3, cfg=TINY):
    H, W = cfg.img_size
    return minivit.asarray(rng.standard_normal((n, H, W, cfg.in_chans)), dtype="float32")


def test_patch_mosaic_puts_each_patch_in_its_cell_with_gaps(rng):
    img = rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)
    m = viz.patch_mosaic(img, 3, gap=1)
    assert m.shape == (2 * 4 - 1, 3 * 4 - 1, 3)
    np.testing.assert_allclose(m[4:7, 8:11], img[3:6, 6:9] / 255.0)   # patch (1, 2)
    assert np.all(m[3] == 1.0) and np.all(m[:, 3] == 1.0)              # white gaps
    with pytest.raises(ValueError, match="not a whole number"):
        viz.patch_mosaic(img, 4)


def test_to_display_scales_uint8_and_rescales_normalised_floats():
    np.testing.assert_allclose(viz.to_display(np.full((2, 2, 3), 255, np.uint8)), 1.0)
    x = np.array([[-2.0, 0.0], [1.0, 2.0]])
    np.testing.assert_allclose(viz.to_display(x), (x + 2) / 4)
    assert viz.to_display(np.zeros((2, 2, 1), np.float32)).shape == (2, 2)


def test_attention_weights_match_the_functional_attention_and_restore_the_mode(rng):
    model = minivit.ViT(TINY, seed=1).eval()
    x = _images(rng)
    attns = viz.attention_weights(model, x, batch_size=2)
    assert len(attns) == TINY.depth
    assert attns[0].shape == (3, TINY.num_heads, TINY.seq_len, TINY.seq_len)
    np.testing.assert_allclose(attns[1].sum(-1), 1.0, atol=1e-5)
    # block 0 by hand: LN, packed qkv, softmax(q k^T / sqrt(hs))
    h = model.pos_embed.forward(model.patch_embed.forward(x))
    b0 = model.blocks[0]
    q, k, _ = F.split_heads(b0.attn.qkv.forward(b0.norm1.forward(h)).astype(np.float64), TINY.num_heads)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])                      # (B, nh, N, N)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    np.testing.assert_allclose(attns[0], weights / weights.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    assert model.training is False and b0.attn.cache is None


def test_attention_weights_ignore_dropout(rng):
    x = _images(rng)
    plain = viz.attention_weights(minivit.ViT(TINY, seed=1), x)
    noisy_model = minivit.ViT(dataclasses.replace(TINY, drop_rate=0.5), seed=1)  # same parameters
    noisy = viz.attention_weights(noisy_model, x)
    for a, b in zip(plain, noisy):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert noisy_model.training is True and all(d.training for d in viz._dropouts(noisy_model))


def test_rollout_of_one_block_is_the_head_mean_plus_identity_over_two(rng):
    a = rng.random((2, 3, 5, 5))
    a /= a.sum(-1, keepdims=True)
    r = viz.attention_rollout([a])
    np.testing.assert_allclose(r, 0.5 * (a.mean(1) + np.eye(5)))
    r2 = viz.attention_rollout([a, a])
    np.testing.assert_allclose(r2, r @ r)
    np.testing.assert_allclose(r2.sum(-1), 1.0)
    np.testing.assert_allclose(viz.attention_rollout([a], residual=False), a.mean(1))


def test_rollout_map_reads_the_class_token_row():
    N = 1 + 2 * 3
    r = np.zeros((1, N, N))
    r[0, 0, 1 + 4] = 0.8                                     # the class token reads patch 4 = (1, 1)
    r[0, 0, 1 + 0] = 0.2
    m = viz.rollout_map(r, (2, 3))
    assert m.shape == (1, 2, 3) and m[0, 1, 1] == 1.0 and m[0, 0, 0] == pytest.approx(0.25)
    gap = viz.rollout_map(np.full((1, 6, 6), 1 / 6), (2, 3), num_prefix_tokens=0)
    np.testing.assert_allclose(gap, 1.0)


def test_mean_attention_distance_on_attention_patterns_known_by_hand():
    gh, gw, P = 3, 4, 16
    Np = gh * gw
    self_only = np.eye(Np + 1)[None, None]                   # every token looks at itself
    right = np.zeros((1, 1, Np + 1, Np + 1))
    right[0, 0, 0, 0] = 1.0
    for i in range(Np):                                       # each patch looks one column to the right
        r, c = divmod(i, gw)
        j = i + 1 if c + 1 < gw else i
        right[0, 0, 1 + i, 1 + j] = 1.0
    d = viz.mean_attention_distance([self_only, right], (gh, gw), P)
    assert d.shape == (2, 1)
    assert d[0, 0] == 0.0
    assert d[1, 0] == pytest.approx(P * gh * (gw - 1) / Np)  # the last column looks at itself
    # uniform attention: the mean of all pairwise distances
    uniform = np.full((1, 2, Np, Np), 1.0 / Np)
    dist = viz.patch_distances((gh, gw), P)
    np.testing.assert_allclose(viz.mean_attention_distance([uniform], (gh, gw), P, num_prefix_tokens=0),
                               [[dist.mean(), dist.mean()]])
    assert dist[0, gw + 1] == pytest.approx(P * np.sqrt(2))  # (0, 0) to (1, 1)


def test_pos_embed_similarity_is_cosine_and_drops_the_class_token(rng):
    pe = rng.standard_normal((1, 1 + 6, 5))
    s = viz.pos_embed_similarity(pe, (2, 3))
    assert s.shape == (2, 3, 2, 3)
    flat = s.reshape(6, 6)
    np.testing.assert_allclose(np.diag(flat), 1.0)
    np.testing.assert_allclose(flat, flat.T)
    a, b = pe[0, 1 + 1], pe[0, 1 + 5]                         # patches (0, 1) and (1, 2)
    assert s[0, 1, 1, 2] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    with pytest.raises(ValueError, match="patch rows"):
        viz.pos_embed_similarity(pe, (3, 3))
    mosaic = viz.similarity_mosaic(s)
    assert mosaic.shape == (2 * 3 - 1, 3 * 4 - 1) and np.isnan(mosaic[2]).all()
    np.testing.assert_allclose(mosaic[3:5, 4:7], s[1, 1])                 # query patch (1, 1)'s map
    every_other = viz.similarity_mosaic(s, step=2)                        # query rows 0, columns 0 and 2
    assert every_other.shape == (2, 2 * 4 - 1)
    np.testing.assert_allclose(every_other[:, 4:7], s[0, 2])


def test_patch_embed_pca_finds_a_planted_direction(rng):
    P, C, D = 2, 3, 200
    direction = rng.standard_normal(P * P * C)
    direction /= np.linalg.norm(direction)
    weight = np.outer(direction, 5.0 * rng.standard_normal(D)) + 0.01 * rng.standard_normal((P * P * C, D))
    comps, ratio = viz.patch_embed_pca(weight, P, C, n_components=4)
    assert comps.shape == (4, P, P, C) and ratio.shape == (4,)
    assert abs(comps[0].ravel() @ direction) > 0.999
    assert ratio[0] > 0.99 and np.all(np.diff(ratio) <= 0)
    flat = comps.reshape(4, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(4), atol=1e-10)


def test_every_plot_draws(rng):
    img = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    model = minivit.ViT(TINY, seed=0)
    attns = viz.attention_weights(model, _images(rng, 2))
    figs = [
        viz.plot_patch_grid(img, 2, numbers=True),
        viz.plot_patch_sequence(F.im2patch(img[None].astype(float), 2)[0], 2, count=5),
        viz.plot_attention_maps(img, [np.ones((4, 4)), np.eye(4)], titles=["a", "b"], marks=[(0, 0), None]),
        viz.plot_attention_maps(img, [np.eye(4)], style="heat"),
        viz.plot_images_and_maps([img, img], [np.eye(4), np.ones((4, 4))], titles=["x", "y"]),
        viz.plot_mean_attention_distance(viz.mean_attention_distance(attns, (4, 4), 2), reference=3.0),
        viz.plot_pos_embed_similarity(viz.pos_embed_similarity(model.params["pos_embed"], (4, 4))),
        viz.plot_embedding_filters(viz.patch_embed_pca(model.params["patch_embed.proj.weight"], 2, 3, 5)[0]),
    ]
    assert len(figs[0].axes) == 1 and len(figs[1].axes) == 5
    assert len([ax for ax in figs[2].axes if ax.images]) == 2
    assert len(figs[3].axes[0].images) == 2                              # photo + heat layer
    assert len(figs[4].axes) == 4
    assert len(figs[7].axes) == 5
    for fig in figs:
        fig.canvas.draw()
    with pytest.raises(ValueError, match="style"):
        viz.plot_attention_maps(img, [np.eye(4)], style="glow")


def test_spotlight_dims_the_image_where_the_map_is_low():
    img = np.full((4, 4, 3), 200, np.uint8)
    fig = viz.plot_attention_maps(img, [np.array([[1.0, 0.0], [0.0, 0.0]])])
    shown = fig.axes[0].images[0].get_array()
    assert shown[0, 0, 0] == pytest.approx(200 / 255) and shown[3, 3, 0] == pytest.approx(0.15 * 200 / 255)


def test_similarity_by_distance_averages_each_distance():
    grid = (2, 3)
    sim = np.zeros(grid + grid)
    for r in range(2):
        for c in range(3):
            for r2 in range(2):
                for c2 in range(3):
                    sim[r, c, r2, c2] = -np.hypot(r - r2, c - c2)        # similarity = minus the distance
    d, m = viz.similarity_by_distance(sim)                               # distances 1 and sqrt 2 share bin 1
    np.testing.assert_array_equal(d, [0, 1, 2])
    # ordered pairs: 14 at distance 1 and 8 at sqrt 2 (bin 1); 4 at 2 and 4 at sqrt 5 (bin 2)
    np.testing.assert_allclose(m[1], -(14 * 1 + 8 * np.sqrt(2)) / 22)
    np.testing.assert_allclose(m[2], -(4 * 2 + 4 * np.sqrt(5)) / 8)
    assert m[0] == 0.0
    with pytest.raises(ValueError, match="gh, gw, gh, gw"):
        viz.similarity_by_distance(np.zeros((2, 3, 3, 2)))


def test_rollout_map_with_registers_reads_the_output_s_row_not_a_register_s():
    # tokens [cls, reg_1, reg_2, patches] (pool="cls") or [reg_1, reg_2, patches] (pool="gap"): the map must be
    # the class token's row, or the mean of the patch rows; never row 0 when row 0 is a register
    gh, gw, nr = 2, 3, 2
    N = 1 + nr + gh * gw
    r = np.zeros((1, N, N))
    r[0, 0, 1 + nr + 4] = 1.0                                # the class token reads patch 4
    r[0, 1, 1 + nr + 0] = 1.0                                # a register reads patch 0
    m = viz.rollout_map(r, (gh, gw), num_prefix_tokens=1 + nr)
    assert m[0, 1, 1] == 1.0 and m[0, 0, 0] == 0.0
    N = nr + gh * gw                                         # GAP with registers: no class token
    r = np.zeros((1, N, N))
    r[0, 0, nr + 0] = 1.0                                    # register 1's row reads patch 0: not the output
    r[0, nr:, nr + 5] = 1.0                                  # every patch row reads patch 5 = (1, 2)
    m = viz.rollout_map(r, (gh, gw), num_prefix_tokens=nr, class_token=False)
    assert m[0, 1, 2] == 1.0 and m[0, 0, 0] == 0.0


def test_show_jpeg_shows_the_figure_as_a_jpeg_of_its_size_and_closes_it(capsys):
    fig, ax = plt.subplots(figsize=(9, 2), dpi=80)
    ax.plot(np.random.default_rng(0).random(50))
    image = viz.show_jpeg(fig, quality=80)
    assert image.format == "jpeg" and image.data[:2] == b"\xff\xd8"               # the JPEG start-of-image marker
    from PIL import Image
    import io
    width, height = Image.open(io.BytesIO(image.data)).size
    assert 600 <= width <= 720 and height < 200, (width, height)                  # 9 x 2 inches at 80 dpi, cropped
    assert not plt.fignum_exists(fig.number)                                      # closed: not shown again as PNG
    with pytest.raises(ValueError, match="quality"):
        viz.show_jpeg(plt.figure(), quality=100)
