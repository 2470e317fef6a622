"""Flax, optax and Orbax on top, as plain multi-process JAX code (tests/flax_orbax.py).

A Flax NNX model trained data-parallel with ``jax.jit`` over every device of
every rank (each rank loads only its rows of the global batch) equals the same
training in one process on one device; its state saved with Orbax by every
rank restores bit for bit. tests/test_flax_orbax_jobs.py restores a 4-rank
checkpoint on 2 ranks x 2 devices and on 1 rank.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from mpijax._src import mpi_util

pytest.importorskip("flax", reason="flax is in the test extra: pip install -e '.[test]'")
pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is in the test extra")

from tests import flax_orbax  # noqa: E402


@pytest.fixture
def shared_dir(rt):
  """A directory every rank sees (rank 0 makes it; the name is broadcast)."""
  name = tempfile.mkdtemp(prefix="mpijax-orbax-") if rt.rank == 0 else None
  name = mpi_util.bcast_str(rt.comm, name)
  yield name
  rt.comm.Barrier()
  if rt.rank == 0:
    shutil.rmtree(name, ignore_errors=True)


def test_flax_data_parallel_with_jit_equals_one_process_and_orbax_round_trip(rt, shared_dir):
  params, opt_state, losses, mesh = flax_orbax.data_parallel()
  # The gradient all-reduce is JAX's (jit over a batch sharded across the ranks).
  assert params["hidden"]["kernel"].get_value().is_fully_replicated
  assert len(mesh.devices.flat) == rt.size * rt.local_device_count
  flax_orbax.assert_close_to_one_device(params, opt_state, losses)

  path = os.path.join(shared_dir, "state")
  flax_orbax.save(path, flax_orbax.state_to_save(params, opt_state, mesh))
  # Every process took part; process 0 wrote the metadata and committed.
  assert os.path.isfile(os.path.join(path, "_CHECKPOINT_METADATA"))
  restored = flax_orbax.restore(path, mesh)
  flax_orbax.check_restored(restored, mesh, params, opt_state, exact=True)
