"""Drop-in data-parallel training over MPI ranks (layer 6).

Broadcast the initial state, all-reduce gradients inside the jitted step
(fused into a few buckets), give every rank its own part of each global batch
with the same number of steps everywhere, checkpoint atomically, and log on
rank 0. See :class:`DataParallel` for the one-line version of the loop.
"""

from mpijax._src.train.broadcast import broadcast as broadcast
from mpijax._src.train.checkpoint import CheckpointError as CheckpointError
from mpijax._src.train.checkpoint import checkpoint_metadata as checkpoint_metadata
from mpijax._src.train.checkpoint import restore_checkpoint as restore_checkpoint
from mpijax._src.train.checkpoint import save_checkpoint as save_checkpoint
from mpijax._src.train.data import Batch as Batch
from mpijax._src.train.data import ShardedBatches as ShardedBatches
from mpijax._src.train.data import shard_batches as shard_batches
from mpijax._src.train.data_parallel import DataParallel as DataParallel
from mpijax._src.train.data_parallel import TrainState as TrainState
from mpijax._src.train.gradients import accumulate_gradients as accumulate_gradients
from mpijax._src.train.gradients import allreduce_gradients as allreduce_gradients
from mpijax._src.train.gradients import fused_allreduce as fused_allreduce
from mpijax._src.train.metrics import is_main_process as is_main_process
from mpijax._src.train.metrics import log as log
from mpijax._src.train.metrics import mean_metrics as mean_metrics
from mpijax._src.train.metrics import progress as progress

__all__ = [
    "Batch",
    "CheckpointError",
    "DataParallel",
    "ShardedBatches",
    "TrainState",
    "accumulate_gradients",
    "allreduce_gradients",
    "broadcast",
    "checkpoint_metadata",
    "fused_allreduce",
    "is_main_process",
    "log",
    "mean_metrics",
    "progress",
    "restore_checkpoint",
    "save_checkpoint",
    "shard_batches",
]
