"""MPI operations as JAX primitives: eager, inside ``jax.jit``, differentiable.

Each op works on an mpi4py communicator (default: the runtime's; always on a
private clone) and runs in the same order on every rank.
"""

from mpijax._src.ops.dtypes import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from mpijax._src.ops.allgather import allgather as allgather
from mpijax._src.ops.allreduce import allreduce as allreduce
from mpijax._src.ops.alltoall import alltoall as alltoall
from mpijax._src.ops.barrier import barrier as barrier
from mpijax._src.ops.bcast import bcast as bcast
from mpijax._src.ops.bcast import reduce as reduce
from mpijax._src.ops.ppermute import ppermute as ppermute
from mpijax._src.ops.ppermute import sendrecv as sendrecv
from mpijax._src.ops.reduce_scatter import reduce_scatter as reduce_scatter

__all__ = [
    "SUPPORTED_DTYPES",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "bcast",
    "ppermute",
    "reduce",
    "reduce_scatter",
    "sendrecv",
]
