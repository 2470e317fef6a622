"""Which communicator, rank and rank count the training layer talks to, and a
barrier that sleeps while it waits."""

from __future__ import annotations

from typing import Any

from mpijax._src.runtime import state as runtime


def get_comm(comm: Any | None, what: str) -> Any:
  """``comm`` if given, else mpijax's private communicator (needs ``mpijax.init()``)."""
  if comm is not None:
    return comm
  return runtime.get(what).comm


def rank_and_size(comm: Any | None = None) -> tuple[int, int]:
  """This process' rank and the rank count, without requiring ``mpijax.init()``.

  Logging and progress bars must work in a plain single-process script too, so
  this falls back to (0, 1) when neither a communicator nor the runtime exists.
  """
  if comm is not None:
    return comm.Get_rank(), comm.Get_size()
  if runtime.is_initialized():
    rt = runtime.get()
    return rt.rank, rt.size
  found = launcher()
  if found is not None:  # before init(): the launcher's own variables
    rank, size = found.get_process_id(), found.get_process_count()
    if rank is not None and size is not None:
      return rank, size
  return 0, 1


def launcher() -> Any | None:
  """The detector of the launcher that started this process (mpirun, srun, ...), or None."""
  from mpijax._src import cluster

  for detector in cluster.base.registered():
    if detector.name not in ("mpi", "single") and detector.is_env_present():
      return detector
  return None


def idle_barrier(comm: Any, poll_seconds: float = 0.002) -> None:
  """A barrier that sleeps while it waits instead of spinning.

  Blocking MPI calls busy-poll. When ranks share cores (oversubscribed CPU
  runs), a rank that finished compiling and spins in the first all-reduce
  steals the CPU that a slower rank needs to finish compiling.
  """
  import time

  if comm.Get_size() == 1:
    return
  req = comm.Ibarrier()
  while not req.Test():
    time.sleep(poll_seconds)
