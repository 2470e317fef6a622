"""MPICH (and Intel MPI): processes started by Hydra's ``mpiexec``.

Hydra's proxy gives each process ``PMI_RANK``, ``PMI_SIZE`` and the node-local
``MPI_LOCALRANKID``/``MPI_LOCALNRANKS`` (captured with the MPICH 5.0 wheel in
tests/unit/data/env_mpich_rank*.json; also ``PMI_FD`` and ``PMI_HOSTNAME``,
which is this host only). Hydra exports neither the node index nor the node
list; mpijax.init() gathers them over MPI.
"""

from __future__ import annotations

from mpijax._src.cluster import base

_RANK = "PMI_RANK"
_SIZE = "PMI_SIZE"
_LOCAL_RANK = "MPI_LOCALRANKID"
_LOCAL_SIZE = "MPI_LOCALNRANKS"


class MpichEnv(base.ClusterEnv):
  """MPICH / Intel MPI Hydra ``mpiexec``."""

  name = "mpich"
  env_hint = f"{_RANK} and {_SIZE} set"
  env_vars = {"rank": _RANK, "size": _SIZE, "local_rank": _LOCAL_RANK,
              "local_size": _LOCAL_SIZE}

  @classmethod
  def is_env_present(cls) -> bool:
    return base.env_present(_RANK, _SIZE)
