"""Open MPI 4 (ORTE): processes started by Open MPI 4's ``mpirun``/``orterun``.

Open MPI 4's launcher sets ``OMPI_COMM_WORLD_*`` and, through its runtime ORTE,
``OMPI_MCA_orte_*`` (captured with Open MPI 4.1.4 in
tests/unit/data/env_openmpi4_rank*.json). Open MPI 5 sets the same
``OMPI_COMM_WORLD_*`` variables but launches through PRRTE and never sets
``OMPI_MCA_orte_*``; it sets ``PRTE_LAUNCHED`` instead. Both set ``PMIX_*``, so
PMIx variables cannot tell the two apart.
"""

from __future__ import annotations

import os

from mpijax._src.cluster import base

_RANK = "OMPI_COMM_WORLD_RANK"
_SIZE = "OMPI_COMM_WORLD_SIZE"
_LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
_LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
# Set by ORTE's launch (odls) for every process; absent under Open MPI 5.
_ORTE_LAUNCH = "OMPI_MCA_orte_launch"
_ORTE_NUM_PROCS = "OMPI_MCA_orte_ess_num_procs"
# Number of nodes in the job's map (ORTE only).
_NUM_NODES = "OMPI_MCA_orte_num_nodes"
# OMPI_COMM_WORLD_NODE_RANK is the process's rank among all processes on its
# node (local rank counted across spawned jobs), not the node's index, so it is
# not used: Open MPI does not export the node index.


class OpenMPI4Env(base.ClusterEnv):
  """Open MPI 4 ``mpirun`` (ORTE)."""

  name = "openmpi4"
  env_hint = f"{_SIZE} and {_ORTE_LAUNCH} or {_ORTE_NUM_PROCS} set"

  @classmethod
  def is_env_present(cls) -> bool:
    if _SIZE not in os.environ:
      return False
    # Claim only an ORTE launch: an Open MPI 5 launch (PRTE_LAUNCHED) belongs
    # to the prrte detector, registered after this one.
    orte = base.env_first(_ORTE_LAUNCH, _ORTE_NUM_PROCS) is not None
    return orte and "PRTE_LAUNCHED" not in os.environ

  @classmethod
  def get_process_id(cls) -> int | None:
    return base.env_int(_RANK)

  @classmethod
  def get_process_count(cls) -> int | None:
    return base.env_int(_SIZE)

  @classmethod
  def get_local_process_id(cls) -> int | None:
    return base.env_int(_LOCAL_RANK)

  @classmethod
  def get_local_process_count(cls) -> int | None:
    return base.env_int(_LOCAL_SIZE)

  @classmethod
  def get_node_count(cls) -> int | None:
    return base.env_int(_NUM_NODES)
