"""Drop-in data-parallel training over MPI ranks (the training layer).

Broadcast the initial state, all-reduce gradients inside the jitted step
(fused into a few buckets), keep mutable model state (BatchNorm statistics)
equal across ranks, give every rank its own part of each global batch with
the same number of steps everywhere, checkpoint atomically, resume after a
restart, stop cleanly on preemption, and log on rank 0. See
:class:`DataParallel` for the one-line version of the loop.
"""

from mpijax._src.train.broadcast import broadcast as broadcast
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
from mpijax._src.train.preemption import PREEMPTED_EXIT_CODE as PREEMPTED_EXIT_CODE
from mpijax._src.train.preemption import Preempted as Preempted
from mpijax._src.train.preemption import install_preemption_handler as install_preemption_handler
from mpijax._src.train.preemption import preemption_requested as preemption_requested
from mpijax._src.train.preemption import request_preemption as request_preemption
from mpijax._src.train.preemption import stop_requested as stop_requested
from mpijax._src.train.preemption import (
    uninstall_preemption_handler as uninstall_preemption_handler,
)
from mpijax._src.train.replicated_checkpoint import CheckpointError as CheckpointError
from mpijax._src.train.replicated_checkpoint import CheckpointMismatch as CheckpointMismatch
from mpijax._src.train.replicated_checkpoint import checkpoint_metadata as checkpoint_metadata
from mpijax._src.train.replicated_checkpoint import restore_checkpoint as restore_checkpoint
from mpijax._src.train.replicated_checkpoint import save_checkpoint as save_checkpoint
from mpijax._src.train.resume import checkpoint_path as checkpoint_path
from mpijax._src.train.resume import latest_checkpoint as latest_checkpoint
from mpijax._src.train.resume import list_checkpoints as list_checkpoints
from mpijax._src.train.resume import restart_attempt as restart_attempt
from mpijax._src.train.resume import resume_or_init as resume_or_init
from mpijax._src.train.resume import save_step_checkpoint as save_step_checkpoint

__all__ = [
    "Batch",
    "CheckpointError",
    "CheckpointMismatch",
    "DataParallel",
    "PREEMPTED_EXIT_CODE",
    "Preempted",
    "ShardedBatches",
    "TrainState",
    "accumulate_gradients",
    "allreduce_gradients",
    "broadcast",
    "checkpoint_metadata",
    "checkpoint_path",
    "fused_allreduce",
    "install_preemption_handler",
    "is_main_process",
    "latest_checkpoint",
    "list_checkpoints",
    "log",
    "mean_metrics",
    "preemption_requested",
    "progress",
    "request_preemption",
    "restart_attempt",
    "restore_checkpoint",
    "resume_or_init",
    "save_checkpoint",
    "save_step_checkpoint",
    "shard_batches",
    "stop_requested",
    "uninstall_preemption_handler",
]
