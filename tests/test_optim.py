"""Tests for minivit.optim: steps worked out by hand, in-place updates, no_decay, saving and resuming,
clipping and the schedule; then 50-step parity runs against torch.optim (marked parity)."""

import math

import numpy as np
import pytest

from minivit.optim import SGD, AdamW, WarmupCosine, clip_grad_norm, default_no_decay


class FakeModel:
    """The interface the optimizers need: .params and .grads, dicts of the same keys. params is a
    property that builds a fresh dict on each call, as a real model may; the arrays in it are live."""

    def __init__(self, params):
        self._params = {name: np.array(p, dtype=np.float64) for name, p in params.items()}
        self._grads = {name: np.zeros_like(p) for name, p in self._params.items()}

    @property
    def params(self):
        return dict(self._params)

    @property
    def grads(self):
        return dict(self._grads)

    def set_grads(self, grads):
        for name, g in grads.items():
            self._grads[name][...] = g


def one_param_model():
    return FakeModel({"w": [1.0, -2.0]})


G1 = [0.5, 0.25]  # the gradient of the first step
G2 = [1.0, -1.0]  # the gradient of the second step


def run_steps(opt, model, grads_per_step):
    for g in grads_per_step:
        model.set_grads({"w": g})
        opt.step()
    return model.params["w"]


# ---------------------------------------------------------------------------------------- SGD by hand


def test_sgd_plain_step():
    model = one_param_model()
    w = run_steps(SGD(model, lr=0.1, momentum=0.0), model, [G1])
    np.testing.assert_allclose(w, [1.0 - 0.1 * 0.5, -2.0 - 0.1 * 0.25], rtol=1e-15)  # [0.95, -2.025]


def test_sgd_weight_decay_step():
    model = one_param_model()
    w = run_steps(SGD(model, lr=0.1, momentum=0.0, weight_decay=0.1), model, [G1])
    # g + wd p = [0.5 + 0.1, 0.25 - 0.2] = [0.6, 0.05]
    np.testing.assert_allclose(w, [1.0 - 0.1 * 0.6, -2.0 - 0.1 * 0.05], rtol=1e-15)  # [0.94, -2.005]


def test_sgd_momentum_two_steps():
    model = one_param_model()
    opt = SGD(model, lr=0.1, momentum=0.9)
    w = run_steps(opt, model, [G1])
    np.testing.assert_allclose(w, [0.95, -2.025], rtol=1e-15)  # b_1 = g_1: a plain first step
    w = run_steps(opt, model, [G2])
    # b_2 = 0.9 [0.5, 0.25] + [1, -1] = [1.45, -0.775]
    np.testing.assert_allclose(opt.buffers["momentum_buffer"]["w"], [1.45, -0.775], rtol=1e-15)
    np.testing.assert_allclose(w, [0.95 - 0.145, -2.025 + 0.0775], rtol=1e-15)  # [0.805, -1.9475]


def test_sgd_nesterov_two_steps():
    model = one_param_model()
    opt = SGD(model, lr=0.1, momentum=0.9, nesterov=True)
    w = run_steps(opt, model, [G1])
    # d_1 = g_1 + 0.9 b_1 = 1.9 g_1 = [0.95, 0.475]
    np.testing.assert_allclose(w, [1.0 - 0.095, -2.0 - 0.0475], rtol=1e-15)  # [0.905, -2.0475]
    w = run_steps(opt, model, [G2])
    # b_2 = [1.45, -0.775];  d_2 = [1, -1] + 0.9 b_2 = [2.305, -1.6975]
    np.testing.assert_allclose(w, [0.905 - 0.2305, -2.0475 + 0.16975], rtol=1e-15)  # [0.6745, -1.87775]


def test_sgd_does_not_modify_grads():
    model = one_param_model()
    model.set_grads({"w": G1})
    SGD(model, lr=0.1, momentum=0.9, weight_decay=0.1).step()
    np.testing.assert_array_equal(model.grads["w"], G1)


# -------------------------------------------------------------------------------------- AdamW by hand


def test_adamw_two_steps_by_hand():
    model = one_param_model()
    opt = AdamW(model, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    # step 1: decay p *= 1 - 0.1 * 0.01 = 0.999  ->  [0.999, -1.998]
    # m = 0.1 g = [0.05, 0.025], v = 0.001 g^2 = [2.5e-4, 6.25e-5]; m_hat = g, sqrt(v_hat) = |g|,
    # so the first step is lr g / (|g| + eps): almost exactly lr * sign(g)
    w = run_steps(opt, model, [G1])
    np.testing.assert_allclose(opt.buffers["exp_avg"]["w"], [0.05, 0.025], rtol=1e-15)
    np.testing.assert_allclose(opt.buffers["exp_avg_sq"]["w"], [2.5e-4, 6.25e-5], rtol=1e-15)
    w1 = np.array([0.999 - 0.1 * 0.5 / (0.5 + 1e-8), -1.998 - 0.1 * 0.25 / (0.25 + 1e-8)])
    np.testing.assert_allclose(w, w1, rtol=1e-15)  # ~ [0.899, -2.098]

    # step 2: g = [1, -1];  1 - b1^2 = 0.19,  1 - b2^2 = 0.001999
    m = np.array([0.145, -0.0775])  # 0.9 [0.05, 0.025] + 0.1 [1, -1]
    v = np.array([0.00124975, 0.0010624375])  # 0.999 [2.5e-4, 6.25e-5] + 0.001 [1, 1]
    w = run_steps(opt, model, [G2])
    np.testing.assert_allclose(opt.buffers["exp_avg"]["w"], m, rtol=1e-14)
    np.testing.assert_allclose(opt.buffers["exp_avg_sq"]["w"], v, rtol=1e-14)
    w2 = w1 * 0.999 - 0.1 / 0.19 * m / (np.sqrt(v) / math.sqrt(0.001999) + 1e-8)
    np.testing.assert_allclose(w, w2, rtol=1e-14)  # ~ [0.8016, -2.0400]
    assert opt.t == 2


# ------------------------------------------------------------------------------ in place and no_decay


@pytest.mark.parametrize("make_opt", [lambda m: SGD(m, lr=0.1), lambda m: AdamW(m, lr=0.1)])
def test_update_is_in_place(make_opt):
    model = one_param_model()
    w = model.params["w"]
    opt = make_opt(model)
    run_steps(opt, model, [G1, G2])
    assert model.params["w"] is w  # the same array object...
    assert not np.array_equal(w, [1.0, -2.0])  # ...with new values


def test_model_arrays_replaced_between_steps():
    # a model moved between devices replaces its arrays: step() must re-read model.params
    model = one_param_model()
    opt = SGD(model, lr=0.1, momentum=0.0)
    model._params["w"] = np.array([10.0, 20.0])
    model._grads["w"] = np.array(G1)
    opt.step()
    np.testing.assert_allclose(model.params["w"], [10.0 - 0.05, 20.0 - 0.025], rtol=1e-15)


@pytest.mark.parametrize("make_opt", [
    lambda m, nd: SGD(m, lr=0.1, momentum=0.9, weight_decay=0.5, no_decay=nd),
    lambda m, nd: AdamW(m, lr=0.1, weight_decay=0.5, no_decay=nd),
])
def test_no_decay_is_respected(make_opt):
    # with zero gradients only weight decay can move a parameter (Adam's update is 0 / (0 + eps) = 0)
    model = FakeModel({"w": [[1.0, -2.0]], "b": [3.0]})
    opt = make_opt(model, {"b"})
    opt.step()
    np.testing.assert_array_equal(model.params["b"], [3.0])
    np.testing.assert_allclose(model.params["w"], [[1.0 * 0.95, -2.0 * 0.95]], rtol=1e-15)  # 1 - 0.1 * 0.5


def test_default_no_decay():
    params = {
        "cls_token": np.zeros((1, 1, 8)), "pos_embed": np.zeros((1, 5, 8)),
        "patch_embed.proj.weight": np.zeros((8, 3, 2, 2)), "patch_embed.proj.bias": np.zeros(8),
        "blocks.0.norm1.weight": np.zeros(8), "blocks.0.attn.qkv.weight": np.zeros((24, 8)),
        "head.weight": np.zeros((10, 8)), "head.bias": np.zeros(10),
        "pos_embed_row": np.zeros((1, 4, 4)), "pos_embed_col": np.zeros((1, 4, 4)),   # pos_embed="learned2d"
    }
    assert default_no_decay(params) == {"cls_token", "pos_embed", "patch_embed.proj.bias",
                                        "blocks.0.norm1.weight", "head.bias", "pos_embed_row", "pos_embed_col"}


# ----------------------------------------------------------------------------------- state_dict


def random_model(seed):
    rng = np.random.default_rng(seed)
    return FakeModel({"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)})


def random_grads(seed, n):
    rng = np.random.default_rng(seed)
    return [{"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)} for _ in range(n)]


OPTIMIZERS = {
    "sgd": lambda m: SGD(m, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, no_decay={"b"}),
    "adamw": lambda m: AdamW(m, lr=0.01, betas=(0.8, 0.99), weight_decay=0.05, no_decay={"b"}),
}


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_state_dict_round_trip_continues_identically(kind):
    grads = random_grads(1, 6)
    model_a = random_model(0)  # uninterrupted: 6 steps
    opt_a = OPTIMIZERS[kind](model_a)
    for i, g in enumerate(grads):
        if i == 3:
            saved_params = {name: p.copy() for name, p in model_a.params.items()}
            saved = opt_a.state_dict()
        model_a.set_grads(g)
        opt_a.lr *= 0.9  # as a schedule would
        opt_a.step()

    model_b = FakeModel(saved_params)  # resumed after 3 steps, in a fresh optimizer with another lr
    opt_b = OPTIMIZERS[kind](model_b)
    opt_b.lr = 123.0
    opt_b.load_state_dict(saved)
    assert opt_b.t == 3 and opt_b.lr == saved["hyperparams"]["lr"]
    for g in grads[3:]:
        model_b.set_grads(g)
        opt_b.lr *= 0.9
        opt_b.step()
    for name in model_a.params:
        np.testing.assert_array_equal(model_b.params[name], model_a.params[name])


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_state_dict_holds_host_copies(kind):
    model = random_model(0)
    opt = OPTIMIZERS[kind](model)
    model.set_grads(random_grads(1, 1)[0])
    opt.step()
    d = opt.state_dict()
    assert d["step"] == 1 and d["type"] == type(opt).__name__
    for kind_name, bufs in d["buffers"].items():
        assert set(bufs) == {"w", "b"}
        for name, arr in bufs.items():
            assert isinstance(arr, np.ndarray)
            assert arr is not opt.buffers[kind_name][name]
            assert not np.shares_memory(arr, opt.buffers[kind_name][name])
    # loading must copy too: stepping afterwards does not write into the dict
    before = {k: {n: a.copy() for n, a in b.items()} for k, b in d["buffers"].items()}
    opt.load_state_dict(d)
    opt.step()
    for k in before:
        for n in before[k]:
            np.testing.assert_array_equal(d["buffers"][k][n], before[k][n])


def corrupt(d, how):
    d = {**d, "hyperparams": dict(d["hyperparams"]), "buffers": {k: dict(v) for k, v in d["buffers"].items()}}
    kind = next(iter(d["buffers"]))
    if how == "shape":
        d["buffers"][kind]["w"] = np.zeros((4, 3))
    elif how == "unknown_param":
        d["buffers"][kind]["nope"] = np.zeros(2)
    elif how == "missing_param":
        del d["buffers"][kind]["b"]
    elif how == "missing_key":
        del d["step"]
    elif how == "bad_lr":
        d["hyperparams"]["lr"] = -1.0
    elif how == "bad_no_decay":
        d["hyperparams"]["no_decay"] = ["nope"]
    elif how == "type":
        d["type"] = "Other"
    return d


@pytest.mark.parametrize("kind", OPTIMIZERS)
@pytest.mark.parametrize("how", ["shape", "unknown_param", "missing_param", "missing_key", "bad_lr",
                                 "bad_no_decay", "type"])
def test_load_state_dict_rejects_bad_state_and_changes_nothing(kind, how):
    model = random_model(0)
    opt = OPTIMIZERS[kind](model)
    for g in random_grads(1, 2):
        model.set_grads(g)
        opt.step()
    good = opt.state_dict()
    with pytest.raises(ValueError):
        opt.load_state_dict(corrupt(good, how))
    after = opt.state_dict()
    assert after["step"] == good["step"] and after["hyperparams"] == good["hyperparams"]
    for k in good["buffers"]:
        for n in good["buffers"][k]:
            np.testing.assert_array_equal(after["buffers"][k][n], good["buffers"][k][n])


# ----------------------------------------------------------------------------------- clip_grad_norm


def test_clip_grad_norm_by_hand():
    grads = {"a": np.array([3.0, 4.0]), "b": np.array([[12.0]])}  # total norm sqrt(9 + 16 + 144) = 13
    a = grads["a"]
    total = clip_grad_norm(grads, max_norm=1.3)
    assert isinstance(total, float) and total == 13.0
    scale = 1.3 / (13.0 + 1e-6)  # ~0.1
    np.testing.assert_allclose(grads["a"], [3.0 * scale, 4.0 * scale], rtol=1e-15)
    np.testing.assert_allclose(grads["b"], [[12.0 * scale]], rtol=1e-15)
    assert grads["a"] is a  # in place


def test_clip_grad_norm_leaves_small_grads_and_accepts_a_model():
    model = FakeModel({"a": [0.0, 0.0], "b": [[0.0]]})
    model.set_grads({"a": [3.0, 4.0], "b": [[12.0]]})
    assert clip_grad_norm(model, max_norm=100.0) == 13.0
    np.testing.assert_array_equal(model.grads["a"], [3.0, 4.0])
    np.testing.assert_array_equal(model.grads["b"], [[12.0]])


# ----------------------------------------------------------------------------------- schedule


def test_warmup_cosine_values():
    s = WarmupCosine(base_lr=1.0, total_steps=110, warmup_steps=10, min_lr=0.1)
    assert s(0) == pytest.approx(0.1)  # (0 + 1) / 10: already > 0 on the first step
    assert s(4) == pytest.approx(0.5)
    assert s(9) == pytest.approx(1.0)  # end of the warm-up
    assert s(10) == pytest.approx(1.0)  # start of the cosine
    assert s(60) == pytest.approx(0.55)  # midpoint: (base_lr + min_lr) / 2
    assert s(110) == pytest.approx(0.1)  # end: min_lr
    assert s(500) == pytest.approx(0.1)
    lrs = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # decreasing after the warm-up


def test_warmup_cosine_no_warmup_and_constant():
    s = WarmupCosine(base_lr=2.0, total_steps=100)
    assert s(0) == 2.0 and s(50) == pytest.approx(1.0) and s(100) == 0.0
    c = WarmupCosine(base_lr=2.0, total_steps=100, warmup_steps=4, decay="constant")
    assert [c(i) for i in (0, 3, 4, 50, 100, 1000)] == [0.5, 2.0, 2.0, 2.0, 2.0, 2.0]


@pytest.mark.parametrize("kwargs, bad", [
    (dict(base_lr=0.0, total_steps=10), "0.0"),
    (dict(base_lr="1", total_steps=10), "'1'"),
    (dict(base_lr=1.0, total_steps=0), "0"),
    (dict(base_lr=1.0, total_steps=10, warmup_steps=11), "11"),
    (dict(base_lr=1.0, total_steps=10, warmup_steps=-1), "-1"),
    (dict(base_lr=1.0, total_steps=10, min_lr=2.0), "2.0"),
    (dict(base_lr=1.0, total_steps=10, decay="linear"), "linear"),
])
def test_warmup_cosine_rejects_bad_arguments(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        WarmupCosine(**kwargs)


def test_warmup_cosine_rejects_negative_step():
    with pytest.raises(ValueError, match="-1"):
        WarmupCosine(1.0, 10)(-1)


# ----------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("make, bad", [
    (lambda m: SGD(m, lr=0.0), "0.0"),
    (lambda m: SGD(m, lr=-0.1), "-0.1"),
    (lambda m: SGD(m, lr="0.1"), "'0.1'"),
    (lambda m: SGD(m, lr=float("nan")), "nan"),
    (lambda m: SGD(m, lr=0.1, momentum=-0.5), "-0.5"),
    (lambda m: SGD(m, lr=0.1, weight_decay=-1e-4), "-0.0001"),
    (lambda m: SGD(m, lr=0.1, momentum=0.0, nesterov=True), "nesterov"),
    (lambda m: SGD(m, lr=0.1, no_decay={"w", "nope"}), "nope"),
    (lambda m: AdamW(m, lr=None), "None"),
    (lambda m: AdamW(m, lr=0.1, betas=(1.0, 0.999)), "1.0"),
    (lambda m: AdamW(m, lr=0.1, betas=(0.9, -0.1)), "-0.1"),
    (lambda m: AdamW(m, lr=0.1, betas=0.9), "0.9"),
    (lambda m: AdamW(m, lr=0.1, weight_decay=-0.01), "-0.01"),
    (lambda m: AdamW(m, lr=0.1, eps=-1e-8), "-1e-08"),
    (lambda m: AdamW(m, lr=0.1, no_decay="w"), "'w'"),
    (lambda m: AdamW(m, lr=0.1, no_decay=["bias"]), "bias"),
    (lambda m: clip_grad_norm(m, max_norm=0), "0"),
])
def test_bad_input_raises_value_error_naming_it(make, bad):
    with pytest.raises(ValueError, match=bad.replace("(", r"\(").replace(".", r"\.")):
        make(one_param_model())


def test_grads_that_do_not_match_params():
    model = one_param_model()
    opt = AdamW(model, lr=0.1)
    del model._grads["w"]
    with pytest.raises(ValueError, match="'w'"):
        opt.step()


# ----------------------------------------------------------------------------------- PyTorch parity

SHAPES = {"cls_token": (1, 1, 6), "pos_embed": (1, 5, 6), "blocks.0.attn.qkv.weight": (18, 6),
          "blocks.0.attn.qkv.bias": (18,), "blocks.0.norm1.weight": (6,), "head.weight": (3, 6)}
N_STEPS = 50


def parity_setup(seed=0):
    """Random float64 params and a fixed sequence of random gradients (their scale varying by step)."""
    rng = np.random.default_rng(seed)
    params = {name: rng.normal(size=shape) for name, shape in SHAPES.items()}
    grads = [{name: rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 1) for name, shape in SHAPES.items()}
             for _ in range(N_STEPS)]
    return params, grads


def run_both(make_ours, make_torch, seed=0, clip=None):
    """50 steps of our optimizer and of torch's on the same params and grads, with a schedule setting
    lr before each step (and clipping, if clip is a max_norm). Returns both sets of final params."""
    torch = pytest.importorskip("torch")
    params, grads = parity_setup(seed)
    no_decay = default_no_decay(params)
    model = FakeModel(params)
    ours = make_ours(model, no_decay)
    tparams = {name: torch.tensor(p, dtype=torch.float64) for name, p in params.items()}
    groups = [{"params": [t for n, t in tparams.items() if n not in no_decay]},
              {"params": [t for n, t in tparams.items() if n in no_decay], "weight_decay": 0.0}]
    theirs = make_torch(groups)
    schedule = WarmupCosine(base_lr=ours.lr, total_steps=N_STEPS, warmup_steps=5, min_lr=ours.lr / 10)
    for step, g in enumerate(grads):
        model.set_grads(g)
        for name, t in tparams.items():
            t.grad = torch.tensor(g[name], dtype=torch.float64)
        if clip is not None:
            total = clip_grad_norm(model, clip)
            ttotal = torch.nn.utils.clip_grad_norm_(list(tparams.values()), clip)
            assert total == pytest.approx(float(ttotal), rel=1e-12, abs=0)
        ours.lr = schedule(step)
        for group in theirs.param_groups:
            group["lr"] = schedule(step)
        ours.step()
        theirs.step()
    return model.params, {name: t.detach().numpy() for name, t in tparams.items()}


def assert_params_match(ours, theirs):
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-12, atol=0, err_msg=name)


SGD_CONFIGS = [dict(momentum=0.0, weight_decay=0.0), dict(momentum=0.0, weight_decay=1e-2),
               dict(momentum=0.9, weight_decay=5e-2), dict(momentum=0.9, nesterov=True, weight_decay=5e-2)]


@pytest.mark.parity
@pytest.mark.parametrize("cfg", SGD_CONFIGS, ids=str)
def test_sgd_matches_torch(cfg):
    torch = pytest.importorskip("torch")
    ours, theirs = run_both(
        lambda m, nd: SGD(m, lr=0.05, no_decay=nd, **cfg),
        lambda groups: torch.optim.SGD(groups, lr=0.05, dampening=0.0, **cfg))
    assert_params_match(ours, theirs)


ADAMW_CONFIGS = [dict(weight_decay=0.0), dict(weight_decay=0.05), dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3)]


@pytest.mark.parity
@pytest.mark.parametrize("cfg", ADAMW_CONFIGS, ids=str)
def test_adamw_matches_torch(cfg):
    torch = pytest.importorskip("torch")
    ours, theirs = run_both(
        lambda m, nd: AdamW(m, lr=1e-2, no_decay=nd, **cfg),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, **cfg))
    assert_params_match(ours, theirs)


@pytest.mark.parity
def test_clip_then_adamw_matches_torch():
    # max_norm 1.0 against gradient norms of ~0.1 to ~100: some steps clipped, some not
    torch = pytest.importorskip("torch")
    ours, theirs = run_both(
        lambda m, nd: AdamW(m, lr=1e-2, weight_decay=0.05, no_decay=nd),
        lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05), clip=1.0)
    assert_params_match(ours, theirs)


@pytest.mark.parity
@pytest.mark.parametrize("max_norm", [0.5, 5.0, 1e3])
def test_clip_grad_norm_matches_torch(max_norm):
    torch = pytest.importorskip("torch")
    _, grads = parity_setup(seed=3)
    for g in grads[:10]:
        ours = {name: a.copy() for name, a in g.items()}
        theirs = [torch.tensor(a, dtype=torch.float64) for a in g.values()]
        for t in theirs:
            t.grad = t.clone()
        total = clip_grad_norm(ours, max_norm)
        ttotal = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        assert total == pytest.approx(float(ttotal), rel=1e-12, abs=0)
        for a, t in zip(ours.values(), theirs):
            np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------------- GPU (CuPy)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_cupy_step_matches_numpy_and_state_moves(kind):
    from minivit import backend

    if not backend.gpu_available():
        pytest.skip("needs CuPy and a GPU")
    grads = random_grads(1, 3)
    cpu = random_model(0)
    gpu = random_model(0)
    gpu._params = {n: backend.asarray(p, backend="cupy") for n, p in gpu._params.items()}
    gpu._grads = {n: backend.asarray(g, backend="cupy") for n, g in gpu._grads.items()}
    opt_cpu, opt_gpu = OPTIMIZERS[kind](cpu), OPTIMIZERS[kind](gpu)
    for g in grads[:2]:
        cpu.set_grads(g)
        gpu.set_grads({n: backend.asarray(a, backend="cupy") for n, a in g.items()})
        opt_cpu.step()
        opt_gpu.step()
    d = opt_gpu.state_dict()
    assert all(isinstance(a, np.ndarray) for bufs in d["buffers"].values() for a in bufs.values())
    opt_gpu.load_state_dict(opt_cpu.state_dict())  # host state onto the GPU model's device
    assert all(backend.backend_of(a) == "cupy" for bufs in opt_gpu.buffers.values() for a in bufs.values())
    for name in cpu.params:
        np.testing.assert_allclose(backend.to_numpy(gpu.params[name]), cpu.params[name], rtol=1e-12)
