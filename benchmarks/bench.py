"""minivit against PyTorch eager (timm's VisionTransformer): speed, memory, MFU, and where the time goes.

    make bench                                     # the CPU, vit_cifar_tiny at batch 64, plus a sweep
    make bench ARGS="--batch 128 --repeats 9"      # the issue's batch (slower: ~2x)
    make bench ARGS="--full"                       # adds ViT-S/16 (batch 8) and ViT-B/16 (batch 4) at 224
    .venv-parity/bin/python benchmarks/bench.py --device gpu      # CuPy against PyTorch CUDA

What is measured. The same ViT is built in minivit and in timm, with minivit's weights copied into timm
(minivit.weights.convert.to_timm), and each is timed on the same batch for:
- a training step: zero_grad, forward, cross-entropy loss, backward (every parameter gradient);
- an optimizer step: minivit.optim.AdamW against torch.optim.AdamW (PyTorch's default implementation
  for the device), lr 1e-3, weight decay 0.05 on every parameter.
The two libraries are ALTERNATED in one process (minivit, torch, then torch, minivit, ...) after
warm-up steps, and the reported ratio is the median over rounds of minivit's time / PyTorch's time in
the same round: on a shared machine the load changes from one second to the next, and alternation
exposes both to the same load. Each library runs --block calls in a row (3) and the first is not timed:
both libraries leave threads spinning for a while after their work (OpenBLAS, OpenMP), and the first call
after a switch would be timed while the other's threads still hold the cores; the rest are steady state,
as in a training loop. Times are wall-clock; on the GPU each step ends with a synchronisation
of the device. The CPU time of the process is recorded too (a steadier number when the machine is busy).

Threads: PyTorch gets as many threads as NumPy's BLAS uses (torch.set_num_threads), or --threads N sets
both. The BLAS is read with threadpoolctl when it is installed, else straight from OpenBLAS's own
functions (found in /proc/self/maps). minivit's Numba kernels (LayerNorm, GELU, softmax, attention,
AdamW) use MINIVIT_NUM_THREADS (default: all cores); --threads sets it too.

FLOPs and MFU. The FLOPs of a step are 3x those of the forward (the backward computes two products,
dx and dW, for each one in the forward). The forward is minivit.flops(config) (minivit/model.py), per
image, multiply-add = 2 FLOPs:
    per image  2 * (N * P*P*C * D                       patch embedding, N patches
                    + depth * T * (3D*D + D*D + 2*D*M)  qkv, proj, fc1, fc2, T = N (+1) tokens
                    + D * K)                            head
             + depth * 4 * T^2 * D                      q k^T and attn v
which is FACTS.md's "2 x matmul-params x tokens + 4 x depth x T^2 x D" with each weight matrix applied
to the tokens it actually sees. Elementwise work (LayerNorm, GELU, softmax) is not counted. MFU here is
achieved FLOP/s over the float32 matrix-multiply rate *measured on this machine* by the same library
(a 2048^3 product for NumPy and for torch): a fraction of what the machine's matmuls can do, not of a
datasheet peak.

Memory. "activations" is what the forward keeps for the backward: for minivit, every array referenced
by a layer cache (counted once per underlying buffer, parameters excluded); for PyTorch, every tensor
autograd saves (saved_tensors_hooks, once per storage, parameters excluded). "peak" is the rise of the
process's peak resident memory during one training step (VmHWM after resetting it via
/proc/self/clear_refs, freed memory first returned by malloc_trim); for minivit also tracemalloc's peak
of NumPy's allocations. On the GPU: CuPy's memory pool (total bytes held after the step, from an emptied
pool) against torch.cuda.max_memory_allocated.

Results go to benchmarks/results/<device>-<time>.json (or --out DIR), with the machine, versions,
threads and every raw time; a markdown table is printed at the end for the README. No part of this is
a test: nothing here asserts on a time.
"""

import argparse
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # minivit from this checkout, without installing it
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import minivit  # noqa: E402
from minivit import backend  # noqa: E402
from minivit.fast import kernels, ops  # noqa: E402
from minivit.weights import convert  # noqa: E402
from minivit.amp import LossScaler  # noqa: E402
from minivit.optim import AdamW  # noqa: E402

import profile_layers  # noqa: E402

LR, WEIGHT_DECAY = 1e-3, 0.05


# ==================================================================================================
# The machine: CPU, BLAS, threads, versions
# ==================================================================================================

def cpu_model():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _openblas_libs():
    """Paths of the OpenBLAS libraries loaded in this process (NumPy's, possibly SciPy's)."""
    paths = []
    try:
        for line in open("/proc/self/maps"):
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "openblas" in path.lower() and path not in paths:
                paths.append(path)
    except OSError:
        pass
    return paths


def _openblas_call(lib, stem, restype=ctypes.c_int, *args):
    for prefix, suffix in (("scipy_", "64_"), ("", "64_"), ("", ""), ("scipy_", "")):
        fn = getattr(lib, f"{prefix}{stem}{suffix}", None)
        if fn is not None:
            fn.restype = restype
            return fn(*args)
    return None


def blas_info():
    """[{library, api, version, num_threads, corename}] for NumPy's BLAS, and how it was read."""
    try:
        from threadpoolctl import threadpool_info
        info = [dict(library=d.get("filepath"), api=d.get("internal_api"), version=d.get("version"),
                     num_threads=d.get("num_threads"), corename=d.get("architecture"))
                for d in threadpool_info() if d.get("user_api") == "blas"]
        return info, "threadpoolctl"
    except ImportError:
        pass
    info = []
    for path in _openblas_libs():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        core = _openblas_call(lib, "openblas_get_corename", ctypes.c_char_p)
        config = _openblas_call(lib, "openblas_get_config", ctypes.c_char_p)
        info.append(dict(library=path, api="openblas", version=config.decode() if config else None,
                         num_threads=_openblas_call(lib, "openblas_get_num_threads"),
                         corename=core.decode() if core else None))
    return info, "ctypes (threadpoolctl is not installed: pip install threadpoolctl to read any BLAS)"


def blas_threads():
    info, _ = blas_info()
    counts = [d["num_threads"] for d in info if d.get("num_threads")]
    return counts[0] if counts else os.cpu_count()


def set_blas_threads(n):
    """Limit NumPy's BLAS to n threads (threadpoolctl, else OpenBLAS's own setter)."""
    try:
        from threadpoolctl import threadpool_limits
        return threadpool_limits(n, user_api="blas")
    except ImportError:
        for path in _openblas_libs():
            lib = ctypes.CDLL(path)
            for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                         "openblas_set_num_threads"):
                fn = getattr(lib, name, None)
                if fn is not None:
                    fn(ctypes.c_int(n))
                    break
    return None


def git_revision():
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("+dirty" if dirty else "") if rev else None
    except (OSError, subprocess.SubprocessError):
        return None


def _numba_layer():
    """The threading layer Numba chose (known once a parallel kernel has run), or what it will use."""
    if not kernels.HAVE_NUMBA:
        return None
    try:
        return kernels.numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet
        return kernels.numba.config.THREADING_LAYER


def machine_info(torch):
    import scipy
    info, blas_how = blas_info()
    m = dict(
        cpu=cpu_model(), cores=os.cpu_count(),
        cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        platform=platform.platform(), python=platform.python_version(),
        numpy=np.__version__, scipy=scipy.__version__, torch=torch.__version__,
        numba=getattr(kernels.numba, "__version__", None), numba_threading_layer=_numba_layer(),
        minivit_revision=git_revision(), blas=info, blas_read_with=blas_how,
        torch_threads=torch.get_num_threads(), minivit_kernel_threads=kernels.num_threads(),
        minivit_attention_threads=kernels._attention_workers(),
        fast_kernels=ops.fast_kernels_enabled(),
        env={k: v for k, v in os.environ.items()
             if k.startswith(("OPENBLAS", "OMP_", "MKL_", "MINIVIT_", "NUMBA_", "CUPY_", "NVIDIA_TF32", "GOTO",
                              "BLIS"))},
    )
    try:
        import timm
        m["timm"] = timm.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
        m["torch_cuda"] = torch.version.cuda
        m["torch_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        m["torch_cudnn_allow_tf32"] = torch.backends.cudnn.allow_tf32
    try:
        import cupy
        m["cupy"] = cupy.__version__
    except ImportError:
        pass
    return m


# ==================================================================================================
# FLOPs and the machine's matmul rate
# ==================================================================================================

def step_flops(c, batch):
    """A training step's FLOPs: 3x the forward's, minivit.flops (see the module docstring)."""
    return 3 * minivit.flops(c) * batch


def facts_approx_step_flops(c, batch):
    """FACTS.md's rule of thumb: 3 x (2 x params x tokens + 4 x depth x T^2 x D) per image."""
    return 3 * batch * (2 * c.num_params() * c.seq_len + 4 * c.depth * c.seq_len ** 2 * c.embed_dim)


def _median_time(fn, sync, repeats):
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matmul_rates(torch, device, n=2048, repeats=5):
    """float32 GEMM rate (GFLOP/s) of NumPy/CuPy and of torch at n^3, measured here, plus one
    model-shaped product (rows x 192 @ 192 x 576, the CIFAR model's qkv at batch 64)."""
    rng = np.random.default_rng(0)
    out = {}
    shapes = {"square": (n, n, n), "qkv_shape": (64 * 65, 192, 576)}
    for name, (m, k, nn) in shapes.items():
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, nn)).astype(np.float32)
        flops = 2 * m * k * nn
        if device == "cpu":
            t = _median_time(lambda: a @ b, lambda: None, repeats)
            out[f"numpy_{name}_gflops"] = flops / t / 1e9
            ta, tb = torch.from_numpy(a), torch.from_numpy(b)
            t = _median_time(lambda: ta @ tb, lambda: None, repeats)
            out[f"torch_{name}_gflops"] = flops / t / 1e9
        else:
            import cupy
            ca, cb = cupy.asarray(a), cupy.asarray(b)
            t = _median_time(lambda: ca @ cb, backend.synchronize, repeats)
            out[f"cupy_{name}_gflops"] = flops / t / 1e9
            ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
            t = _median_time(lambda: ta @ tb, torch.cuda.synchronize, repeats)
            out[f"torch_{name}_gflops"] = flops / t / 1e9
    return out


# ==================================================================================================
# The two models, the steps, and the memory they keep
# ==================================================================================================

class Pair:
    """The same ViT in minivit and in timm, a batch for each, and their optimizers."""

    def __init__(self, torch, config, batch, device, seed=0, precision="float32"):
        import timm.models.vision_transformer as tv
        self.torch, self.config, self.batch, self.device = torch, config, batch, device
        bname = "cupy" if device == "gpu" else "numpy"
        minivit.set_backend(bname)
        self.model = minivit.ViT(config, seed=seed)
        tdev = "cuda" if device == "gpu" else "cpu"
        self.ref = tv.VisionTransformer(**convert.timm_kwargs(config)).to(tdev)
        sd = convert.to_timm(self.model.state_dict(), config.patch_size, config.in_chans)
        self.ref.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
        self.model.train()
        self.ref.train()
        rng = np.random.default_rng(seed + 1)
        H, W = config.img_size
        x = rng.standard_normal((batch, H, W, config.in_chans)).astype(np.float32)
        y = rng.integers(0, config.num_classes, batch)
        self.x, self.y = minivit.asarray(x, backend=bname), minivit.asarray(y, backend=bname)
        self.tx = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous().to(tdev)
        self.ty = torch.from_numpy(y).to(tdev)
        self.opt = AdamW(self.model, lr=LR, weight_decay=WEIGHT_DECAY)
        self.topt = torch.optim.AdamW(self.ref.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        self.sync_m = backend.synchronize
        self.sync_t = torch.cuda.synchronize if device == "gpu" else (lambda: None)
        # mixed precision: minivit's float16 Linear products + LossScaler against torch.autocast + GradScaler
        self.mixed = precision == "float16"
        self.scaler = self.tscaler = None
        if self.mixed:
            self.model.set_matmul_dtype("float16")
            self.scaler, self.tscaler = LossScaler(), torch.amp.GradScaler(tdev)

    def minivit_step(self):
        self.model.zero_grad()
        logits = self.model.forward(self.x)
        loss, dlogits = minivit.cross_entropy(logits, self.y)
        self.model.backward(self.scaler.scale(dlogits) if self.mixed else dlogits)
        return loss

    def torch_step(self):
        self.ref.zero_grad(set_to_none=True)
        with self.torch.autocast(self.tx.device.type, dtype=self.torch.float16, enabled=self.mixed):
            logits = self.ref(self.tx)
        loss = self.torch.nn.functional.cross_entropy(logits.float(), self.ty)
        (self.tscaler.scale(loss) if self.mixed else loss).backward()
        return loss

    def minivit_opt(self):
        if not self.mixed:
            return self.opt.step()
        finite = self.scaler.unscale(self.model)       # as GradScaler.step: unscale, check, step if finite
        if finite:
            self.opt.step()
        self.scaler.update(finite)

    def torch_opt(self):
        if not self.mixed:
            return self.topt.step()
        self.tscaler.step(self.topt)
        self.tscaler.update()

    def logits_agreement(self):
        """Relative max difference of the two models' logits on the batch (both in train mode)."""
        with self.torch.no_grad():
            b = self.ref(self.tx).float().cpu().numpy()
        a = minivit.to_numpy(self.model.forward(self.x))
        self.model.train()
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def alternate(pair, warmup, repeats, block=3):
    """Time train steps and optimizer steps of both, alternating the order each round. Each library runs
    `block` calls back to back and the first is not timed: both libraries leave threads spinning for a
    while after their work (OpenBLAS, OpenMP), and the first call after a switch would be timed while
    the other's threads still hold the cores. The others are steady state, as in a training loop."""
    names = ("minivit_step", "torch_step", "minivit_opt", "torch_opt")
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    fns = {"minivit_step": (pair.minivit_step, pair.sync_m), "torch_step": (pair.torch_step, pair.sync_t),
           "minivit_opt": (pair.minivit_opt, pair.sync_m), "torch_opt": (pair.torch_opt, pair.sync_t)}
    for r in range(warmup + repeats):
        order = ("minivit", "torch") if r % 2 == 0 else ("torch", "minivit")
        for what in ("step", "opt"):
            for lib in order:
                key = f"{lib}_{what}"
                fn, sync = fns[key]
                walls, cpus = [], []
                for i in range(max(block, 2)):
                    sync()
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    sync()
                    t1, c1 = time.perf_counter(), time.process_time()
                    if i > 0:
                        walls.append(t1 - t0)
                        cpus.append(c1 - c0)
                if r >= warmup:
                    wall[key].append(statistics.median(walls))
                    cpu[key].append(statistics.median(cpus))
    return wall, cpu


def _owner(a):
    while getattr(a, "base", None) is not None:
        a = a.base
    return a


def _arrays_in(obj, out):
    if backend.is_array(obj):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _arrays_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _arrays_in(o, out)


def minivit_activation_bytes(model, x):
    """Bytes kept by the layer caches after one training forward: each underlying buffer once,
    parameters excluded."""
    model.train()
    model.forward(x)
    params = {id(_owner(p)) for p in model.params.values()}
    seen, total = set(), 0
    for layer in model.sublayers():
        arrays = []
        _arrays_in(layer.cache, arrays)
        for a in arrays:
            o = _owner(a)
            if id(o) in params or id(o) in seen:
                continue
            seen.add(id(o))
            total += o.nbytes
    return total


def torch_activation_bytes(torch, ref, tx):
    """Bytes of the tensors autograd saves in one training forward: each storage once, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in ref.parameters()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ref(tx)
    del out
    return sum(storages.values())


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None


def peak_rss_rise(fn):
    """Bytes by which the process's peak resident memory rises during fn(), or None where Linux's
    /proc/self/clear_refs cannot reset the peak."""
    gc.collect()
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kb("VmRSS")
        fn()
        return (_status_kb("VmHWM") - before) * 1024
    except OSError:
        return None


def tracemalloc_peak(fn):
    """Peak bytes of NumPy (and Python) allocations during fn(), above what was allocated before."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak - before


def _drop_caches(model):
    """minivit keeps the last step's caches until the next forward replaces them: drop them, so that
    a measurement starts from the same state as PyTorch's (whose graph is freed by backward)."""
    for layer in model.sublayers():
        layer.cache = None


def memory(pair):
    torch = pair.torch
    _drop_caches(pair.model)
    m = dict(minivit_activation_bytes=minivit_activation_bytes(pair.model, pair.x),
             torch_activation_bytes=torch_activation_bytes(torch, pair.ref, pair.tx))
    if pair.device == "cpu":
        _drop_caches(pair.model)
        m["minivit_peak_rss_rise_bytes"] = peak_rss_rise(pair.minivit_step)
        m["torch_peak_rss_rise_bytes"] = peak_rss_rise(pair.torch_step)
        _drop_caches(pair.model)
        m["minivit_tracemalloc_peak_bytes"] = tracemalloc_peak(pair.minivit_step)
    else:
        import cupy
        pool = cupy.get_default_memory_pool()
        _drop_caches(pair.model)
        gc.collect()
        backend.synchronize()
        pool.free_all_blocks()
        before = pool.used_bytes()
        pair.minivit_step()
        backend.synchronize()
        m["cupy_pool_peak_bytes"] = pool.total_bytes() - before
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        pair.torch_step()
        torch.cuda.synchronize()
        m["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated() - before
        m["torch_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return m


# ==================================================================================================
# One configuration, the whole run, the tables
# ==================================================================================================

def run_config(torch, name, config, batch, device, warmup, repeats, rates, with_memory=True, with_profile=False,
               profile_repeats=3, block=3, precision="float32"):
    pair = Pair(torch, config, batch, device, precision=precision)
    agreement = pair.logits_agreement()
    wall, cpu = alternate(pair, warmup, repeats, block)
    med = {k: statistics.median(v) for k, v in wall.items()}
    ratios = {what: statistics.median(m / t for m, t in zip(wall[f"minivit_{what}"], wall[f"torch_{what}"]))
              for what in ("step", "opt")}
    cpu_ratio = statistics.median(m / t for m, t in zip(cpu["minivit_step"], cpu["torch_step"]))
    flops = step_flops(config, batch)
    mm = "numpy" if device == "cpu" else "cupy"
    result = dict(
        name=name, device=device, batch=batch, precision=precision, config=config.to_dict(), tokens=config.seq_len,
        params=config.num_params(), logits_rel_diff=agreement,
        step_flops=flops, facts_approx_step_flops=facts_approx_step_flops(config, batch),
        wall_s=wall, cpu_s=cpu, median_s=med,
        ratio_step=ratios["step"], ratio_opt=ratios["opt"], ratio_step_cpu_time=cpu_ratio,
        minivit_gflops=flops / med["minivit_step"] / 1e9, torch_gflops=flops / med["torch_step"] / 1e9,
    )
    result["minivit_mfu"] = result["minivit_gflops"] / rates[f"{mm}_square_gflops"]
    result["torch_mfu"] = result["torch_gflops"] / rates["torch_square_gflops"]
    if with_memory:
        result["memory"] = memory(pair)
    if with_profile:
        result["profile"] = profile_layers.profile(pair.model, pair.x, pair.y, profile_repeats)
    del pair
    gc.collect()
    return result


def sweep_configs(base):
    """Patch size (sequence length) at the base depth, and depth at the base patch size."""
    out = []
    for P in (8, 4, 2):
        out.append((f"P{P} depth {base.depth}", dataclasses.replace(base, patch_size=P)))
    for depth in (3, 12):
        out.append((f"P{base.patch_size} depth {depth}", dataclasses.replace(base, depth=depth)))
    return out


def fmt_mb(b):
    return "-" if b is None else f"{b / 2 ** 20:.0f}"


def table(results):
    lines = ["| model | device | batch | tokens | minivit step ms | PyTorch step ms | ratio | ratio (CPU time) "
             "| minivit AdamW ms | PyTorch AdamW ms | ratio | MFU minivit | MFU PyTorch |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        m = r["median_s"]
        lines.append(f"| {r['name']} | {r['device']} | {r['batch']} | {r['tokens']} | {1e3 * m['minivit_step']:.0f} "
                     f"| {1e3 * m['torch_step']:.0f} | **{r['ratio_step']:.2f}** | {r['ratio_step_cpu_time']:.2f} "
                     f"| {1e3 * m['minivit_opt']:.1f} | {1e3 * m['torch_opt']:.1f} | {r['ratio_opt']:.2f} "
                     f"| {100 * r['minivit_mfu']:.0f}% | {100 * r['torch_mfu']:.0f}% |")
    return "\n".join(lines)


def memory_table(results):
    rows = [r for r in results if "memory" in r]
    if not rows:
        return ""
    lines = ["| model | device | batch | activations minivit MB | activations PyTorch MB | peak minivit MB "
             "| peak PyTorch MB | NumPy peak (tracemalloc) MB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mem = r["memory"]
        if r["device"] == "cpu":
            pm, pt = mem.get("minivit_peak_rss_rise_bytes"), mem.get("torch_peak_rss_rise_bytes")
        else:
            pm, pt = mem.get("cupy_pool_peak_bytes"), mem.get("torch_max_allocated_bytes")
        lines.append(f"| {r['name']} | {r['device']} | {r['batch']} | {fmt_mb(mem['minivit_activation_bytes'])} "
                     f"| {fmt_mb(mem['torch_activation_bytes'])} | {fmt_mb(pm)} | {fmt_mb(pt)} "
                     f"| {fmt_mb(mem.get('minivit_tracemalloc_peak_bytes'))} |")
    return "\n".join(lines)


def used_precision(torch, devices, precision):
    """One line per device saying which arithmetic each side's matrix products use in this run."""
    lines = []
    if "cpu" in devices:
        lines.append("precision [cpu]: minivit float32 (NumPy/BLAS), PyTorch float32")
    if "gpu" in devices:
        tf32 = kernels.tf32_enabled()
        fp32 = "TF32 (CUPY_TF32=1)" if tf32 else "FP32"
        linear = "float16 (float32 sums) with loss scaling" if precision == "float16" else fp32
        torch_mm = ("float16 under autocast, GradScaler" if precision == "float16" else
                    "TF32" if torch.backends.cuda.matmul.allow_tf32 else "FP32")
        lines.append(f"precision [gpu]: minivit Linear products {linear}, attention products {fp32} "
                     f"(cuBLAS, kernels._gpu_matmul); PyTorch matmuls {torch_mm}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description="minivit vs PyTorch eager: speed, memory, MFU, per-layer profile")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu", "both"],
                    help="auto: the CPU, and the GPU too when CuPy and CUDA torch can use one")
    ap.add_argument("--preset", default="vit_cifar_tiny", help="the main model (a name in minivit.presets)")
    ap.add_argument("--batch", type=int, default=None, help="main model's batch (default 64 on CPU, 128 on GPU)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each: both libraries, alternated)")
    ap.add_argument("--threads", type=int, default=None, help="BLAS and torch threads (default: NumPy's BLAS's)")
    ap.add_argument("--full", action="store_true", help="also ViT-S/16 (batch 8) and ViT-B/16 (batch 4) at 224")
    ap.add_argument("--no-sweep", action="store_true", help="skip the patch-size / depth sweep")
    ap.add_argument("--sweep-batch", type=int, default=16)
    ap.add_argument("--no-profile", action="store_true", help="skip the per-layer profile")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--block", type=int, default=3,
                    help="calls of one library in a row per round; the first is not timed (default 3)")
    ap.add_argument("--precision", default="float32", choices=["float32", "float16"],
                    help="float16: mixed precision on both sides (minivit: set_matmul_dtype + LossScaler; "
                         "PyTorch: autocast + GradScaler); GPU only")
    ap.add_argument("--out", default=None, help="folder for the JSON (default benchmarks/results, or $OUT)")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        set_blas_threads(args.threads)
        os.environ["MINIVIT_NUM_THREADS"] = str(args.threads)  # minivit's Numba kernels, the same count
    torch.set_num_threads(args.threads or blas_threads())
    gpu_ok = backend.gpu_available() and torch.cuda.is_available()
    if args.device == "gpu" and not gpu_ok:
        sys.exit("--device gpu: no usable GPU here (needs CuPy with a GPU and a CUDA build of torch)")
    if args.precision == "float16" and args.device != "gpu":
        sys.exit("--precision float16 needs --device gpu: NumPy's float16 products have no BLAS (hundreds of "
                 "times slower than float32), so a CPU comparison would measure nothing useful")
    devices = {"cpu": ["cpu"], "gpu": ["gpu"], "both": ["cpu", "gpu"],
               "auto": ["cpu"] + (["gpu"] if gpu_ok else [])}[args.device]
    if args.device == "both" and not gpu_ok:
        devices = ["cpu"]
        print("no usable GPU: the CPU only")
    if gpu_ok:
        tf32 = os.environ.get("CUPY_TF32", "0") == "1"           # torch uses TF32 exactly when CuPy does
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32                     # the patch embedding is a convolution

    precision_used = used_precision(torch, devices, args.precision)
    for line in precision_used:
        print(line)

    info = machine_info(torch)
    blas = ", ".join(f"{d.get('api')} {d.get('version') or ''} ({d.get('corename')}, {d.get('num_threads')} threads)"
                     for d in info["blas"]) or "unknown"
    print(f"{info['cpu']}, {info['cores']} cores; numpy {info['numpy']} BLAS: {blas}; torch {info['torch']} "
          f"with {info['torch_threads']} threads; load {info['load_average']}")
    if "OPENBLAS_CORETYPE" in info["env"]:
        print(f"note: OPENBLAS_CORETYPE={info['env']['OPENBLAS_CORETYPE']} is set (it can slow NumPy's matmuls)")
    results, rates, profiles = [], {}, {}
    t_start = time.time()
    for device in devices:
        rates[device] = matmul_rates(torch, device)
        print(f"[{device}] measured float32 matmul GFLOP/s: " +
              ", ".join(f"{k.replace('_gflops', '')} {v:.0f}" for k, v in rates[device].items()), flush=True)
        batch = args.batch or (64 if device == "cpu" else 128)
        base = minivit.presets[args.preset]
        runs = [(args.preset, base, batch, True)]
        if not args.no_sweep:
            sweep_batch = args.sweep_batch if device == "cpu" else max(args.sweep_batch, 64)
            runs += [(f"{args.preset} {n}", c, sweep_batch, False) for n, c in sweep_configs(base)]
        if args.full:
            runs += [("vit_small_patch16_224", minivit.presets["vit_small_patch16_224"], 8, True),
                     ("vit_base_patch16_224", minivit.presets["vit_base_patch16_224"], 4, True)]
        for i, (name, config, b, mem) in enumerate(runs):
            r = run_config(torch, name, config, b, device, args.warmup, args.repeats if i == 0 or mem else
                           max(3, args.repeats - 2), rates[device], with_memory=mem and not args.no_memory,
                           with_profile=(i == 0 and not args.no_profile),
                           block=args.block, precision=args.precision)
            results.append(r)
            if "profile" in r:
                profiles[f"{name} {device} batch {b}"] = r["profile"]
            print(f"[{device}] {name} batch {b}: minivit {1e3 * r['median_s']['minivit_step']:.0f} ms, "
                  f"PyTorch {1e3 * r['median_s']['torch_step']:.0f} ms, ratio {r['ratio_step']:.2f} "
                  f"(CPU time {r['ratio_step_cpu_time']:.2f}); AdamW ratio {r['ratio_opt']:.2f}; "
                  f"logits agree to {r['logits_rel_diff']:.1e}", flush=True)
        minivit.set_backend("numpy")

    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"{'-'.join(devices)}-{stamp}.json"
    record = dict(machine=info, matmul_gflops=rates, args=vars(args), results=results, precision_used=precision_used,
                  seconds=time.time() - t_start, created=stamp)
    path.write_text(json.dumps(record, indent=1, default=str))

    print(f"\nSpeed: median over {args.repeats} alternated rounds (after {args.warmup} warm-up) of "
          f"minivit / PyTorch in the same round; {args.precision}"
          f"{' (mixed: float16 matmuls, loss scaling)' if args.precision == 'float16' else ''}. {info['cpu']}, "
          f"{info['torch_threads']} threads for both.\n")
    print(table(results))
    mt = memory_table(results)
    if mt:
        print("\nMemory of one training step (activations: what the forward keeps for the backward):\n")
        print(mt)
    for title, prof in profiles.items():
        print(f"\nPer-layer profile, minivit, {title} (median of 3 steps, each call timed):\n")
        print(profile_layers.markdown(prof))
        print("\nHot spots (self time): " + "; ".join(f"{p} {ms:.0f} ms ({pct:.0f}%)"
                                                     for p, ms, pct in profile_layers.hot_spots(prof)))
    print(f"\nwritten: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
          f"({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
