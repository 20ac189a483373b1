"""What does checking the fast kernels cost? (issue 12: target, under 1% of the first minute of `make demo`)

    .venv/bin/python benchmarks/probe_cost.py                # the demo recipe's model and batch, CPU
    .venv/bin/python benchmarks/probe_cost.py --repeats 20

The first time an op runs for a dtype and backend, minivit/fast/ops.py runs its functional.py pair and its
kernels.py twin on a small probe input and compares them (see ops._probe). The figure that
`python -m minivit.train` prints at its start ("... 538 ms in all") is the time of those first calls,
which also holds the one-time cost of loading Numba's compiled kernels from its disk cache (or of
compiling them, after a fresh clone): a cost the first fast call pays whether or not it is checked.
This script separates the two. It runs the demo model's first training step (probes included), then
probes every op again: the warm re-probe is what the check itself costs.
"""

import argparse
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: minivit without installing

import numpy as np  # noqa: E402
from minivit import ops  # noqa: E402
from minivit import train as T  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="warm re-probes per op (the median is kept)")
    args = parser.parse_args(argv)

    cfg = T.resolve(T.TrainConfig(dataset="shapes", recipe="demo", out=None))
    data = types.SimpleNamespace(image_shape=(32, 32, 3), num_classes=10)    # the shapes data set's
    model, rng = T.build_model(cfg, data), np.random.default_rng(0)
    optimizer = T.build_optimizer(cfg, model)
    x = rng.standard_normal((cfg.batch_size, 32, 32, 3)).astype(cfg.dtype)   # (B, H, W, C)
    y = rng.integers(0, 10, cfg.batch_size)                                  # (B,)

    start = time.perf_counter()
    T.train_step(model, optimizer, x, y, cfg, None)                          # probes every op it meets
    first_step = time.perf_counter() - start
    start = time.perf_counter()
    T.train_step(model, optimizer, x, y, cfg, None)
    second_step = time.perf_counter() - start
    first_calls = ops.report()
    print(first_calls)

    warm = 0.0
    for op, backend, key, _, _, _, seconds in first_calls:
        if seconds is None:
            continue
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            ops._probe(op, backend, key)
            times.append(time.perf_counter() - t)
        warm += float(np.median(times))
        print(f"re-probe {op:<10} {str(key):<18} {np.median(times) * 1e3:6.2f} ms")
    print(f"first step {first_step:.2f} s (with the first calls), second step {second_step:.2f} s")
    print(f"first calls of the checked ops: {first_calls.probe_seconds * 1e3:.0f} ms "
          f"({100 * first_calls.probe_seconds / 60:.2f}% of a minute), of which the checks themselves "
          f"(warm re-probes): {warm * 1e3:.1f} ms ({100 * warm / 60:.3f}% of a minute)")


if __name__ == "__main__":
    main()
