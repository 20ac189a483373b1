"""Train the demo recipe on `shapes` on the GPU, with minivit and with PyTorch, and compare (scripts/gpu_check.sh).

    python scripts/gpu_train_compare.py --steps 300 --out DIR

minivit: ``minivit.train.train`` itself (the demo recipe, --backend cupy, exactly --steps steps, one
evaluation at the end). PyTorch: the same loop written in PyTorch on the same GPU: timm's
VisionTransformer with minivit's initial weights (minivit.weights.convert.to_timm), the same batches in the same
order (epoch e shuffled by host_rng([seed, e]); the demo recipe has no augmentation), torch.optim.AdamW
with the same lr, weight decay and no-decay set, the same warm-up + cosine schedule (minivit.optim's
WarmupCosine), float32 (TF32 when CUPY_TF32=1, for both). Each side's images/s is counted the way
minivit.train's summary counts it: every step over the wall time of the whole run (first-call compiles
and the final evaluation included), and again over the second half of the steps alone (steady state).
Not a test: it asserts nothing; it prints one JSON object and a markdown table, and writes
train_compare.json to --out.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_minivit(steps, seed, out):
    from minivit.train import TrainConfig, train

    cfg = TrainConfig(dataset="shapes", recipe="demo", backend="cupy", max_steps=steps, num_evals=2, seed=seed,
                      out=os.path.join(out, "minivit_run"), progress=False)
    result = train(cfg)
    s, (half, end) = result.summary, result.history
    steady = (end["step"] - half["step"]) * result.summary["train_config"]["batch_size"] / (
        end["wall_seconds"] - half["wall_seconds"])     # includes the first evaluation's time: a lower bound
    return {"images_per_second": s["images_per_second"], "steady_images_per_second": steady,
            "final_val_accuracy": s["final_val_accuracy"], "final_train_loss": end["train_loss"],
            "wall_seconds": s["wall_seconds"], "steps": s["steps"]}, result


def run_torch(steps, seed):
    import timm.models.vision_transformer as tv
    import torch

    from minivit import backend
    from minivit.weights import convert
    from minivit.data import load_dataset
    from minivit.optim import WarmupCosine, default_no_decay
    from minivit.train import TrainConfig, build_model, resolve

    cfg = resolve(TrainConfig(dataset="shapes", recipe="demo", max_steps=steps, seed=seed, out=None))
    data = load_dataset("shapes")
    backend.set_backend("numpy")                        # the initial weights drawn on the host, as train() does
    model = build_model(cfg, data)                      # what train() builds: the same initial weights
    config = model.config
    dev = torch.device("cuda")
    net = tv.VisionTransformer(**convert.timm_kwargs(config)).to(dev)
    sd = convert.to_timm(model.state_dict(), config.patch_size, config.in_chans)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    no_decay = default_no_decay(model.params)
    groups = [{"params": [p for n, p in net.named_parameters() if n not in no_decay], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in net.named_parameters() if n in no_decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    n_train = data.x_train.shape[0]
    steps_per_epoch = n_train // cfg.batch_size
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    schedule = WarmupCosine(cfg.lr, steps, warmup_steps=min(warmup, steps), min_lr=cfg.min_lr)
    mean = torch.tensor(data.mean, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(data.std, device=dev).view(1, 3, 1, 1)

    def prepare(x_u8):                                  # uint8 NHWC on the GPU -> normalised float NCHW
        return (x_u8.permute(0, 3, 1, 2).float() / 255 - mean) / std

    x_train = torch.from_numpy(data.x_train).to(dev)
    y_train = torch.from_numpy(data.y_train).to(dev)
    loss_sum = torch.zeros((), device=dev)
    net.train()
    start, half_time = time.perf_counter(), None
    for step in range(steps):
        epoch, i = divmod(step, steps_per_epoch)
        order = backend.host_rng([cfg.seed, epoch]).permutation(n_train)
        idx = torch.from_numpy(order[i * cfg.batch_size:(i + 1) * cfg.batch_size]).to(dev)
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        loss = torch.nn.functional.cross_entropy(net(prepare(x_train[idx])), y_train[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= steps // 2:
            loss_sum += loss.detach()
        if step + 1 == steps // 2:
            torch.cuda.synchronize()
            half_time = time.perf_counter()
    torch.cuda.synchronize()
    train_end = time.perf_counter()
    net.eval()
    correct = 0
    with torch.no_grad():
        x_test, y_test = torch.from_numpy(data.x_test).to(dev), torch.from_numpy(data.y_test).to(dev)
        for b in range(0, x_test.shape[0], cfg.eval_batch_size):
            logits = net(prepare(x_test[b:b + cfg.eval_batch_size]))
            correct += int((logits.argmax(-1) == y_test[b:b + cfg.eval_batch_size]).sum())
    wall = time.perf_counter() - start
    return {"images_per_second": steps * cfg.batch_size / wall,
            "steady_images_per_second": (steps - steps // 2) * cfg.batch_size / (train_end - half_time),
            "final_val_accuracy": correct / x_test.shape[0],
            "final_train_loss": float(loss_sum) / (steps - steps // 2), "wall_seconds": wall, "steps": steps,
            "tf32": bool(torch.backends.cuda.matmul.allow_tf32), "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps for each side (batch 128)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for train_compare.json")
    args = ap.parse_args(argv)
    if args.steps < 2:
        sys.exit(f"--steps must be at least 2, got {args.steps}")
    import torch

    tf32 = os.environ.get("CUPY_TF32", "0") == "1"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    os.makedirs(args.out, exist_ok=True)
    ours, _ = run_minivit(args.steps, args.seed, args.out)
    theirs = run_torch(args.steps, args.seed)
    record = {"steps": args.steps, "batch": 128, "recipe": "demo", "dataset": "shapes", "tf32": tf32,
              "minivit": ours, "pytorch": theirs}
    path = os.path.join(args.out, "train_compare.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    print(json.dumps(record))
    print(f"\n| demo recipe on shapes, {args.steps} steps of 128, GPU | images/s (whole run) | images/s (2nd half) "
          f"| val accuracy | train loss (2nd half) |\n|---|---|---|---|---|")
    for name, r in (("minivit (CuPy)", ours), ("PyTorch eager", theirs)):
        print(f"| {name} | {r['images_per_second']:.0f} | {r['steady_images_per_second']:.0f} | "
              f"{r['final_val_accuracy']:.2%} | {r['final_train_loss']:.3f} |")


if __name__ == "__main__":
    main()
