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
thread keeps the affinity of the thread that created it).
"""

from __future__ import annotations

import os

from mpijax._src import config
from mpijax._src import rank_env


def choose(local_rank: int | None, local_size: int | None, cpus: list[int]) -> int | None:
  """The core for a rank at ``local_rank`` of ``local_size`` on a node whose cores are
  ``cpus``; None where there is a core or more per rank (or the place is unknown)."""
  if local_rank is None or local_size is None or not cpus or local_size <= len(cpus):
    return None
  return sorted(cpus)[local_rank % len(cpus)]


def configure() -> int | None:
  """Binds this process to one core where its node is oversubscribed; the core, or None."""
  try:
    # gloo's own threads need the cores: bound, its collectives took 2-9x as long.
    if config.get("cpu_bind") == "none" or config.get("xla_collectives") == "gloo":
      return None
  except ValueError:
    return None  # mpijax.init() reports the malformed value
  info = rank_env.launch_info()
  if info is None or not hasattr(os, "sched_setaffinity"):
    return None
  try:
    cpu = choose(info.local_rank, info.local_size, list(os.sched_getaffinity(0)))
    if cpu is not None:
      os.sched_setaffinity(0, {cpu})
  except OSError:
    return None
  return cpu
