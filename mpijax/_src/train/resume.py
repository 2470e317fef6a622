"""Checkpoint directories: numbered checkpoints, resume from the last complete one.

A directory holds ``step_<step>.ckpt`` files, each written atomically by
:func:`mpijax.train.save_checkpoint` (a temporary file, fsync, rename): a file
under that name is complete, and a checksum catches a disk that lied. The
newest ``keep`` are kept, so a corrupt newest file still leaves one to fall
back to. :func:`resume_or_init` makes a script restartable: the same code
runs the first time (no checkpoint: ``init_fn()``) and after a crash or a
preemption (the newest readable checkpoint).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mpijax._src import config
from mpijax._src import log
from mpijax._src import mpi_util
from mpijax._src.train import communicator
from mpijax._src.train import replicated_checkpoint as _ckpt

_NAME = re.compile(r"step_(\d+)\.ckpt")


def restart_attempt() -> int:
  """Which run of a restarted job this is: 0 first, 1 after the first restart, ...

  ``mpijax-run --max-restarts N`` sets ``MPIJAX_RESTART_ATTEMPT`` on every
  rank; outside it this is 0.
  """
  return int(config.get("restart_attempt"))


def checkpoint_path(directory: str | os.PathLike, step: int) -> str:
  """The file name of step ``step``'s checkpoint in ``directory``.

  Args:
    directory: the checkpoint directory.
    step: the training step.

  Returns:
    ``<directory>/step_<step, 9 digits>.ckpt``.

  Examples:
    >>> mpijax.train.checkpoint_path("ckpt", 1200)
    'ckpt/step_000001200.ckpt'
  """
  return os.path.join(os.fspath(directory), f"step_{int(step):09d}.ckpt")


def _list_local(directory: str) -> list[tuple[int, str]]:
  try:
    names = os.listdir(directory)
  except (FileNotFoundError, NotADirectoryError):
    return []
  found = [
    (int(m.group(1)), os.path.join(directory, name))
    for name in names
    if (m := _NAME.fullmatch(name))
  ]
  return sorted(found)


def list_checkpoints(
  directory: str | os.PathLike, *, comm: Any | None = None
) -> list[tuple[int, str]]:
  """``[(step, path), ...]`` of the checkpoints in ``directory``, oldest first.

  Collective in a multi-rank job: rank 0 lists the directory and every rank
  gets its list (so all ranks decide alike even if their views lag).

  Args:
    directory: the checkpoint directory (a missing one has none).
    comm: an mpi4py communicator; default mpijax's (none in a plain
      single process).

  Returns:
    ``(step, path)`` pairs of the ``step_<step>.ckpt`` files, by step; each
    path is in this rank's ``directory``.
  """
  directory = os.fspath(directory)
  comm = _ckpt._comm_or_none(comm)
  if comm is None or comm.Get_size() == 1:
    return _list_local(directory)
  mine = (
    [(step, os.path.basename(path)) for step, path in _list_local(directory)]
    if comm.Get_rank() == 0
    else None
  )
  # Names, not paths: each rank opens them in its own `directory` (on
  # node-local disks a rank that lacks the file then says so).
  return [
    (int(step), os.path.join(directory, name))
    for step, name in json.loads(mpi_util.bcast_str(comm, json.dumps(mine), 0))
  ]


def latest_checkpoint(directory: str | os.PathLike, *, comm: Any | None = None) -> str | None:
  """The newest checkpoint in ``directory`` (by step), or None.

  Collective, as :func:`list_checkpoints`.

  Args:
    directory: the checkpoint directory.
    comm: an mpi4py communicator; default mpijax's.

  Returns:
    The path of the checkpoint with the largest step, or None when there is
    none. It is not opened: :func:`resume_or_init` also falls back to an
    older one when the newest cannot be read.
  """
  found = list_checkpoints(directory, comm=comm)
  return found[-1][1] if found else None


def save_step_checkpoint(
  directory: str | os.PathLike,
  tree: Any,
  step: int,
  *,
  keep: int | None = 2,
  metadata: dict[str, Any] | None = None,
  comm: Any | None = None,
) -> str:
  """Writes ``tree`` as step ``step``'s checkpoint in ``directory``, then prunes old ones.

  Collective (see :func:`mpijax.train.save_checkpoint`: rank 0 writes, the
  file appears atomically). Afterwards rank 0 deletes all but the newest
  ``keep`` checkpoints of the directory (``None`` keeps every one); a crash at
  any moment leaves at least the previous complete checkpoint.

  Args:
    directory: the checkpoint directory (created if missing).
    tree: the replicated pytree to save (e.g. a ``TrainState``).
    step: the training step it holds (names the file; newest = largest).
    keep: how many checkpoints to keep, >= 1, or None for all.
    metadata: JSON-serializable extras (``checkpoint_metadata(path)``).
    comm: an mpi4py communicator; default mpijax's.

  Returns:
    The path written.

  Raises:
    ValueError: ``keep`` or ``step`` is not a valid count, or ``tree``
      carries a step of its own (``tree["step"]``, ``TrainState.step``)
      other than ``step``.
    TypeError: as :func:`save_checkpoint`.
    OSError: as :func:`save_checkpoint`.
  """
  if keep is not None and (not isinstance(keep, int) or keep < 1):
    raise ValueError(f"keep={keep!r} must be an integer >= 1 (or None to keep every checkpoint)")
  if not isinstance(step, int) or step < 0:
    raise ValueError(f"step={step!r} must be an integer >= 0")
  own = _tree_step(tree)
  if own is not None and own != step:
    raise ValueError(
      f"save_step_checkpoint(..., step={step}) got a tree whose own step is {own}: a run "
      f"resumed from it would start again at step {own}. Advance the tree's step with the "
      f"training (e.g. state['step'] = step + 1 in your step function), or pass step={own}."
    )
  directory = os.fspath(directory)
  path = checkpoint_path(directory, step)
  _ckpt.save_checkpoint(path, tree, metadata={"step": step, **(metadata or {})}, comm=comm)
  comm = _ckpt._comm_or_none(comm)
  if keep is not None and (comm is None or comm.Get_rank() == 0):
    for _, old in _list_local(directory)[:-keep]:
      try:
        os.unlink(old)
      except OSError:
        pass  # gone already; another try at the next save
  return path


def _tree_step(tree: Any) -> int | None:
  """The step a tree carries itself (``state["step"]``, ``TrainState.step``), if any."""
  value = tree.get("step") if isinstance(tree, Mapping) else getattr(tree, "step", None)
  if value is None or isinstance(value, bool):
    return None
  try:
    array = np.asarray(value)
  except Exception:  # a tracer or an object: nothing to compare
    return None
  if array.shape != () or array.dtype.kind not in "iu":
    return None
  return int(array)


def resume_or_init(
  directory: str | os.PathLike, init_fn: Callable[[], Any], *, comm: Any | None = None
) -> Any:
  """The newest complete checkpoint in ``directory`` if there is one, else ``init_fn()``.

  ``init_fn()`` is called on every rank in any case: its result gives the
  structure (and leaf kinds and placement) to restore into, like
  :func:`mpijax.train.restore_checkpoint`'s ``like``. Checkpoints are tried
  newest first; one that a rank cannot read (corrupt, truncated) is skipped
  with a warning, on every rank alike. A checkpoint that does not fit
  ``init_fn()``'s tree (another model) is an error, not skipped.

  Collective: every rank calls it, with the same directory.

  Args:
    directory: a checkpoint directory (as written by
      :func:`save_step_checkpoint` or ``DataParallel(checkpoint_dir=...)``);
      need not exist.
    init_fn: builds the fresh tree (e.g. ``lambda: dp.init(params, rng)``).
    comm: an mpi4py communicator; default mpijax's.

  Returns:
    The restored tree, or ``init_fn()``'s.

  Raises:
    CheckpointMismatch: the newest checkpoint does not fit ``init_fn()``'s
      tree (another model, optimizer or state).
    CheckpointError: there are checkpoints, but no rank-wide readable one
      (starting afresh would overwrite the run's progress).

  Examples:
    >>> state = mpijax.train.resume_or_init("ckpt", lambda: dp.init(params))  # doctest: +SKIP
    >>> epoch, start = divmod(int(state.step), steps_per_epoch)
  """
  fresh = init_fn()
  rank = communicator.rank_and_size(_ckpt._comm_or_none(comm))[0]
  skipped: list[str] = []
  for step, path in reversed(list_checkpoints(directory, comm=comm)):
    try:
      restored = _ckpt.restore_checkpoint(path, like=fresh, comm=comm)
    except _ckpt.CheckpointMismatch as e:
      raise _ckpt.CheckpointMismatch(
        f"resume_or_init({os.fspath(directory)!r}): the newest checkpoint there is not one of "
        f"this run (another model, optimizer or state): {e}\nTo start afresh, use another "
        "directory or move this one away."
      ) from None
    except _ckpt.CheckpointError as e:
      reason = str(e).replace("\n", "\n    ")
      skipped.append(f"{path}: {reason}")
      if rank == 0:
        log.warning(f"mpijax.train.resume_or_init: skipping unreadable checkpoint {path}: {reason}")
      continue
    log.notice(f"mpijax.train.resume_or_init: resumed from {path} (step {step})")
    return restored
  if skipped:
    raise _ckpt.CheckpointError(
      f"resume_or_init({os.fspath(directory)!r}): no checkpoint could be read, so nothing is "
      "resumed (starting afresh would overwrite the run's progress):\n  "
      + "\n  ".join(skipped)
      + "\nMove the directory away to start afresh."
    )
  return fresh
