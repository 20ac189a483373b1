"""What a swapped attention costs: images/s of a training step of vit_cifar_tiny, three ways.

    /work/main/.venv/bin/python benchmarks/bench_layer_swap.py            # batch 64, 7 rounds
    MINIVIT_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/bench_layer_swap.py --rounds 9

- default:     minivit's Attention (the fused kernel, kernels.attention_forward/backward)
- temp-folded: layer_examples.TempAttention in every block, the temperature folded into q: the kernel stays
- temp-plain:  layer_examples.PlainTempAttention in every block, scores computed in the layer: no kernel

A step is zero_grad, forward, cross-entropy, backward. The variants are ALTERNATED (round r runs each, in
an order rotated by r), each runs 3 steps in a row of which the first is not timed; the figure is the median
over rounds. Each variant's ops.report summary is printed first, so the table says what ran. Not a test.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: minivit without installing

import numpy as np  # noqa: E402

import minivit  # noqa: E402
from minivit import ops  # noqa: E402
from minivit.functional import cross_entropy  # noqa: E402
from minivit.layer_examples import PlainTempAttention, TempAttention  # noqa: E402


def build(kind):
    model = minivit.create_model("vit_cifar_tiny")
    for blk in model.blocks:
        if kind == "temp-folded":
            blk.attn = TempAttention.from_attention(blk.attn)
        elif kind == "temp-plain":
            plain = PlainTempAttention(blk.attn.qkv.in_features, blk.attn.num_heads)
            plain.qkv, plain.proj = blk.attn.qkv, blk.attn.proj
            blk.attn = plain
    return model


def step(model, x, y):
    model.zero_grad()
    logits = model.forward(x)
    _, dlogits = cross_entropy(logits, y)
    model.backward(dlogits)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    kinds = ["default", "temp-folded", "temp-plain"]
    models = {k: build(k) for k in kinds}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, args.batch)
    for k in kinds:
        print(f"{k}:")
        for line in ops.report(models[k], x[:2], training=True).summary_lines():
            print("   ", line)
        step(models[k], x, y)                                     # warm-up (probes, Numba compiles)
    times = {k: [] for k in kinds}
    cpu = {k: [] for k in kinds}
    for r in range(args.rounds):
        for k in kinds[r % 3:] + kinds[:r % 3]:
            step(models[k], x, y)                                 # not timed: the other's threads settle
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(2):
                step(models[k], x, y)
            times[k].append((time.perf_counter() - start) / 2)
            cpu[k].append((time.process_time() - start_cpu) / 2)
    base, base_cpu = statistics.median(times["default"]), statistics.median(cpu["default"])
    print(f"\nvit_cifar_tiny training step, batch {args.batch}, median of {args.rounds} alternated rounds "
          f"(CPU time: of this process, steadier on a loaded machine)")
    print("| variant | ms / step | images/s | vs default | CPU ms / step | CPU vs default |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in kinds:
        t, c = statistics.median(times[k]), statistics.median(cpu[k])
        print(f"| {k} | {t * 1e3:.1f} | {args.batch / t:.0f} | {base / t:.2f}x | {c * 1e3:.0f} | {base_cpu / c:.2f}x |")


if __name__ == "__main__":
    main()
