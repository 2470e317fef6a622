"""The node-local all-reduce's C++ API (node_local::Allreduce), as a library
outside mpijax's handlers calls it: on a plain communicator from
MPI_Comm_split, with its own state, checked against mpi4py's Allreduce.

usage: node_allreduce_api.py
Each rank prints "rank R paths [P...]": the path of each call below (0
MPI_Allreduce, 1 shared memory, 2 cross-memory attach).
"""

import numpy as np

from mpijax._src import ffi
from mpijax._src import mpi_util

MPI = mpi_util.import_mpi()
ext = ffi.load()
world = MPI.COMM_WORLD
comm = world.Split(0, world.rank)  # a communicator mpijax never registered
r, p = comm.rank, comm.size


def data(n, dtype):
  # Integer values: every summation order gives the same bits.
  return (np.arange(n) % 977 + 3 * r).astype(dtype)


def want(x, op):
  out = np.empty_like(x)
  comm.Allreduce(x, out, op=op)
  return out


paths = []
cases = [  # (elements, dtype, op, extra arguments)
    (1000, np.float32, "sum", {}),                        # 4 KB: shared memory
    (1 << 17, np.float64, "sum", {}),                     # 1 MiB: cross-memory attach
    ((1 << 17) + 3, np.int64, "max", {}),
    ((1 << 15) + 1, np.int32, "min", {"cma_min_bytes": 0}),  # 128 KiB, no CMA: shm
    ((1 << 18) + 7, np.float32, "sum", {"cma_min_bytes": 0}),  # 1 MiB + 28 B: MPI
]
for n, dtype, op, extra in cases:
  x = data(n, dtype)
  out = np.full_like(x, -1)
  paths += ext.node_allreduce(MPI._handleof(comm), x, out, op=op, repeat=3, **extra)
  np.testing.assert_array_equal(out, want(x, {"sum": MPI.SUM, "max": MPI.MAX,
                                              "min": MPI.MIN}[op]))
  np.testing.assert_array_equal(x, data(n, dtype))  # the input is untouched
for n, dtype in [(1000, np.float32), ((1 << 17) + 5, np.float64)]:  # in place
  x = data(n, dtype)
  expected = want(x, MPI.SUM)
  paths += ext.node_allreduce(MPI._handleof(comm), x, x)
  np.testing.assert_array_equal(x, expected)
comm.Free()
print(f"rank {world.rank} paths {paths}", flush=True)
