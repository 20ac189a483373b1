"""Fine-tuning the paper's way (issue 6): train() with --init starts from the checkpoint's weights,
resizes the position embeddings for the new resolution, and follows the "finetune" recipe."""

import numpy as np

from minivit.weights.convert import from_pretrained
from minivit.embeddings import resize_pos_embed
from minivit.train import TrainConfig, train


def test_finetune_from_a_checkpoint_at_a_higher_resolution(tmp_path):
    tiny = dict(dataset="shapes", train_subset=128, batch_size=32, progress=False)
    pre = train(TrainConfig(**tiny, embed_dim=16, depth=1, num_heads=2, max_steps=4, out=str(tmp_path / "pre")))
    ckpt = str(tmp_path / "pre" / "checkpoint.npz")
    before = {k: np.array(v) for k, v in pre.model.state_dict().items()}
    assert pre.model.config.img_size == (32, 32) and pre.model.config.patch_size == 4

    # the model that train() builds for --init (the same call as train.build_model): the checkpoint's
    # weights, the position embeddings resized from the 8x8 grid to 12x12, a zero-initialised head (the
    # paper's; train() asks for it by default), the rest untouched
    start = from_pretrained(ckpt, num_classes=10, img_size=48, verbose=False, new_head=True)
    got = {k: np.array(v) for k, v in start.state_dict().items()}
    assert got.keys() == before.keys()
    for k, v in before.items():
        if k == "pos_embed":
            assert got[k].shape == (1, 1 + 12 * 12, 16)
            np.testing.assert_allclose(got[k], resize_pos_embed(v, (8, 8), (12, 12)), rtol=1e-6, atol=1e-7)
        elif k.startswith("head."):
            assert not got[k].any() and v.any(), k
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=k)

    ft = train(TrainConfig(**tiny, init=ckpt, img_size=48, recipe="finetune", max_steps=6, grad_accum=2,
                           eval_every=3, warmup_steps=1, lr=0.01, out=str(tmp_path / "ft")))
    assert ft.summary["steps"] == 6 and [r["step"] for r in ft.history] == [3, 6]
    assert ft.model.config.img_size == (48, 48) and ft.model.config.embed_dim == 16   # the checkpoint's width,
    assert ft.model.config.depth == 1                                                 # not vit_base's 768 / 12
    assert ft.summary["train_config"]["optimizer"] == "sgd" and ft.summary["train_config"]["clip_grad"] == 1.0
    # and it started from the checkpoint: six SGD steps of lr <= 0.01 on gradients clipped to norm 1, with
    # momentum 0.9, move the weights by at most 0.01 * (1 + 1.9 + 2.71 + 3.44 + 4.10 + 4.69) < 0.18 in L2
    # norm (0.04 here), while a model initialised afresh, even with the same seed, is 0.24 from the
    # checkpoint (what the 4 AdamW steps of pre-training moved it). A falling loss is no test here: six
    # steps after a 4-step pre-training are too noisy for it.
    distance = np.sqrt(sum(((np.array(v) - got[k]) ** 2).sum() for k, v in ft.model.state_dict().items()))
    assert 0 < distance < 0.18, distance
