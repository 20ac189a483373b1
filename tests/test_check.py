"""python -m minivit.check: it passes on the code as it is, fails on each planted bug naming the tensor and
the likeliest cause, sees edits made at run time (monkeypatched functions, edited layer methods), and
its command line refuses bad names."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minivit import check as C
from minivit import embeddings as E
from minivit import functional as F
from minivit import kernels
from minivit import layers as L
from minivit import optim
from minivit.backend import get_array_module
from minivit.gradcheck import PairLayer, gradcheck

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clean_report():
    return C.run()


def test_the_default_set_passes_on_the_code_as_it_is_in_under_a_minute(clean_report):
    assert clean_report.ok, clean_report.table(verbose=True)
    assert clean_report.seconds < 60, f"the default check took {clean_report.seconds:.0f} s"
    assert list(dict.fromkeys(r.op for r in clean_report.rows)) == list(C.OPS)
    grads = {(r.op, r.what) for r in clean_report.rows if r.tensor is not None}
    for row in [("layernorm", "dx"), ("layernorm", "dweight"), ("attention", "dq"), ("attention", "dk"),
                ("attention", "dv"), ("pos_embed", "dcls_token"), ("cross_entropy", "dlogits"),
                ("model", "dblocks.1.mlp.fc2.weight"), ("model", "dx"), ("dropout", "dx"), ("drop_path", "dx")]:
        assert row in grads, row
    table = str(clean_report)
    assert "WRONG" not in table and table.splitlines()[-1].startswith("all ")


def test_the_fast_kernels_are_compared_where_numba_is_there(clean_report):
    kernel_rows = [r for r in clean_report.rows if "kernels." in r.what]
    if not kernels.HAVE_NUMBA:                                                       # linear's twin is plain NumPy
        assert all(r.skipped == (r.op != "linear") for r in kernel_rows)
        return
    ops = {r.op for r in kernel_rows}
    assert ops == {"linear", "layernorm", "gelu_erf", "gelu_tanh", "softmax", "attention", "adamw"}
    assert all(r.tol == C.TOL_KERNEL and 0 < r.error < 1e-5 for r in kernel_rows)  # float32 rounding, no more


# ---- planted bugs: each caught, naming the tensor, with its diagnosis --------------------------------------


def layernorm_without_mean_term(dout, cache):
    xhat, rstd, weight = cache
    dxhat = dout * weight
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))             # term 2 forgotten
    return dx, (dout * xhat).reshape(-1, xhat.shape[-1]).sum(0), dout.reshape(-1, xhat.shape[-1]).sum(0)


def layernorm_without_variance_term(dout, cache):
    xhat, rstd, weight = cache
    dxhat = dout * weight
    dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True))                              # term 3 forgotten
    return dx, (dout * xhat).reshape(-1, xhat.shape[-1]).sum(0), dout.reshape(-1, xhat.shape[-1]).sum(0)


def attention_backward_without_scale_in_dq(dout, cache):
    q, k, v, attn, scale = cache
    B, nh, N, hs = q.shape
    dctx = dout.reshape(B, N, nh, hs).transpose(0, 2, 1, 3)
    dv = attn.swapaxes(-1, -2) @ dctx
    dscores = F.softmax_backward(dctx @ v.swapaxes(-1, -2), attn)
    return F.merge_heads(dscores @ k, dscores.swapaxes(-1, -2) @ q * scale, dv)   # dq: the 1/sqrt(hs) forgotten


def block_backward_without_residual(self, dout):
    dx1 = self.norm2.backward(self.mlp.backward(self.drop_path2.backward(dout)))   # `dout +` dropped
    return dx1 + self.norm1.backward(self.attn.backward(self.drop_path1.backward(dx1)))


def pos_embed_backward_without_batch_sum(self, dout):
    self._need_cache()
    self.grads["pos_embed"] += dout.sum(0, keepdims=True)
    self.grads["cls_token"] += dout[:1, :1]                                         # only sample 0's
    return dout[:, 1:]


def pool_backward_forgetting_the_class_token(self, dout):
    B, N, D = self._need_cache()
    return get_array_module(dout).zeros((B, N, D), dtype=dout.dtype)               # dx[:, 0] = dout forgotten


def patch2im_wrong_transpose(patches, patch_size, img_size):
    B, N, PPC = patches.shape
    (H, W), P = img_size, patch_size
    C = PPC // (P * P)
    x = patches.reshape(B, H // P, W // P, P, P, C).transpose(0, 2, 3, 1, 4, 5)     # should be (0, 1, 3, 2, 4, 5)
    return x.reshape(B, H, W, C)


def drop_path_with_a_mask_per_value(self, x):
    if not self.training or self.p == 0.0:
        self.cache = None
        return x
    keep = self.rng.random(x.shape) >= self.p                                       # should be (B, 1, 1)
    out, self.cache = F.dropout_forward(x, keep, self.p)
    return out


def dropout_keeping_with_probability_p(self, x):
    if not self.training or self.p == 0.0:
        self.cache = None
        return x
    shape = (x.shape[0],) + (1,) * (x.ndim - 1) if self.per_sample else x.shape
    out, self.cache = F.dropout_forward(x, self.rng.random(shape) < self.p, self.p)  # keeps p, drops 1 - p
    return out


def adamw_without_bias_corrections(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    p *= 1 - lr * weight_decay
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * g * g
    p -= lr * m / (v ** 0.5 + eps)                                                  # m_hat, v_hat forgotten


def adamw_with_l2(f):
    return lambda p, g, m, v, lr, b1, b2, eps, wd, step: f(p, g + wd * p, m, v, lr, b1, b2, eps, 0.0, step)


def sgd_ignoring_nesterov(f):
    return lambda p, g, buf, lr, mu, nesterov, wd: f(p, g, buf, lr, mu, False, wd)


PLANTED = {
    # id: (owner, attribute, replacement (given the original), op, row, words the diagnosis must contain)
    "layernorm mean term": (F, "layernorm_backward", lambda f: layernorm_without_mean_term, "layernorm", "dx",
                            "the same all along D"),
    "layernorm variance term": (F, "layernorm_backward", lambda f: layernorm_without_variance_term, "layernorm",
                                "dx", "proportional to xhat"),
    "layernorm dx halved": (F, "layernorm_backward", lambda f: lambda d, c: (0.5 * f(d, c)[0],) + f(d, c)[1:],
                            "layernorm", "dx", "x0.5"),
    "gelu forward halved": (F, "gelu_forward", lambda f: lambda x, a="erf": (0.5 * f(x, a)[0], f(x, a)[1]),
                            "gelu_erf", "dx", "x2"),
    "gelu backward zero": (F, "gelu_backward", lambda f: lambda d, c: 0 * f(d, c), "gelu_tanh", "dx",
                           "zero everywhere"),
    "softmax sign": (F, "softmax_backward", lambda f: lambda d, s: -f(d, s), "softmax", "dx", "wrong sign"),
    "softmax sum term": (F, "softmax_backward", lambda f: lambda d, s: s * d, "softmax", "dx", "proportional to s"),
    "dq without 1/sqrt(hs)": (F, "attention_backward", lambda f: attention_backward_without_scale_in_dq,
                              "attention", "dq", "x4 (= sqrt(hs)"),
    "heads swapped in the merge": (F, "merge_heads",
                                   lambda f: lambda dq, dk, dv: f(dq[:, ::-1], dk[:, ::-1], dv[:, ::-1]),
                                   "attention", "dv", "head 0 and head 1 swapped"),
    "dW transposed": (F, "linear_backward", lambda f: lambda d, c: (f(d, c)[0], f(d, c)[1].T, f(d, c)[2]),
                      "linear", "dweight", "in and out transposed"),
    "1/B dropped in the loss": (F, "cross_entropy_backward", lambda f: lambda c: f(c) * c[0].shape[0],
                                "cross_entropy", "dlogits", "x5 (= B"),
    "class token not summed over the batch": (E.PosEmbed, "backward", lambda f: pos_embed_backward_without_batch_sum,
                                              "pos_embed", "dcls_token", "sum over the batch"),
    "pool cls forgets the class token": (L.Pool, "backward", lambda f: pool_backward_forgetting_the_class_token,
                                         "pool", "cls: dx", "zero everywhere"),
    "AdamW without bias corrections": (F, "adamw_update", lambda f: adamw_without_bias_corrections, "adamw",
                                       "step 1 (eps = wd = 0): p moves by -lr sign(g)",
                                       "x3.162 (= (1 - b1) / sqrt(1 - b2))"),
    "AdamW with L2 decay": (F, "adamw_update", adamw_with_l2, "adamw", "g = 0: p <- p (1 - lr wd)", "decoupled"),
    "AdamW ignoring the step count": (F, "adamw_update", lambda f: lambda *a: f(*a[:-1], 1), "adamw",
                                      "3 steps: p vs kernels.adamw_update, float32", "step count"),
    "SGD ignoring nesterov": (F, "sgd_update", sgd_ignoring_nesterov, "sgd",
                              "nesterov, 3 steps: p vs the rule written out", "differs"),
    "AdamW.step forgetting no_decay": (optim.AdamW, "_decay", lambda f: lambda self, name: self.weight_decay, "adamw",
                                       "optim.AdamW.step, 3 steps: bias vs functional.adamw_update by hand", "differs"),
    "drop-path with a mask per value": (L.Dropout, "forward", lambda f: drop_path_with_a_mask_per_value, "drop_path",
                                        "forward: each sample is 0 or x / (1 - p)", "zeros inside a sample"),
    "dropout keeping with probability p": (L.Dropout, "forward", lambda f: dropout_keeping_with_probability_p,
                                           "dropout", "forward: the share of values dropped, of 2000 (p = 0.25)",
                                           "kept with probability p instead of dropped"),
    "drop-path backward without 1/(1-p)": (F, "dropout_backward", lambda f: lambda d, c: d * (c != 0), "drop_path",
                                           "dx", "x0.75 (= 1 - p)"),
    "dropout backward passing dout": (F, "dropout_backward", lambda f: lambda d, c: d, "dropout", "dx",
                                      "dx = dout"),
    "patch2im undoes the wrong transpose": (F, "patch2im", lambda f: patch2im_wrong_transpose, "patch_embed", "dx",
                                            "the right values in the wrong places"),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_is_caught_naming_the_tensor_and_the_cause(bug):
    owner, name, make, op, what, words = PLANTED[bug]
    if "kernels." in what and not kernels.HAVE_NUMBA:
        pytest.skip("the row compares with a Numba kernel, and Numba is not installed")
    original = getattr(owner, name)
    with C.replaced(owner, name, make(original)):
        report = C.run([op])
    assert getattr(owner, name) is original                                          # restored
    assert not report.ok
    row = report.row(op, what)
    assert row.status == "WRONG" and row.error > 1e-3, row
    assert words in row.note, f"{bug}: {row.note!r}"
    assert f"{op}" in str(report) and "WRONG" in str(report)


def test_a_dropped_residual_in_the_block_is_traced_to_the_attention_branch():
    with C.replaced(L.Block, "backward", block_backward_without_residual):
        report = C.run(["block", "model"])
    wrong = {(r.op, r.what) for r in report.wrong()}
    assert ("block", "dx") in wrong and ("block", "dattn.proj.bias") in wrong
    # the MLP branch is right
    assert ("block", "dmlp.fc2.weight") not in wrong and ("block", "dnorm2.weight") not in wrong
    assert "first goes wrong at dattn.proj.bias" in report.hints["block"]
    assert "dout +" in report.hints["block"] and "blocks.1.attn" in report.hints["model"]
    assert L.Block.backward is not block_backward_without_residual                 # restored


def test_a_dropped_final_residual_leaves_only_dx_wrong():
    def backward(self, dout):
        dx1 = dout + self.norm2.backward(self.mlp.backward(self.drop_path2.backward(dout)))
        return self.norm1.backward(self.attn.backward(self.drop_path1.backward(dx1)))  # `dx1 +` dropped

    with C.replaced(L.Block, "backward", backward):
        report = C.run(["block"])
    assert [r.what for r in report.wrong()] == ["dx"]
    assert "residual" in report.hints["block"]


def test_an_edited_layer_forward_is_compared_with_the_functional_pairs():
    def forward(self, x):                                                            # the residual forgotten
        x1 = self.drop_path1.forward(self.attn.forward(self.norm1.forward(x)))
        return x1 + self.drop_path2.forward(self.mlp.forward(self.norm2.forward(x1)))

    with C.replaced(L.Block, "forward", forward):
        report = C.run(["block"])
    assert report.row("block", "forward: layers.Block vs functional").status == "WRONG"


def test_a_wrong_fast_kernel_is_caught_while_the_gradients_stay_right():
    if not kernels.HAVE_NUMBA:
        pytest.skip("no Numba: the CPU kernels are not there")
    original = kernels.layernorm_forward

    def doubled(x, weight, bias, eps):
        out, cache = original(x, weight, bias, eps)
        return 2 * out, cache

    with C.replaced(kernels, "layernorm_forward", doubled):
        report = C.run(["layernorm"])
        without = C.run(["layernorm"], use_kernels=False)
    wrong = report.wrong()
    assert [r.what for r in wrong] == ["forward vs kernels.layernorm_forward, float32"]
    assert "x0.5" in wrong[0].note and "--no-kernels" in wrong[0].note              # functional = 0.5 x kernel
    assert without.ok and not any("kernels." in r.what for r in without.rows)


def test_without_numba_the_kernel_rows_are_skipped_not_failed(monkeypatch):
    monkeypatch.setattr(kernels, "HAVE_NUMBA", False)
    report = C.run(["gelu_erf"])
    assert report.ok
    skipped = [r for r in report.rows if r.skipped]
    assert len(skipped) == 1 and "Numba" in skipped[0].note and "skipped" in str(report)


def test_an_edit_that_raises_is_reported_and_the_other_ops_still_run():
    def broken(dout, cache):
        raise ValueError("shapes (15, 6) and (5, 6) not aligned")

    with C.replaced(F, "linear_backward", broken):
        report = C.run(["linear", "softmax"])
    row = report.rows[0]
    assert (row.op, row.what, row.status) == ("linear", "raised ValueError", "WRONG")
    assert "not aligned" in row.note and "test_check.py" in row.note
    assert all(r.ok for r in report.rows if r.op == "softmax")


# ---- replaced(): restores, always -------------------------------------------------------------------------


def test_replaced_restores_functions_and_methods_even_after_an_error():
    original = F.gelu_backward
    with pytest.raises(RuntimeError):
        with C.replaced(F, "gelu_backward", None):
            assert F.gelu_backward is None
            raise RuntimeError("a failing cell")
    assert F.gelu_backward is original
    with C.replaced(L.PreLogits, "train", lambda self, mode=True: self):            # inherited from Layer
        assert "train" in L.PreLogits.__dict__
    assert "train" not in L.PreLogits.__dict__ and L.PreLogits.train is L.Layer.train
    with pytest.raises(AttributeError, match="layernorm_backwards"):
        with C.replaced(F, "layernorm_backwards", None):
            pass


# ---- the diagnoses, on arrays made for them ---------------------------------------------------------------


@pytest.fixture
def true(rng):
    return rng.standard_normal((3, 2, 5, 4))                                        # (B, head, N, hs)


AXES = ("B", "head", "N", "hs")


def test_diagnose_constant_factor_and_sign(true):
    assert "x0.5" in C.diagnose(0.5 * true, true, AXES)
    assert "x0.3333 (= 1/B, B = 3 here)" in C.diagnose(true / 3, true, AXES, factors={"B": 3})
    assert "wrong sign (x-1)" in C.diagnose(-true, true, AXES)
    assert "wrong sign and off by a constant factor: x-2" in C.diagnose(-2 * true, true, AXES)


def test_diagnose_zero_and_a_part_zero(true):
    assert "zero everywhere" in C.diagnose(0 * true, true, AXES)
    assert "should be zero" in C.diagnose(true, 0 * true, AXES)
    part = true.copy()
    part[:, :, 0] = 0                                                               # token 0 left out
    assert C.diagnose(part, true, AXES).startswith("zero only at N = 0 (of 0..4)")


def test_diagnose_permutation_and_transposition(true):
    assert C.diagnose(true[:, ::-1], true, AXES) == "head 0 and head 1 swapped"
    assert C.diagnose(true[:, :, [1, 2, 0, 3, 4]], true, AXES).startswith("permuted along N")
    square = true[:, :, :4]                                                        # (3, 2, 4, 4)
    assert C.diagnose(square.swapaxes(2, 3), square, AXES) == "N and hs transposed"


def test_diagnose_errors_with_structure_along_an_axis(true, rng):
    offset = rng.standard_normal((3, 2, 5, 1))
    assert "the same all along hs" in C.diagnose(true + offset, true, AXES)
    z = rng.standard_normal(true.shape)
    assert "proportional to z along hs" in C.diagnose(true + offset * z, true, AXES, refs={"z": z})
    wrong = true.copy()
    wrong[1] += rng.standard_normal(wrong[1].shape)                                 # sample 1 only
    assert C.diagnose(wrong, true, AXES).startswith("wrong only at B = 1 (of 0..2)")


def test_diagnose_says_nothing_when_nothing_simple_fits(true, rng):
    assert C.diagnose(true + rng.standard_normal(true.shape), true, AXES) == ""
    assert C.diagnose((0.5 * true).ravel()[:7], true.ravel()[:7], ()) .startswith("off by")  # samples: factor only


# ---- gradcheck's additions --------------------------------------------------------------------------------


def test_gradcheck_keeps_its_samples_and_checks_named_parameters_only(arr):
    layer = L.LayerNorm(4, dtype="float64")
    report = gradcheck(layer, arr(2, 3, 4), max_checks=None, names=["bias"])
    assert [r[0] for r in report.rows] == ["input", "bias"]
    indices, analytic, numeric, shape = report.samples["input"]
    assert list(indices) == list(range(24)) and shape == (2, 3, 4)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="gamma"):
        gradcheck(layer, arr(2, 3, 4), names=["gamma"])


def test_pair_layer_checks_a_functional_pair_and_refuses_a_short_backward(arr):
    w, b = arr(5), arr(5)
    pair = PairLayer(lambda x, w, b: F.layernorm_forward(x, w, b), lambda d, c: F.layernorm_backward(d, c),
                     {"weight": w, "bias": b})
    assert gradcheck(pair, arr(2, 5), tol=1e-7).ok
    short = PairLayer(lambda x, w, b: F.layernorm_forward(x, w, b), lambda d, c: F.layernorm_backward(d, c)[:2],
                      {"weight": w, "bias": b})
    with pytest.raises(ValueError, match="dx and 2 parameter gradients"):
        gradcheck(short, arr(2, 5))


# ---- the command line -------------------------------------------------------------------------------------


def test_names_select_ops_and_groups_and_bad_names_are_refused_with_the_list():
    assert C.select(["gelu"]) == ["gelu_erf", "gelu_tanh"]
    assert C.select(["attention"]) == ["attention", "attention_layer"]
    assert C.select(None) == list(C.OPS)
    with pytest.raises(ValueError, match="'layrnorm'.*choose from: patch_embed, linear, layernorm"):
        C.select(["layernorm", "layrnorm"])


def test_main_exits_2_on_a_bad_name_and_1_on_a_wrong_gradient(capsys):
    with pytest.raises(SystemExit) as stop:
        C.main(["layrnorm"])
    assert stop.value.code == 2 and "choose from" in capsys.readouterr().err
    with C.replaced(F, "softmax_backward", lambda d, s: s * d):
        assert C.main(["softmax", "--no-kernels"]) == 1
    out = capsys.readouterr().out
    assert "softmax" in out and "WRONG" in out and "kernels" not in out
    assert C.main(["softmax"]) == 0


def test_the_module_runs_as_a_command_with_help():
    run = subprocess.run([sys.executable, "-m", "minivit.check", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0 and "cross_entropy" in run.stdout and "--no-kernels" in run.stdout
    run = subprocess.run([sys.executable, "-m", "minivit.check", "pool", "linear"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1].startswith("all ") and "pool" in run.stdout


@pytest.mark.gpu
def test_the_check_passes_on_the_gpu_backend_with_the_cuda_kernels():
    import minivit

    minivit.set_backend("cupy")                       # the suite's backend is restored after each test
    report = C.run(["layernorm", "attention", "cross_entropy", "model"])
    assert report.ok, report.table(verbose=True)
    assert any("kernels." in r.what and not r.skipped for r in report.rows)
