"""The run folder room: what a run writes to OUT and reads back from it.

OUT is refused when it holds a run nobody asked to continue or replace, locked (OUT/.lock) while a run
writes it, checked writable before the first step; every write is atomic (or an append to metrics.jsonl
whose torn end is dropped on resume). Resuming: the checkpoint's settings checked against the flags given,
its data against the data, its state put back into the run. The summary: written at the end with the curves,
or kept as it is when a finished run is resumed.
"""

import dataclasses
import errno
import json
import os

import numpy

from .. import distributed
from ..weights.checkpoint import (check_finite, load_checkpoint, remove_stale_temporaries, restore_dropout_rngs,
                                  write_atomic)
from .plot import read_metrics
from .config import RESUME_APPLIED, RESUME_RUNTIME, RUN_FILES, TrainConfig, _cadence, _flag, resolve, run_length

# --------------------------------------------------------------------------------------------------
# The run folder: refused when it holds a run nobody asked to continue or replace, checked writable before
# the first step, every write atomic (or an append whose torn end is dropped on resume)
# --------------------------------------------------------------------------------------------------


def _naming_path(err, path):
    """The OSError err, naming the file being written (a failed write() names none, a failed temporary file
    its own name), with the original cause."""
    return OSError(err.errno, err.strerror or str(err), path)


def _append_jsonl(path, record):
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:
        raise _naming_path(err, path) from None


def _write_json_atomic(path, obj):
    try:
        write_atomic(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))
    except OSError as err:
        raise _naming_path(err, path) from None


def _write_jsonl_atomic(path, records):
    try:
        write_atomic(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in records).encode()))
    except OSError as err:
        raise _naming_path(err, path) from None


def check_out(cfg):
    """Refuse, before anything is read or written, an out that is a file, or that holds a run (checkpoint,
    metrics or summary) which cfg neither resumes nor overwrites."""
    out = cfg.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(errno.ENOTDIR, "--out must be a folder, and a file is in the way", out)
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):                 # the folders makedirs would create: under a file?
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"--out cannot be created: {parent} is a file", out)
    check_not_in_use(out)
    held = [name for name in RUN_FILES[:3] if os.path.exists(os.path.join(out, name))]
    if held and not (cfg.resume or cfg.overwrite) and "checkpoint.npz" not in held:
        raise ValueError(f"--out {out} holds the start of a run that saved no checkpoint ({', '.join(held)}; "
                         f"stopped before or during its first save): nothing to resume; replace it with "
                         f"--overwrite, or choose another --out")
    if held and not (cfg.resume or cfg.overwrite):
        raise ValueError(f"--out {out} already holds a run ({', '.join(held)}): continue it with --resume, "
                         f"replace it with --overwrite, or choose another --out")


LOCK_FILE = ".lock"            # OUT/.lock: held (fcntl.flock) by the run writing OUT, its pid inside; removed at end
REPLACED = ".replaced-run"     # OUT/.replaced-run/: the run --overwrite replaces, kept to the new run's 1st checkpoint


class RunFolderInUse(RuntimeError):
    """Another process holds the lock of the run folder: two runs writing one folder would interleave their
    metrics and overwrite each other's checkpoints."""


def _lock_pid(fd):
    """The pid written in an open lock file (None when it holds none)."""
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 64).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None


def _in_use(out, pid):
    return RunFolderInUse(f"--out {out} is in use by another run (pid {pid if pid is not None else 'unknown'}, which "
                          f"holds {os.path.join(out, LOCK_FILE)}): wait for it to end or stop it, "
                          f"or choose another --out")


def check_not_in_use(out):
    """Refuse, before anything is read, an out whose lock another live run holds (a look, not a lock: the run
    takes it in lock_out). Skipped under an MPI launcher, where rank 0 alone takes the lock, maybe already."""
    path = os.path.join(out, LOCK_FILE)
    if distributed.launched_by_mpi() or not os.path.isfile(path):
        return
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return                                    # unreadable: lock_out will say why
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out, _lock_pid(fd)) from None
    finally:
        os.close(fd)


def lock_out(out):
    """Take the advisory lock of out (created if missing) for the life of this run, writing this pid into
    OUT/.lock. Another live run's lock is refused naming its pid; a lock file whose process has ended (the
    kernel dropped its lock) is taken over, saying so. Returns the lock's file descriptor (for unlock_out)."""
    import fcntl

    path = os.path.join(out, LOCK_FILE)
    while True:
        try:
            os.makedirs(out, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as err:
            raise OSError(err.errno, f"--out cannot be used as the run folder: {err.strerror or err}", out) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _lock_pid(fd)
            os.close(fd)
            raise _in_use(out, pid) from None
        try:                                      # the file locked is still the one at path (the run before
            if os.path.samestat(os.fstat(fd), os.stat(path)):   # may have removed it meanwhile): then it is ours
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    old = _lock_pid(fd)
    if old is not None and old != os.getpid():
        print(f"{os.path.join(out, LOCK_FILE)}: the run of pid {old} ended without releasing it (killed?); "
              f"taking it over", flush=True)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_out(fd, out):
    """Release lock_out's lock: OUT/.lock is removed while still locked (a run that opened it meanwhile sees,
    once it holds the lock, that the file at that path is no longer the one it locked, and starts again)."""
    try:
        os.remove(os.path.join(out, LOCK_FILE))
    except OSError:
        pass                                      # the lock itself is what matters, and closing releases it
    os.close(fd)


def open_out(out, overwrite=False):
    """Make out ready for the first step: created, written to once (a probe file), cleared of the temporary
    files of an interrupted write; an earlier --overwrite that a hard kill interrupted is settled (settle_replaced);
    with overwrite, the run out holds is moved aside to OUT/.replaced-run/ (deleted at the new run's first
    checkpoint, moved back if the new run fails before it). Returns that folder, or None. An OSError names
    out and the cause."""
    aside = None
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-probe.tmp")
        with open(probe, "w") as f:
            f.write("minivit checks that it can write here\n")
        os.remove(probe)
        stale = remove_stale_temporaries(out)
        settle_replaced(out)
        present = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
        if overwrite and present:
            aside = os.path.join(out, REPLACED)
            os.makedirs(aside)
            for name in present:
                os.replace(os.path.join(out, name), os.path.join(aside, name))
    except OSError as err:
        raise OSError(err.errno, f"--out cannot be used as the run folder: {err.strerror or err}", out) from None
    if stale:
        print(f"removed {len(stale)} temporary file(s) of an interrupted write: "
              f"{', '.join(os.path.basename(p) for p in stale)}", flush=True)
    return aside


def settle_replaced(out, failed=False):
    """The run that --overwrite moved aside to OUT/.replaced-run/: deleted once the new run has a checkpoint;
    moved back (over the new run's files) when the new run failed (failed=True) or a hard kill stopped it
    before its first checkpoint."""
    import shutil

    aside = os.path.join(out, REPLACED)
    if not os.path.isdir(aside):
        return
    if not failed and os.path.exists(os.path.join(out, "checkpoint.npz")):
        shutil.rmtree(aside)
        return
    for name in RUN_FILES:
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in os.listdir(aside):
        os.replace(os.path.join(aside, name), os.path.join(out, name))
    os.rmdir(aside)
    print(f"the run that --overwrite was to replace is back in {out}: the new run ended before its first "
          f"checkpoint", flush=True)


# --------------------------------------------------------------------------------------------------
# Resuming: the run's settings and data checked, its state put back
# --------------------------------------------------------------------------------------------------


def _resume_folder(cfg):
    """cfg.out, with "{dataset}" replaced: by cfg.dataset, or with fallback by the first data set the run
    may have fallen back to whose folder holds a checkpoint."""
    if "{dataset}" not in cfg.out:
        return cfg.out
    names = [cfg.dataset] + (["fashion-mnist", "shapes"] if cfg.fallback and cfg.dataset == "cifar10" else [])
    for name in names:
        folder = cfg.out.replace("{dataset}", name)
        if os.path.exists(os.path.join(folder, "checkpoint.npz")):
            return folder
    return cfg.out.replace("{dataset}", cfg.dataset)


def resume_config(cfg):
    """The run in cfg.out to continue: (its TrainConfig with cfg's permitted changes, the checkpoint, the
    TrainConfig it was saved with, {field: new value} of the changes applied). A field of cfg that is not
    its default and differs from the run's own is a change: applied if it is the run's length or its
    evaluation cadence (RESUME_APPLIED), refused by name otherwise; where and how it runs always follow cfg."""
    if cfg.out is None:
        raise ValueError("resume needs out: the folder that holds checkpoint.npz")
    out = _resume_folder(cfg)
    check_not_in_use(out)
    ckpt_path = os.path.join(out, "checkpoint.npz")
    if not os.path.exists(ckpt_path) and os.path.exists(os.path.join(out, "metrics.jsonl")):
        raise FileNotFoundError(f"--resume: the run in {out} saved no checkpoint (stopped before or during its "
                                f"first save): nothing to resume; start it again with --overwrite")
    if not os.path.exists(ckpt_path):
        raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path!r} (train into --out {out!r} first)")
    resumed = load_checkpoint(ckpt_path)
    extra = resumed["meta"].get("extra") or {}
    missing = [k for k in ("train_config", "step", "best_val_accuracy") if k not in extra]
    if resumed["optimizer"] is None:
        missing.append("optimizer state")
    if missing:
        raise ValueError(f"{ckpt_path!r} holds no training state to resume (no {', '.join(missing)}): "
                         f"was it written by minivit.train?")
    check_finite(resumed["params"], repr(ckpt_path))
    check_finite({f"optim/{kind}/{name}": buf for kind, buffers in resumed["optimizer"]["buffers"].items()
                  for name, buf in buffers.items()}, repr(ckpt_path), "optimizer buffers",
                 "a damaged or edited file: resume from another checkpoint, or start a new run")
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in extra["train_config"].items()
             if k in fields}                             # JSON made img_size a list; older runs may have more keys
    before = TrainConfig(**saved)
    fell_back = cfg.fallback and cfg.dataset == "cifar10" and saved.get("dataset") != "cifar10"
    applied, refused = {}, []
    for name, value in dataclasses.asdict(cfg).items():
        if name in RESUME_RUNTIME or value == fields[name] or value == saved.get(name, fields[name]):
            continue
        if fell_back and name in ("dataset", "data_dir"):   # asked again for the CIFAR-10 it fell back from
            continue
        if name in RESUME_APPLIED:
            applied[name] = value
        else:
            refused.append(f"{_flag(name)} {value!r} (the run's: {saved.get(name, fields[name])!r})")
    if refused:
        raise ValueError(f"--resume continues the run in {out} with its own settings, and these differ from "
                         f"them: {'; '.join(refused)}. On resume only {', '.join(map(_flag, RESUME_APPLIED))} "
                         f"may change; to change the rest, start a new run (another --out, or --overwrite)")
    if "epochs" in applied or "max_steps" in applied:        # the new length, said as a fresh run says it
        saved.update(epochs=applied.get("epochs"), max_steps=applied.get("max_steps"))
    if "eval_every" in applied or "num_evals" in applied:
        saved.update(eval_every=applied.get("eval_every"), num_evals=applied.get("num_evals"))
    saved.update({k: getattr(cfg, k) for k in RESUME_RUNTIME}, out=out)
    return TrainConfig(**saved), resumed, before, applied


def check_resumed_data(resumed, data):
    """Refuse to resume on other data than the run's: another data set, or classes renamed, added or removed
    (a renamed class folder would swap the labels silently). The checkpoint stores the data set's name, its
    class names and their count; each change is named."""
    path, extra = resumed["path"], resumed["meta"]["extra"]
    changes = []
    if "dataset" in extra and extra["dataset"] != data.name:
        changes.append(f"the data set is {data.name!r}, the run's was {extra['dataset']!r}")
    saved, now = extra.get("classes"), getattr(data, "classes", None)
    if saved is not None and now is not None and list(saved) != list(now):
        gone, new = [c for c in saved if c not in now], [c for c in now if c not in saved]
        if len(gone) == len(new) and gone:
            changes.append("classes renamed: " + ", ".join(f"{a!r} -> {b!r}" for a, b in zip(gone, new)))
        else:
            if new:
                changes.append(f"classes added: {new}")
            if gone:
                changes.append(f"classes removed: {gone}")
            if not new and not gone:
                changes.append(f"the classes are in another order: {list(now)}, the run's {list(saved)}")
    count = extra.get("num_classes", len(saved) if saved is not None else None)
    if count is not None and now is not None and count != len(now) and not changes:
        changes.append(f"{len(now)} classes, the run's model has {count}")
    if changes:
        raise ValueError(f"--resume: the data differ from those the run in {os.path.dirname(path)} trained on: "
                         f"{'; '.join(changes)}. Resume on the run's own data, or start a new run (another --out, "
                         f"or --overwrite)")


def _history_to_resume(out, step):
    """The evaluation records of the run in out up to its checkpoint's step (a record written after the
    checkpoint, and a torn last line, are dropped: the resumed run writes them again)."""
    if not os.path.exists(os.path.join(out, "metrics.jsonl")):
        return []
    records = read_metrics(out)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) < len(records):
        print(f"dropped {len(records) - len(kept)} record(s) of {os.path.join(out, 'metrics.jsonl')} written "
              f"after the checkpoint's step {step}", flush=True)
    return kept


def restore(run, resumed, before, applied):
    """Put the checkpoint's state into run (weights, optimizer, dropout RNGs, loss scale, step, history),
    and say what cfg changed: the run's length (its schedule recomputed) or its evaluation cadence."""
    path, meta, extra = resumed["path"], resumed["meta"], resumed["meta"]["extra"]
    if run.scaler is not None and "loss_scaler" not in extra:
        raise ValueError(f"{path!r} has no loss-scaler state for its float16 run (an edited file?)")
    try:
        run.model.load_state_dict(resumed["params"])
        run.optimizer.load_state_dict(resumed["optimizer"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path!r}: {err}") from None
    restore_dropout_rngs(run.model, meta.get("dropout_rng") or {})
    if run.scaler is not None:
        run.scaler.load_state_dict(extra["loss_scaler"])
    run.step = run.start_step = run.saved_step = extra["step"]
    run.best = extra["best_val_accuracy"]
    if run.total_steps < run.step:
        raise ValueError(f"{' '.join(f'{_flag(k)} {v}' for k, v in applied.items())}: the run is already at "
                         f"step {run.step}, past the {run.total_steps} steps that asks for")
    run.history = _history_to_resume(run.cfg.out, run.step)
    print(f"resuming {path} at step {run.step} of {run.total_steps}", flush=True)
    old_total = run_length(resolve(before), run.steps_per_epoch)
    if run.total_steps != old_total:
        print(f"the run now ends at step {run.total_steps} instead of {old_total}: the learning-rate schedule is "
              f"recomputed for {run.total_steps} steps from step {run.step} on, so the result differs from that "
              f"of a run set up for {run.total_steps} steps from the start", flush=True)
    if _cadence(run.cfg) != _cadence(before):
        print(f"from step {run.step} on, evaluations and checkpoints {_cadence(run.cfg)} (the run had them "
              f"{_cadence(before)})", flush=True)


def check_resume_flags(cfg, given):
    """resume_config cannot tell a flag given with its default's value (--dataset cifar10) from no flag;
    main can: such a flag that differs from the run's own setting is refused, as resume_config refuses the
    rest. given: the names of the flags on the command line."""
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    path = os.path.join(_resume_folder(cfg), "checkpoint.npz")
    try:                                   # the metadata alone; a file that cannot be read is resume_config's to name
        with numpy.load(path, allow_pickle=False) as npz:
            saved = json.loads(str(npz["meta"]))["extra"]["train_config"]
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
    except Exception:
        return
    fell_back = cfg.fallback and saved.get("dataset") != "cifar10"
    refused = [f"{_flag(name)} {fields[name]!r} (the run's: {saved[name]!r})" for name in given
               if name in saved and getattr(cfg, name) == fields[name] != saved[name]
               and name not in RESUME_RUNTIME + RESUME_APPLIED and not (fell_back and name in ("dataset", "data_dir"))]
    if refused:
        raise ValueError(f"--resume continues the run in {os.path.dirname(path)} with its own settings, and these "
                         f"differ from them: {'; '.join(refused)}; to change them, start a new run (another --out, "
                         f"or --overwrite)")


# --------------------------------------------------------------------------------------------------
# The summary
# --------------------------------------------------------------------------------------------------


def _summary_of_a_finished_run(run):
    """A finished run resumed trains no step: its summary.json is kept as it is (rewritten, it said 0 img/s)
    and returned; None when this run trained, or there is no readable summary to keep."""
    path = None if run.cfg.out is None else os.path.join(run.cfg.out, "summary.json")
    if run.step != run.start_step or run.step == 0 or path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != run.step:
        return None
    if run.cfg.verbose:
        print(f"the run in {run.cfg.out} had already finished its {run.step} steps: nothing trained, its summary "
              f"kept (to train on, resume with a larger --max-steps or --epochs)", flush=True)
    return summary


def write_summary(out, summary, history):
    """summary.json (atomically), and curves.png from metrics.jsonl when there is a history to draw."""
    _write_json_atomic(os.path.join(out, "summary.json"), summary)
    if history:
        try:
            from .plot import plot_curves

            plot_curves(out, os.path.join(out, "curves.png"))
        except ImportError:  # matplotlib missing: the numbers are in metrics.jsonl
            pass
