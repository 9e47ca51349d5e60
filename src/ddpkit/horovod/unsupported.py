"""What Horovod has and ddpkit.horovod does not: one error, one line each, naming what to use instead."""

from __future__ import annotations

from ddpkit.errors import UserError


class HorovodUnsupportedError(UserError):
    """A Horovod feature that ddpkit.horovod does not provide; the message names the alternative."""


ADASUM = (
    "op=Adasum is not supported by ddpkit.horovod; use op=hvd.Average (or hvd.Sum) and, for large "
    "batches, a large-batch optimizer such as LAMB or LARS"
)
ELASTIC = (
    "hvd.elastic is not supported by ddpkit.horovod; for fault tolerance save with ddpkit.Checkpointer "
    "and resume with ckpt.resume('auto'), and let `ddpkit run max_restarts=N` (or torchrun "
    "--max-restarts) restart the workers"
)
PROCESS_SETS = (
    "process sets other than the global one are not supported by ddpkit.horovod; run the collective "
    "on every rank (process_set=hvd.global_process_set), or use torch.distributed.new_group "
    "and its collectives for a subgroup"
)
SYNC_BATCH_NORM = (
    "hvd.SyncBatchNorm is not supported by ddpkit.horovod; use torch.nn.SyncBatchNorm "
    "through ddpkit.prepare_model(model, sync_batchnorm=True) on CUDA"
)
COMM = (
    "hvd.init(comm=...) is not supported by ddpkit.horovod; start every rank with mpirun, srun, torchrun "
    "or `ddpkit run` and call hvd.init() with no arguments"
)
