"""Per-rank start-up under ``mpijax-run``: the variables torchrun users' code reads.

Launchers give each process its place in the job in variables of their own
(``OMPI_COMM_WORLD_RANK``, ``PMI_RANK``, ``SLURM_PROCID``, ...). Code written
for ``torchrun`` reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE`` instead, and ``MASTER_ADDR``/``MASTER_PORT`` for its own
rendezvous. These differ per rank, so the launcher cannot set them: every
rank sets its own, from the launcher's variables as the cluster layer reads
them, before the program starts.

``python -m mpijax PROGRAM`` does this in the process that then runs
PROGRAM; ``python -m mpijax --exec PROGRAM ARGS`` does it and then
replaces itself with any (non-Python) PROGRAM. ``MASTER_ADDR`` and
``MASTER_PORT`` are the same on every rank: ``mpijax-run`` exports them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping, Sequence

from mpijax._src import cluster
from mpijax._src import config

# The detectors that read nothing a launcher set: "mpi" would initialize MPI
# to ask COMM_WORLD (too early: the program decides when), "single" means no
# launcher at all.
_NOT_A_LAUNCHER = ("mpi", "single")

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def launch_info() -> cluster.LaunchInfo | None:
  """What the launcher's variables say about this process; None without a launcher.

  Never initializes MPI. A malformed launcher variable also gives None here:
  ``mpijax.init()`` reports it, with the variable's name.
  """
  try:
    forced = config.get("launcher") or None
  except ValueError:
    forced = None
  try:
    if forced is not None:
      return None if forced in _NOT_A_LAUNCHER else cluster.detect(forced)
    for cls in cluster.registered():
      if cls.name not in _NOT_A_LAUNCHER and cls.is_env_present():
        return cluster.detect(cls.name)
  except ValueError:
    return None
  return None


def torchrun_env(info: cluster.LaunchInfo | None) -> dict[str, str]:
  """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (those the launcher says)."""
  if info is None:
    return {}
  values = {
    "RANK": info.rank,
    "WORLD_SIZE": info.size,
    "LOCAL_RANK": info.local_rank,
    "LOCAL_WORLD_SIZE": info.local_size,
  }
  return {name: str(value) for name, value in values.items() if value is not None}


def apply(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
  """Sets this rank's torchrun-style variables in ``environ`` (default ``os.environ``).

  Returns:
    The variables set (empty when no launcher started this process).
  """
  environ = os.environ if environ is None else environ
  values = torchrun_env(launch_info())
  environ.update(values)
  return values


def main(argv: Sequence[str]) -> None:
  """``python -m mpijax``: set the rank's variables, then run the program.

  ``--exec PROGRAM ARGS`` replaces this process with PROGRAM (any executable);
  otherwise PROGRAM is Python (``script.py``, ``-m module``, ``-c code``) and
  runs here under the abort-on-exception hooks.
  """
  argv = list(argv)
  apply()
  if argv and argv[0] == "--exec":
    if len(argv) < 2:
      sys.exit("usage: python -m mpijax --exec PROGRAM [ARGS ...]")
    try:
      os.execvp(argv[1], argv[1:])
    except OSError as e:
      sys.exit(f"python -m mpijax: cannot run {argv[1]!r}: {e}")
  from mpijax._src.guards.failure import run_main

  run_main(argv)
