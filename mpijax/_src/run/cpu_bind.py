"""One core per rank where a node has more ranks than cores.

With more ranks on a node than cores (as on a laptop or a small CI machine),
the kernel moves each rank's threads from core to core, and ranks that wait
for each other end up queued behind one another: the same jitted
collective-permute of 4 KiB over 4 ranks on 2 cores took 50 µs in one job and
150-240 µs in the next. Each rank pinned to one core, round robin over the
node's ranks, ran it in 50-57 µs in every job (all-to-all 49-51 µs against
53-204, all-reduce 38-40 against 44-86). Messages of MiBs lose some: a 4 MiB
all-gather over those 4 ranks took 5.3 ms bound against 3.4 unbound, since
a rank's copies no longer spread to the core its neighbour leaves idle.
With a core or more per rank nothing is bound: XLA's thread pools use every
core the rank may run on, as the launchers' ``--bind-to none`` intends.

Runs when mpijax is imported, before MPI and JAX start their threads (a
thread keeps the affinity of the thread that created it). Also notes whether
the node has more ranks than cores at all: there the transport's waits yield
the core after every poll (``oversubscribed``), bound or not.
"""

from __future__ import annotations

import os

from mpijax._src import config
from mpijax._src.run import rank as rank_env


def choose(local_rank: int | None, local_size: int | None, cpus: list[int],
           online: int) -> int | None:
  """The core for a rank at ``local_rank`` of ``local_size`` that may run on ``cpus`` of the
  node's ``online`` ones; None where there is a core or more per rank, where the rank is
  already bound to fewer than all of them (by its launcher, or a cpuset), or where its
  place is unknown."""
  if local_rank is None or local_size is None or not cpus or len(cpus) < online:
    return None
  if local_size <= len(cpus):
    return None
  return sorted(cpus)[local_rank % len(cpus)]


_oversubscribed = False


def oversubscribed() -> bool:
  """Whether this rank's node runs more ranks than it has cores (known once mpijax is imported)."""
  return _oversubscribed


def configure() -> int | None:
  """Binds this process to one core where its node is oversubscribed; the core, or None."""
  global _oversubscribed
  info = rank_env.launch_info()
  online = os.cpu_count() or 0
  _oversubscribed = bool(info is not None and info.local_size is not None and online
                         and info.local_size > online)
  try:
    # gloo's own threads need the cores: bound, its collectives took 2-9x as long.
    if config.get("cpu_bind") == "none" or config.get("xla_collectives") == "gloo":
      return None
  except ValueError:
    return None  # mpijax.init() reports the malformed value
  if info is None or not hasattr(os, "sched_setaffinity"):
    return None
  try:
    cpus = list(os.sched_getaffinity(0))
    cpu = choose(info.local_rank, info.local_size, cpus, online or len(cpus))
    if cpu is not None:
      os.sched_setaffinity(0, {cpu})
  except OSError:
    return None
  return cpu
