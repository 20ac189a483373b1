"""The five ops `python -m minivit.check` checks beside the ViT's own: quick GELU (CLIP), attention with a
causal mask (CLIP's text tower), Embedding (token ids), GridPosEmbed (the 2-D position embeddings) and
ConvStem (the hybrid's stem). The default ViT walked by the command uses none of them, so each has its
own op: it passes on the code as it is, and a planted bug in it is caught."""

import numpy as np
import pytest

from minivit import check as C
from minivit import conv
from minivit import embeddings as E
from minivit import functional as F
from minivit.backend import get_array_module

NEW_OPS = ("quick_gelu", "masked_attention", "embedding", "grid_pos_embed", "conv_stem")


def test_each_is_an_op_of_the_default_command_and_passes():
    assert set(NEW_OPS) <= set(C.select(None))                  # `python -m minivit.check` with no NAME runs them
    report = C.run(list(NEW_OPS))
    assert report.ok, report.table(verbose=True)
    assert [op for op in dict.fromkeys(r.op for r in report.rows)] == list(NEW_OPS)
    assert all(any(r.tensor is not None for r in report.rows if r.op == op) for op in NEW_OPS)  # gradients too


def gelu_backward_quick_without_1702(f):
    def backward(dout, cache):
        x, approximate = cache
        if approximate != "quick":
            return f(dout, cache)
        s = 1.0 / (1.0 + get_array_module(x).exp(-1.702 * x))
        return dout * (s + x * s * (1.0 - s))                   # the chain rule's 1.702 forgotten
    return backward


def attention_forward_ignoring_the_mask(f):
    return lambda qkv, num_heads, mask=None: f(qkv, num_heads)


def embedding_backward_assigning(f):
    def backward(dout, cache):
        ids, shape = cache
        dweight = get_array_module(dout).zeros(shape, dtype=dout.dtype)
        dweight[ids.reshape(-1)] = dout.reshape(-1, shape[1])   # a repeated id keeps only its last row
        return dweight
    return backward


def grid_backward_row_mean(f):
    def backward(self, dout):
        if self.kind != "learned2d":
            return f(self, dout)
        before = self.grads["pos_embed_row"].copy()
        dx = f(self, dout)
        gw = self.grid_size[1]                                  # the row's sum over its gw patches made a mean
        self.grads["pos_embed_row"][...] = before + (self.grads["pos_embed_row"] - before) / gw
        return dx
    return backward


PLANTED = {
    # id: (owner, attribute, replacement (given the original), op, row)
    "quick gelu without the 1.702": (F, "gelu_backward", gelu_backward_quick_without_1702, "quick_gelu", "dx"),
    "attention ignoring the mask": (F, "attention_forward", attention_forward_ignoring_the_mask, "masked_attention",
                                    "forward: functional.attention_forward(mask) vs softmax(+ mask) by hand"),
    "embedding rows assigned, not added": (F, "embedding_backward", embedding_backward_assigning, "embedding",
                                           "dweight"),
    "learned2d row gradient averaged": (E.GridPosEmbed, "backward", grid_backward_row_mean, "grid_pos_embed",
                                        "learned2d: dpos_embed_row"),
    "relu backward passing everything": (conv, "relu_backward", lambda f: lambda dout, mask: dout, "conv_stem",
                                         "dstages.0.conv.weight"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_in_each_is_caught(bug):
    owner, name, make, op, what = PLANTED[bug]
    original = getattr(owner, name)
    with C.replaced(owner, name, make(original)):
        report = C.run([op])
    assert getattr(owner, name) is original
    assert not report.ok
    row = report.row(op, what)
    assert row.status == "WRONG" and row.error > 1e-3, row


def test_the_mask_is_what_the_masked_op_adds():
    """Attention that ignores its mask passes the plain attention op (no mask there) and fails the masked one."""
    with C.replaced(F, "attention_forward", attention_forward_ignoring_the_mask(F.attention_forward)):
        assert C.run(["attention"], use_kernels=False).ok
        assert not C.run(["masked_attention"]).ok


def test_the_command_exits_1_on_a_bug_in_one_of_them(capsys):
    with C.replaced(F, "embedding_backward", embedding_backward_assigning(F.embedding_backward)):
        assert C.main(["embedding"]) == 1
    assert "embedding" in capsys.readouterr().out
    assert C.main(["embedding", "conv_stem"]) == 0
    np.testing.assert_array_equal(C.select(["embedding"]), ["embedding"])
