"""Optimizers, gradient clipping and the learning-rate schedule, written out with no autograd.

A model is anything with two dicts of the same keys: ``model.params`` (name -> array) and
``model.grads`` (name -> array of the same shape). The optimizers re-read both on every ``step()``
(the model may have been moved to another device, or a layer added or replaced, since the last one) and
update each parameter
IN PLACE, so the arrays the layers hold are the ones that change.

The update rules are exactly PyTorch's (torch.optim.SGD with dampening=0, torch.optim.AdamW), which
tests/test_optim.py checks to 1e-12 in float64. Glossary for the math in the comments:
    p  a parameter          g  its gradient            t   the step number, 1 for the first step
    lr learning rate        wd weight decay            mu  SGD momentum
    b  SGD momentum buffer  m, v  Adam's first and second moment estimates
"""

import math
import numbers

from .fast import ops
from .backend import asarray, backend_of, get_array_module, to_numpy


# ----------------------------------------------------------------------------------------------------
# checking arguments: every bad value raises a ValueError that names it


def _check_number(name, value, ok, rule):
    """value as a float, or a ValueError naming it when it is not a finite number or ok(value) fails.
    rule: ok in words, for the message (e.g. "> 0")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number {rule}, got {value!r}")
    if not ok(value):
        raise ValueError(f"{name} must be {rule}, got {value!r}")
    return float(value)


def _check_int(name, value, low=0):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _check_no_decay(no_decay, params):
    """no_decay as a frozenset of parameter names; a ValueError lists any name the model does not have."""
    if isinstance(no_decay, str):  # a lone string would be read letter by letter
        raise ValueError(f"no_decay must be a collection of parameter names, got the string {no_decay!r}")
    names = frozenset(no_decay)
    unknown = sorted(names - set(params))
    if unknown:
        raise ValueError(f"no_decay names parameters the model does not have: {unknown}")
    return names


def default_no_decay(params):
    """The names the trainer exempts from weight decay: every 1-D array (biases, LayerNorm weights)
    plus the class token, the register tokens and every position embedding (pos_embed, pos_embed_row, pos_embed_col).
    params: dict name -> array. Returns a set of names."""
    return {name for name, p in params.items()
            if p.ndim <= 1 or name.endswith(("cls_token", "reg_token")) or "pos_embed" in name.rsplit(".", 1)[-1]}


def _params_and_grads(model):
    """model.params and model.grads, read now, with a clear error when their keys differ."""
    params, grads = model.params, model.grads
    if params.keys() != grads.keys():
        missing = sorted(set(params) - set(grads))
        extra = sorted(set(grads) - set(params))
        raise ValueError(f"model.grads does not match model.params: no grad for {missing}, "
                         f"grads without a parameter: {extra}")
    return params, grads


def _like(buf, p):
    """buf on p's device (buffers follow the model when it is moved between NumPy and CuPy)."""
    return buf if backend_of(buf) == backend_of(p) else asarray(buf, backend=backend_of(p))


# ----------------------------------------------------------------------------------------------------
# what SGD and AdamW share: the model, the no-decay set, the step count, per-parameter buffers, and
# saving/loading them. A subclass lists its hyperparameters and buffers, checks them, and writes step().


class Optimizer:
    hyperparam_names = ()  # attributes saved in state_dict, e.g. ("lr", "momentum", ...)
    buffer_names = ()  # per-parameter state, e.g. ("exp_avg", "exp_avg_sq")

    def __init__(self, model, no_decay):
        self.model = model
        self.no_decay = _check_no_decay(no_decay, model.params)
        self.t = 0  # steps taken so far (t in the math)
        self.buffers = {kind: {} for kind in self.buffer_names}  # kind -> {param name -> array}, made lazily

    def _check_hyperparams(self, hp):
        """hp (dict name -> value) checked and normalised; raises ValueError naming a bad value."""
        raise NotImplementedError

    def _set_hyperparams(self, hp):
        for name, value in hp.items():
            setattr(self, name, value)

    def _decay(self, name):
        """The weight decay for one parameter: 0 for names in no_decay."""
        return 0.0 if name in self.no_decay else self.weight_decay

    def step(self):
        raise NotImplementedError

    def _read_model(self):
        """model.params and model.grads as the model stands now (they are live: a layer added or swapped
        since the last step is in them). Buffers of parameters that are gone are dropped, and a buffer whose
        parameter changed shape (its layer was replaced by a different one) starts again from zero."""
        params, grads = _params_and_grads(self.model)
        for bufs in self.buffers.values():
            for name in [n for n, b in bufs.items() if n not in params or b.shape != params[n].shape]:
                del bufs[name]
        self.no_decay = self.no_decay & frozenset(params)
        return params, grads

    def state_dict(self):
        """Everything needed to resume: host NumPy copies of the buffers, the step count, the
        hyperparameters. Returns {"type", "step", "hyperparams", "buffers": {kind: {name: array}}}."""
        hp = {name: getattr(self, name) for name in self.hyperparam_names}
        hp["no_decay"] = sorted(self.no_decay)
        buffers = {kind: {name: to_numpy(buf).copy() for name, buf in bufs.items()}
                   for kind, bufs in self.buffers.items()}
        return {"type": type(self).__name__, "step": self.t, "hyperparams": hp, "buffers": buffers}

    def load_state_dict(self, d):
        """Restore what state_dict saved, onto the devices of the model's current parameters.
        Everything is checked first; on any error nothing is changed."""
        params = self.model.params
        if not isinstance(d, dict) or set(d) != {"type", "step", "hyperparams", "buffers"}:
            keys = sorted(d) if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"expected a dict with keys ['buffers', 'hyperparams', 'step', 'type'], got {keys}")
        if d["type"] != type(self).__name__:
            raise ValueError(f"this state is for {d['type']!r}, not {type(self).__name__!r}")
        t = _check_int("step", d["step"])
        hp = dict(d["hyperparams"])
        expected_hp = set(self.hyperparam_names) | {"no_decay"}
        if set(hp) != expected_hp:
            raise ValueError(f"hyperparams must have keys {sorted(expected_hp)}, got {sorted(hp)}")
        no_decay = _check_no_decay(hp.pop("no_decay"), params)
        hp = self._check_hyperparams(hp)
        if set(d["buffers"]) != set(self.buffer_names):
            raise ValueError(f"buffers must have kinds {sorted(self.buffer_names)}, got {sorted(d['buffers'])}")
        buffers = {}
        for kind, saved in d["buffers"].items():
            # after a step every parameter has a buffer; before one (or with momentum=0) none has
            if saved and set(saved) != set(params):
                raise ValueError(f"{kind}: no buffer for {sorted(set(params) - set(saved))}, "
                                 f"buffers for unknown parameters {sorted(set(saved) - set(params))}")
            buffers[kind] = {}
            for name, arr in saved.items():
                p = params[name]
                arr = to_numpy(arr)
                if arr.shape != p.shape:
                    raise ValueError(f"{kind}[{name!r}] has shape {arr.shape}, the parameter has {p.shape}")
                # astype copies, so later in-place updates never write into d
                buffers[kind][name] = asarray(arr.astype(p.dtype), backend=backend_of(p))
        # all checked: now change the optimizer
        self.t, self.no_decay, self.buffers = t, no_decay, buffers
        self._set_hyperparams(hp)


# ----------------------------------------------------------------------------------------------------


class SGD(Optimizer):
    """SGD with momentum, as torch.optim.SGD (dampening=0). Per parameter, at step t:
        g_t = g + wd p                        (L2 decay, added to the gradient)
        b_t = g_t  (t = 1),   b_t = mu b_{t-1} + g_t  (t > 1)
        d_t = b_t,  or  g_t + mu b_t  with nesterov   (d_t = g_t when mu = 0)
        p  <- p - lr d_t
    model: has .params and .grads (dicts name -> array); no_decay: names that get wd = 0."""

    hyperparam_names = ("lr", "momentum", "nesterov", "weight_decay")
    buffer_names = ("momentum_buffer",)

    def __init__(self, model, lr, momentum=0.9, nesterov=False, weight_decay=0.0, no_decay=()):
        super().__init__(model, no_decay)
        hp = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        self._set_hyperparams(self._check_hyperparams(hp))

    def _check_hyperparams(self, hp):
        hp = dict(hp)
        hp["lr"] = _check_number("lr", hp["lr"], lambda x: x > 0, "> 0")
        hp["momentum"] = _check_number("momentum", hp["momentum"], lambda x: x >= 0, ">= 0")
        hp["weight_decay"] = _check_number("weight_decay", hp["weight_decay"], lambda x: x >= 0, ">= 0")
        if not isinstance(hp["nesterov"], bool):
            raise ValueError(f"nesterov must be True or False, got {hp['nesterov']!r}")
        if hp["nesterov"] and hp["momentum"] == 0:
            raise ValueError("nesterov=True needs a momentum > 0, got momentum=0")
        return hp

    def step(self):
        """Update every parameter in place from its current gradient (gradients are not modified)."""
        params, grads = self._read_model()
        bufs = self.buffers["momentum_buffer"]
        self.t += 1
        for name, p in params.items():
            buf = _like(bufs[name], p) if name in bufs else None
            # the update rule: functional.sgd_update (ops may run its one-launch GPU twin, checked against it)
            buf = ops.sgd_update(p, grads[name], buf, self.lr, self.momentum, self.nesterov, self._decay(name))
            if buf is not None:
                bufs[name] = buf


class AdamW(Optimizer):
    """Adam with decoupled weight decay, as torch.optim.AdamW. Per parameter, at step t:
        p   <- p (1 - lr wd)                  (decay first, not through the gradient)
        m_t  = b1 m_{t-1} + (1 - b1) g        (m_0 = v_0 = 0)
        v_t  = b2 v_{t-1} + (1 - b2) g^2
        p   <- p - lr / (1 - b1^t) * m_t / (sqrt(v_t) / sqrt(1 - b2^t) + eps)
    model: has .params and .grads (dicts name -> array); no_decay: names that get wd = 0."""

    hyperparam_names = ("lr", "betas", "eps", "weight_decay")
    buffer_names = ("exp_avg", "exp_avg_sq")

    def __init__(self, model, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, no_decay=()):
        super().__init__(model, no_decay)
        hp = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._set_hyperparams(self._check_hyperparams(hp))

    def _check_hyperparams(self, hp):
        hp = dict(hp)
        hp["lr"] = _check_number("lr", hp["lr"], lambda x: x > 0, "> 0")
        betas = hp["betas"]
        if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ValueError(f"betas must be a pair (b1, b2), got {betas!r}")
        hp["betas"] = (_check_number("betas[0]", betas[0], lambda x: 0 <= x < 1, "in [0, 1)"),
                       _check_number("betas[1]", betas[1], lambda x: 0 <= x < 1, "in [0, 1)"))
        hp["eps"] = _check_number("eps", hp["eps"], lambda x: x >= 0, ">= 0")
        hp["weight_decay"] = _check_number("weight_decay", hp["weight_decay"], lambda x: x >= 0, ">= 0")
        return hp

    def step(self):
        """Update every parameter in place from its current gradient (gradients are not modified)."""
        params, grads = self._read_model()
        ms, vs = self.buffers["exp_avg"], self.buffers["exp_avg_sq"]
        b1, b2 = self.betas
        self.t += 1
        for name, p in params.items():
            xp = get_array_module(p)
            m = _like(ms[name], p) if name in ms else xp.zeros_like(p)   # m_0 = 0
            v = _like(vs[name], p) if name in vs else xp.zeros_like(p)   # v_0 = 0
            ms[name], vs[name] = m, v
            # the update rule: functional.adamw_update (ops may run its one-pass twin, checked against it)
            ops.adamw_update(p, grads[name], m, v, self.lr, b1, b2, self.eps, self._decay(name), self.t)


# ----------------------------------------------------------------------------------------------------


def clip_grad_norm(model, max_norm):
    """Scale all gradients in place by min(1, max_norm / (||g|| + 1e-6)), where ||g|| is the 2-norm of
    every gradient joined into one vector (torch.nn.utils.clip_grad_norm_).
    model: has .grads, or is itself a dict name -> array. Returns ||g|| before clipping, computed where the
    gradients are: a NumPy float on the CPU, a 0-d CuPy array on the GPU (float() it to read it; that waits
    for the GPU, so the trainer reads it with the step's other numbers, in one transfer). inf or nan when a
    gradient is not finite: the caller decides whether to skip the step."""
    max_norm = _check_number("max_norm", max_norm, lambda x: x > 0, "> 0")
    grads = model if isinstance(model, dict) else model.grads
    if not grads:
        return 0.0
    xp = get_array_module(*grads.values())
    norms = [xp.linalg.norm(g.ravel()) for g in grads.values()]  # ||g_i|| for each array
    total = xp.linalg.norm(xp.stack(norms))  # sqrt(sum_i ||g_i||^2)
    scale = max_norm / (total + 1e-6)
    scale = xp.where(scale < 1.0, scale, 1.0)  # never scales up (and a nan norm scales nothing)
    # decided on the device: the host never waits for the norm (times 1.0 changes no value)
    for g in grads.values():
        g *= scale.astype(g.dtype)
    return total


class WarmupCosine:
    """The learning rate for step = 0, 1, 2, ...  (W = warmup_steps, T = total_steps):
        step <  W:       base_lr * (step + 1) / W                                  (linear warm-up)
        W <= step < T:   min_lr + (base_lr - min_lr) * (1 + cos(pi * (step - W) / (T - W))) / 2
        step >= T:       min_lr
    so the first step already has lr > 0, step W - 1 and W both have base_lr, and the midpoint
    W + (T - W) / 2 has (base_lr + min_lr) / 2. decay="constant" holds base_lr after the warm-up.
    Use: opt.lr = schedule(step); opt.step()."""

    def __init__(self, base_lr, total_steps, warmup_steps=0, min_lr=0.0, decay="cosine"):
        self.base_lr = _check_number("base_lr", base_lr, lambda x: x > 0, "> 0")
        self.total_steps = _check_int("total_steps", total_steps, low=1)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, low=0)
        if self.warmup_steps > self.total_steps:
            raise ValueError(f"warmup_steps must be <= total_steps={total_steps}, got {warmup_steps!r}")
        self.min_lr = _check_number("min_lr", min_lr, lambda x: 0 <= x <= self.base_lr,
                                    f"in [0, base_lr={self.base_lr}]")
        if decay not in ("cosine", "constant"):
            raise ValueError(f"decay must be 'cosine' or 'constant', got {decay!r}")
        self.decay = decay

    def __call__(self, step):
        step = _check_int("step", step, low=0)
        W, T = self.warmup_steps, self.total_steps
        if step < W:
            return self.base_lr * (step + 1) / W
        if self.decay == "constant":
            return self.base_lr
        if step >= T:
            return self.min_lr
        progress = (step - W) / (T - W)  # 0 at the end of the warm-up, -> 1 at T
        return self.min_lr + (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2
