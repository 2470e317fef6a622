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
from mpijax._src.cluster import ompi

_LAUNCHED = "PRTE_LAUNCHED"
_PMIX_RANK = "PMIX_RANK"
# PRRTE exports neither the node index nor the node count nor the node list
# (PMIX_HOSTNAME is this host only); mpijax.init() gathers them over MPI.


class PrrteEnv(base.ClusterEnv):
  """Open MPI 5 ``mpirun`` / PRRTE ``prterun``."""

  name = "prrte"
  env_hint = f"{_LAUNCHED} and {ompi.RANK} or {_PMIX_RANK} set"
  env_vars = {"rank": (ompi.RANK, _PMIX_RANK), "size": ompi.SIZE,
              "local_rank": ompi.LOCAL_RANK, "local_size": ompi.LOCAL_SIZE}

  @classmethod
  def is_env_present(cls) -> bool:
    return _LAUNCHED in os.environ and base.env_first(ompi.RANK, _PMIX_RANK) is not None
