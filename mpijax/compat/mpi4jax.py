"""mpi4jax's API on mpijax's transport: ``import mpijax.compat.mpi4jax as mpi4jax``.

The functions, signatures, return values and autodiff rules of mpi4jax
0.8-0.9 (no tokens), on mpijax's MPI primitives. Importing this module starts
the mpijax runtime (``mpijax.init()``, if not done yet) and registers the
default communicator and ``MPI.COMM_WORLD`` on every rank. See
docs/mpi4jax.md for the deviations and their reasons.
"""

from mpijax._src.compat.api import __version__ as __version__
from mpijax._src.compat.api import allgather as allgather
from mpijax._src.compat.api import allreduce as allreduce
from mpijax._src.compat.api import alltoall as alltoall
from mpijax._src.compat.api import barrier as barrier
from mpijax._src.compat.api import bcast as bcast
from mpijax._src.compat.api import gather as gather
from mpijax._src.compat.api import has_cuda_support as has_cuda_support
from mpijax._src.compat.api import has_sycl_support as has_sycl_support
from mpijax._src.compat.api import recv as recv
from mpijax._src.compat.api import reduce as reduce
from mpijax._src.compat.api import scan as scan
from mpijax._src.compat.api import scatter as scatter
from mpijax._src.compat.api import send as send
from mpijax._src.compat.api import sendrecv as sendrecv
from mpijax._src.compat.api import start as _start

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "bcast",
    "gather",
    "recv",
    "reduce",
    "scan",
    "scatter",
    "send",
    "sendrecv",
    "has_cuda_support",
    "has_sycl_support",
]

_start()
del _start
