"""minivit.distributed: data parallelism, R processes (ranks), each with a whole copy of the model and a
slice of the batch. Started by an MPI launcher:

    mpiexec -n 2 python -m minivit.train --dataset shapes --recipe demo          # 2 ranks, this machine
    mpiexec -n 4 python -m minivit.train --dataset cifar10 --backend cupy       # 4 GPUs, one rank each

    communicators.py  the ranks and how they talk: whether a launcher started this process (init), the
                      collectives on MPI (MPIComm, host arrays) and NCCL (NCCLComm, GPU arrays), and faults:
                      a collective that waits too long (Watchdog), an error that ends every rank (abort)
    data_parallel.py  what they do with it, and why it gives one process's step: each rank's slice of the
                      batch and its random streams, the gradients in one flat buffer (FlatBuffer), the
                      step's exchange (DataParallel: all-reduce, or ZeRO-1), sharded evaluation, and the
                      all-gather with its gradient that CLIP's loss needs

Every public name of both is here too: ``minivit.distributed.init``, ``.DataParallel``, ``.local_slice``...
The user's guide: docs/distributed.md.
"""

from .communicators import (ABORT_DRAIN_S, DEFAULT_TIMEOUT, EXIT_TIMEOUT, INSTALL, LAUNCHER_VARIABLES, MPIComm,
                            NCCLComm, Watchdog, exit_status, init, launched_by_mpi, timeout_from_env,
                            wait_until_output_is_read)
from .data_parallel import (DataParallel, FlatBuffer, all_gather_rows, all_gather_rows_backward, all_gather_shards,
                            check_global_batch, check_in_sync, local_slice, mean_over_ranks, rank_seed, seed_dropout,
                            shard, shard_range)

__all__ = ["ABORT_DRAIN_S", "DEFAULT_TIMEOUT", "EXIT_TIMEOUT", "INSTALL", "LAUNCHER_VARIABLES", "MPIComm", "NCCLComm",
           "Watchdog", "exit_status", "init", "launched_by_mpi", "timeout_from_env", "wait_until_output_is_read",
           "DataParallel", "FlatBuffer", "all_gather_rows", "all_gather_rows_backward", "all_gather_shards",
           "check_global_batch", "check_in_sync", "local_slice", "mean_over_ranks", "rank_seed", "seed_dropout",
           "shard", "shard_range"]
