"""minivit/fast/ops.py: the code a student edits is the code that runs.

A fast twin from kernels.py runs in place of a functional.py pair only after ops has checked, in the
running process, that it agrees with the pair as it stands. Here functional.py is edited the way a
student edits it, in the text of a pair's body, and the module is re-executed from the edited text (what
a restart or importlib.reload does with an edited file; the last test edits a copy of the file on disk).
Then a float32 model must compute exactly what the float64 model computes with the same edit, and the
run must say which op it took from functional.py.
"""

import contextlib
import inspect
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import minivit
from minivit import functional as F
from minivit import kernels, layers, ops

needs_numba = pytest.mark.skipif(not kernels.HAVE_NUMBA, reason="the CPU fast twins need Numba")

CONFIG = minivit.ViTConfig(img_size=16, patch_size=4, num_classes=5, embed_dim=24, depth=2, num_heads=3)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    ops.reset()
    ops.set_fast_kernels(True)
    yield
    ops.reset()
    ops.set_fast_kernels(True)


@contextlib.contextmanager
def edited_functional(old, new):
    """functional.py with `old` replaced by `new` in its text, re-executed in the module's own namespace
    (so every `F.name` lookup sees the edited functions); the original module is restored afterwards."""
    source = inspect.getsource(F)
    assert source.count(old) == 1, f"the edit's anchor must occur once in functional.py: {old!r}"
    saved = dict(vars(F))
    exec(compile(source.replace(old, new), F.__file__, "exec"), vars(F))
    try:
        yield
    finally:
        vars(F).clear()
        vars(F).update(saved)


def step(dtype, seed=0, config=CONFIG):
    """Logits, dx and every gradient of one forward/backward of a fresh model, as float64 host arrays."""
    rng = np.random.default_rng(7)
    x = minivit.asarray(rng.standard_normal((3, 16, 16, 3)), dtype=dtype)
    labels = minivit.asarray(rng.integers(0, 5, 3))
    model = minivit.ViT(config, seed=seed, dtype=dtype)
    logits = model.forward(x)
    _, dlogits = minivit.cross_entropy(logits, labels)
    model.zero_grad()
    dx = model.backward(dlogits)
    grads = {k: minivit.to_numpy(g).astype(np.float64) for k, g in model.grads.items()}
    return minivit.to_numpy(logits).astype(np.float64), minivit.to_numpy(dx).astype(np.float64), grads


def worst(a, b):
    """The largest of max|a - b| / max|b| over (logits, dx, every gradient)."""
    def rel(u, v):
        return float(np.abs(u - v).max() / max(np.abs(v).max(), 1e-30))
    return max([rel(a[0], b[0]), rel(a[1], b[1])] + [rel(a[2][k], b[2][k]) for k in b[2]])


# ---- unedited: the twins run, and they agree ----------------------------------------------------------

@needs_numba
def test_unedited_float32_model_runs_the_checked_twins_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ops.FastPathDisagrees)
        float32 = step("float32")
    assert ops.report().from_kernels() == ["attention", "gelu", "layernorm", "linear"]
    assert ops.report().from_functional() == []
    assert worst(float32, step("float64")) < 1e-4           # float32 rounding only
    assert ops.report().from_functional() == ["attention", "gelu", "layernorm", "linear"]   # float64's rows
    assert all("float64" in row[4] for row in ops.report() if row[3] == "functional.py")


def test_float64_and_fast_kernels_off_run_functional_and_say_why():
    ops.set_fast_kernels(False)
    step("float32")
    rows = ops.report()
    assert rows.from_kernels() == [] and "attention" in rows.from_functional()
    assert all("fast kernels off" in row[4] for row in rows)
    assert ops.summary_lines() == [f"ops from functional.py: {', '.join(rows.from_functional())} "
                                   "(fast kernels off (set_fast_kernels / MINIVIT_FAST_KERNELS))"]


# ---- edited: the edit runs, in float32 as in float64, and is named ----------------------------------------

EDITS = {   # op: (anchor in functional.py, the edited text); each is a bug a student could plant
    "layernorm forward": ("    return xhat * weight + bias, (xhat, rstd, weight)",
                          "    return 0.5 * xhat * weight + bias, (xhat, rstd, weight)"),
    "layernorm backward": ("    dx = rstd * (dxhat                                        # term 1",
                           "    dx = 0.5 * rstd * (dxhat                                  # term 1"),
    "gelu forward": ("        return x * cdf, (x, approximate)",
                     "        return 0.5 * x * cdf, (x, approximate)"),
    "gelu backward": ("        return dout * (cdf + x * pdf)",
                      "        return dout * (cdf + 0.5 * x * pdf)"),
    "softmax forward": ("    out = e / e.sum(-1, keepdims=True)",
                        "    out = e / (e.sum(-1, keepdims=True) + 0.5)"),
    "softmax backward": ("    return s * (dout - (dout * s).sum(-1, keepdims=True))",
                         "    return 3 * s * (dout - (dout * s).sum(-1, keepdims=True))"),
    "attention forward": ("    scale = 1.0 / math.sqrt(D // num_heads)                   # 1 / sqrt(hs)",
                          "    scale = 0.5 / math.sqrt(D // num_heads)                   # 1 / sqrt(hs)"),
    "attention backward": ("    dq *= scale                                               "
                           "#   (in place: no second array)",
                           "    dq *= 2 * scale"),
}
# the op that ops then takes from functional.py: softmax runs inside attention in a ViT
RUNS_FROM_FUNCTIONAL = {"layernorm": "layernorm", "gelu": "gelu", "softmax": "attention", "attention": "attention"}


@needs_numba
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edit_inside_a_pair_changes_the_float32_model_exactly_as_the_float64_one(edit):
    unedited64 = step("float64")
    old, new = EDITS[edit]
    op = RUNS_FROM_FUNCTIONAL[edit.split()[0]]
    with edited_functional(old, new):
        ops.reset()
        with pytest.warns(ops.FastPathDisagrees, match=f"minivit.ops: {op} now runs from functional.py") as seen:
            edited32 = step("float32")
        assert ops.report().from_functional() == [op]
        assert ops.report().from_kernels() == sorted({"attention", "gelu", "layernorm", "linear"} - {op})
        assert ops.summary_lines()[-1].startswith(f"ops from functional.py: {op} (")
        edited64 = step("float64")
    assert len([w for w in seen if issubclass(w.category, ops.FastPathDisagrees)]) == 1   # once, not per call
    assert worst(edited32, edited64) < 1e-4                  # the edit ran in float32: float32 rounding only
    assert worst(edited64, unedited64) > 1e-2                # and it is a real change


@needs_numba
def test_after_the_edit_is_undone_the_twin_is_checked_again_and_runs():
    old, new = EDITS["gelu forward"]
    with edited_functional(old, new), pytest.warns(ops.FastPathDisagrees):
        ops.gelu_forward(np.ones((2, 3), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ops.FastPathDisagrees)
        out, _ = ops.gelu_forward(np.ones((2, 3), np.float32))
    verdicts = [row for row in ops.report() if row[0] == "gelu"]
    assert [row[3] for row in verdicts] == ["functional.py", "kernels.py"]
    np.testing.assert_allclose(out, F.gelu_forward(np.ones((2, 3)))[0], rtol=1e-6)


@needs_numba
def test_a_replaced_pair_is_what_runs():
    """Assigning a new function to functional.py's name (what a notebook cell does) counts as an edit."""
    real = F.layernorm_backward

    def halved(dout, cache):
        dx, dw, db = real(dout, cache)
        return 0.5 * dx, dw, db

    x = np.random.default_rng(0).standard_normal((2, 4, 8)).astype(np.float32)
    w, b = np.ones(8, np.float32), np.zeros(8, np.float32)
    dout = np.ones_like(x) + x
    want = halved(dout, F.layernorm_forward(x, w, b)[1])[0]
    try:
        F.layernorm_backward = halved
        with pytest.warns(ops.FastPathDisagrees, match="differs: dx by 100% of its largest value"):
            _, cache = ops.layernorm_forward(x, w, b)
            dx = ops.layernorm_backward(dout, cache)[0]
    finally:
        F.layernorm_backward = real
    np.testing.assert_allclose(dx, want, rtol=1e-5, atol=1e-7)


@needs_numba
def test_a_wrong_twin_is_refused_and_the_pair_runs(monkeypatch):
    real = kernels.gelu_forward
    monkeypatch.setattr(kernels, "gelu_forward",
                        lambda x, approximate="erf": (2 * real(x, approximate)[0], (x, approximate)))
    x = np.linspace(-3, 3, 50, dtype=np.float32)
    with pytest.warns(ops.FastPathDisagrees, match="differs: out by 100%"):
        out, _ = ops.gelu_forward(x)
    np.testing.assert_allclose(out, F.gelu_forward(x.astype(np.float64))[0], rtol=1e-5, atol=1e-7)


@needs_numba
def test_a_pair_that_fails_on_the_probe_runs_and_raises_its_own_error():
    old = "    xhat = xc * rstd                                          # (..., D)"
    with edited_functional(old, old + "\n    raise RuntimeError('my edit is unfinished')"):
        with pytest.warns(ops.FastPathDisagrees, match="functional.py raised RuntimeError"), \
                pytest.raises(RuntimeError, match="my edit is unfinished"):
            ops.layernorm_forward(np.ones((2, 8), np.float32), np.ones(8, np.float32), np.zeros(8, np.float32))


def test_a_students_own_layer_and_an_edited_layer_method_run(monkeypatch):
    """No fast path replaces a layer: whatever a layer class says is what runs, in float32 too."""
    class MyNorm(layers.LayerNorm):            # a student's own layer, with its own (wrong) backward
        def backward(self, dout):
            return 2 * super().backward(dout)

    x = np.random.default_rng(1).standard_normal((2, 5, 8)).astype(np.float32)
    plain, mine = layers.LayerNorm(8), MyNorm(8)
    dout = np.ones_like(x) + x
    plain.forward(x), mine.forward(x)
    np.testing.assert_allclose(mine.backward(dout), 2 * plain.backward(dout), rtol=1e-6)
    monkeypatch.setattr(layers.GELU, "forward", lambda self, x: 3 * x)      # an edited layers.py method
    model = minivit.ViT(CONFIG, seed=0)
    act = model.blocks[0].mlp.act
    h = np.ones((1, 2, 3), np.float32)
    np.testing.assert_array_equal(act.forward(h), 3 * h)


@needs_numba
def test_mixed_precision_linear_is_checked_at_float16_tolerance_and_steps_aside_for_an_edit():
    x = np.random.default_rng(2).standard_normal((4, 3, 24)).astype(np.float32)
    w = (0.2 * np.random.default_rng(3).standard_normal((24, 12))).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ops.FastPathDisagrees)
        y, cache = ops.linear_forward(x, w, None, matmul_dtype="float16")
    assert cache[0].dtype == np.float16                       # the mixed twin ran
    old = "    y = x2 @ weight                                           # (rows, out)"
    with edited_functional(old, "    y = 2 * (x2 @ weight)"):
        with pytest.warns(ops.FastPathDisagrees, match="linear now runs from functional.py"):
            y, cache = ops.linear_forward(x, w, None, matmul_dtype="float16")
    assert cache[0].dtype == np.float32                       # functional.py in float32: the edit runs
    np.testing.assert_allclose(y, 2 * (x.reshape(-1, 24) @ w).reshape(4, 3, 12), rtol=1e-5)


@needs_numba
def test_adamw_twin_is_checked_against_functional_adamw_update(monkeypatch):
    from minivit.optim import AdamW

    class Toy:
        def __init__(self):
            self.params = {"w": np.ones((3, 4), np.float32)}
            self.grads = {"w": np.full((3, 4), 0.5, np.float32)}

    AdamW(Toy(), lr=1e-2).step()
    assert "adamw" in ops.report().from_kernels()
    old = "    p -= (lr / bias_c1) * (m / denom)                         # p <- p - lr m_hat / denom"
    with edited_functional(old, "    p -= (lr / bias_c1) * (m / denom) * 0.5"):
        ops.reset()
        toy = Toy()
        with pytest.warns(ops.FastPathDisagrees, match="adamw now runs from functional.py"):
            AdamW(toy, lr=1e-2).step()
    # the edited rule ran: half of AdamW's first step (lr times m_hat / sqrt(v_hat) = 1), after the decay
    np.testing.assert_allclose(toy.params["w"], (1 - 1e-2 * 0.01) - 0.5 * 1e-2, rtol=1e-6)


# ---- the whole path on disk, as a student does it: edit the file, run the trainer ---------------------------

@needs_numba
def test_an_edited_functional_py_on_disk_runs_and_the_trainer_names_it(tmp_path):
    root = Path(minivit.__file__).resolve().parents[1]
    shutil.copytree(root / "minivit", tmp_path / "minivit", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "minivit" / "functional.py"
    old, new = EDITS["gelu backward"]
    path.write_text(path.read_text().replace(old, new))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    code = ("from minivit.train import TrainConfig, train\n"
            "train(TrainConfig(dataset='shapes', embed_dim=16, depth=1, num_heads=2, max_steps=2, batch_size=8,"
            " train_subset=32, out=None, progress=False, eval_batch_size=64))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(line.startswith("ops from kernels.py") and "layernorm" in line for line in lines), run.stdout
    assert any(line.startswith("ops from functional.py: gelu") for line in lines), run.stdout
    assert "gelu now runs from functional.py" in run.stderr
