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

The ranks, their communicator (MPIComm or NCCLComm: one interface) and what a fault does are in
communicators.py; this file only calls the collectives.

Glossary: R world_size (ranks), r rank (0 .. R-1), B global batch, b = B / R images per rank,
n number of parameter values (all of them, flat), k = ceil(n / R) values in each ZeRO shard.
"""

import math

from ..backend import get_array_module, host_rng
from ..layers import Dropout
from ..optim import clip_grad_norm


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
