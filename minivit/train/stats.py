"""Training statistics, every K steps (python -m minivit.train --log-stats K): what each layer's
activations, gradients and updates look like, the numbers Karpathy reads in makemore part 3.

One record per logged step, into metrics.jsonl beside the evaluation records, told apart by its "kind":

    {"kind": "stats", "step": s,
     "activations": {stage: {"mean", "std"}, ...},              every stage's output, in forward order
     "blocks": {"blocks.i": {"attn_entropy", "attn_max", "gelu_flat"}, ...},
     "params": {name: {"grad_norm", "param_norm", "update_ratio"}, ...}}

* activations: the mean and std of each stage's output (patch_embed, pos_embed, blocks.i, norm, pool,
  head) over the step's batch: a std that grows block after block, or collapses, is the scale going wrong.
* attn_entropy: each attention row's entropy over log N, averaged over heads, rows and images
  (1: uniform, 0: one-hot, a saturated softmax whose gradient vanishes); attn_max: the mean largest weight.
* gelu_flat: the fraction of GELU inputs below -3, where GELU is flat (its slope under 0.012 in magnitude)
  and passes almost no gradient: the transformer's "dead ReLU".
* grad_norm ||g||, param_norm ||theta|| (before the step) and update_ratio ||theta' - theta|| / ||theta||,
  the size of the optimizer's actual step relative to the parameter (AdamW's, weight decay included).
  About 1e-3 per step is the rule of thumb; far below, the layer barely learns; far above, it thrashes.

The activations come from one extra forward of the step's batch, before the step, with the weights the
step starts from and every dropout off (so the dropout generators, and the run, are not changed).
"""

import math

from ..backend import get_array_module, to_numpy

GELU_FLAT = -3.0   # below this GELU'(x) = Phi(x) + x phi(x) is within 0.012 of 0


def _norm(a):
    """||a||_2 as a 0-d array on a's device."""
    xp = get_array_module(a)
    return xp.sqrt((a.astype("float64") ** 2).sum())


def snapshot(model):
    """A copy of every parameter, on its device: what the step starts from."""
    return {name: p.copy() for name, p in model.params.items()}


def activation_stats(model, x):
    """One forward of x (B, H, W, C) stage by stage, in training mode with every dropout switched off:
    ({stage: (mean, std)}, {block: (attn_entropy, attn_max, gelu_flat)}) as 0-d device arrays, read later
    in one transfer. The model's mode (and so its dropouts') is restored."""
    from ..layers import Dropout

    was_training = model.training
    dropouts = [d for d in model.sublayers() if isinstance(d, Dropout)]
    acts, blocks = {}, {}
    try:
        model.train()
        for d in dropouts:
            d.training = False                               # no draw from the dropout generators
        h = x
        for name, layer in model.stages():
            h = layer.forward(h)                             # (B, ...) the stage's output
            xp = get_array_module(h)
            acts[name] = (h.mean(), h.std())
            attn_layer = getattr(layer, "attn", None)
            if attn_layer is not None and hasattr(layer, "mlp"):   # a transformer block
                a = attn_layer.attn                          # (B, nh, N, N), rows sum to 1
                N = a.shape[-1]
                entropy = -(a * xp.log(xp.maximum(a, 1e-30))).sum(-1)   # (B, nh, N)
                gelu_in = layer.mlp.act.cache[0]             # (B, N, M): fc1's output, GELU's input
                blocks[name] = (entropy.mean() / math.log(N), a.max(-1).mean(), (gelu_in < GELU_FLAT).mean())
    finally:
        model.train(was_training)                            # every layer's mode back, dropouts included
    return acts, blocks


def step_record(step, model, before, acts, blocks):
    """The stats record of the step that took the model from before (snapshot) to its parameters now,
    with this step's gradients still in model.grads. Every number comes to the host in one transfer."""
    names = list(model.params)
    xp = get_array_module(model.params[names[0]])
    values = []
    for name in names:
        p0, p1, g = before[name], model.params[name], model.grads[name]
        values += [_norm(g), _norm(p0), _norm(p1 - p0)]
    for mean, std in acts.values():
        values += [mean, std]
    for triple in blocks.values():
        values += list(triple)
    read = [float(v) for v in to_numpy(xp.stack([xp.asarray(v, dtype="float64") for v in values]))]
    it = iter(read)
    params = {}
    for name in names:
        grad_norm, param_norm, update = next(it), next(it), next(it)
        ratio = update / param_norm if param_norm > 0 else None
        params[name] = {"grad_norm": grad_norm, "param_norm": param_norm, "update_ratio": ratio}
    activations = {name: {"mean": next(it), "std": next(it)} for name in acts}
    block_stats = {name: {"attn_entropy": next(it), "attn_max": next(it), "gelu_flat": next(it)} for name in blocks}
    return {"kind": "stats", "step": int(step), "activations": activations, "blocks": block_stats, "params": params}
