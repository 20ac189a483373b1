"""Where does a minivit training step spend its time? A per-layer profile of forward and backward.

    .venv/bin/python benchmarks/profile_layers.py                      # vit_cifar_tiny, batch 64, CPU
    .venv/bin/python benchmarks/profile_layers.py --batch 128 --repeats 5 --preset vit_cifar_small
    .venv/bin/python benchmarks/profile_layers.py --backend cupy       # on a GPU (each call synchronised)

Every stage of ``model.stages()`` and every layer inside it (``norm1``, ``attn``, ``attn.qkv``, ``mlp.fc1``,
``mlp.act``...) gets its ``forward`` and ``backward`` wrapped by a timer, for the duration of the
profile only (an instance attribute that shadows the method; removed afterwards). A layer's time
includes its children's; its "self" time is what is left when they are taken away: for ``attn`` that
is the attention core (split heads, q k^T, softmax, attn v), for a block the residual additions.
Rows for the blocks are summed over all blocks (``blocks.*.mlp.fc1``): one line per kind of layer.

Times are medians over ``repeats`` steps, after one warm-up step. On CuPy each timed call is
synchronised before and after, which removes the overlap of queued kernels: the profile then shows
where the GPU is busy, but its total is a little above an unprofiled step.
"""

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: minivit without installing

import numpy as np  # noqa: E402
import minivit  # noqa: E402
from minivit import backend, ops  # noqa: E402

CLOCK = time.perf_counter  # wall clock; --clock process switches to the CPU time (one thread only)


def walk(stage, layer, max_depth):
    """(path, layer, depth) for a stage's layer and the layers inside it (Layer.named_sublayers), up to
    max_depth below the stage; depth counts the layers a layer sits in (blocks.0.mlp.fc1: 2, under
    blocks.0 and blocks.0.mlp). A dropout that is off is the identity and gets no row."""
    subs = list(layer.named_sublayers(stage))
    for path, sub in subs:
        depth = sum(path.startswith(outer + ".") for outer, _ in subs)
        if depth <= max_depth and not (isinstance(sub, minivit.layers.Dropout) and sub.p == 0.0):
            yield path, sub, depth


class Profiler:
    """Wraps forward/backward of every layer under each stage with a timer. Use as a context manager."""

    def __init__(self, model, max_depth=2):
        self.model = model
        self.targets = []  # (path, layer, depth)
        for stage, layer in model.stages():
            self.targets += list(walk(stage, layer, max_depth))
        self.times = {}  # (path, "fwd"|"bwd") -> [seconds, ...], one entry per step
        self._step = {}  # (path, "fwd"|"bwd") -> seconds in the current step

    def _wrap(self, path, layer, kind):
        method = getattr(layer, "forward" if kind == "fwd" else "backward")
        key = (path, kind)

        def timed(x):
            backend.synchronize()
            t0 = CLOCK()
            out = method(x)
            backend.synchronize()
            self._step[key] = self._step.get(key, 0.0) + CLOCK() - t0
            return out

        return timed

    def __enter__(self):
        for path, layer, _ in self.targets:
            layer.forward = self._wrap(path, layer, "fwd")
            layer.backward = self._wrap(path, layer, "bwd")
        return self

    def __exit__(self, *exc):
        for _, layer, _ in self.targets:
            layer.__dict__.pop("forward", None)
            layer.__dict__.pop("backward", None)

    def end_step(self):
        for key, seconds in self._step.items():
            self.times.setdefault(key, []).append(seconds)
        self._step = {}


def _kind(path):
    return re.sub(r"^blocks\.\d+", "blocks.*", path)


def profile(model, x, labels, repeats=3):
    """Profile `repeats` training steps (after one warm-up). Returns a dict: rows (one per kind of layer,
    in forward order: path, depth, fwd_ms, bwd_ms, self_fwd_ms, self_bwd_ms, count), loss_ms, zero_grad_ms,
    step_ms (the median total of the profiled steps)."""
    model.train()
    loss_t, zero_t, step_t = [], [], []
    with Profiler(model) as prof:
        for i in range(repeats + 1):
            backend.synchronize()
            t0 = CLOCK()
            logits = model.forward(x)
            t1 = CLOCK()
            loss, dlogits = minivit.cross_entropy(logits, labels)
            backend.synchronize()
            t2 = CLOCK()
            model.zero_grad()
            backend.synchronize()
            t3 = CLOCK()
            model.backward(dlogits)
            backend.synchronize()
            t4 = CLOCK()
            if i == 0:  # warm-up
                prof._step = {}
                continue
            prof.end_step()
            loss_t.append(t2 - t1)
            zero_t.append(t3 - t2)
            step_t.append(t4 - t0)
    depth_of = {path: d for path, _, d in prof.targets}
    children = {}  # path -> direct children paths
    for path, _, d in prof.targets:
        parent = [p for p, _, dp in prof.targets if dp == d - 1 and path.startswith(p + ".")]
        if parent:
            children.setdefault(parent[-1], []).append(path)

    def per_step(path, kind):
        return prof.times.get((path, kind), [0.0] * repeats)

    rows = {}
    for path, _, _ in prof.targets:
        k = _kind(path)
        r = rows.setdefault(k, dict(path=k, depth=depth_of[path], fwd_ms=0.0, bwd_ms=0.0, self_fwd_ms=0.0,
                                    self_bwd_ms=0.0, count=0))
        for kind in ("fwd", "bwd"):
            total = per_step(path, kind)
            kids = [per_step(c, kind) for c in children.get(path, [])]
            self_t = [t - sum(kid[j] for kid in kids) for j, t in enumerate(total)]  # this step's self time
            r[f"{kind}_ms"] += 1e3 * statistics.median(total)
            r[f"self_{kind}_ms"] += 1e3 * statistics.median(self_t)
        r["count"] += 1
    return dict(rows=list(rows.values()), loss_ms=1e3 * statistics.median(loss_t),
                zero_grad_ms=1e3 * statistics.median(zero_t), step_ms=1e3 * statistics.median(step_t))


def markdown(result):
    """The profile as a markdown table: per kind of layer, forward/backward (with children) and self time."""
    total = result["step_ms"]
    lines = ["| layer | fwd ms | bwd ms | self fwd ms | self bwd ms | self % of step |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        name = "&nbsp;&nbsp;" * r["depth"] + r["path"] + (f" (x{r['count']})" if r["count"] > 1 else "")
        self_ms = r["self_fwd_ms"] + r["self_bwd_ms"]
        lines.append(f"| {name} | {r['fwd_ms']:.1f} | {r['bwd_ms']:.1f} | {r['self_fwd_ms']:.1f} | "
                     f"{r['self_bwd_ms']:.1f} | {100 * self_ms / total:.1f} |")
    lines.append(f"| loss (cross_entropy) | {result['loss_ms']:.1f} | | | | {100 * result['loss_ms'] / total:.1f} |")
    lines.append(f"| zero_grad | | {result['zero_grad_ms']:.1f} | | | {100 * result['zero_grad_ms'] / total:.1f} |")
    lines.append(f"| **step** | | | | | **{total:.0f} ms** |")
    return "\n".join(lines)


def hot_spots(result, n=5):
    """The n layers with the largest self time (forward + backward), as (path, ms, % of step)."""
    total = result["step_ms"]
    rows = sorted(result["rows"], key=lambda r: -(r["self_fwd_ms"] + r["self_bwd_ms"]))[:n]
    return [(r["path"], r["self_fwd_ms"] + r["self_bwd_ms"],
             100 * (r["self_fwd_ms"] + r["self_bwd_ms"]) / total) for r in rows]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="vit_cifar_tiny", help="a name in minivit.presets")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--backend", default="numpy", choices=list(backend.BACKENDS))
    ap.add_argument("--clock", default="wall", choices=["wall", "process"],
                    help="process: CPU time of the process, steadier on a busy machine (meaningful with one "
                         "thread: OPENBLAS_NUM_THREADS=1)")
    ap.add_argument("--reference", action="store_true", help="turn the fast kernels off (minivit/fast/kernels.py)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "process" else time.perf_counter
    if args.reference:
        ops.set_fast_kernels(False)
    minivit.set_backend(args.backend)
    model = minivit.create_model(args.preset, dtype=args.dtype)
    c = model.config
    rng = np.random.default_rng(0)
    x = minivit.asarray(rng.standard_normal((args.batch, *c.img_size, c.in_chans)), dtype=args.dtype)
    labels = minivit.asarray(rng.integers(0, c.num_classes, args.batch))
    result = profile(model, x, labels, args.repeats)
    print(f"{args.preset}, batch {args.batch}, {args.dtype}, {args.backend}, {args.clock} clock, fast kernels "
          f"{'off' if args.reference else 'on'}: median of {args.repeats} steps\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
