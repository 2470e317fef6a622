"""The runtime seen from inside a real MPI job (any rank count).

mpi4py.MPI is imported in the tests, not at module level: importing it starts
MPI, and the module is also imported (and its tests skipped) without MPI.
"""

from __future__ import annotations

import jax
import numpy as np

import mpijax
from mpijax._src import mpi_util


def test_init_is_idempotent(rt):
  assert mpijax.init() is rt


def test_topology_matches_mpi(rt):
  from mpi4py import MPI
  world = MPI.COMM_WORLD
  t = rt.topology
  assert (t.rank, t.size) == (world.rank, world.size)
  assert mpijax.process_index() == world.rank
  assert mpijax.process_count() == world.size
  assert len(t.hostnames) == t.size
  assert 0 <= t.local_rank < t.local_size <= t.size
  assert 0 <= t.node_index < t.node_count
  # Consistent across ranks: everybody agrees on the hostnames and the coordinator.
  assert mpi_util.allgather_str(rt.comm, "|".join(t.hostnames)) == ["|".join(t.hostnames)] * t.size
  assert mpi_util.allgather_str(rt.comm, t.coordinator_address) == [t.coordinator_address] * t.size
  host, port = t.coordinator_address.rsplit(":", 1)
  assert host and 0 < int(port) < 65536
  # Local ranks on a node are 0..local_size-1, exactly once.
  same_node = [r for r, h in enumerate(t.hostnames) if h == t.hostname]
  assert len(same_node) == t.local_size
  assert sorted(mpi_util.allgather_int(rt.comm, t.local_rank)[r] for r in same_node) == list(range(t.local_size))


def test_private_communicator(rt):
  from mpi4py import MPI
  assert rt.comm != MPI.COMM_WORLD
  assert MPI.Comm.Compare(rt.comm, MPI.COMM_WORLD) == MPI.CONGRUENT


def test_device_table(rt):
  L = mpijax.local_device_count()
  assert L == len(jax.local_devices()) == len(mpijax.local_devices())
  table = mpijax.devices()
  assert len(table) == L * mpijax.process_count()
  for g, d in enumerate(table):
    assert d.global_index == g == d.process_index * L + d.local_index
    assert d.platform == "cpu"
    assert d.host == rt.topology.hostnames[d.process_index]
  mine = [d for d in table if d.process_index == mpijax.process_index()]
  assert [d.local_index for d in mine] == list(range(L))


def test_mpi_thread_multiple(rt):
  from mpi4py import MPI
  assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_str_names_rank_and_coordinator(rt):
  text = str(rt)
  assert f"rank {rt.rank}/{rt.size}" in text
  assert rt.topology.coordinator_address in text
