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

# Open MPI's own variables, set under Open MPI 5 too (prrte reads them).
RANK = "OMPI_COMM_WORLD_RANK"
SIZE = "OMPI_COMM_WORLD_SIZE"
LOCAL_RANK = "OMPI_COMM_WORLD_LOCAL_RANK"
LOCAL_SIZE = "OMPI_COMM_WORLD_LOCAL_SIZE"
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
  env_hint = f"{SIZE} and {_ORTE_LAUNCH} or {_ORTE_NUM_PROCS} set"
  env_vars = {"rank": RANK, "size": SIZE, "local_rank": LOCAL_RANK,
              "local_size": LOCAL_SIZE, "node_count": _NUM_NODES}

  @classmethod
  def is_env_present(cls) -> bool:
    if SIZE not in os.environ:
      return False
    # Claim only an ORTE launch: an Open MPI 5 launch (PRTE_LAUNCHED) belongs
    # to the prrte detector, registered after this one.
    orte = base.env_first(_ORTE_LAUNCH, _ORTE_NUM_PROCS) is not None
    return orte and "PRTE_LAUNCHED" not in os.environ
