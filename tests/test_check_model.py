"""The model walk of minivit.check (run_model, --model, the default command): every layer of a model as
its classes stand, each checked on its own input by central differences, children before parents. Right
code of each structural change passes with no false row; each planted bug is WRONG under the layer's path
and the tensor's full name, and no right layer is blamed. Plus the diagnoses of issue 28, item 4."""

import subprocess
import sys
from pathlib import Path

import pytest
from test_architecture import RMSNorm, ScaledBlock

from minivit import check as C
from minivit import embeddings as E
from minivit import functional as F
from minivit import layers as L
from minivit.backend import get_array_module
from minivit.model import ViT, ViTConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ViTConfig(img_size=8, patch_size=4, in_chans=3, num_classes=3, embed_dim=8, depth=2, num_heads=2,
                   mlp_ratio=2.0)


# ---- a student's layers: right, and each with one planted bug ----------------------------------------------


class TemperatureAttention(L.Attention):
    """softmax(t_h q k^T / sqrt(hs)) v with a learned temperature t per head (nh,)."""

    def __init__(self, dim, num_heads, dtype="float64", seed=0):
        super().__init__(dim, num_heads, dtype=dtype, seed=seed)
        self.params["temperature"] = 1.5 * L.ones((num_heads,), dtype)           # (nh,)

    def forward(self, x):                                                       # (B, N, D)
        B, N, D = x.shape
        nh = self.num_heads
        hs = D // nh
        qkv = self.qkv.forward(x).reshape(B, N, 3, nh, hs).transpose(2, 0, 3, 1, 4)  # (3, B, nh, N, hs)
        q, k, v = qkv[0], qkv[1], qkv[2]
        t = self.params["temperature"].reshape(1, nh, 1, 1)
        s = q @ k.swapaxes(-1, -2) / hs ** 0.5                                  # (B, nh, N, N)
        p, _ = F.softmax_forward(s * t)                                         # (B, nh, N, N)
        self.cache = (q, k, v, s, p)
        ctx = (p @ v).transpose(0, 2, 1, 3).reshape(B, N, D)                    # (B, N, D)
        return self.proj.forward(ctx)

    def dtemperature(self, dst, s):
        return (dst * s).sum(axis=(0, 2, 3))                                    # (nh,)

    def backward(self, dout):                                                   # (B, N, D)
        q, k, v, s, p = self._need_cache()
        xp = get_array_module(dout)
        B, nh, N, hs = q.shape
        t = self.params["temperature"].reshape(1, nh, 1, 1)
        dctx = self.proj.backward(dout).reshape(B, N, nh, hs).transpose(0, 2, 1, 3)   # (B, nh, N, hs)
        dv = p.swapaxes(-1, -2) @ dctx
        dst = F.softmax_backward(dctx @ v.swapaxes(-1, -2), p)                  # d(s * t)
        self.grads["temperature"] += self.dtemperature(dst, s)
        ds = dst * t / hs ** 0.5
        dqkv = xp.stack([ds @ k, ds.swapaxes(-1, -2) @ q, dv])                  # (3, B, nh, N, hs)
        return self.qkv.backward(dqkv.transpose(1, 3, 0, 2, 4).reshape(B, N, 3 * nh * hs))


class SquaredReLU(L.Layer):
    """relu(x)^2 (Primer): a new activation class."""

    def forward(self, x):
        self.cache = x
        return (x > 0) * x * x

    def backward(self, dout):
        x = self._need_cache()
        return dout * 2 * x * (x > 0)


class TemperatureWrongSign(TemperatureAttention):
    def dtemperature(self, dst, s):
        return -super().dtemperature(dst, s)                                    # planted: the sign


class ScaledBlockHalfGamma(ScaledBlock):
    def backward(self, dout):
        a = self._need_cache()
        dx1 = dout + self.norm2.backward(self.mlp.backward(dout))
        self.grads["gamma"] += 0.5 * (dx1 * a).sum(axis=(0, 1))                 # planted: a factor 0.5
        return dx1 + self.norm1.backward(self.attn.backward(dx1 * self.params["gamma"]))


class RMSNormWithoutMeanTerm(RMSNorm):
    def backward(self, dout):
        x, r = self._need_cache()
        self.grads["weight"] += (dout * x * r).reshape(-1, x.shape[-1]).sum(0)
        return r * dout * self.params["weight"]                                 # planted: the mean term


class SquaredReLUHalf(SquaredReLU):
    def backward(self, dout):
        return 0.5 * super().backward(dout)                                     # planted: x0.5


def changed(change, dtype="float64"):
    """A ViT with one structural change (the names are the suite's ids)."""
    model = ViT(ViTConfig(**{**CONFIG.to_dict(), "num_registers": 2}) if change == "registers" else CONFIG,
                seed=0, dtype=dtype)
    if change == "composite owns gamma":
        model.blocks[1] = ScaledBlock(8, 2, dtype=dtype)
    elif change == "leaf swapped (RMSNorm)":
        model.blocks[0].norm1 = RMSNorm(8, dtype=dtype)
    elif change == "block replaced":
        model.blocks[0] = L.Block(8, 2, mlp_ratio=3.0, dtype=dtype, seed=7)
    elif change == "temperature":
        model.blocks[1].attn = TemperatureAttention(8, 2, dtype=dtype)
    elif change == "new activation":
        model.blocks[0].mlp.act = SquaredReLU()
    return model


CHANGES = ["composite owns gamma", "leaf swapped (RMSNorm)", "block replaced", "temperature", "registers",
           "new activation"]


def build_all_changes(dtype="float64"):
    """Every change at once: what the --model test's file returns."""
    model = ViT(ViTConfig(**{**CONFIG.to_dict(), "num_registers": 2}), seed=0, dtype=dtype)
    model.blocks[1] = ScaledBlock(8, 2, dtype=dtype)
    model.blocks[1].attn = TemperatureAttention(8, 2, dtype=dtype)
    model.blocks[0].norm1 = RMSNorm(8, dtype=dtype)
    model.blocks[0].mlp.act = SquaredReLU()
    model.blocks.append(L.Block(8, 2, mlp_ratio=3.0, dtype=dtype, seed=7))
    return model


# ---- the default model, and right code of each change ------------------------------------------------------


def test_the_default_model_passes_the_walk_and_every_layer_has_rows():
    model = C._default_model()
    report = C.run_model(model)
    assert report.ok, report.table(verbose=True)
    paths = {r.op for r in report.rows}
    assert {"patch_embed.proj", "pos_embed", "blocks.1.attn.qkv", "blocks.1.attn", "blocks.1", "pool",
            "head", "model"} <= paths
    tensors = {r.tensor for r in report.rows}
    assert {"blocks.1.attn.qkv.weight", "cls_token", "pos_embed", "head.bias"} <= tensors
    ops = list(dict.fromkeys(r.op for r in report.rows))
    assert ops.index("blocks.0.attn.qkv") < ops.index("blocks.0.attn") < ops.index("blocks.0") < ops.index("model")
    assert report.row("blocks.0.norm1", "forward vs textbook LayerNorm").status == "ok"


@pytest.mark.parametrize("change", CHANGES)
def test_right_code_of_a_structural_change_passes_with_no_false_row(change):
    model = changed(change)
    report = C.run_model(model)
    assert report.ok, report.table(verbose=True)
    statuses = {r.status for r in report.rows}
    assert statuses <= {"ok", "differs"}, statuses
    if change == "composite owns gamma":
        assert report.row("blocks.1", "dgamma").tensor == "blocks.1.gamma"
        assert report.row("blocks.1", "forward vs textbook Block").status == "differs"
    if change == "leaf swapped (RMSNorm)":
        assert report.row("blocks.0.norm1", "dweight").status == "ok"
        row = report.row("blocks.0", "forward vs textbook Block")                # KeyError 'bias' inside
        assert row.status == "differs" and "checked by numerical gradients only" in row.note
    if change == "temperature":
        assert report.row("blocks.1.attn", "dtemperature").tensor == "blocks.1.attn.temperature"
        assert report.row("blocks.1.attn", "forward vs textbook Attention").status == "differs"
    if change == "registers":
        assert report.row("pos_embed", "dreg_token").status == "ok"
    if change == "new activation":
        assert report.row("blocks.0.mlp.act", "dx").status == "ok"


def test_run_model_leaves_the_model_as_it_was():
    model = changed("composite owns gamma")
    before = {k: p.copy() for k, p in model.params.items()}
    C.run_model(model)
    assert all((model.params[k] == p).all() for k, p in before.items())
    assert "forward" not in model.blocks[1].__dict__                            # the recording is undone


# ---- planted bugs: WRONG under the layer's path and the tensor, no right layer blamed ----------------------


def _planted(change):
    model = changed(change)
    if change == "composite owns gamma":
        model.blocks[1] = ScaledBlockHalfGamma(8, 2)
        return model, "blocks.1", "blocks.1.gamma"
    if change == "leaf swapped (RMSNorm)":
        model.blocks[0].norm1 = RMSNormWithoutMeanTerm(8)
        return model, "blocks.0.norm1", "blocks.0.norm1 dx"
    if change == "temperature":
        model.blocks[1].attn = TemperatureWrongSign(8, 2)
        return model, "blocks.1.attn", "blocks.1.attn.temperature"
    model.blocks[0].mlp.act = SquaredReLUHalf()
    return model, "blocks.0.mlp.act", "blocks.0.mlp.act dx"


@pytest.mark.parametrize("change", ["composite owns gamma", "leaf swapped (RMSNorm)", "temperature",
                                    "new activation"])
def test_a_planted_bug_is_named_by_layer_and_tensor_and_nothing_right_is_blamed(change):
    model, path, label = _planted(change)
    report = C.run_model(model)
    assert not report.ok
    wrong = report.wrong()
    assert {r.op for r in wrong} == {path}, [r.label for r in wrong]
    assert label in {r.label for r in wrong}
    assert label in report.table().splitlines()[-1]                             # the summary names it
    for r in report.rows:                                                       # those around it: skipped
        if path.startswith(r.op + ".") or r.op == "model":
            assert r.status == f"skipped: fix {path} first", r
    if change == "composite owns gamma":
        assert "x0.5" in report.row("blocks.1", "dgamma").note
    if change == "leaf swapped (RMSNorm)":
        assert "proportional to x along D" in report.row("blocks.0.norm1", "dx").note
    if change == "temperature":
        assert "wrong sign" in report.row("blocks.1.attn", "dtemperature").note
    assert path in report.verdict()


# ---- the command line: --model, the default walk, --clip ---------------------------------------------------


def _student_file(tmp_path, body):
    file = tmp_path / "mymodel.py"
    file.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n" + body)
    return file


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "minivit.check", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_the_command_line_checks_a_students_model(tmp_path):
    file = _student_file(tmp_path, "from test_check_model import build_all_changes as build\n"
                                   "from test_check_model import ScaledBlockHalfGamma\n"
                                   "def broken(dtype='float32'):\n"
                                   "    model = build(dtype)\n"
                                   "    model.blocks[1] = ScaledBlockHalfGamma(8, 2)\n"
                                   "    return model\n"
                                   "def thirty_two():\n    return build('float32')\n"
                                   "def not_a_model():\n    return 3\n")
    right = _cli("--model", f"{file}:build")
    assert right.returncode == 0, right.stdout + right.stderr
    assert "blocks.2" in right.stdout and "WRONG" not in right.stdout and "differs" in right.stdout
    wrong = _cli("--model", f"{file}:broken")
    assert wrong.returncode == 1 and "blocks.1.gamma" in wrong.stdout.splitlines()[-1]
    for spec, words in ((f"{file}:nope", "no function 'nope'"), (f"{tmp_path}/none.py:build", "no file"),
                        (f"{file}:not_a_model", "not a minivit model"), (f"{file}:thirty_two", "float64")):
        run = _cli("--model", spec)
        assert run.returncode == 2 and words in run.stderr, (spec, run.stderr)


def test_the_default_command_walks_the_vit_and_clip_walks_clip():
    run = _cli()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "every layer of the ViT" in run.stdout and "blocks.1.attn.qkv" in run.stdout
    run = _cli("--clip")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr
    assert "text.blocks.0.attn" in run.stdout and "visual.blocks.0.mlp.fc1" in run.stdout


# ---- diagnoses that point at the right place (issue 28, item 4) --------------------------------------------


def adamw_rebinding_p(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    p = p * (1 - lr * weight_decay)                                             # planted: p rebound, twice
    m *= beta1
    m += (1 - beta1) * g
    v *= beta2
    v += (1 - beta2) * g * g
    p = p - lr * (m / (1 - beta1 ** step)) / ((v / (1 - beta2 ** step)) ** 0.5 + eps)   # noqa: F841


def test_an_adamw_that_rebinds_p_is_named_as_such():
    with C.replaced(F, "adamw_update", adamw_rebinding_p):
        report = C.run(["adamw"], use_kernels=False)
    row = report.row("adamw", "step 1 (eps = wd = 0): p moves by -lr sign(g)")
    assert row.status == "WRONG"
    assert "rebound, not updated in place: the model's array did not change" in row.note
    assert report.row("adamw", "step 1: m = (1 - b1) g").status == "ok"           # m and v were updated in place


def test_an_optimizer_that_replaces_a_parameter_array_is_named_as_such():
    from minivit import optim

    original = optim.AdamW.step

    def step(self):                                                             # right values, new arrays
        original(self)
        for name, p in list(self.model.params.items()):
            self.model.params[name] = p.copy()

    with C.replaced(optim.AdamW, "step", step):
        report = C.run(["adamw"], use_kernels=False)
    wrong = report.wrong()
    assert {r.what.split(": ")[1].split()[0] for r in wrong} == {"weight", "bias"}
    assert all("replaced (a new array put into params) instead of updated in place" in r.note for r in wrong)


def attention_backward_without_transpose_in_dv(dout, cache):
    q, k, v, attn, scale = cache
    B, nh, N, hs = q.shape
    dctx = dout.reshape(B, N, nh, hs).transpose(0, 2, 1, 3)
    dv = attn @ dctx                                                            # planted: attn^T
    dscores = F.softmax_backward(dctx @ v.swapaxes(-1, -2), attn)
    return F.merge_heads(dscores @ k * scale, dscores.swapaxes(-1, -2) @ q * scale, dv)


def test_dv_without_the_transpose_is_diagnosed_and_no_linear_is_blamed():
    with C.replaced(F, "attention_backward", attention_backward_without_transpose_in_dv):
        report = C.run(["attention"], use_kernels=False)
        walk = C.run_model(C._default_model())
    row = report.row("attention", "dv")
    assert row.status == "WRONG" and "transpose of P is missing" in row.note
    assert report.row("attention", "dq").status == "ok" and report.row("attention", "dk").status == "ok"
    assert {r.op for r in walk.wrong()} == {"blocks.0.attn", "blocks.1.attn"}     # not attn.qkv: it is right
    assert "'attention' rows" in walk.wrong()[0].note


def pos_embed_backward_shifted(self, dout):
    T = int(self.class_token) + self.num_registers
    self.grads["pos_embed"] += dout.sum(0, keepdims=True)
    self.grads["cls_token"] += dout[:, :1].sum(0, keepdims=True)
    return dout[:, T - 1:-1]                                                    # planted: one token early


def pool_backward_wrong_token(self, dout):
    B, S, D = self._need_cache()
    dx = get_array_module(dout).zeros((B, S, D), dtype=dout.dtype)
    dx[:, 1] = dout                                                             # planted: token 1, not 0
    return dx


@pytest.mark.parametrize("owner, bug, path", [(E.PosEmbed, pos_embed_backward_shifted, "pos_embed"),
                                              (L.Pool, pool_backward_wrong_token, "pool")])
def test_a_wrong_prefix_slice_is_blamed_on_the_layer_that_has_it(owner, bug, path):
    with C.replaced(owner, "backward", bug):
        report = C.run(["model"], use_kernels=False)
        walk = C.run_model(C._default_model())
    hint = report.hints["model"]
    assert f"whose own check fails (the layers inside it pass) is {path}:" in hint, hint
    assert "position embedding" not in hint.replace("pos_embed", "") and "patch_embed" not in hint
    assert {r.op for r in walk.wrong()} == {path}


def test_overfit_does_not_say_a_lower_loss_is_a_right_gradient():
    reference = C.overfit(30, lr=0.05, optimizer="sgd")
    original = F.cross_entropy_backward
    with C.replaced(F, "cross_entropy_backward", lambda cache: 2 * original(cache)):    # wrong: x2
        losses = C.overfit(30, lr=0.05, optimizer="sgd")
    assert losses[-1] < reference[-1]                     # the wrong gradient reaches a lower loss here
    text = losses.summary(reference)
    assert "lower than it" in text and "a lower loss does not make it right" in text
    assert "does not prove the gradients right" in reference.summary(reference)
    assert "lower loss than the right one" in " ".join(C.overfit.__doc__.split())
    readme = (ROOT / "README.md").read_text()
    assert "only worse" not in readme and "even to a lower loss" in readme


def test_the_verdict_groups_rows_that_share_a_note():
    with C.replaced(F, "gelu_backward", lambda d, c: 0 * d):
        report = C.run(["gelu"], use_kernels=False)
    verdict = report.verdict()
    zero = [line for line in verdict.splitlines() if "zero everywhere" in line]
    assert len(zero) == 1 and "gelu_erf dx" in zero[0] and "gelu_tanh dx" in zero[0], verdict


def test_a_kernel_row_defers_to_its_wrong_gradient_row_and_names_the_python_switch():
    from minivit import kernels

    if not kernels.HAVE_NUMBA:
        pytest.skip("no Numba: the kernel rows are skipped")
    original = F.softmax_backward
    with C.replaced(F, "softmax_backward", lambda d, s: 2 * original(d, s)):
        report = C.run(["softmax"])
    kernel = [r for r in report.wrong() if "kernels." in r.what]
    assert kernel and all("the gradient row dx is WRONG too" in r.note for r in kernel)
    assert "x2" in report.row("softmax", "dx").note
    forward = kernels.layernorm_forward
    with C.replaced(kernels, "layernorm_forward", lambda x, w, b, eps: (2 * forward(x, w, b, eps)[0],
                                                                       forward(x, w, b, eps)[1])):
        row = C.run(["layernorm"]).row("layernorm", "forward vs kernels.layernorm_forward, float32")
    assert "check.run(..., use_kernels=False)" in row.note


def test_an_op_whose_class_no_longer_has_the_textbook_arrays_differs_and_a_students_error_still_raises():
    class NormWithoutBias(RMSNorm):                                             # LayerNorm's signature
        def __init__(self, dim, eps=1e-6, dtype="float32"):
            super().__init__(dim, eps, dtype)

    with C.replaced(L, "LayerNorm", NormWithoutBias):                           # every Block builds it now
        report = C.run(["layernorm", "block"], use_kernels=False)
    assert report.ok, report.table(verbose=True)
    assert {r.status for r in report.rows} == {"differs"}
    assert all("checked by numerical gradients only" in r.note for r in report.rows)

    def broken(self, x):
        return self.params["beta"] * x                                          # the student's own KeyError

    with C.replaced(L.LayerNorm, "forward", broken):
        report = C.run(["layernorm"], use_kernels=False)
    assert report.rows[0].status == "WRONG" and report.rows[0].what == "raised KeyError"


def test_a_model_with_one_float32_parameter_is_refused_naming_that_parameter(tmp_path):
    from minivit.check.walk import not_float64

    model = build_all_changes("float64")
    assert not_float64(model) == ""
    model.blocks[1].attn.params["temperature"] = model.blocks[1].attn.params["temperature"].astype("float32")
    total = len(model.params)
    assert not_float64(model) == f"parameter blocks.1.attn.temperature (float32) is not float64 (1 of {total})"
    with pytest.raises(TypeError, match=r"blocks\.1\.attn\.temperature \(float32\).*A layer you wrote"):
        C.run_model(model)
    assert not_float64(build_all_changes("float32")).startswith(f"all {total} parameters are float32")
    with pytest.raises(TypeError, match="Build it with dtype='float64'"):
        C.run_model(build_all_changes("float32"))
    file = _student_file(tmp_path, "from test_check_model import build_all_changes\n"
                                   "def build(dtype='float64'):\n"
                                   "    model = build_all_changes(dtype)\n"
                                   "    attn = model.blocks[1].attn\n"
                                   "    attn.params['temperature'] = attn.params['temperature'].astype('float32')\n"
                                   "    return model\n")
    run = _cli("--model", f"{file}:build")
    assert run.returncode == 2 and "blocks.1.attn.temperature (float32) is not float64" in run.stderr, run.stderr
