"""Data parallelism (minivit/distributed/) with real ranks: `mpiexec -n 2` subprocesses on the CPU.

The ranks run this file's worker (the bottom of the file: `python tests/test_distributed.py SCENARIO OUT`);
the 1-process reference runs here, in the test, through the same loop with comm=None. Each rank gets one
BLAS thread and one kernel thread (OPENBLAS_NUM_THREADS=1 MINIVIT_NUM_THREADS=1).

Equality is measured as the largest relative difference over the whole flattened state,
||a - b||_inf / ||b||_inf, for the parameters and for each kind of optimizer buffer. (Not array by array:
the gradient of the attention's key bias is zero up to rounding, softmax ignores a shift of its logits,
so that array holds rounding noise in both runs and its own relative difference measures nothing.)
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)   # the worker, started as a script, imports this checkout's minivit

import minivit  # noqa: E402
from minivit import distributed as dist  # noqa: E402
from minivit.clip import presets  # noqa: E402
from minivit.clip.loss import contrastive_loss_rows  # noqa: E402
from minivit.functional import cross_entropy  # noqa: E402
from minivit.layers import Block  # noqa: E402
from minivit.model import ViT, ViTConfig  # noqa: E402
from minivit.optim import SGD, AdamW, clip_grad_norm, default_no_decay  # noqa: E402

MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
# found, not imported: the 1-process trainer must not import it (checked below)
HAVE_MPI = MPIEXEC is not None and importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(not HAVE_MPI, reason=f"needs mpi4py and mpiexec: {dist.INSTALL}")

B = 8   # the global batch: 4 images per rank on 2 ranks
CONFIG = ViTConfig(img_size=8, patch_size=4, in_chans=3, num_classes=3, embed_dim=16, depth=2, num_heads=2,
                   mlp_ratio=2.0)
LOOPS = {   # name: (optimizer, grad_accum, clip, zero, change the architecture after step 1)
    "adamw": ("adamw", 1, None, False, False),
    "adamw_accum_clip": ("adamw", 2, 0.05, False, False),
    "sgd_accum_clip": ("sgd", 2, 0.05, False, False),
    "zero_adamw_accum_clip": ("adamw", 2, 0.05, True, False),
    "zero_sgd": ("sgd", 1, None, True, False),
    "adamw_changed": ("adamw", 1, None, False, True),
    "zero_adamw_changed": ("adamw", 2, 0.05, True, True),
}


def change_architecture(model):
    """What a student does between two steps: replace a block by a wider one and add a third block. The
    model's parameters change names and shapes; data parallel must follow with no call."""
    wide = Block(CONFIG.embed_dim, CONFIG.num_heads, mlp_ratio=3.0, dtype="float64", seed=11)
    model.blocks[1] = wide
    model.blocks.append(Block(CONFIG.embed_dim, CONFIG.num_heads, mlp_ratio=2.0, dtype="float64", seed=12))


def env(**extra):
    e = dict(os.environ, OPENBLAS_NUM_THREADS="1", MINIVIT_NUM_THREADS="1", PYTHONPATH=ROOT)
    for name in dist.LAUNCHER_VARIABLES:   # a test run under mpiexec must not pass its own rank on
        e.pop(name, None)
    e.update(extra)
    return e


def mpiexec(n, args, timeout=120, **extra):
    """Run `mpiexec -n n python args...` from the repository root; returns the CompletedProcess."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable] + list(args)
    return subprocess.run(cmd, cwd=ROOT, env=env(**extra), capture_output=True, text=True, timeout=timeout)


def max_rel(a, b):
    """||a - b||_inf / ||b||_inf over dicts of arrays (the same keys), flattened together."""
    assert sorted(a) == sorted(b)
    da = max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max()) for k in a)
    return da / max(float(np.abs(np.asarray(b[k], np.float64)).max()) for k in b)


# --------------------------------------------------------------------------------------------------
# The hand-written loop both sides run: minivit's model and optimizer, no trainer
# --------------------------------------------------------------------------------------------------


def global_batch(step):
    """Batch `step` of the global run: a function of step alone, the same on every rank."""
    rng = np.random.default_rng([7, step])
    x = rng.standard_normal((B, 8, 8, 3))             # (B, H, W, C)
    y = rng.integers(0, 3, size=B)                     # (B,)
    return x, y


def hand_loop(comm, optimizer_name, grad_accum, clip, zero, change=False, steps=3):
    """`steps` optimizer steps in float64. comm=None: one process on the whole batch, as the trainer does;
    otherwise this rank's slice and a DataParallel. Returns (params, optimizer state, grad norms)."""
    model = ViT(CONFIG, seed=0, dtype="float64")
    no_decay = default_no_decay(model.params)
    if optimizer_name == "adamw":
        optimizer = AdamW(model, lr=1e-2, weight_decay=0.05, no_decay=no_decay)
    else:
        optimizer = SGD(model, lr=0.1, momentum=0.9, weight_decay=0.05, no_decay=no_decay)
    dp = None if comm is None else dist.DataParallel(comm, model, optimizer, zero=zero)
    norms = []
    for step in range(steps):
        if change and step == 2:
            change_architecture(model)
        optimizer.lr = optimizer.lr * 0.9             # a schedule: the ZeRO shard must follow it
        x, y = global_batch(step)
        if comm is not None:
            rows = dist.local_slice(B, comm.rank, comm.world_size)
            x, y = x[rows], y[rows]                   # (b, H, W, C), (b,)
        x, y = minivit.asarray(x), minivit.asarray(y)   # onto the model's backend
        model.zero_grad()
        micro = x.shape[0] // grad_accum
        for j in range(grad_accum):
            logits = model.forward(x[j * micro:(j + 1) * micro])
            _, dlogits = cross_entropy(logits, y[j * micro:(j + 1) * micro])
            model.backward(dlogits / grad_accum)
        if dp is None:
            norms.append(clip_grad_norm(model, clip) if clip else None)
            optimizer.step()
        else:
            dp.average_gradients()
            norms.append(dp.clip_grad_norm(clip) if clip else None)
            dp.step()
    if dp is not None:
        dp.gather_optimizer_state()
    params = {k: minivit.to_numpy(v).copy() for k, v in model.params.items()}
    return params, optimizer.state_dict(), norms


def flat_state(state):
    """An optimizer.state_dict()'s buffers as one dict "kind/name" -> array."""
    return {f"{kind}/{name}": v for kind, bufs in state["buffers"].items() for name, v in bufs.items()}


# --------------------------------------------------------------------------------------------------
# The worker: what each rank runs
# --------------------------------------------------------------------------------------------------


def worker_loops(comm, out):
    """Every loop of LOOPS; rank 0 saves the results, rank 1 its parameters (to show they are the same)."""
    for name, (opt, accum, clip, zero, change) in LOOPS.items():
        params, state, norms = hand_loop(comm, opt, accum, clip, zero, change)
        if comm.rank <= 1:
            arrays = {f"param/{k}": v for k, v in params.items()}
            arrays.update({f"state/{k}": v for k, v in flat_state(state).items()})
            np.savez(os.path.join(out, f"{name}.rank{comm.rank}.npz"), t=state["step"],
                     norms=np.array([np.nan if v is None else v for v in norms]), **arrays)


def worker_collectives(comm, out):
    """The small pieces: evaluation shards and their mean, the global overflow test, the feature gather."""
    r, R = comm.rank, comm.world_size
    results = {}
    # evaluation: 7 items over the ranks; each rank's mean of its items, then the mean over all
    values = np.arange(7.0) ** 2
    start, stop = dist.shard_range(7, r, R)
    mine = values[start:stop]
    results["eval_mean"] = dist.mean_over_ranks(comm, [float(mine.mean()), float((mine > 10).mean())],
                                                stop - start)
    # CLIP's evaluation: the ranks' uneven shards of test features (4 and 3 rows) gathered whole, in order
    whole = np.arange(14.0).reshape(7, 2)                                          # (7, E)
    results["shards_gathered"] = dist.all_gather_shards(comm, whole[start:stop].copy(), 7)
    # the loss scaler's overflow test: rank 1 alone overflows at its backward; both must skip the step
    from minivit.amp import LossScaler

    for zero in (False, True):
        model = ViT(CONFIG, seed=0, dtype="float64")
        dp = dist.DataParallel(comm, model, AdamW(model, lr=1e-3), zero=zero)
        x, y = global_batch(0)
        rows = dist.local_slice(B, r, R)
        scaler = LossScaler(init_scale=2.0 ** 10)
        model.zero_grad()
        _, dlogits = cross_entropy(model.forward(x[rows]), y[rows])
        if r == 1:
            dlogits[0, 0] = np.inf                    # float16 would have overflowed here
        with np.errstate(invalid="ignore", over="ignore"):
            model.backward(scaler.scale(dlogits))
            dp.average_gradients()
            results[f"finite_zero{int(zero)}"] = dp.unscale(scaler)
    # the contrastive loss over the global batch: features gathered, their gradients reduce-scattered
    rng = np.random.default_rng(3)
    img_all, txt_all = rng.standard_normal((B, 5)), rng.standard_normal((B, 5))   # (B, E): every rank's
    img, txt = img_all[rows].copy(), txt_all[rows].copy()                          # (b, E): this rank's
    img_g, txt_g = dist.all_gather_rows(comm, img), dist.all_gather_rows(comm, txt)  # (B, E)
    results["gathered_equal"] = bool((img_g == img_all).all() and (txt_g == txt_all).all())
    s = 2.0
    loss, dli, dlt = contrastive_loss_rows(s * img @ txt_g.T, s * txt @ img_g.T, r)   # (b, B) each
    dimg = s * dli @ txt_g                                     # (b, E)  through this rank's own rows
    dtxt = s * dlt @ img_g
    dimg_g = dist.all_gather_rows_backward(comm, s * dlt.T @ txt)   # (b, E)  through the gathered rows
    dtxt_g = dist.all_gather_rows_backward(comm, s * dli.T @ img)
    results["clip_loss"] = dist.mean_over_ranks(comm, [loss], 1)[0]
    grad = np.zeros((2 * B, 5))                                # d(mean loss)/d(all features), rank rows
    grad[:B][rows] = (dimg + dimg_g) / R                       # / R: DataParallel's mean over the ranks
    grad[B:][rows] = (dtxt + dtxt_g) / R
    grad_sum = np.empty_like(grad)
    comm.comm.Allreduce(grad, grad_sum)
    if r == 0:
        np.save(os.path.join(out, "clip_grad.npy"), grad_sum)
        np.save(os.path.join(out, "collectives.npy"), np.array(results, dtype=object), allow_pickle=True)


def worker_faults(comm, scenario):
    """A rank that fails in one of three ways while rank 0 waits in the gradient all-reduce."""
    import signal

    if comm.rank == 1:
        time.sleep(0.5)
        if scenario == "killed":
            os.kill(os.getpid(), signal.SIGKILL)          # dies: no message, no MPI call
        elif scenario == "hangs":
            os.kill(os.getpid(), signal.SIGSTOP)          # alive but never answers
        elif scenario == "raises":
            try:
                raise RuntimeError("rank 1 broke")
            except RuntimeError as err:
                print(f"error: {err}", file=sys.stderr, flush=True)
                comm.abort(3)
        elif scenario == "uncaught":                      # what a bug in a student's layer does on one rank
            raise RuntimeError("rank 1 broke, uncaught")
    comm.allreduce(np.ones(4))
    print(f"rank {comm.rank} went past the all-reduce", flush=True)


# --------------------------------------------------------------------------------------------------
# The trainer under mpiexec: minivit.train.train on every rank, against train in one process
# --------------------------------------------------------------------------------------------------

# float64, no augmentation or dropout, a constant learning rate (min_lr = lr: a run stopped after 2 steps
# and resumed to 4 follows the schedule of a 4-step run), an evaluation and a checkpoint every 2 steps
TRAIN = dict(dataset="shapes", model="vit_cifar_tiny", embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0,
             patch_size=4, dtype="float64", batch_size=8, max_steps=4, eval_every=2, lr=3e-3, min_lr=3e-3,
             warmup_steps=0, augment="none", optimizer="adamw", weight_decay=0.05, progress=False, verbose=False)
RUNS = {   # name: the changes to TRAIN; each runs on 2 ranks, and (but "half") in one process
    "adamw": {},
    "sgd_accum_clip": dict(optimizer="sgd", grad_accum=2, clip_grad=0.05),
    "adamw_accum_clip_zero": dict(grad_accum=2, clip_grad=0.05, zero=True),
    "half": dict(max_steps=2),                      # 2 ranks, resumed below by one process to step 4 (= "adamw")
    "resumed": dict(resume=True),                   # one process's 2 steps, resumed here by 2 ranks to step 4
    "dropout_augment": dict(drop_rate=0.1, augment="standard"),
    "amp": dict(precision="float16", dtype="float32"),   # float16 products: the loss scaler's global decision
}


def tiny_shapes():
    """64 training and 9 test images of 8 x 8 (9: the ranks' evaluation shards are 5 and 4 images)."""
    from minivit.data import Dataset, make_shapes

    (x, y), (xt, yt) = make_shapes(num_train=64, num_test=9, seed=0, img_size=8)
    mean = tuple(float(v) for v in x.reshape(-1, 3).mean(0) / 255)
    std = tuple(float(v) for v in x.reshape(-1, 3).std(0) / 255)
    return Dataset("shapes", x, y, xt, yt, [str(k) for k in range(10)], mean, std)


def train_run(name, out, **changes):
    """minivit.train.train of RUNS[name] (and changes) into out/runs/NAME, in this process."""
    from minivit.train import TrainConfig, train

    cfg = TrainConfig(**{**TRAIN, **RUNS[name], "out": os.path.join(out, "runs", name), **changes})
    on_numpy = (cfg.backend or minivit.backend.get_backend()) == "numpy"
    if cfg.precision == "float16" and on_numpy:   # the trainer says that float16 is slow on NumPy: this run means it
        with pytest.warns(RuntimeWarning, match="float16 matrix products on NumPy"):
            return train(cfg, data=tiny_shapes())
    return train(cfg, data=tiny_shapes())


def watch_writes(root):
    """Record every file this process opens for writing, renames or removes under root (an audit hook)."""
    writes = []
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def hook(event, args):
        if event == "open" and isinstance(args[0], str) and args[0].startswith(root):
            mode, flags = args[1], args[2]
            if (mode and any(c in mode for c in "wax+")) or (mode is None and flags & write_flags):
                writes.append(args[0])
        elif event in ("os.rename", "os.remove") and str(args[0]).startswith(root):
            writes.append(str(args[0]))

    sys.addaudithook(hook)
    return writes


def worker_trainer(comm, out):
    """Every run of RUNS through the trainer; each rank saves its final parameters and summary, rank 1
    the files it wrote under runs/ (it should write none); and a global batch that does not divide."""
    from minivit.train import TrainConfig, train

    writes = watch_writes(os.path.join(out, "runs"))
    results = os.path.join(out, "results")
    for name in RUNS:
        result = train_run(name, out)
        params = {k: minivit.to_numpy(v) for k, v in result.model.params.items()}
        np.savez(os.path.join(results, f"{name}.rank{comm.rank}.npz"), **params)
    try:
        train(TrainConfig(**dict(TRAIN, batch_size=9, out=None)), data=tiny_shapes())
        refused = "not refused"
    except ValueError as err:
        refused = str(err)
    with open(os.path.join(results, f"rank{comm.rank}.json"), "w") as f:
        json.dump({"writes": writes, "refused": refused}, f)


# CLIP through the trainer (--task clip): the same, the contrastive loss over the whole global batch
CLIP_TRAIN = dict(task="clip", dataset="shapes", model="clip_shapes_tiny", dtype="float64", batch_size=8, max_steps=4,
                  eval_every=2, lr=2e-3, min_lr=2e-3, warmup_steps=0, optimizer="adamw", weight_decay=0.1,
                  progress=False, verbose=False)
CLIP_RUNS = {   # name: the changes to CLIP_TRAIN; each runs on 2 ranks, and (but "half") in one process
    "adamw": {},
    # SGD, unlike AdamW or a clip that binds, moves in proportion to the gradient: a wrong factor on it shows
    "sgd": dict(optimizer="sgd", lr=0.005, min_lr=0.005),
    "sgd_clip": dict(optimizer="sgd", lr=0.05, min_lr=0.05, clip_grad=0.2),   # binds: norms 67 to 22
    "adamw_clip_zero": dict(clip_grad=0.2, zero=True),                        # binds: norms 67 to 0.41
    "half": dict(max_steps=2),                      # 2 ranks, resumed below by one process to step 4 (= "adamw")
    "resumed": dict(resume=True),                   # one process's 2 steps, resumed here by 2 ranks to step 4
}


def tiny_captioned():
    """64 captioned training pairs and 9 test pairs of 16 x 16 (the ranks' evaluation shards: 5 and 4)."""
    from minivit.captions import make_captioned_shapes

    return make_captioned_shapes(num_train=64, num_test=9, seed=0, img_size=16)


def clip_run(name, out, **changes):
    """minivit.train.train of CLIP_RUNS[name] (and changes) into out/clip/NAME, in this process."""
    from minivit.train import TrainConfig, train

    cfg = TrainConfig(**{**CLIP_TRAIN, **CLIP_RUNS[name], "out": os.path.join(out, "clip", name), **changes})
    return train(cfg, data=tiny_captioned())


def worker_clip_trainer(comm, out):
    """Every run of CLIP_RUNS through the trainer; each rank saves its final parameters, and the files it
    wrote under clip/ (rank 1 should write none)."""
    writes = watch_writes(os.path.join(out, "clip"))
    for name in CLIP_RUNS:
        result = clip_run(name, out)
        params = {k: minivit.to_numpy(v) for k, v in result.model.params.items()}
        np.savez(os.path.join(out, "results", f"clip_{name}.rank{comm.rank}.npz"), **params)
    with open(os.path.join(out, "results", f"clip_rank{comm.rank}.json"), "w") as f:
        json.dump({"writes": writes}, f)


def worker_trainer_killed(comm, out):
    """Rank 1 is killed (SIGKILL) at the first evaluation; rank 0 would wait for it in the next step."""
    import signal

    def callback(record):
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    from minivit.train import TrainConfig, train

    cfg = TrainConfig(**dict(TRAIN, max_steps=40, out=os.path.join(out, "runs", "killed")))
    train(cfg, callback=callback, data=tiny_shapes())


# --------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------


def test_without_a_launcher_there_is_no_communicator(monkeypatch):
    for name in dist.LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not dist.launched_by_mpi()
    assert dist.init() is None
    assert dist.launched_by_mpi({"PMI_RANK": "0"}) and dist.launched_by_mpi({"OMPI_COMM_WORLD_RANK": "1"})


def test_slices_and_shards_cover_everything_once():
    assert [dist.local_slice(12, r, 3) for r in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    bounds = [dist.shard_range(10, r, 4) for r in range(4)]
    assert bounds == [(0, 3), (3, 6), (6, 8), (8, 10)]
    with pytest.raises(ValueError, match="global batch size 10 must divide by the number of ranks 4"):
        dist.check_global_batch(10, 4)
    with pytest.raises(ValueError, match="grad_accum 4 must divide each rank's 6 images"):
        dist.check_global_batch(12, 2, grad_accum=4)


def test_flat_buffer_packs_and_unpacks_in_place():
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((2, 3)), "b": rng.standard_normal(5)}
    buf = dist.FlatBuffer(arrays, pad=4)
    assert buf.flat.shape == (12,) and buf.offsets == [0, 6]
    flat = buf.pack(arrays)
    np.testing.assert_array_equal(flat[:6], arrays["a"].ravel())
    assert (flat[11:] == 0).all()
    held = arrays["a"]
    buf.unpack(arrays, flat * 2)
    assert arrays["a"] is held                               # the layers keep their arrays
    np.testing.assert_array_equal(held.ravel(), flat[:6] * 2)


@pytest.fixture(scope="module")
def loops_run(tmp_path_factory):
    """One mpiexec -n 2 run of every loop in LOOPS (a few seconds)."""
    if not HAVE_MPI:
        pytest.skip(f"needs mpi4py and mpiexec: {dist.INSTALL}")
    out = tmp_path_factory.mktemp("loops")
    run = mpiexec(2, ["tests/test_distributed.py", "loops", str(out)])
    assert run.returncode == 0, run.stdout + run.stderr
    return out


@needs_mpi
@pytest.mark.parametrize("name", list(LOOPS))
def test_two_ranks_equal_one_process(loops_run, name):
    """Parameters and optimizer state after 3 steps of 2 ranks x 4 images = 1 process x 8, in float64."""
    opt, accum, clip, zero, change = LOOPS[name]
    params, state, norms = hand_loop(None, opt, accum, clip, zero, change)
    if change:                             # the new and widened block are trained and in the state
        assert "blocks.2.mlp.fc1.weight" in params and params["blocks.1.mlp.fc1.weight"].shape == (16, 48)
    got = dict(np.load(loops_run / f"{name}.rank0.npz"))
    assert int(got["t"]) == state["step"] == 3
    got_params = {k[len("param/"):]: v for k, v in got.items() if k.startswith("param/")}
    assert max_rel(got_params, params) < 1e-10
    ref_state = flat_state(state)
    for kind in state["buffers"]:
        theirs = {k: v for k, v in got.items() if k.startswith(f"state/{kind}/")}
        mine = {f"state/{k}": v for k, v in ref_state.items() if k.startswith(f"{kind}/")}
        assert len(theirs) == len(params) and max_rel(theirs, mine) < 1e-10, kind
    if clip:                               # the clip did bind, with the norm of the whole batch's gradient
        assert all(n > clip for n in norms)
        np.testing.assert_allclose(got["norms"], norms, rtol=1e-10)
    other = dict(np.load(loops_run / f"{name}.rank1.npz"))
    for k in got_params:                   # and rank 1 holds exactly rank 0's parameters
        np.testing.assert_array_equal(other[f"param/{k}"], got_params[k])


@needs_mpi
def test_two_ranks_differ_from_one_process_when_the_gradients_are_not_averaged(loops_run, monkeypatch):
    """The check above can fail: without the exchange each rank follows its own slice's gradient."""
    params, _, _ = hand_loop(None, "adamw", 1, None, False)
    got = dict(np.load(loops_run / "adamw.rank0.npz"))
    got_params = {k[len("param/"):]: v for k, v in got.items() if k.startswith("param/")}

    class NoExchange:                      # a communicator that sums nothing: rank 0 alone
        rank, world_size = 0, 2

        def allreduce(self, buf, what=None):
            buf *= 2                       # as if the other rank had the same gradient
            return buf

    alone, _, _ = hand_loop(NoExchange(), "adamw", 1, None, False)
    assert max_rel(got_params, params) < 1e-10 < max_rel(alone, params)


@needs_mpi
def test_evaluation_overflow_and_contrastive_features(tmp_path):
    run = mpiexec(2, ["tests/test_distributed.py", "collectives", str(tmp_path)])
    assert run.returncode == 0, run.stdout + run.stderr
    results = np.load(tmp_path / "collectives.npy", allow_pickle=True).item()
    values = np.arange(7.0) ** 2
    np.testing.assert_allclose(results["eval_mean"], [values.mean(), (values > 10).mean()], rtol=1e-14)
    np.testing.assert_array_equal(results["shards_gathered"], np.arange(14.0).reshape(7, 2))
    # rank 1's overflow alone makes both ranks skip, with and without ZeRO
    assert not results["finite_zero0"] and not results["finite_zero1"]
    assert results["gathered_equal"]
    # the contrastive loss of the global batch, and its gradient for every feature, as one process has it
    rng = np.random.default_rng(3)
    img, txt = rng.standard_normal((B, 5)), rng.standard_normal((B, 5))
    s = 2.0
    logits = s * img @ txt.T                                              # (B, B)
    loss_i, dl_i = cross_entropy(logits, np.arange(B))
    loss_t, dl_t = cross_entropy(logits.T, np.arange(B))
    dlogits = (dl_i + dl_t.T) / 2
    grad = np.concatenate([s * dlogits @ txt, s * dlogits.T @ img])       # d loss / d (img, txt)
    assert abs(results["clip_loss"] - (loss_i + loss_t) / 2) < 1e-12
    np.testing.assert_allclose(np.load(tmp_path / "clip_grad.npy"), grad, rtol=1e-12, atol=1e-15)


def test_abort_waits_until_the_launcher_has_read_the_error(tmp_path):
    """Before MPI_Abort a rank waits until its output pipe is empty (the launcher may act on the abort
    before forwarding the error, which the user would then never see), and no longer than the limit."""
    import threading

    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"error: rank 1 broke\n")
    reader = threading.Timer(0.3, os.read, (read_fd, 100))   # the launcher, reading a little later
    start = time.monotonic()
    reader.start()
    dist.wait_until_output_is_read([write_fd], limit=10.0)
    waited = time.monotonic() - start
    reader.join()
    assert 0.25 < waited < 5.0                                 # returned once read, not at the limit

    os.write(write_fd, b"nobody reads this\n")                # a launcher that never reads: the limit
    start = time.monotonic()
    dist.wait_until_output_is_read([write_fd], limit=0.2)
    assert 0.15 < time.monotonic() - start < 5.0
    os.close(read_fd)
    os.close(write_fd)

    with open(tmp_path / "log", "w") as log:                   # not a pipe (a file, a terminal): no wait
        log.write("x" * 100)
        log.flush()
        start = time.monotonic()
        dist.wait_until_output_is_read([log.fileno()], limit=10.0)
        assert time.monotonic() - start < 1.0


@needs_mpi
@pytest.mark.parametrize("scenario, status", [("killed", None), ("hangs", dist.EXIT_TIMEOUT), ("raises", 3),
                                              ("uncaught", 1)])
def test_a_failed_rank_ends_the_others(tmp_path, scenario, status):
    """Rank 1 dies, hangs, raises or leaves an exception uncaught while rank 0 waits in an all-reduce: the job
    ends within seconds, and what rank 1 said reaches the user."""
    start = time.monotonic()
    run = mpiexec(2, ["tests/test_distributed.py", scenario, str(tmp_path)], timeout=60, MINIVIT_DIST_TIMEOUT="3")
    # a hang would run into the 60 s timeout above; 55 s leaves room for two ranks starting on a loaded machine
    assert run.returncode != 0 and time.monotonic() - start < 55
    assert "went past the all-reduce" not in run.stdout
    if status is not None:
        assert run.returncode == status, run.stdout + run.stderr
    if scenario == "hangs":
        assert "rank 0 waited more than 3 s for the other ranks in the gradient all-reduce" in run.stderr
    if scenario == "raises":
        assert "error: rank 1 broke" in run.stderr, (run.returncode, run.stdout, run.stderr)
    if scenario == "uncaught":                          # the traceback, printed before every rank is ended
        assert "Traceback" in run.stderr and "RuntimeError: rank 1 broke, uncaught" in run.stderr, run.stderr


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """One mpiexec -n 2 job running every run of RUNS through minivit.train.train (worker_trainer), and
    the same runs in this process; before it, this process's first 2 steps of "resumed", which the job
    continues, and after it, this process continues the job's "half" to step 4."""
    if not HAVE_MPI:
        pytest.skip(f"needs mpi4py and mpiexec: {dist.INSTALL}")
    out, ref = tmp_path_factory.mktemp("ranks"), str(tmp_path_factory.mktemp("one"))
    os.makedirs(out / "results")
    train_run("resumed", str(out), resume=False, max_steps=2)
    run = mpiexec(2, ["tests/test_distributed.py", "trainer", str(out)], timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    had_mpi4py = "mpi4py" in sys.modules
    one = {name: train_run(name, ref) for name in ("adamw", "sgd_accum_clip", "adamw_accum_clip_zero", "amp")}
    half = train_run("half", str(out), resume=True, max_steps=4)      # 2 ranks' 2 steps, then 1 process's 2
    assert had_mpi4py or "mpi4py" not in sys.modules, "one process imported mpi4py"
    return out, ref, one, half


def params_of(result):
    return {k: minivit.to_numpy(v) for k, v in result.model.params.items()}


def optimizer_state(folder):
    """The optimizer's step count and buffers ("kind/name" -> array) in folder's checkpoint.npz."""
    from minivit.weights.checkpoint import load_checkpoint

    state = load_checkpoint(os.path.join(folder, "checkpoint.npz"))["optimizer"]
    return state["step"], flat_state(state)


def assert_two_ranks_equal_one(out, ref, folder, name, prefix, one, recorded):
    """The 2-rank run `name` (its results under out/results/<prefix><name>.rank{0,1}.npz, its run folder
    out/<folder>/<name>) against the 1-process run `one` (a TrainResult, its folder ref/<folder>/<name>):
    parameters, optimizer state and every recorded figure equal to 1e-10 in float64, rank 1's parameters
    exactly rank 0's. Returns (rank 0's parameters, the 1-process run's)."""
    got = dict(np.load(out / "results" / f"{prefix}{name}.rank0.npz"))
    reference = params_of(one)
    assert max_rel(got, reference) < 1e-10
    other = dict(np.load(out / "results" / f"{prefix}{name}.rank1.npz"))
    for k in got:                                   # rank 1 holds exactly rank 0's parameters
        np.testing.assert_array_equal(other[k], got[k])
    step, state = optimizer_state(out / folder / name)
    ref_step, ref_state = optimizer_state(os.path.join(ref, folder, name))
    assert step == ref_step == 4 and len(state) == len(ref_state) > 0
    assert max_rel(state, ref_state) < 1e-10
    lines = [json.loads(line) for line in open(out / folder / name / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [r["step"] for r in one.history] == [2, 4]
    for mine, theirs in zip(lines, one.history):
        for key in recorded:
            assert abs(mine[key] - theirs[key]) <= 1e-10 * max(1.0, abs(theirs[key])), key
    return got, reference


@needs_mpi
@pytest.mark.parametrize("name", ["adamw", "sgd_accum_clip", "adamw_accum_clip_zero"])
def test_trainer_on_two_ranks_equals_one_process(trainer_runs, name):
    """The trainer's 4 steps on 2 ranks x 4 images = 1 process x 8 images, in float64: the parameters, the
    optimizer state in the checkpoint, and every recorded loss (training, and the sharded evaluation)."""
    out, ref, one, _ = trainer_runs
    assert_two_ranks_equal_one(out, ref, "runs", name, "", one[name],
                               ("train_loss", "val_loss", "train_acc", "val_acc"))
    summary = json.load(open(out / "runs" / name / "summary.json"))
    assert summary["world_size"] == 2 and one[name].summary["world_size"] == 1


@needs_mpi
def test_trainer_mixed_precision_on_two_ranks_follows_one_process(trainer_runs):
    """Mixed precision through the trainer: float32 master weights, float16 products (which round a slice
    as they round the whole batch only up to float16's precision), the same loss-scale decisions. (An
    overflow on one rank alone skipping the step on all is tested above, in the collectives.)"""
    out, _, one, _ = trainer_runs
    summary = json.load(open(out / "runs" / "amp" / "summary.json"))
    assert summary["skipped_steps"] == one["amp"].summary["skipped_steps"]
    assert summary["loss_scale"] == one["amp"].summary["loss_scale"]
    lines = [json.loads(line) for line in open(out / "runs" / "amp" / "metrics.jsonl")]
    for mine, theirs in zip(lines, one["amp"].history, strict=True):
        for key in ("train_loss", "val_loss"):
            assert abs(mine[key] - theirs[key]) < 1e-3 * abs(theirs[key]), key
    # AdamW's steps of about lr = 3e-3 each, from gradients that agree to float16's rounding
    assert max_rel(dict(np.load(out / "results" / "amp.rank0.npz")), params_of(one["amp"])) < 1e-2


@needs_mpi
def test_trainer_resumes_with_another_number_of_ranks(trainer_runs):
    """1 process for 2 steps, then 2 ranks for 2; 2 ranks for 2 steps, then 1 process for 2: both end as
    4 uninterrupted steps of one process."""
    out, _, one, half = trainer_runs
    reference = params_of(one["adamw"])
    assert max_rel(dict(np.load(out / "results" / "resumed.rank0.npz")), reference) < 1e-10
    assert half.summary["steps"] == 4 and max_rel(params_of(half), reference) < 1e-10
    step, state = optimizer_state(out / "runs" / "resumed")
    assert step == 4 and max_rel(state, optimizer_state(out / "runs" / "half")[1]) < 1e-10


@needs_mpi
def test_trainer_rank_0_alone_writes_and_ranks_stay_in_step(trainer_runs):
    out = trainer_runs[0]
    rank0 = json.load(open(out / "results" / "rank0.json"))
    rank1 = json.load(open(out / "results" / "rank1.json"))
    assert rank1["writes"] == []
    assert any(p.endswith("metrics.jsonl") for p in rank0["writes"])   # the watch sees writes where they happen
    for name in RUNS:
        for file in ("checkpoint.npz", "metrics.jsonl", "summary.json", "curves.png"):
            assert (out / "runs" / name / file).exists(), (name, file)
    # with dropout and augmentation each rank draws its own masks, and the parameters still stay equal
    got = dict(np.load(out / "results" / "dropout_augment.rank0.npz"))
    other = dict(np.load(out / "results" / "dropout_augment.rank1.npz"))
    for k in got:
        np.testing.assert_array_equal(other[k], got[k])
    assert all(np.isfinite(v).all() for v in got.values())
    for refused in (rank0["refused"], rank1["refused"]):
        assert "the global batch size 9 must divide by the number of ranks 2" in refused


@pytest.fixture(scope="module")
def clip_runs(tmp_path_factory):
    """One mpiexec -n 2 job running every run of CLIP_RUNS through minivit.train.train, and the same runs
    in this process; before it, this process's first 2 steps of "resumed", which the job continues, and
    after it, this process continues the job's "half" to step 4."""
    if not HAVE_MPI:
        pytest.skip(f"needs mpi4py and mpiexec: {dist.INSTALL}")
    out, ref = tmp_path_factory.mktemp("clip_ranks"), str(tmp_path_factory.mktemp("clip_one"))
    os.makedirs(out / "results")
    clip_run("resumed", str(out), resume=False, max_steps=2)
    run = mpiexec(2, ["tests/test_distributed.py", "clip_trainer", str(out)], timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    one = {name: clip_run(name, ref) for name in ("adamw", "sgd", "sgd_clip", "adamw_clip_zero")}
    half = clip_run("half", str(out), resume=True, max_steps=4)       # 2 ranks' 2 steps, then 1 process's 2
    return out, ref, one, half


CLIP_RECORDED = ("train_loss", "train_acc", "val_loss", "val_acc", "zero_shot_seen", "zero_shot_held_out",
                 "image_to_text@1", "text_to_image@5", "logit_scale")


@needs_mpi
@pytest.mark.parametrize("name", ["adamw", "sgd", "sgd_clip", "adamw_clip_zero"])
def test_clip_trainer_on_two_ranks_equals_one_process(clip_runs, name):
    """--task clip's 4 steps on 2 ranks x 4 pairs = 1 process x 8 pairs, in float64, every image a negative
    of all 8 captions on both: the parameters (logit_scale on its own too: it is one number of thousands),
    the optimizer state in the checkpoint, and every recorded figure (training, and the evaluation)."""
    out, ref, one, _ = clip_runs
    got, reference = assert_two_ranks_equal_one(out, ref, "clip", name, "clip_", one[name], CLIP_RECORDED)
    assert abs(got["logit_scale"] - reference["logit_scale"]) < 1e-10 * abs(reference["logit_scale"])
    assert got["logit_scale"] != presets["clip_shapes_tiny"].init_logit_scale     # it was trained
    summary = json.load(open(out / "clip" / name / "summary.json"))
    assert summary["world_size"] == 2 and summary["eval_pairs"] == one[name].summary["eval_pairs"]


@needs_mpi
def test_clip_trainer_resumes_with_another_number_of_ranks_and_rank_0_alone_writes(clip_runs):
    """1 process for 2 steps then 2 ranks for 2, and 2 ranks then 1 process: both end as 4 uninterrupted
    steps of one process. Rank 1 wrote no file."""
    out, _, one, half = clip_runs
    reference = params_of(one["adamw"])
    assert max_rel(dict(np.load(out / "results" / "clip_resumed.rank0.npz")), reference) < 1e-10
    assert half.summary["steps"] == 4 and max_rel(params_of(half), reference) < 1e-10
    step, state = optimizer_state(out / "clip" / "resumed")
    assert step == 4 and max_rel(state, optimizer_state(out / "clip" / "half")[1]) < 1e-10
    assert json.load(open(out / "results" / "clip_rank1.json"))["writes"] == []
    assert any(p.endswith("metrics.jsonl") for p in json.load(open(out / "results" / "clip_rank0.json"))["writes"])
    for name in CLIP_RUNS:
        for file in ("checkpoint.npz", "metrics.jsonl", "summary.json", "curves.png"):
            assert (out / "clip" / name / file).exists(), (name, file)


@needs_mpi
def test_trainer_ends_when_a_rank_is_killed(tmp_path):
    """Rank 1 is killed mid-run: the job ends within seconds, with an error that says so."""
    os.makedirs(tmp_path / "results")
    start = time.monotonic()
    run = mpiexec(2, ["tests/test_distributed.py", "trainer_killed", str(tmp_path)], timeout=120,
                  MINIVIT_DIST_TIMEOUT="5")
    assert run.returncode != 0 and time.monotonic() - start < 110   # a hang runs into the 120 s timeout
    assert "BAD TERMINATION" in run.stdout and "Killed (signal 9)" in run.stdout   # mpiexec says which
    assert not (tmp_path / "runs" / "killed" / "summary.json").exists()


@needs_mpi
def test_command_line_on_two_ranks_stops_once_on_sigterm(tmp_path):
    """`mpiexec -n 2 python -m minivit.train`: SIGTERM to the job after its first evaluation. Both ranks stop
    after the same step, rank 0 saves the checkpoint of that step, prints once, and the job exits 143."""
    import signal

    out = tmp_path / "run"
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "minivit.train", "--dataset", "shapes", "--train-subset", "128",
           "--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--patch-size", "8", "--batch-size", "8",
           "--max-steps", "100000", "--eval-every", "3", "--eval-batch-size", "1000", "--out", str(out)]
    job = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n")) and time.monotonic() < deadline \
            and job.poll() is None:
        time.sleep(0.2)
    job.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = job.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        job.kill()
        stdout, stderr = job.communicate()
        pytest.fail(f"the job went on 90 s after SIGTERM; its last output:\n{stdout[-1500:]}\n{stderr[-1500:]}")
    assert job.returncode == 143, stdout + stderr
    summary = json.load(open(out / "summary.json"))
    assert summary["interrupted"] and summary["signal"] == "SIGTERM" and summary["world_size"] == 2
    from minivit.weights.checkpoint import load_checkpoint

    assert load_checkpoint(str(out))["meta"]["extra"]["step"] == summary["steps"] > 3
    assert stdout.count("SIGTERM at step") == 1 and stdout.count("done:") == 1 and stdout.count("training ") == 1
    assert stderr.count(" 0/100000 ") == 1          # one progress bar: rank 0's


@pytest.mark.gpu
def test_nccl_with_one_rank_equals_one_process(monkeypatch):
    """NCCLComm on this process alone (NCCL refuses two ranks on one GPU): its collectives, ZeRO-1 through
    NCCL after 3 steps, and the trainer with it, equal to one process. Run by scripts/gpu_check.sh."""
    pytest.importorskip("mpi4py", reason=f"needs mpi4py: {dist.INSTALL}")
    minivit.set_backend("cupy")
    import cupy

    comm = dist.NCCLComm()                         # MPI's COMM_WORLD of a process started alone: 1 rank
    assert (comm.rank, comm.world_size) == (0, 1)
    buf = cupy.arange(6, dtype=cupy.float32)
    np.testing.assert_array_equal(minivit.to_numpy(comm.allreduce(buf)), np.arange(6))
    out = cupy.zeros(6, dtype=cupy.float64)
    comm.reduce_scatter(cupy.arange(6.0), out)
    np.testing.assert_array_equal(minivit.to_numpy(out), np.arange(6.0))
    comm.allgather(cupy.ones(6), out)
    assert float(out.sum()) == 6.0
    for zero in (False, True):
        params, state, _ = hand_loop(None, "adamw", 2, 0.05, False)
        got, got_state, _ = hand_loop(comm, "adamw", 2, 0.05, zero)
        assert max_rel(got, params) < 1e-10
        assert max_rel(flat_state(got_state), flat_state(state)) < 1e-10
    # and the trainer on the GPU, its gradients exchanged through NCCL (ZeRO-1), against the trainer alone
    out = tempfile.mkdtemp()
    alone = train_run("adamw_accum_clip_zero", os.path.join(out, "alone"), backend="cupy")
    monkeypatch.setattr(dist.communicators, "_world", comm)   # what init() returns under a launcher
    ranked = train_run("adamw_accum_clip_zero", os.path.join(out, "nccl"), backend="cupy")
    assert ranked.summary["world_size"] == 1 and max_rel(params_of(ranked), params_of(alone)) < 1e-10


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    world = dist.init()
    if scenario == "loops":
        worker_loops(world, out_dir)
    elif scenario == "collectives":
        worker_collectives(world, out_dir)
    elif scenario == "trainer":
        worker_trainer(world, out_dir)
    elif scenario == "clip_trainer":
        worker_clip_trainer(world, out_dir)
    elif scenario == "trainer_killed":
        worker_trainer_killed(world, out_dir)
    else:
        worker_faults(world, scenario)
    sys.exit(0)
