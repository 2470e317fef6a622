"""Preemption: stop at a step every rank agrees on, checkpoint, exit 75.

A scheduler announces the end of a job with a signal: Slurm's
``--signal=B:USR1@120`` (forwarded to the job step by the batch script),
SIGTERM before a kill. The handler only sets a flag: the training loop looks
at it between steps. The ranks may get the signal at different steps (or only
one of them may get it), so the flag is agreed on collectively, either in the
step's own fused all-reduce (:class:`mpijax.train.DataParallel`) or by
:func:`stop_requested`, a one-integer host all-reduce to call at a cadence.
Then every rank checkpoints the same step and exits with
:data:`PREEMPTED_EXIT_CODE` (75, ``EX_TEMPFAIL``), which requeueing setups
take as "come back later", and ``mpijax-run --max-restarts`` does not restart.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

from mpijax._src import mpi_util
from mpijax._src.guards import failure
from mpijax._src.train import communicator

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h)
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_requested: list[int] = []  # signals received (set by the handler)
_previous: dict[int, Any] = {}
_lock = threading.Lock()


class Preempted(SystemExit):
  """Raised on every rank, at the same step, once the preemption checkpoint is written.

  A ``SystemExit`` with code 75: uncaught, the program exits with that status
  on every rank (``python -m mpijax`` lets it through instead of aborting
  the job, as every rank agreed on it). Catch it to do more before exiting.
  Raise it yourself only on every rank at the same step (after
  :func:`stop_requested` said so).

  Attributes:
    step: the training step the checkpoint holds.
    path: the checkpoint written (None when there was nothing to write).
  """

  def __init__(self, step: int | None = None, path: str | None = None):
    """Marks exit status 75 as agreed by every rank (see above).

    Args:
      step: the training step the checkpoint holds.
      path: the checkpoint written (None when there was nothing to write).
    """
    super().__init__(PREEMPTED_EXIT_CODE)
    self.step, self.path = step, path
    # Raised on every rank at the same step, by contract: the exit is agreed.
    agreed_exit()

  def __str__(self) -> str:
    return (f"preempted at step {self.step}: checkpoint {self.path}, exit status "
            f"{PREEMPTED_EXIT_CODE}")


def _handler(signum: int, _frame: Any) -> None:
  if _requested and signum == signal.SIGTERM:
    # A second SIGTERM: the program did not reach a step boundary in time (or
    # is not training); do what SIGTERM did before.
    previous = _previous.get(signum)
    signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    os.kill(os.getpid(), signum)
    return
  _requested.append(signum)


def install_preemption_handler(signals: Sequence[int] = DEFAULT_SIGNALS) -> bool:
  """Makes ``signals`` (default SIGTERM, SIGUSR1) request a preemption stop instead of killing.

  Idempotent. A second SIGTERM after the first falls back to the previous
  handler (by default: the process ends), so a program that never reaches a
  step boundary can still be stopped.

  Returns:
    False (and installs nothing) outside the main thread, where Python cannot
    install signal handlers.
  """
  if threading.current_thread() is not threading.main_thread():
    return False
  with _lock:
    for sig in signals:
      if sig in _previous:
        continue
      _previous[sig] = signal.signal(sig, _handler)
  return True


def uninstall_preemption_handler() -> None:
  """Restores the handlers :func:`install_preemption_handler` replaced; forgets requests."""
  if threading.current_thread() is not threading.main_thread():
    return
  with _lock:
    for sig, previous in _previous.items():
      signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    _previous.clear()
    _requested.clear()


def preemption_requested() -> bool:
  """Whether THIS rank got a preemption signal (or :func:`request_preemption`); not collective."""
  return bool(_requested)


def request_preemption() -> None:
  """Requests a preemption stop on this rank, as the signal would."""
  _requested.append(0)


def stop_requested(comm: Any | None = None) -> bool:
  """Collective: True on every rank when any rank has a preemption request.

  One host all-reduce of one integer. Call it on every rank at the same steps
  (e.g. every 10 steps) in a loop that does not use ``DataParallel``, then
  checkpoint and ``raise Preempted(step, path)`` when it says so.
  """
  rank_count = communicator.rank_and_size(comm)[1]
  if rank_count == 1:
    return preemption_requested()
  comm = communicator.get_comm(comm, "mpijax.train.stop_requested")
  MPI = mpi_util.import_mpi()
  return bool(comm.allreduce(1 if preemption_requested() else 0, op=MPI.MAX))


def agreed_exit() -> None:
  """Marks exit status 75 as agreed by every rank (no job abort in ``python -m mpijax``)."""
  failure.agree_exit_code(PREEMPTED_EXIT_CODE)
