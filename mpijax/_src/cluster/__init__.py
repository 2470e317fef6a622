"""The environment layer: which launcher started this process, and where
this process sits in the job. See `base` for the registry and `detect()`.

Detection order is the import order below: Open MPI 4 before Open MPI 5 (both
set OMPI_COMM_WORLD_*), both before Slurm (mpirun inside an allocation also
sees SLURM_*), the plain-MPI fallback before the single-process one.
"""

from __future__ import annotations

from mpijax._src.cluster.base import ClusterEnv as ClusterEnv
from mpijax._src.cluster.base import LaunchInfo as LaunchInfo
from mpijax._src.cluster.base import detect as detect
from mpijax._src.cluster.base import registered as registered
from mpijax._src.cluster.hostlist import expand_hostlist as expand_hostlist

# Registration order = detection order; keep it.
from mpijax._src.cluster import ompi as ompi
from mpijax._src.cluster import prrte as prrte
from mpijax._src.cluster import slurm as slurm
from mpijax._src.cluster import mpich as mpich
from mpijax._src.cluster import mpi as mpi
from mpijax._src.cluster import single as single
