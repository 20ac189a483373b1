"""Reliability, third round (issue 29), the rest: nothing allocated blind (7), the downloader's limits (8),
raw tracebacks made one clear line (10), and the smaller faults the issue lists. Each test failed before
its fix."""

import os
import signal
import zipfile
from pathlib import Path

import numpy as np
import pytest

from test_reliability_more import TINY_FLAGS, save_png


def tiny_run(out, steps=2):
    from minivit.train import TrainConfig, train

    train(TrainConfig(dataset="shapes", train_subset=64, embed_dim=16, depth=1, num_heads=2, batch_size=32,
                      max_steps=steps, progress=False, verbose=False, out=str(out)))
    return out / "checkpoint.npz"


def rewrite_member(path, name, edit):
    """Rewrite one member of an .npz (a zip of .npy files) with edit(bytes) -> bytes, the rest unchanged."""
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[name] = edit(members[name])
    with zipfile.ZipFile(path, "w") as z:
        for n, raw in members.items():
            z.writestr(n, raw)


def lying_header(raw):
    """An .npy whose header claims 1e11 float32 values (400 GB) over the 10 it holds; same header length."""
    end = raw.index(b"\n") + 1
    header = raw[:end].replace(b"(10,)", b"(100000000000,)")
    header = header[:-1].rstrip(b" ")
    header += b" " * (end - len(header) - 1) + b"\n"
    return header + raw[end:]


# ---- 7. memory allocated blind --------------------------------------------------------------------------


def test_a_lying_npy_header_is_refused_before_it_is_allocated(tmp_path, capsys):
    import minivit
    from minivit import predict
    from minivit.train import main

    ckpt = tiny_run(tmp_path / "run")
    rewrite_member(ckpt, "param/head.bias.npy", lying_header)
    match = r"checkpoint.npz'?: the header of 'param/head.bias' declares \(100000000000,\) float32 \(400.0 GB\)"
    with pytest.raises(ValueError, match=match):
        minivit.from_pretrained(ckpt)                       # was a raw MemoryError (373 GiB)
    save_png(tmp_path / "x.png", np.zeros((32, 32, 3), np.uint8))
    capsys.readouterr()
    assert predict.main([str(tmp_path / "x.png"), "--checkpoint", str(ckpt)]) == 2
    assert main(["--out", str(tmp_path / "run"), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("declares (100000000000,) float32" in line for line in err)


def test_an_object_array_npz_is_refused_naming_the_file_and_the_array(tmp_path, capsys):
    import minivit
    from minivit.train import main

    ckpt = tiny_run(tmp_path / "run")
    arrays = dict(np.load(ckpt))
    arrays["param/head.bias"] = np.array([None] * 10, dtype=object)
    np.savez(ckpt, **arrays)
    with pytest.raises(ValueError, match=r"checkpoint.npz'?: the array 'param/head.bias' holds Python objects"):
        minivit.from_pretrained(ckpt)
    capsys.readouterr()
    assert main(["--out", str(tmp_path / "run"), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.npz" in err and "'param/head.bias' holds Python objects" in err    # was: no file named


def fashion_bomb(folder, extra_zeros=256 << 20):
    """Fashion-MNIST's four files, the training images a gzip bomb: an honest header for 60000 images, then
    47 MB + extra_zeros of zeros (a few hundred kB compressed)."""
    import gzip

    folder.mkdir(parents=True)
    sizes = {"train-images-idx3-ubyte": (0x803, 60000), "t10k-images-idx3-ubyte": (0x803, 10000),
             "train-labels-idx1-ubyte": (0x801, 60000), "t10k-labels-idx1-ubyte": (0x801, 10000)}
    for name, (magic, n) in sizes.items():
        dims = [n, 28, 28] if magic == 0x803 else [n]
        with gzip.open(folder / (name + ".gz"), "wb", compresslevel=1) as f:
            f.write(b"".join(v.to_bytes(4, "big") for v in [magic, *dims]))
            left = int(np.prod(dims)) + (extra_zeros if name.startswith("train-images") else 0)
            while left:
                f.write(bytes(min(left, 16 << 20)))
                left -= min(left, 16 << 20)
    return folder


def test_a_fashion_mnist_gzip_bomb_is_not_decompressed_whole(tmp_path):
    import tracemalloc

    from minivit.data import load_fashion_mnist

    folder = fashion_bomb(tmp_path / "fm")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: holds more than the 47,040,016 bytes its "
                                             r"header states \(a damaged file or a decompression bomb\)"):
            load_fashion_mnist(folder, verify=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 150e6, peak                        # was the whole 300 MB (8.5 GB for the bomb)


def test_an_idx_header_larger_than_memory_is_refused_with_the_figure(tmp_path, monkeypatch):
    import minivit.memory
    from minivit.data import load_fashion_mnist

    folder = fashion_bomb(tmp_path / "fm", extra_zeros=0)
    monkeypatch.setattr(minivit.memory, "available_memory", lambda: 10_000_000)      # a 10 MB machine
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: its header says 60000 x 28 x 28 bytes of "
                                         r"data, which needs 47.0 MB, and this machine has 10.0 MB"):
        load_fashion_mnist(folder, verify=False)


def test_a_cifar_file_larger_than_any_official_one_is_not_read(tmp_path):
    from minivit.data import load_cifar10

    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in ["batches.meta", *(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (folder / name).write_bytes(b"x")
    os.truncate(folder / "data_batch_1", 8 << 30)                     # 8 GiB, sparse: takes no disk
    with pytest.raises(ValueError, match=r"data_batch_1: 8,589,934,592 bytes, and no CIFAR-10 file is larger"):
        load_cifar10(tmp_path)                                         # was read whole into memory


def test_the_evaluation_steps_of_a_long_run_are_a_rule_not_a_set():
    import sys

    from minivit.train import TrainConfig, evaluation_steps

    steps = evaluation_steps(TrainConfig(max_steps=10**12, eval_every=1), 10**12, 10)
    assert sys.getsizeof(steps) < 1000                  # was a set of every step: 1e12 of them, a raw MemoryError
    assert 1 in steps and 10**12 in steps and 0 not in steps and 10**12 + 1 not in steps
    spread = evaluation_steps(TrainConfig(max_steps=150, num_evals=4), 150, 10)
    assert [s for s in range(200) if s in spread] == [37, 75, 112, 150]


def test_an_img_size_beyond_memory_is_refused_with_the_figures_before_resizing(tmp_path, capsys):
    from minivit.train import main

    assert main([*TINY_FLAGS, "--img-size", "20000", "--max-steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()          # was a raw MemoryError (10.9 TiB) in resize_images
    assert len(err) == 1 and not (tmp_path / "run").exists()
    assert "--img-size 20000: the 2,256 images resized (2.7 TB) and one block's attention for a batch of 32" in err[0]
    assert "lower --img-size (or --batch-size, --train-subset), or raise --patch-size" in err[0]


# ---- 8. the downloader: a size cap, a deadline, a .part file ---------------------------------------------


@pytest.fixture
def server():
    """A local HTTP server in a thread (no internet here): /ok sends BODY, /endless sends zeros forever
    (no Content-Length), /liar announces 10 GB, /slow sends a byte every 0.2 s. Yields its base URL."""
    import http.server
    import threading
    import time

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            if self.path == "/liar":
                self.send_header("Content-Length", str(10**10))
            elif self.path == "/ok":
                self.send_header("Content-Length", str(len(BODY)))
            self.end_headers()
            try:
                if self.path == "/ok":
                    self.wfile.write(BODY)
                elif self.path in ("/endless", "/liar"):
                    for _ in range(4096):                 # 4 GiB at most, if nothing stops the client
                        self.wfile.write(bytes(1 << 20))
                elif self.path == "/slow":
                    for _ in range(600):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.2)
            except OSError:                               # the client hung up: what the tests want
                pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


BODY = b"minivit" * 1000


def _md5(raw):
    import hashlib

    return hashlib.md5(raw).hexdigest()


def test_the_download_stops_at_the_known_size_and_leaves_nothing(server, tmp_path):
    from minivit.download import download_file

    dest = tmp_path / "data.gz"
    with pytest.raises(ValueError, match=r"/endless: the server sent more than the file's 7,000 bytes"):
        download_file(server + "/endless", dest, _md5(BODY), size=len(BODY), progress=False)   # was: filled the disk
    with pytest.raises(ValueError, match=r"/liar: the server announces 10,000,000,000 bytes, and the file is 7,000"):
        download_file(server + "/liar", dest, _md5(BODY), size=len(BODY), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_download_with_no_room_on_disk_is_refused_before_it_starts(server, tmp_path, monkeypatch):
    import shutil

    from minivit.download import download_file

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    with pytest.raises(ValueError, match=r"/ok: 7,000 bytes to download, and .* has 100 bytes free: make room"):
        download_file(server + "/ok", tmp_path / "data.gz", _md5(BODY), size=len(BODY), progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_slow_server_is_given_up_on_at_the_deadline(server, tmp_path):
    import time

    from minivit.download import NetworkError, download_file

    start = time.monotonic()
    with pytest.raises(NetworkError, match=r"/slow did not finish within its deadline .*the server is too slow"):
        download_file(server + "/slow", tmp_path / "data.gz", _md5(BODY), deadline=1.0, progress=False)
    assert time.monotonic() - start < 10                   # was: 2 minutes of a byte every 0.2 s, no deadline
    assert list(tmp_path.iterdir()) == []


def test_the_download_goes_to_a_part_file_renamed_only_when_its_md5_matches(server, tmp_path, monkeypatch):
    import os

    from minivit import download

    dest = tmp_path / "data.gz"
    (tmp_path / "data.gz.part").write_bytes(b"left by a run killed with SIGKILL")
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(download.os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b)))
    assert download.download_file(server + "/ok", dest, _md5(BODY), size=len(BODY), progress=False) == str(dest)
    assert renames == [(str(dest) + ".part", str(dest))] and dest.read_bytes() == BODY
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.gz"]          # the stale .part overwritten
    with pytest.raises(ValueError, match="md5"):
        download.download_file(server + "/ok", tmp_path / "other.gz", "0" * 32, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.gz"]


def test_the_download_scripts_pass_the_official_sizes():
    from minivit.data import CIFAR10_ARCHIVE_SIZE, FASHION_MNIST_GZ_MD5, FASHION_MNIST_GZ_SIZE

    assert set(FASHION_MNIST_GZ_SIZE) == set(FASHION_MNIST_GZ_MD5) and CIFAR10_ARCHIVE_SIZE == 170498071
    for script in ("download_cifar10.py", "download_fashion_mnist.py"):
        assert "size=" in (Path(__file__).resolve().parents[1] / "data_scripts" / script).read_text()


# ---- 5/10. --init of a checkpoint without a learned position table ----------------------------------------


@pytest.mark.parametrize("kind", ["sincos2d", "none"])
def test_init_of_a_checkpoint_without_a_position_table_trains_at_another_img_size(tmp_path, capsys, kind):
    from minivit.train import main

    pre = tmp_path / "pre"
    assert main([*TINY_FLAGS, "--pos-embed", kind, "--max-steps", "2", "--out", str(pre)]) == 0
    assert main([*TINY_FLAGS, "--max-steps", "2", "--init", str(pre / "checkpoint.npz"),      # was KeyError
                 "--out", str(tmp_path / "ft")]) == 0                                       # 'pos_embed'
    assert main([*TINY_FLAGS, "--max-steps", "2", "--img-size", "48", "--init", str(pre / "checkpoint.npz"),
                 "--out", str(tmp_path / "ft48")]) == 0                 # was refused: nothing to resize
    assert (tmp_path / "ft48" / "checkpoint.npz").exists()


# ---- smaller ones ----------------------------------------------------------------------------------------


def test_resume_refuses_a_flag_given_with_the_defaults_value_that_differs_from_the_run(tmp_path, capsys):
    from minivit.train import main

    out = tmp_path / "run"
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--dataset", "cifar10", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()                 # was: accepted silently, trained on shapes
    assert len(err) == 1 and "--dataset 'cifar10' (the run's: 'shapes')" in err[0]
    assert main(["--out", str(out), "--resume", "--dataset", "shapes", "--max-steps", "4", "--no-progress"]) == 0


def test_resuming_a_finished_run_keeps_its_summary(tmp_path, capsys):
    from minivit.train import main

    out = tmp_path / "run"
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 0
    before = (out / "summary.json").read_bytes()
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--no-progress"]) == 0
    assert (out / "summary.json").read_bytes() == before                 # was rewritten with 0 img/s
    said = capsys.readouterr().out
    assert "had already finished its 2 steps: nothing trained" in said and "(0 img/s)" not in said


def test_a_clip_checkpoint_given_to_predict_or_init_is_called_one(tmp_path, capsys):
    from test_reliability_more import rewrite_checkpoint

    from minivit import predict
    from minivit.train import main

    ckpt = tiny_run(tmp_path / "run")                        # a CLIP run's metadata, as --task clip writes it
    rewrite_checkpoint(ckpt, lambda meta: meta.update(config={"embed_dim": 64, "vision_width": 64,
                                                              "text_width": 64, "vocab_size": 34}))
    save_png(tmp_path / "x.png", np.zeros((32, 32, 3), np.uint8))
    capsys.readouterr()
    assert predict.main([str(tmp_path / "x.png"), "--checkpoint", str(ckpt)]) == 2
    assert main([*TINY_FLAGS, "--max-steps", "2", "--init", str(ckpt), "--out", str(tmp_path / "ft")]) == 2
    err = capsys.readouterr().err.strip().splitlines()     # was: "unknown ViTConfig fields [...]"
    assert len(err) == 2 and all("is a CLIP checkpoint" in line and "checkpoint.npz" in line for line in err)


def write_safetensors(path, arrays, dtype):
    """A .safetensors file written by hand (NumPy has no bfloat16): dtype 'BF16' keeps float32's upper 16 bits."""
    import json

    header, blobs, offset = {}, [], 0
    for name, value in arrays.items():
        raw = ((value.astype(np.float32).view(np.uint32) >> 16).astype("<u2") if dtype == "BF16"
               else value.astype({"I32": "<i4", "F32": "<f4"}[dtype])).tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))
    return path


def test_bf16_safetensors_are_widened_and_integer_ones_refused_by_name(tmp_path):
    import minivit
    from minivit.weights import convert
    from minivit.model import ViT, ViTConfig

    model = ViT(ViTConfig(img_size=32, patch_size=8, num_classes=3, embed_dim=16, depth=1, num_heads=2))
    state = {k: ((np.asarray(v, np.float32).view(np.uint32) >> 16) << 16).view(np.float32)   # bf16-exact values
             for k, v in convert.to_timm(model.state_dict(), 8, 3).items()}
    loaded = minivit.from_pretrained(write_safetensors(tmp_path / "bf16.safetensors", state, "BF16"), num_heads=2,
                                     verbose=False)              # was: "cannot be read, truncated or corrupt?"
    back = convert.to_timm(loaded.state_dict(), 8, 3)
    assert all(np.array_equal(back[k], state[k]) for k in state)
    with pytest.raises(ValueError, match=r"int.safetensors'?: 20 tensors are not floating-point \(.* \(I32\)"):
        minivit.from_pretrained(write_safetensors(tmp_path / "int.safetensors", state, "I32"), num_heads=2)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_a_second_signal_during_the_save_stops_at_once_in_one_line(tmp_path, capsys, monkeypatch, name):
    import signal

    import minivit.train.loop as T                          # where run_loop finds evaluate_and_save

    signum, save = getattr(signal, name), T.evaluate_and_save

    def save_interrupted_twice(run):                       # the signal, then the user presses again mid-save
        os.kill(os.getpid(), signum)
        os.kill(os.getpid(), signum)
        return save(run)

    out = tmp_path / "run"
    assert T.main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 0
    monkeypatch.setattr(T, "evaluate_and_save", save_interrupted_twice)
    capsys.readouterr()
    assert T.main(["--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 128 + signum
    err = capsys.readouterr().err.strip().splitlines()      # was a raw KeyboardInterrupt traceback
    assert err == [f"error: {name}: stopped at once; {out / 'checkpoint.npz'}, if there is one, is whole (written "
                   f"atomically): continue from it with --resume"]
    monkeypatch.setattr(T, "evaluate_and_save", save)
    assert T.main(["--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 0


def test_sigterm_while_the_run_is_set_up_stops_at_once_and_frees_the_folder(tmp_path, capsys, monkeypatch):
    """A scheduler's SIGTERM can come before the loop's handler is in place (the folder locked, the data still
    loading): the run stops at once with exit 143 and one line, and the next run finds the folder free."""
    import signal

    import minivit.train.loop as T

    out = tmp_path / "run"
    assert T.main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 0
    set_up = T._set_up_out_and_device

    def terminated_during_set_up(*args):                   # the folder is locked by now
        assert (out / ".lock").exists()
        os.kill(os.getpid(), signal.SIGTERM)               # was: the default action, death with the lock left behind
        return set_up(*args)

    monkeypatch.setattr(T, "_set_up_out_and_device", terminated_during_set_up)
    capsys.readouterr()
    assert T.main(["--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: SIGTERM: stopped at once; {out / 'checkpoint.npz'}, if there is one, is whole (written "
                   f"atomically): continue from it with --resume"]
    assert not (out / ".lock").exists() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    monkeypatch.setattr(T, "_set_up_out_and_device", set_up)
    assert T.main(["--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 0


def test_a_resume_on_ranks_that_do_not_divide_its_batch_is_told_which_counts_do(tmp_path, capsys, monkeypatch):
    import types

    from minivit import distributed
    from minivit.distributed import check_global_batch
    from minivit.train import main

    with pytest.raises(ValueError, match=r"R in \[1, 2, 4, 8\]"):
        check_global_batch(32, 3, grad_accum=4, resumed=True)
    out = tmp_path / "run"
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 0
    monkeypatch.setattr(distributed, "init", lambda: types.SimpleNamespace(world_size=3, rank=0))   # mpiexec -n 3
    capsys.readouterr()
    assert main(["--out", str(out), "--resume", "--max-steps", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err                     # was: "use a batch size of 30", which --resume refuses
    assert ("the resumed run's batch size 32 (grad_accum 1) does not divide over 3 ranks, and it cannot change on "
            "--resume: start it with mpiexec -n R for R in [1, 2, 4, 8, 16, 32]") in err


def test_a_run_killed_before_its_first_checkpoint_gets_advice_that_agrees(tmp_path, capsys):
    from minivit.train import main

    out = tmp_path / "run"
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 0
    (out / "checkpoint.npz").unlink()                       # what SIGKILL during the first save leaves
    (out / "summary.json").unlink()
    capsys.readouterr()
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out)]) == 2
    assert main(["--out", str(out), "--resume", "--no-progress"]) == 2
    new, resume = capsys.readouterr().err.strip().splitlines()
    assert "--resume" not in new.replace("nothing to resume", "")     # was: "continue it with --resume", and
    assert "saved no checkpoint" in new and "--overwrite" in new      # --resume: "train into --out first"
    assert "saved no checkpoint" in resume and "start it again with --overwrite" in resume
    assert main([*TINY_FLAGS, "--max-steps", "2", "--out", str(out), "--overwrite"]) == 0


def test_a_model_beyond_memory_is_refused_with_the_figure_before_it_is_built(tmp_path, capsys):
    from minivit.train import main

    flags = [*TINY_FLAGS, "--embed-dim", "65536", "--depth", "12", "--max-steps", "1", "--out", str(tmp_path / "r")]
    assert main(flags) == 2                                  # was a raw MemoryError (96 GiB) in the weights' init
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and not (tmp_path / "r").exists()
    assert "the model (412,333,834,250 parameters: weights, gradients, the optimizer's two moments) needs 6.6 TB" \
        in err[0] and "lower --embed-dim or --depth" in err[0]


# ---- the stop decision of the loop: once per step, the same on every rank ---------------------------------


class _WorldWithASignalDuringTheCollective:
    """A world of ranks whose allreduce is interrupted by this rank's own SIGTERM (the handler runs when the
    blocking call returns), while the other ranks had none: their maximum is this rank's value before it."""

    def __init__(self, flag, others=0):
        self.flag, self.others, self.calls = flag, others, 0

    def max(self, value, what=""):
        self.calls += 1
        if self.calls == 1:
            self.flag._handle(signal.SIGTERM, None)
        return max(value, self.others)


def test_a_signal_during_the_ranks_agreement_is_kept_for_the_next_step():
    """Was: agree() overwrote the handler's record with the agreed 0, so the signal was lost and the two-rank
    job trained on after SIGTERM. Now every rank decides "go on" for this step (the others saw no signal) and
    "stop" at the next one."""
    from minivit.train.loop import _StopFlag

    flag = _StopFlag()
    world = _WorldWithASignalDuringTheCollective(flag)
    flag.agree(world)
    assert not flag.stop and flag.signum == signal.SIGTERM      # this step: the same answer as the others'
    flag.agree(world)
    assert flag.stop and flag.decided == signal.SIGTERM         # the next step: every rank stops


def test_a_signal_after_the_decision_waits_for_the_next_step():
    """Was: `stop` read the handler's record directly, so a signal arriving during an evaluation made this rank
    break after the step while the others, which had decided to go on, waited for it in the next collective
    forever. Now `stop` is the step's decision, on one process as on several."""
    from minivit.train.loop import _StopFlag

    flag = _StopFlag()
    flag.agree(None)
    flag._handle(signal.SIGTERM, None)                          # e.g. during evaluate_and_save
    assert not flag.stop
    flag.agree(None)
    assert flag.stop and flag.decided == signal.SIGTERM


def test_another_ranks_signal_stops_this_one_and_its_own_late_signal_is_not_a_second():
    from minivit.train.loop import _StopFlag

    class OtherRankSignalled:
        def max(self, value, what=""):
            return max(value, signal.SIGTERM)

    flag = _StopFlag()
    flag.agree(OtherRankSignalled())
    assert flag.stop and flag.decided == signal.SIGTERM
    flag._handle(signal.SIGTERM, None)                          # its own, forwarded later: recorded, no SecondSignal
    assert flag.signum == signal.SIGTERM
