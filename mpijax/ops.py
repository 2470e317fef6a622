"""MPI operations as JAX primitives: eager, inside ``jax.jit``, differentiable.

Each op works on an mpi4py communicator (default: the runtime's; always on a
private clone) and runs in program order on every rank. The collectives are
made by every rank of the communicator; ``send`` and ``recv`` only by the two
ranks that exchange. Reductions take mpijax's op names or mpi4py ``MPI.Op``
objects.
"""

from mpijax._src.ops.allgather import allgather as allgather
from mpijax._src.ops.allreduce import allreduce as allreduce
from mpijax._src.ops.alltoall import alltoall as alltoall
from mpijax._src.ops.barrier import barrier as barrier
from mpijax._src.ops.bcast import bcast as bcast
from mpijax._src.ops.dtypes import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from mpijax._src.ops.gather import gather as gather
from mpijax._src.ops.ppermute import ppermute as ppermute
from mpijax._src.ops.recv import recv as recv
from mpijax._src.ops.reduce import reduce as reduce
from mpijax._src.ops.reduce_scatter import reduce_scatter as reduce_scatter
from mpijax._src.ops.scan import scan as scan
from mpijax._src.ops.scatter import scatter as scatter
from mpijax._src.ops.send import send as send
from mpijax._src.ops.sendrecv import sendrecv as sendrecv

__all__ = [
    "SUPPORTED_DTYPES",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "bcast",
    "gather",
    "ppermute",
    "recv",
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
    "send",
    "sendrecv",
]
