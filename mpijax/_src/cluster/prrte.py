"""Open MPI 5: processes started by ``mpirun``/``prterun`` (PRRTE).

Open MPI 5 launches through PRRTE, which marks its processes with
``PRTE_LAUNCHED=1``; Open MPI's ``schizo`` component adds the familiar
``OMPI_COMM_WORLD_*`` variables (captured with Open MPI 5.0.11 in
tests/unit/data/env_prrte_rank*.json). A plain ``prterun`` of a non-Open MPI
program only sets ``PMIX_RANK``, which is used as the fallback for the rank.
"""

from __future__ import annotations

import os

from mpijax._src.cluster import base

_LAUNCHED = "PRTE_LAUNCHED"
_RANK = "OMPI_COMM_WORLD_RANK"
_SIZE = "OMPI_COMM_WORLD_SIZE"
_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
_PMIX_RANK = "PMIX_RANK"
# PRRTE exports neither the node index nor the node count nor the node list
# (PMIX_HOSTNAME is this host only); mpijax.init() gathers them over MPI.


class PrrteEnv(base.ClusterEnv):
  """Open MPI 5 ``mpirun`` / PRRTE ``prterun``."""

  name = "prrte"
  env_hint = f"{_LAUNCHED} and {_RANK} or {_PMIX_RANK} set"

  @classmethod
  def is_env_present(cls) -> bool:
    return _LAUNCHED in os.environ and base.env_first(_RANK, _PMIX_RANK) is not None

  @classmethod
  def get_process_id(cls) -> int | None:
    return base.env_int(base.env_first(_RANK, _PMIX_RANK) or _RANK)

  @classmethod
  def get_process_count(cls) -> int | None:
    return base.env_int(_SIZE)

  @classmethod
  def get_local_process_id(cls) -> int | None:
    return base.env_int(_LOCAL_RANK)

  @classmethod
  def get_local_process_count(cls) -> int | None:
    return base.env_int(_LOCAL_SIZE)
