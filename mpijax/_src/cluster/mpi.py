"""Plain MPI: no launcher variables we know, but mpi4py is installed.

Asks MPI itself: the rank and size of ``COMM_WORLD``, and the node-local rank
and size from ``COMM_WORLD.Split_type(COMM_TYPE_SHARED)`` (the processes that
share memory, i.e. one node). The node index and count come from one more
split of the node leaders. This covers launchers without a detector of their
own (and a singleton: ``python script.py`` with mpi4py installed is rank 0 of
1), at the price of initializing MPI.

The questions are collective over ``COMM_WORLD``: every rank must call
`detect()`, as ``mpijax.init()`` does. They are asked once per process and
cached, since the answers cannot change while MPI is initialized.
"""

from __future__ import annotations

import functools
import importlib.util
import sys

from mpijax._src import mpi_util
from mpijax._src.cluster import base


def mpi4py_available() -> bool:
  """True when mpi4py can be imported (without importing it)."""
  return "mpi4py" in sys.modules or importlib.util.find_spec("mpi4py") is not None


@functools.cache
def _world() -> tuple[int, int, int, int, int, int]:
  """(rank, size, local_rank, local_size, node_index, node_count)."""
  import numpy as np  # here, not at import: mpijax-run's own process never needs it

  MPI = mpi_util.import_mpi()
  world = MPI.COMM_WORLD
  node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
  try:
    local_rank, local_size = node.rank, node.size
    # Node leaders (local rank 0) number the nodes in the order of their
    # lowest world rank; everyone else learns its node's number from its leader.
    leaders = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=world.rank)
    if local_rank == 0:
      node_index, node_count = leaders.rank, leaders.size
      leaders.Free()
    else:
      node_index = node_count = None
    # A buffer broadcast: nothing received from another rank is unpickled.
    pair = np.array([node_index or 0, node_count or 0], dtype=np.int64)
    node.Bcast([pair, MPI.INT64_T], root=0)
    node_index, node_count = int(pair[0]), int(pair[1])
  finally:
    node.Free()
  return world.rank, world.size, local_rank, local_size, node_index, node_count


class MpiEnv(base.ClusterEnv):
  """Any MPI launch (or a singleton), read through mpi4py."""

  name = "mpi"
  env_hint = "mpi4py importable"

  @classmethod
  def is_env_present(cls) -> bool:
    return mpi4py_available()

  @classmethod
  def get_process_id(cls) -> int | None:
    return _world()[0]

  @classmethod
  def get_process_count(cls) -> int | None:
    return _world()[1]

  @classmethod
  def get_local_process_id(cls) -> int | None:
    return _world()[2]

  @classmethod
  def get_local_process_count(cls) -> int | None:
    return _world()[3]

  @classmethod
  def get_node_index(cls) -> int | None:
    return _world()[4]

  @classmethod
  def get_node_count(cls) -> int | None:
    return _world()[5]
