"""Data parallelism: R processes (ranks), each with a whole copy of the model and a slice of the batch.

    mpiexec -n 2 python -m minivit.train --dataset shapes --recipe demo          # 2 ranks, this machine
    mpiexec -n 4 python -m minivit.train --dataset cifar10 --backend cupy       # 4 GPUs, one rank each

Why it works. A step's loss is the mean over its global batch of B images, which the R ranks split
into slices of b = B / R images each:
    L = 1/B sum_{i=1..B} l_i  =  1/R sum_r L_r,        L_r = 1/b sum_{i in slice r} l_i
so its gradient is the mean of the ranks' gradients:
    dL/dθ = 1/R sum_r dL_r/dθ
Each rank back-propagates its own slice; one all-reduce (a sum over the ranks that every rank receives)
divided by R gives every rank the gradient a single process would have computed on the whole batch.
Clipping, the loss scaler's overflow test and the optimizer step then run on that same gradient, so all
ranks take the same step and their parameters stay equal without ever being sent.

ZeRO-1 (Rajbhandari et al., 2020, stage 1) keeps that result but shares out the optimizer's memory:
the flat gradient is reduce-scattered (rank r receives only the sum of its 1/R-th, its shard), each rank
updates the parameters of its shard with its shard of the optimizer state (AdamW: m and v), and an
all-gather of the updated shards gives every rank the whole new parameter vector.

The engines (optional: pip install minivit[distributed]):
- MPI (mpi4py, any MPI library; the `mpich` wheel brings `mpiexec`) starts the ranks and does the
  collectives on host (NumPy) arrays: MPIComm;
- NCCL (cupy.cuda.nccl) does them on GPU arrays, one GPU per rank: NCCLComm. MPI still carries NCCL's
  id and the few numbers a step exchanges (losses, flags), so no CUDA-aware MPI is needed.
A process that no MPI launcher started imports neither: ``init()`` returns None and the trainer runs
exactly as it always did.

Faults. A rank that raises prints its error and calls ``abort``, which waits (at most ABORT_DRAIN_S) until
the launcher has read that error, then ends every rank (MPI_Abort); one that dies or hangs is caught
by the others' Watchdog: no collective waits longer than MINIVIT_DIST_TIMEOUT seconds (default 300).

Glossary: R world_size (ranks), r rank (0 .. R-1), B global batch, b = B / R images per rank,
n number of parameter values (all of them, flat), k = ceil(n / R) values in each ZeRO shard.
"""

import math
import os
import sys
import threading
import time
from contextlib import contextmanager

from . import backend
from .backend import backend_of, get_array_module, host_rng
from .layers import Dropout
from .optim import clip_grad_norm

# Set by the launchers: MPICH's and Intel MPI's hydra (PMI_*), Open MPI (OMPI_*), PMIx (srun --mpi=pmix,
# Open MPI 5). A process that has none of them was started alone.
LAUNCHER_VARIABLES = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
DEFAULT_TIMEOUT = 300.0   # seconds one collective may wait for the other ranks (MINIVIT_DIST_TIMEOUT)
INSTALL = "pip install minivit[distributed]   (or: pip install mpi4py mpich)"


def launched_by_mpi(environ=None):
    """True when an MPI launcher (mpiexec, mpirun, srun) started this process."""
    environ = os.environ if environ is None else environ
    return any(name in environ for name in LAUNCHER_VARIABLES)


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError(f"this process was started by an MPI launcher but mpi4py is missing ({err}); "
                           f"install it with: {INSTALL}") from None
    return MPI


def timeout_from_env():
    value = os.environ.get("MINIVIT_DIST_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"MINIVIT_DIST_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


# --------------------------------------------------------------------------------------------------
# Faults: a collective that waits too long ends the process
# --------------------------------------------------------------------------------------------------

EXIT_TIMEOUT = 75   # the exit status of a rank that gave up waiting (EX_TEMPFAIL: try again)
ABORT_DRAIN_S = 2.0   # abort waits at most this long for the launcher to read what this rank printed


class Watchdog:
    """Ends this process when one collective has waited more than `timeout` seconds for the others.

    A rank that died (killed, out of memory) or hangs never joins the next collective, and MPI and NCCL
    would wait for it forever. Every collective runs inside ``with watchdog("what"):``; a thread looks
    once a second (or more often for a short timeout) and, past the deadline, prints which collective
    waited and exits with EXIT_TIMEOUT. The launcher then stops the remaining ranks (mpiexec does at
    once). MPI and CuPy release Python's lock while they wait, so the thread gets to run."""

    def __init__(self, rank, timeout=DEFAULT_TIMEOUT):
        self.rank, self.timeout = rank, float(timeout)
        self.waiting = None           # (what, since) while a collective runs, else None
        self._thread = None

    @contextmanager
    def __call__(self, what):
        if self._thread is None:      # started on first use: a communicator that is never used costs nothing
            self._thread = threading.Thread(target=self._watch, name="minivit-watchdog", daemon=True)
            self._thread.start()
        self.waiting = (what, time.monotonic())
        try:
            yield
        finally:
            self.waiting = None

    def _watch(self):
        poll = min(1.0, self.timeout / 10)
        while True:
            time.sleep(poll)
            waiting = self.waiting
            if waiting is not None and time.monotonic() - waiting[1] > self.timeout:
                what, _ = waiting
                sys.stderr.write(f"error: rank {self.rank} waited more than {self.timeout:g} s for the other ranks "
                                 f"in {what}: a rank has died or hangs (its own output says why). Exiting; "
                                 f"MINIVIT_DIST_TIMEOUT sets the limit.\n")
                sys.stderr.flush()
                os._exit(EXIT_TIMEOUT)


# --------------------------------------------------------------------------------------------------
# The communicators: one small interface, on MPI (host arrays) and on NCCL (GPU arrays)
# --------------------------------------------------------------------------------------------------


class MPIComm:
    """The collectives data parallelism needs, on MPI through mpi4py. Every method is collective: all
    ranks call it, in the same order. Array methods work in place on contiguous 1-D NumPy arrays.

    rank, world_size: r and R. local_rank, local_size: this rank among the ranks of its machine (which
    GPU it takes)."""

    def __init__(self, comm=None, timeout=None):
        MPI = _import_mpi()
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)      # the ranks that share this machine's memory
        self.local_rank, self.local_size = node.Get_rank(), node.Get_size()
        node.Free()
        self.watchdog = Watchdog(self.rank, timeout_from_env() if timeout is None else timeout)

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # -- arrays: the gradients and parameters --------------------------------------------------------

    def allreduce(self, buf, what="the gradient all-reduce"):
        """buf <- sum over ranks of buf, in place. buf: (n,)."""
        with self.watchdog(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return buf

    def reduce_scatter(self, buf, out, what="the gradient reduce-scatter"):
        """out <- sum over ranks of buf[r k:(r+1) k], rank r's shard. buf: (R k,); out: (k,)."""
        with self.watchdog(what):
            self.comm.Reduce_scatter_block(buf, out, op=self.MPI.SUM)
        return out

    def allgather(self, shard, out, what="the parameter all-gather"):
        """out[r k:(r+1) k] <- rank r's shard, on every rank. shard: (k,); out: (R k,)."""
        with self.watchdog(what):
            self.comm.Allgather(shard, out)
        return out

    # -- small host values: losses, counts, flags ----------------------------------------------------

    def sum(self, values, what="a sum over the ranks"):
        """The sum over ranks of each float in values (a list); returns a list of floats."""
        import numpy

        buf = numpy.array(values, dtype=numpy.float64)          # (len(values),)
        with self.watchdog(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return [float(v) for v in buf]

    def any(self, flag, what="the stop flag"):
        """True on every rank when flag is true on at least one."""
        with self.watchdog(what):
            return bool(self.comm.allreduce(bool(flag), op=self.MPI.LOR))

    def max(self, value, what="a maximum over the ranks"):
        """The largest of every rank's int value, on every rank."""
        with self.watchdog(what):
            return int(self.comm.allreduce(int(value), op=self.MPI.MAX))

    def broadcast(self, obj, root=0, what="a broadcast"):
        """Rank root's obj (any picklable value), on every rank."""
        with self.watchdog(what):
            return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj, what="an all-gather"):
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        with self.watchdog(what):
            return self.comm.allgather(obj)

    def abort(self, code=1):
        """End every rank now (MPI_Abort), with this exit status. Never returns.

        What this rank printed last (its error) is first left time to reach the user: see
        wait_until_output_is_read."""
        sys.stdout.flush()
        sys.stderr.flush()
        wait_until_output_is_read()
        try:
            self.comm.Abort(code)
        finally:
            os._exit(code)   # MPI_Abort may return before the launcher has ended this process


def wait_until_output_is_read(fds=(1, 2), limit=ABORT_DRAIN_S):
    """Wait (at most limit seconds) until the launcher has read everything this process wrote to its
    stdout and stderr, when they are pipes (under mpiexec they are: the launcher forwards them).

    Why: MPICH's launcher receives a rank's output on its pipes and MPI_Abort on another channel, and it may
    act on the abort first, ending every rank before it forwarded the error that caused it; the user would
    see the exit status and not why. The bytes still in a pipe are counted by ioctl FIONREAD (Linux: on
    either end of the pipe)."""
    import fcntl
    import stat
    import termios
    from array import array

    deadline = time.monotonic() + limit
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            unread = array("i", [0])
            while True:
                fcntl.ioctl(fd, termios.FIONREAD, unread, True)
                if unread[0] == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        except OSError:   # closed, or a system without FIONREAD on pipes: nothing to wait for
            continue


class NCCLComm(MPIComm):
    """MPIComm with the array collectives on the GPU through NCCL (cupy.cuda.nccl), one GPU per rank.

    Rank 0 makes NCCL's unique id, MPI broadcasts it, and every rank joins NcclCommunicator(R, id, r) on
    its device. Arrays that live on the host still go through MPI, and so do the small values."""

    DTYPES = {"float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}

    def __init__(self, comm=None, timeout=None):
        super().__init__(comm, timeout)
        cupy = backend.backend_module("cupy")        # a clear error when CuPy or a GPU is missing
        from cupy.cuda import nccl

        self.cupy, self.nccl = cupy, nccl
        self.device = _choose_device(self, cupy)
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.broadcast(uid, what="NCCL's unique id")
        with self.watchdog("NCCL's setup (ncclCommInitRank)"):
            self.nccl_comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)

    def _dtype(self, buf):
        name = self.DTYPES.get(buf.dtype.name)
        if name is None:
            raise TypeError(f"NCCLComm moves float16, float32 or float64 arrays, got dtype {buf.dtype}")
        return getattr(self.nccl, name)

    def _run(self, what, launch):
        """Queue one NCCL collective on the current stream and wait for it (under the watchdog)."""
        stream = self.cupy.cuda.get_current_stream()
        with self.watchdog(what):
            launch(stream.ptr)
            stream.synchronize()

    def allreduce(self, buf, what="the gradient all-reduce"):
        if backend_of(buf) != "cupy":
            return super().allreduce(buf, what)
        ptr = buf.data.ptr
        self._run(what, lambda s: self.nccl_comm.allReduce(ptr, ptr, buf.size, self._dtype(buf), self.nccl.NCCL_SUM, s))
        return buf

    def reduce_scatter(self, buf, out, what="the gradient reduce-scatter"):
        if backend_of(buf) != "cupy":
            return super().reduce_scatter(buf, out, what)
        self._run(what, lambda s: self.nccl_comm.reduceScatter(buf.data.ptr, out.data.ptr, out.size, self._dtype(buf),
                                                               self.nccl.NCCL_SUM, s))
        return out

    def allgather(self, shard, out, what="the parameter all-gather"):
        if backend_of(shard) != "cupy":
            return super().allgather(shard, out, what)
        self._run(what, lambda s: self.nccl_comm.allGather(shard.data.ptr, out.data.ptr, shard.size,
                                                           self._dtype(shard), s))
        return out


def _choose_device(comm, cupy):
    """Put this rank on GPU local_rank (or on its only visible GPU, when the launcher gave each rank its
    own, as srun --gpus-per-task does) and refuse two ranks on one GPU: NCCL cannot run them."""
    count = cupy.cuda.runtime.getDeviceCount()
    if count >= comm.local_size:
        device = comm.local_rank
    elif count == 1:
        device = 0
    else:
        raise ValueError(f"{comm.local_size} ranks on this machine but {count} GPUs: start at most {count} "
                         "ranks per machine (NCCL needs one GPU per rank)")
    cupy.cuda.Device(device).use()
    bus = cupy.cuda.Device(device).pci_bus_id
    buses = comm.allgather_object((os.uname().nodename, bus), what="the GPU check")
    mine = [r for r, where in enumerate(buses) if where == (os.uname().nodename, bus)]
    if len(mine) > 1:
        raise ValueError(f"ranks {mine} share the GPU {bus} on {os.uname().nodename}: NCCL needs one GPU per rank "
                         f"(start at most {count} ranks per machine, or give each rank its own GPU)")
    return device


_world = None   # the communicator of this process, once made


def init(backend_name=None, timeout=None):
    """The communicator of this process, made once: None when no MPI launcher started it (one process,
    nothing imported), NCCLComm when the backend is 'cupy' (default: the current one), else MPIComm.

    With several ranks, from then on: ranks other than 0 print nothing (their stdout goes to os.devnull;
    stderr, where errors go, stays), and an exception that nothing catches ends every rank (MPI_Abort),
    since the others would otherwise wait for this one in their next collective."""
    global _world
    if _world is None and launched_by_mpi():
        name = backend.get_backend() if backend_name is None else backend_name
        _world = NCCLComm(timeout=timeout) if name == "cupy" else MPIComm(timeout=timeout)
        if _world.rank != 0:
            sys.stdout = open(os.devnull, "w")
        sys.excepthook = _abort_on_uncaught
    return _world


def _abort_on_uncaught(kind, value, traceback):
    """sys.excepthook with several ranks: print the traceback as usual, then end every rank."""
    sys.__excepthook__(kind, value, traceback)
    _world.abort(1)


def exit_status(code):
    """The exit of a rank with this status: after an error (any status but 0, 130 after Ctrl-C and 143 after
    SIGTERM, where all ranks stop together) every rank is ended (MPI_Abort), because the others may be
    waiting for this one. Returns code (for sys.exit) when there is nothing to end."""
    if _world is not None and code not in (0, 130, 143):
        _world.abort(code)
    return code


# --------------------------------------------------------------------------------------------------
# The batch: each rank takes its slice; its own random streams
# --------------------------------------------------------------------------------------------------


def check_global_batch(batch_size, world_size, grad_accum=1, resumed=False):
    """b = B / R, or a ValueError when B does not divide by R (or b by grad_accum). resumed: B is a resumed
    run's own, which cannot change, so the advice is the numbers of ranks that divide it."""
    ok = batch_size % world_size == 0 and (batch_size // world_size) % grad_accum == 0
    if not ok and resumed:
        counts = [r for r in range(1, batch_size + 1) if batch_size % r == 0 and (batch_size // r) % grad_accum == 0]
        raise ValueError(f"the resumed run's batch size {batch_size} (grad_accum {grad_accum}) does not divide over "
                         f"{world_size} ranks, and it cannot change on --resume: start it with mpiexec -n R for R in "
                         f"{counts[:12]}")
    if batch_size % world_size:
        fits = world_size * max(1, batch_size // world_size)
        raise ValueError(f"the global batch size {batch_size} must divide by the number of ranks {world_size} "
                         f"(each rank takes B / R images): use a batch size of {fits} or another number of ranks")
    b = batch_size // world_size
    if b % grad_accum:
        raise ValueError(f"grad_accum {grad_accum} must divide each rank's {b} images (batch size {batch_size} "
                         f"over {world_size} ranks)")
    return b


def local_slice(batch_size, rank, world_size):
    """The rows of the global batch that rank r takes: [r b, (r + 1) b)."""
    b = check_global_batch(batch_size, world_size)
    return slice(rank * b, (rank + 1) * b)


def shard_range(n, rank, world_size):
    """Rank r's part [start, stop) of n items (e.g. the test set) as even as it goes: the first n % R
    ranks take one more. Every item belongs to exactly one rank."""
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    return start, start + per + (rank < extra)


def shard(comm, x, y):
    """This rank's share of a held-out split (x (N, ...), y (N,)): rows shard_range(N, r, R). Refused when
    a rank would get none (its mean would be 0 / 0)."""
    n = x.shape[0]
    if n < comm.world_size:
        raise ValueError(f"the held-out split has {n} images, fewer than the {comm.world_size} ranks that share "
                         f"its evaluation")
    start, stop = shard_range(n, comm.rank, comm.world_size)
    return x[start:stop], y[start:stop]


def rank_seed(seed_parts, rank):
    """The seed of one rank's random stream: seed_parts + [rank]. Augmentation and dropout draw from
    streams of (seed, step, rank), so ranks draw different masks and a resumed run, with any number
    of ranks, draws what it would have drawn uninterrupted."""
    return list(seed_parts) + [rank]


def seed_dropout(model, seed, step, rank):
    """Give every Dropout (and drop-path) layer of model a generator of (seed, step, rank, its place)."""
    dropouts = [layer for layer in model.sublayers() if isinstance(layer, Dropout)]
    for i, layer in enumerate(dropouts):
        layer.rng = host_rng(rank_seed([seed, 2_000_003, step, i], rank))


# --------------------------------------------------------------------------------------------------
# The gradients in one flat buffer, so that one collective moves them all
# --------------------------------------------------------------------------------------------------


def _layout(params):
    """What the flat buffers depend on: every parameter's name, shape and dtype, in order."""
    return tuple((name, tuple(p.shape), str(p.dtype)) for name, p in params.items())


class FlatBuffer:
    """One flat array holding a dict of arrays (a model's params or grads) end to end:
        flat = [a_0.ravel(), a_1.ravel(), ..., zeros]          (N,), N = n rounded up to a multiple of `pad`
    names, shapes: as the dict's; offsets[i]: where array i starts. pack copies the arrays in, unpack
    copies them back out, in place (the layers keep their arrays)."""

    def __init__(self, arrays, pad=1):
        first = next(iter(arrays.values()))
        dtypes = {a.dtype for a in arrays.values()}
        if len(dtypes) != 1:
            raise TypeError(f"FlatBuffer needs arrays of one dtype, got {sorted(str(d) for d in dtypes)}")
        xp = get_array_module(first)
        self.names = list(arrays)
        self.shapes = [arrays[k].shape for k in self.names]
        self.sizes = [int(arrays[k].size) for k in self.names]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.n = sum(self.sizes)
        N = -(-self.n // pad) * pad                                 # n rounded up to a multiple of pad
        self.flat = xp.zeros(N, dtype=first.dtype)                  # (N,)

    def pack(self, arrays):
        for name, o, s in zip(self.names, self.offsets, self.sizes):
            self.flat[o:o + s] = arrays[name].ravel()
        return self.flat

    def unpack(self, arrays, flat=None):
        flat = self.flat if flat is None else flat
        for name, shape, o, s in zip(self.names, self.shapes, self.offsets, self.sizes):
            arrays[name][...] = flat[o:o + s].reshape(shape)


# --------------------------------------------------------------------------------------------------
# One step's exchange: plain data parallelism, or ZeRO-1
# --------------------------------------------------------------------------------------------------


class _Shard:
    """What an optimizer needs of a model (params, grads), for one rank's ZeRO shard: 1-D views into the
    shard's flat arrays, one per parameter that the shard covers (a parameter may be split between two)."""

    def __init__(self, params, grads):
        self.params, self.grads = params, grads


class DataParallel:
    """The exchange of one training step, on every rank, after its backward on its own slice:

        dp.average_gradients()          g <- 1/R sum_r g_r          (ZeRO: only this rank's shard of it)
        finite = dp.unscale(scaler)     mixed precision: g <- g / S, and True when every rank's g is finite
        norm = dp.clip_grad_norm(c)     the norm of the whole g, clipped to c, as one process does it
        dp.step()                       optimizer.step()            (ZeRO: the shard's, then all-gather)

    comm: an MPIComm or NCCLComm. model: has params and grads. optimizer: an SGD or AdamW of model;
    set its lr as usual, dp.step() reads it. zero: shard the optimizer state (ZeRO-1). With zero, call
    ``gather_optimizer_state()`` (on every rank) before saving optimizer.state_dict()."""

    def __init__(self, comm, model, optimizer, zero=False):
        self.comm, self.model, self.optimizer, self.zero = comm, model, optimizer, bool(zero)
        self._build()

    def _build(self):
        """The flat buffers (and ZeRO's shard) for the model's parameters as they stand now."""
        model, optimizer, R = self.model, self.optimizer, self.comm.world_size
        self.layout = _layout(model.params)
        self.grads = FlatBuffer(model.grads, pad=R if self.zero else 1)   # flat g (N,)
        if not self.zero:
            return
        self.params = FlatBuffer(model.params, pad=R)                     # flat p (N,)
        xp = get_array_module(self.grads.flat)
        k = self.grads.flat.size // R                                     # values per shard
        self.k, self.start = k, self.comm.rank * k                        # this shard: [start, start + k)
        self.g_shard = xp.zeros(k, dtype=self.grads.flat.dtype)           # (k,)
        self.p_shard = xp.zeros(k, dtype=self.params.flat.dtype)          # (k,)
        params, grads, self.segments = {}, {}, []
        for name, o, s in zip(self.params.names, self.params.offsets, self.params.sizes):
            a, b = max(o, self.start), min(o + s, self.start + k)         # the part of [o, o + s) in the shard
            if a < b:
                self.segments.append((name, a - o, b - o))               # name, its values [a - o, b - o)
                params[name] = self.p_shard[a - self.start:b - self.start]
                grads[name] = self.g_shard[a - self.start:b - self.start]
        self.shard = _Shard(params, grads)
        # the same optimizer, on the shard only: its state is 1/R of the whole
        hp = {name: getattr(optimizer, name) for name in optimizer.hyperparam_names}
        self.shard_optimizer = type(optimizer)(self.shard, **hp, no_decay=optimizer.no_decay & set(params))
        self._take_optimizer_state()

    def _follow_model(self):
        """Rebuild the buffers when the model's parameters changed (a layer added, removed or replaced by one
        of other shapes since the last step: model.params is live). Every rank runs the same code, so every
        rank rebuilds at the same step. ZeRO gathers the optimizer's state first and re-shards it, so the
        parameters that stayed keep theirs and a new one starts from zero, as with one process."""
        if _layout(self.model.params) == self.layout:
            return
        if self.zero:
            self.gather_optimizer_state()                                 # by the old layout, on every rank
            self.optimizer._read_model()                                  # drops the state of what is gone
        self._build()

    # -- the four parts of a step --------------------------------------------------------------------

    def average_gradients(self):
        """g <- 1/R sum_r g_r: into model.grads (plain), or into this rank's shard only (ZeRO)."""
        self._follow_model()
        flat = self.grads.pack(self.model.grads)                          # (N,) this rank's g_r
        inv_R = flat.dtype.type(1.0 / self.comm.world_size)
        if self.zero:
            self.comm.reduce_scatter(flat, self.g_shard)                  # (k,) sum_r of this shard
            self.g_shard *= inv_R
            return
        self.comm.allreduce(flat)                                         # (N,) sum_r g_r
        flat *= inv_R
        self.grads.unpack(self.model.grads)

    def batch_metrics(self, loss, correct):
        """The global batch's numbers from the ranks': the mean of their mean losses (equal slices), the sum of
        their counts of correct answers. Every rank gets the same, so all take the same branch after it."""
        loss_sum, correct_sum = self.comm.sum([loss, correct], what="the step's loss")
        return loss_sum / self.comm.world_size, int(round(correct_sum))

    def unscale(self, scaler):
        """Divide the averaged gradients by the loss scale S; True when all of them are finite, on every
        rank. (An overflow on one rank makes the sum inf or nan, so the plain test is already global.)"""
        if not self.zero:
            return scaler.unscale(self.model)
        return not self.comm.any(not scaler.unscale(self.shard), what="the overflow test")

    def clip_grad_norm(self, max_norm):
        """Scale g by min(1, max_norm / (||g|| + 1e-6)) with ||g|| the norm of the whole averaged gradient
        (optim.clip_grad_norm); ZeRO adds up the shards' ||g_shard||^2. Returns ||g||."""
        if not self.zero:
            return clip_grad_norm(self.model, max_norm)
        xp = get_array_module(self.g_shard)
        sq = float(xp.dot(self.g_shard, self.g_shard))                    # ||g_shard||^2
        total = math.sqrt(self.comm.sum([sq], what="the gradient norm")[0])  # ||g||
        scale = max_norm / (total + 1e-6)
        if scale < 1.0:
            self.g_shard *= self.g_shard.dtype.type(scale)
        return total

    def step(self):
        """The optimizer's update. ZeRO: of this rank's shard (its slice of p, with its slice of the state),
        then every shard all-gathered into the whole p of every rank."""
        if not self.zero:
            self.optimizer.step()
            return
        opt, inner = self.optimizer, self.shard_optimizer
        for name in opt.hyperparam_names:                                 # lr follows the schedule
            setattr(inner, name, getattr(opt, name))
        inner.t = opt.t
        flat_p = self.params.pack(self.model.params)                      # (N,) the current p
        self.p_shard[...] = flat_p[self.start:self.start + self.k]        # (k,) this rank's slice of it
        inner.step()                                                      # updates p_shard in place
        opt.t = inner.t
        self.comm.allgather(self.p_shard, flat_p)                         # (N,) every rank's new slice
        self.params.unpack(self.model.params)

    # -- ZeRO's optimizer state: sharded while training, whole in a checkpoint -------------------------

    def _take_optimizer_state(self):
        """Move the optimizer's state (e.g. loaded from a checkpoint) into the shard's optimizer: each
        rank keeps its slice of every buffer, and the whole optimizer keeps none (that is the saving)."""
        opt, inner = self.optimizer, self.shard_optimizer
        inner.t = opt.t
        for kind, buffers in opt.buffers.items():
            inner.buffers[kind] = {name: buffers[name].ravel()[a:b].copy()
                                   for name, a, b in self.segments if name in buffers}
            buffers.clear()

    def gather_optimizer_state(self):
        """Every rank's slice of each optimizer buffer gathered back into the whole optimizer (on every
        rank), so that optimizer.state_dict() holds what a single process would. Collective."""
        if not self.zero:
            return
        opt, inner = self.optimizer, self.shard_optimizer
        xp = get_array_module(self.p_shard)
        opt.t = inner.t
        flat = xp.zeros_like(self.params.flat)                            # (N,)
        for kind in opt.buffer_names:
            shard = xp.zeros_like(self.p_shard)                           # (k,) this rank's slice of the buffer
            mine = inner.buffers[kind]
            for name, a, b in self.segments:
                if name in mine:
                    o = self.params.offsets[self.params.names.index(name)]
                    shard[o + a - self.start:o + b - self.start] = mine[name]
            # a buffer exists for every parameter or for none (SGD with momentum 0, or before step 1)
            has = self.comm.any(bool(mine), what="the optimizer state")
            self.comm.allgather(shard, flat, what="the optimizer state")
            if has:
                opt.buffers[kind] = {}
                for name, shape, o, s in zip(self.params.names, self.params.shapes, self.params.offsets,
                                             self.params.sizes):
                    opt.buffers[kind][name] = flat[o:o + s].reshape(shape).copy()

    def release_optimizer_state(self):
        """After saving: drop the whole optimizer's gathered buffers again (they are the shard's)."""
        if self.zero:
            for buffers in self.optimizer.buffers.values():
                buffers.clear()


# --------------------------------------------------------------------------------------------------
# Evaluation sharded, and the mean of per-rank numbers
# --------------------------------------------------------------------------------------------------


def mean_over_ranks(comm, values, count):
    """The mean over all ranks' items of quantities each rank averaged over its own `count` items:
        mean = sum_r count_r * value_r / sum_r count_r
    values: a list of floats (e.g. [loss, accuracy]). Returns a list of floats."""
    totals = comm.sum([v * count for v in values] + [count], what="the evaluation sum")
    n = totals[-1]
    return [t / n for t in totals[:-1]]


def check_in_sync(comm, model):
    """Raise a RuntimeError when the ranks' parameters differ (they should be equal bit for bit)."""
    xp = get_array_module(*model.params.values())
    mine = [float(xp.abs(p).sum()) + float(p.ravel()[0]) for p in model.params.values()]
    ranks = comm.allgather_object(mine, what="the parameter check")
    different = [r for r, theirs in enumerate(ranks) if theirs != ranks[0]]
    if different:
        raise RuntimeError(f"the parameters of ranks {different} differ from rank 0's: the ranks went out of step")


# --------------------------------------------------------------------------------------------------
# All-gather with its gradient: CLIP's loss over the global batch (clip/loss.py) needs every rank's features
# --------------------------------------------------------------------------------------------------


def all_gather_rows(comm, x):
    """The rows of every rank, stacked in rank order: x (b, E) -> (R b, E), the same on every rank.
    The contrastive loss needs them: every image of the global batch is a negative for every text."""
    xp = get_array_module(x)
    b = x.shape[0]
    out = xp.empty((comm.world_size * b,) + x.shape[1:], dtype=x.dtype)     # (R b, E)
    comm.allgather(xp.ascontiguousarray(x).reshape(-1), out.reshape(-1), what="the feature all-gather")
    return out


def all_gather_shards(comm, x, n):
    """The whole (n, E) array from every rank's shard of it, x = rows shard_range(n, r, R) (uneven by one
    at most), the same on every rank. Each shard is padded to k = ceil(n / R) rows, all_gather_rows
    stacks them (R k, E), and the padding is cut out again. CLIP's evaluation gathers its test features."""
    xp = get_array_module(x)
    R = comm.world_size
    k = -(-n // R)                                                             # rows of the largest shard
    padded = xp.zeros((k,) + x.shape[1:], dtype=x.dtype)                       # (k, E)
    padded[:x.shape[0]] = x
    rows = all_gather_rows(comm, padded)                                       # (R k, E)
    parts = []
    for q in range(R):
        start, stop = shard_range(n, q, R)
        parts.append(rows[q * k:q * k + stop - start])                         # (n_q, E) rank q's rows
    return xp.concatenate(parts)                                               # (n, E)


def all_gather_rows_backward(comm, dout):
    """The gradient of all_gather_rows (open_clip's gather_with_grad): a reduce-scatter. Rank q's loss L_q
    used every rank's rows, so what reaches this rank's rows x_r is the sum of every rank's gradient for
    them:
        dx_r = sum_q dL_q/dx_r,      dL_q/dx_r = rows [r b, (r + 1) b) of rank q's dout
    dout: (R b, E), dL_r/d(the gathered rows) on this rank. Returns dx (b, E). Back-propagated through
    this rank's encoder it gives the gradient of sum_q L_q; DataParallel.average_gradients then divides by
    R, which makes it the gradient of the mean loss 1/R sum_q L_q, the loss of the whole global batch."""
    xp = get_array_module(dout)
    b = dout.shape[0] // comm.world_size
    flat = xp.ascontiguousarray(dout).reshape(-1).copy()                      # (R b E,)
    dx = xp.empty((b,) + dout.shape[1:], dtype=dout.dtype)                     # (b, E)
    comm.reduce_scatter(flat, dx.reshape(-1), what="the feature gradient reduce-scatter")
    return dx
