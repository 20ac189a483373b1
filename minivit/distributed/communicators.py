"""The ranks and how they talk: who started this process, its communicator, and what a fault does.

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

What the ranks do with their communicator, data parallelism itself: data_parallel.py.
"""

import math
import os
import sys
import threading
import time
from contextlib import contextmanager

from .. import backend
from ..backend import backend_of

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
# Faults: a collective that waits too long ends the process; an abort lets the error out first
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
                wait_until_output_is_read()          # the launcher may end the job as soon as this rank exits
                os._exit(EXIT_TIMEOUT)


def wait_until_output_is_read(fds=(1, 2), limit=ABORT_DRAIN_S):
    """Wait (at most limit seconds) until the launcher has read everything this process wrote to its
    stdout and stderr, when they are pipes (under mpiexec they are: the launcher forwards them).

    Why: MPICH's launcher receives a rank's output on its pipes and MPI_Abort on another channel, and it may
    act on the abort first, ending every rank before it forwarded the error that caused it; the user would
    see the exit status and not why. The bytes still in a pipe are counted by ioctl FIONREAD (Linux: on
    either end of the pipe)."""
    import stat
    from array import array

    try:
        import fcntl
        import termios
    except ImportError:   # not POSIX (Windows): no way to count the unread bytes; abort must still go on
        return
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
