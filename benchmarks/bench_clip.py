"""minivit's CLIP against open_clip's, PyTorch eager, on the CPU: one training step, side by side.

    .venv-parity/bin/python benchmarks/bench_clip.py                      # clip_shapes_tiny at batch 128
    .venv-parity/bin/python benchmarks/bench_clip.py --config b32 --batch 32     # OpenAI's ViT-B/32 shape
    .venv-parity/bin/python benchmarks/bench_clip.py --threads 1

What is measured. The same CLIP is built in minivit and in open_clip (open_clip.CLIP, the same sizes),
minivit's weights copied into open_clip (minivit.clip.to_open_clip), and each is timed on the same batch
of images and captions for:
- a training step: zero_grad, forward (both towers, the normalised features, the logits), the symmetric
  InfoNCE loss (minivit.clip.contrastive_loss / open_clip.ClipLoss), backward (every parameter);
- an optimizer step: minivit.optim.AdamW against torch.optim.AdamW, lr 1e-3, weight decay 0.05 on every
  parameter, then logit_scale clamped to [0, log 100] on both sides.
The two libraries are alternated in one process as benchmarks/bench.py does (its `alternate`: each
library runs --block calls in a row and the first is not timed; the ratio is the median over rounds of
minivit's time / PyTorch's in the same round). Threads: PyTorch gets as many as NumPy's BLAS uses, or
--threads N sets both (and minivit's Numba kernels). The GELU is the exact one on both sides (open_clip's
default; --quick-gelu for QuickGELU on both).

Results go to benchmarks/results/clip-cpu-<time>.json (or --out DIR). No part of this is a test.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # minivit from this checkout, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))

import minivit  # noqa: E402  (before NumPy: it sets OpenBLAS's idle threads to sleep, minivit/_blas_env.py)
import numpy as np  # noqa: E402
from minivit import clip  # noqa: E402
from minivit.optim import AdamW  # noqa: E402

import bench  # noqa: E402  (the machine's description, the thread settings, the alternated timing)

LR, WEIGHT_DECAY = 1e-3, 0.05

CONFIGS = {
    "tiny": clip.presets["clip_shapes_tiny"],
    "b32": clip.CLIPConfig(),                     # OpenAI's ViT-B/32 (at 224, 77 tokens, 49408 words)
}


def open_clip_like(config, quick_gelu):
    """The open_clip.CLIP of a CLIPConfig (open_clip's towers take head_width, its images 3 channels)."""
    import open_clip

    if config.in_chans != 3 or config.img_size[0] != config.img_size[1]:
        raise ValueError("open_clip's CLIP takes square RGB images")
    vision = dict(image_size=config.img_size[0], patch_size=config.patch_size, width=config.vision_width,
                  layers=config.vision_layers, head_width=config.vision_width // config.vision_heads,
                  mlp_ratio=config.mlp_ratio)
    text = dict(context_length=config.context_length, vocab_size=config.vocab_size, width=config.text_width,
                heads=config.text_heads, layers=config.text_layers, mlp_ratio=config.mlp_ratio)
    return open_clip.CLIP(embed_dim=config.embed_dim, vision_cfg=vision, text_cfg=text, quick_gelu=quick_gelu)


class ClipPair:
    """The same CLIP in minivit and open_clip, one batch for each, their optimizers: bench.alternate's pair."""

    def __init__(self, torch, config, batch, seed=0):
        import open_clip

        self.torch, self.config, self.batch = torch, config, batch
        minivit.set_backend("numpy")
        self.model = clip.CLIP(config, seed=seed).train()
        self.ref = open_clip_like(config, config.gelu == "quick").train()
        self.ref.load_state_dict({k: torch.from_numpy(v)
                                  for k, v in clip.to_open_clip(self.model.state_dict()).items()})
        self.loss = open_clip.ClipLoss()
        rng = np.random.default_rng(seed + 1)
        H, W = config.img_size
        x = rng.standard_normal((batch, H, W, config.in_chans)).astype(np.float32)
        L, V = config.context_length, config.vocab_size
        t = np.zeros((batch, L), dtype=np.int64)
        for b in range(batch):                        # captions of 3 to L - 2 words, <end> = V - 1
            n = int(rng.integers(3, L - 1))
            t[b, :n + 2] = [2] + list(rng.integers(3, V - 1, size=n)) + [V - 1]
        self.x, self.t = x, t
        self.tx, self.tt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(t)
        self.opt = AdamW(self.model, lr=LR, weight_decay=WEIGHT_DECAY)
        self.topt = torch.optim.AdamW(self.ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        self.sync_m = self.sync_t = lambda: None

    def minivit_step(self):
        self.model.zero_grad()
        loss, dlogits = clip.contrastive_loss(self.model.forward(self.x, self.t))
        self.model.backward(dlogits)
        return loss

    def torch_step(self):
        self.ref.zero_grad(set_to_none=True)
        image, text, scale = self.ref(self.tx, self.tt)
        loss = self.loss(image, text, scale)
        loss.backward()
        return loss

    def minivit_opt(self):
        self.opt.step()
        self.model.clamp_logit_scale()

    def torch_opt(self):
        self.topt.step()
        with self.torch.no_grad():
            self.ref.logit_scale.clamp_(0, np.log(100))

    def agreement(self):
        """Relative max difference of the two losses' logits on the batch, before any step."""
        with self.torch.no_grad():
            image, text, scale = self.ref(self.tx, self.tt)
            b = (scale * image @ text.T).numpy()
        a = self.model.forward(self.x, self.t)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main(argv=None):
    ap = argparse.ArgumentParser(description="minivit's CLIP vs open_clip (PyTorch eager) on the CPU")
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS), help="tiny: clip_shapes_tiny; b32: ViT-B/32")
    ap.add_argument("--batch", type=int, default=None, help="default 128 (tiny), 16 (b32)")
    ap.add_argument("--quick-gelu", action="store_true", help="QuickGELU on both sides (OpenAI's models)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="BLAS and torch threads (default: NumPy's BLAS's)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/results, or $OUT)")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        bench.set_blas_threads(args.threads)
        os.environ["MINIVIT_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads or bench.blas_threads())
    config = CONFIGS[args.config]
    if args.quick_gelu:
        import dataclasses
        config = dataclasses.replace(config, gelu="quick")
    batch = args.batch or (128 if args.config == "tiny" else 16)
    info = bench.machine_info(torch)
    print(f"{info['cpu']}, {info['cores']} cores; torch {info['torch']} with {info['torch_threads']} threads; "
          f"load {info['load_average']}")
    pair = ClipPair(torch, config, batch)
    agree = pair.agreement()
    t0 = time.time()
    wall, cpu = bench.alternate(pair, args.warmup, args.repeats, block=args.block)
    med = {k: statistics.median(v) for k, v in wall.items()}
    ratio_step = statistics.median(m / t for m, t in zip(wall["minivit_step"], wall["torch_step"]))
    ratio_opt = statistics.median(m / t for m, t in zip(wall["minivit_opt"], wall["torch_opt"]))
    ratio_cpu = statistics.median(m / t for m, t in zip(cpu["minivit_step"], cpu["torch_step"]))
    result = dict(config=args.config, clip_config=config.to_dict(), batch=batch, params=pair.model.num_params(),
                  median_s=med, ratio_step=ratio_step, ratio_step_cpu_time=ratio_cpu, ratio_opt=ratio_opt,
                  logits_rel_diff=agree, wall=wall, cpu=cpu, seconds=time.time() - t0)
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"clip-cpu-{stamp}.json"
    path.write_text(json.dumps(dict(machine=info, args=vars(args), result=result, created=stamp), indent=1,
                               default=str))
    print("\n| model | batch | params | minivit step | open_clip step | ratio (wall) | ratio (CPU time) "
          "| AdamW ratio |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.config} | {batch} | {pair.model.num_params():,} | {1e3 * med['minivit_step']:.0f} ms | "
          f"{1e3 * med['torch_step']:.0f} ms | {ratio_step:.2f} | {ratio_cpu:.2f} | {ratio_opt:.2f} |")
    print(f"\nlogits agree to {agree:.1e} (float32); median of {args.repeats} alternated rounds after "
          f"{args.warmup} warm-up; {info['torch_threads']} threads for both. Written to {path}")


if __name__ == "__main__":
    main()
