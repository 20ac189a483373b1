"""What the trainer's ops lines cost at start: the old eval forward against ops.report's recorded training
forward and backward (both on 2 images of vit_cifar_tiny, warm: probes and Numba already loaded).

    /work/main/.venv/bin/python benchmarks/announce_cost.py
Alternated, 9 rounds, medians. Not a test."""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: minivit without installing

import numpy as np  # noqa: E402

import minivit  # noqa: E402
from minivit import ops  # noqa: E402

model = minivit.create_model("vit_cifar_tiny")
x = np.random.default_rng(0).standard_normal((2, 32, 32, 3)).astype(np.float32)
ops.report(model, x, training=True)                              # warm: probes, Numba
old, new = [], []
for _ in range(9):
    start = time.perf_counter()
    model.eval().forward(x)
    model.train()
    old.append(time.perf_counter() - start)
    start = time.perf_counter()
    ops.report(model, x, training=True)
    new.append(time.perf_counter() - start)
print(f"eval forward (before): {statistics.median(old) * 1e3:.1f} ms; "
      f"ops.report(training=True): {statistics.median(new) * 1e3:.1f} ms (medians of 9)")
