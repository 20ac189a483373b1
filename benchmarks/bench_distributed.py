"""Data parallelism on the CPU: images/s of 2 ranks x 1 thread against 1 process x 1 and x 2 threads,
and against PyTorch's DistributedDataParallel (gloo) on the same model, ranks and global batch.

    .venv-parity/bin/python benchmarks/bench_distributed.py                       # vit_cifar_tiny, batch 64
    .venv-parity/bin/python benchmarks/bench_distributed.py --batch 128 --steps 20
    .venv-parity/bin/python benchmarks/bench_distributed.py --embed-dim 32 --depth 2 --batch 8 --steps 3 --warmup 1
                                                                                  # a tiny check that it runs

It needs torch (the parity venv: make test-parity builds it) and mpi4py + mpich in the same venv (the
Makefile's parity line installs them). What runs, each in fresh processes started by this script:
    minivit 1x1   one process, OPENBLAS_NUM_THREADS=1 MINIVIT_NUM_THREADS=1, the whole global batch B
    minivit 1x2   one process, two BLAS and two kernel threads
    minivit 2x1   mpiexec -n 2, one thread each, B / 2 images per rank, DataParallel's gradient all-reduce
    torch 1x1     torch.set_num_threads(1), timm's VisionTransformer with minivit's weights
    torch 2x1     mpiexec -n 2 (as the launcher only), DistributedDataParallel on gloo, one thread each
A step is the whole of training: zero_grad, forward, cross-entropy, backward, the gradient exchange
(2 ranks), AdamW (lr 1e-3, weight decay 0.05). Each configuration runs --warmup steps, then --steps
timed ones; the figure is B / the median step time (rank 0's clock; the exchange makes the ranks wait
for each other, so it is the job's). Scaling efficiency = (2x1 images/s) / (2 x 1x1 images/s).

On a shared machine the load changes from one second to the next: the lead runs this on a quiet one.
Results go to benchmarks/results/distributed-<time>.json; a markdown table is printed at the end.
"""

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # minivit from this checkout, without installing it

LR, WEIGHT_DECAY = 1e-3, 0.05
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def model_config(args):
    import dataclasses

    from minivit.model import presets

    overrides = {k: v for k, v in (("embed_dim", args.embed_dim), ("depth", args.depth),
                                   ("num_heads", args.num_heads)) if v is not None}
    return dataclasses.replace(presets[args.model], **overrides)


def global_batch(config, B, seed=1):
    import numpy as np

    rng = np.random.default_rng(seed)
    H, W = config.img_size
    x = rng.standard_normal((B, H, W, config.in_chans)).astype(np.float32)     # (B, H, W, C)
    y = rng.integers(0, config.num_classes, B)                                 # (B,)
    return x, y


# --------------------------------------------------------------------------------------------------
# The workers: one process (or one rank) each
# --------------------------------------------------------------------------------------------------


def minivit_worker(args):
    import minivit
    from minivit import distributed as dist
    from minivit.optim import AdamW

    comm = dist.init("numpy")
    rank, R = (0, 1) if comm is None else (comm.rank, comm.world_size)
    config = model_config(args)
    model = minivit.ViT(config, seed=0)
    optimizer = AdamW(model, lr=LR, weight_decay=WEIGHT_DECAY)
    dp = None if comm is None else dist.DataParallel(comm, model, optimizer)
    x, y = global_batch(config, args.batch)
    rows = dist.local_slice(args.batch, rank, R)
    x, y = x[rows], y[rows]                                                    # (b, H, W, C), (b,)

    def step():
        model.zero_grad()
        loss, dlogits = minivit.cross_entropy(model.forward(x), y)
        model.backward(dlogits)
        if dp is None:
            optimizer.step()
        else:
            dp.average_gradients()
            dp.step()

    times = timed(step, args, barrier=None if comm is None else comm.comm.Barrier)
    if rank == 0:
        print(json.dumps({"times": times, "num_params": model.num_params()}), flush=True)


def torch_worker(args, port):
    import numpy as np
    import timm.models.vision_transformer as tv
    import torch

    import minivit
    from minivit.weights import convert
    from minivit.distributed import local_slice

    torch.set_num_threads(args.threads)
    rank, R = rank_from_env()
    if R > 1:
        import torch.distributed as tdist

        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=R)
    config = model_config(args)
    ref = tv.VisionTransformer(**convert.timm_kwargs(config))
    state = convert.to_timm(minivit.ViT(config, seed=0).state_dict(), config.patch_size, config.in_chans)
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    model = torch.nn.parallel.DistributedDataParallel(ref) if R > 1 else ref
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = global_batch(config, args.batch)
    rows = local_slice(args.batch, rank, R)
    tx = torch.from_numpy(x[rows]).permute(0, 3, 1, 2).contiguous()            # (b, C, H, W)
    ty = torch.from_numpy(y[rows])

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tx), ty)
        loss.backward()                                                        # DDP all-reduces here
        optimizer.step()

    times = timed(step, args, barrier=tdist.barrier if R > 1 else None)
    if rank == 0:
        print(json.dumps({"times": times, "num_params": sum(p.numel() for p in ref.parameters())}), flush=True)
    if R > 1:
        tdist.destroy_process_group()


def rank_from_env():
    """(rank, world size) as the MPI launcher set them (torch's side uses mpiexec only to start)."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def timed(step, args, barrier=None):
    """Seconds of each of args.steps steps after args.warmup untimed ones (the ranks start each together)."""
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times


# --------------------------------------------------------------------------------------------------
# The driver: each configuration in fresh processes, then the table
# --------------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(library, ranks, threads, args):
    """Run one configuration; returns the worker's JSON (times, num_params)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(OPENBLAS_NUM_THREADS=str(threads), MINIVIT_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               PYTHONPATH=str(ROOT))
    worker = [sys.executable, str(Path(__file__).resolve()), "--worker", library, "--port", str(free_port()),
              "--threads", str(threads)] + args.passthrough
    if ranks > 1:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        worker = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks)] + worker
    run = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=args.timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{library} {ranks}x{threads} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


RUNS = [("minivit", 1, 1), ("minivit", 1, 2), ("minivit", 2, 1), ("torch", 1, 1), ("torch", 2, 1)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_cifar_tiny")
    p.add_argument("--embed-dim", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--batch", type=int, default=64, help="the global batch (each of 2 ranks takes half)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=1800, help="seconds for one configuration")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--worker", choices=("minivit", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch % 2:
        p.error(f"--batch must divide by the 2 ranks, got {args.batch}")
    if args.worker == "minivit":
        return minivit_worker(args)
    if args.worker == "torch":
        return torch_worker(args, args.port)

    args.passthrough = ["--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
                        "--warmup", str(args.warmup)]
    for flag, value in (("--embed-dim", args.embed_dim), ("--depth", args.depth), ("--num-heads", args.num_heads)):
        if value is not None:
            args.passthrough += [flag, str(value)]
    config = model_config(args)
    print(f"{args.model} (D={config.embed_dim}, depth={config.depth}, img={config.img_size}), global batch "
          f"{args.batch}, {args.warmup} warm-up + {args.steps} timed steps", flush=True)
    results = []
    for library, ranks, threads in RUNS:
        got = launch(library, ranks, threads, args)
        median = statistics.median(got["times"])
        results.append(dict(library=library, ranks=ranks, threads=threads, median_step_s=median,
                            images_per_s=args.batch / median, times=got["times"], num_params=got["num_params"]))
        print(f"  {library:8s} {ranks}x{threads}: {args.batch / median:8.1f} images/s "
              f"(median step {median * 1e3:.1f} ms)", flush=True)
    ips = {(r["library"], r["ranks"], r["threads"]): r["images_per_s"] for r in results}
    summary = {
        "minivit_scaling_efficiency": ips["minivit", 2, 1] / (2 * ips["minivit", 1, 1]),
        "torch_scaling_efficiency": ips["torch", 2, 1] / (2 * ips["torch", 1, 1]),
        "minivit_2x1_over_1x2": ips["minivit", 2, 1] / ips["minivit", 1, 2],
        "minivit_over_torch_2x1": ips["minivit", 2, 1] / ips["torch", 2, 1],
        "minivit_over_torch_1x1": ips["minivit", 1, 1] / ips["torch", 1, 1],
    }
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(args.out) / f"distributed-{stamp}.json"
    with open(path, "w") as f:
        json.dump({"model": args.model, "config": config.to_dict(), "batch": args.batch, "steps": args.steps,
                   "warmup": args.warmup, "cpu_count": os.cpu_count(), "command": " ".join(sys.argv),
                   "results": results, "summary": summary}, f, indent=2)
    print("\n| configuration | images/s |\n|---|---|")
    for r in results:
        print(f"| {r['library']} {r['ranks']} rank(s) x {r['threads']} thread(s) | {r['images_per_s']:.1f} |")
    print(f"\nscaling efficiency 2x1 vs 1x1: minivit {summary['minivit_scaling_efficiency']:.2f}, "
          f"PyTorch DDP {summary['torch_scaling_efficiency']:.2f}; minivit 2x1 / 1x2 threads "
          f"{summary['minivit_2x1_over_1x2']:.2f}; minivit / PyTorch at 2x1 {summary['minivit_over_torch_2x1']:.2f}, "
          f"at 1x1 {summary['minivit_over_torch_1x1']:.2f}")
    print(f"results in {path}")


if __name__ == "__main__":
    main()
