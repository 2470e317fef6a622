"""The training layer: data-parallel training over MPI ranks.

Public API in :mod:`mpijax.train`. Modules:

* ``communicator``: which communicator and rank to use; the sleeping barrier.
* ``broadcast``: parameters and optimizer state from one rank to all.
* ``gradients``: fused (bucketed) gradient all-reduce as an optax
  ``GradientTransformation``, and gradient accumulation.
* ``data``: per-rank batches with equal step counts.
* ``metrics``: cross-rank means, rank-0 logging and progress.
* ``checkpoint``: atomic, checksummed checkpoints.
* ``resume``: numbered checkpoints in a directory, resume from the newest.
* ``preemption``: SIGTERM/SIGUSR1 -> a step every rank agrees on -> exit 75.
* ``model_state``: BatchNorm-style state: synchronized or averaged over ranks.
* ``data_parallel``: the ``DataParallel`` helper for the common loop.
"""
