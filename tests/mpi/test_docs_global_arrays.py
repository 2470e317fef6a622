"""docs/global-arrays.md's Python examples run as printed, and give the values it shows.

Each example is taken from the page at test time (not a copy) and executed on
every rank of the job.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from mpijax._src import mpi_util
from tests import guides

PAGE = Path(__file__).resolve().parents[2] / "docs" / "global-arrays.md"


def _block(marker: str) -> str:
  """The page's one ```python block that contains ``marker``."""
  blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)
  found = [b for b in blocks if marker in b]
  assert len(found) == 1, f"{PAGE.name}: expected one python block containing {marker!r}"
  return found[0]


@pytest.fixture
def in_shared_dir(rt, tmp_path):
  """Runs the test in a directory every rank sees (rank 0's tmp_path; one machine)."""
  path = mpi_util.bcast_str(rt.comm, str(tmp_path) if rt.rank == 0 else None, 0)
  old = os.getcwd()
  os.chdir(path)
  try:
    yield path
  finally:
    os.chdir(old)
    rt.comm.Barrier()


def test_global_array_example(rt, in_shared_dir):
  if 8 % rt.size:
    pytest.skip(f"the example splits 8 rows over the ranks; {rt.size} ranks do not divide 8")
  ns: dict = {}
  guides.run(_block("mpijax.visualize_sharding(w)"), ns)
  np.testing.assert_allclose(ns["w3"].gather(), np.tanh(np.arange(32.0).reshape(8, 4)), rtol=1e-6)
  np.testing.assert_array_equal(ns["cols"].gather(), np.arange(32.0).reshape(8, 4))


def test_global_array_and_jax_array_example(rt, jax_multiprocess):
  if 8 % rt.size:
    pytest.skip(f"the example splits 8 rows over the ranks; {rt.size} ranks do not divide 8")
  ns: dict = {}
  _, printed = guides.run(_block("ga.to_jax()"), ns)
  assert printed.strip() == "496.0"
  g = np.arange(32.0).reshape(8, 4)
  np.testing.assert_allclose(ns["back"].gather(), np.tanh(g) * 2, rtol=1e-6)
  assert isinstance(ns["sums"], jax.Array) and ns["sums"].shape == (4,)
  for s in ns["sums"].addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), g.sum(0)[s.index])


def test_the_guides_example(rt, jax_multiprocess):
  L = rt.local_device_count
  if rt.size * L != 4:
    pytest.skip(f"the example is written for 4 devices in the job, this job has {rt.size * L}")
  _, printed = guides.run(_block("create_device_mesh((2, 2))"), {})
  lines = printed.splitlines()
  assert lines[0] == f"{rt.rank} {rt.size}" and lines[1] == f"4 {L}"
  assert "[48. 52. 56. 60. 64. 68. 72. 76.]" in printed
  layer = [line for line in lines if line.startswith("[0.0213")]
  assert len(layer) == 1
  np.testing.assert_allclose(np.array(layer[0].strip("[]").split(), np.float32),
                             guides.LAYER_VALUES, atol=1e-6)
  assert lines[-1] == "[" + " ".join(["4."] * L) + "]"
  assert len(re.findall(r"CPU \d+", printed)) == 4  # the 2 x 2 drawing


def test_flax_and_orbax_recipe_equals_one_process_and_round_trips(rt, jax_multiprocess,
                                                                   in_shared_dir):
  """A Flax NNX model trained data-parallel with plain jax.jit over every device of
  every rank (each rank its own rows of the global batch) equals the same training in
  one process on one device; its Orbax checkpoint restores bit for bit (on another rank
  count: tests/test_flax_orbax_jobs.py)."""
  pytest.importorskip("flax", reason="flax is in the test extra: pip install -e '.[test]'")
  pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is in the test extra")
  ns: dict = {}
  with contextlib.redirect_stderr(io.StringIO()):
    guides.run(_block("ocp.StandardCheckpointer()"), ns)
  state, restored = ns["state"], ns["restored"]
  # The gradient all-reduce was JAX's: the parameters stayed replicated on every device.
  for a in jax.tree.leaves(state):
    assert a.is_fully_replicated and len(a.sharding.device_set) == jax.device_count()

  # One device, the whole global batch: every rank's rows, in rank order.
  rngs = [np.random.default_rng(p) for p in range(rt.size)]
  device = jax.local_devices()[0]
  params, opt_state = jax.device_put(jax.jit(ns["create"])(), device)
  for _ in range(3):
    x = np.concatenate([r.normal(size=(16, 8)).astype(np.float32) for r in rngs])
    params, opt_state, loss = ns["train_step"](params, opt_state, jax.device_put(x, device),
                                               jax.device_put(x.sum(1), device))
  np.testing.assert_allclose(float(ns["loss"].addressable_data(0)), float(loss), rtol=1e-5)
  for got, want in zip(jax.tree.leaves(state),
                       jax.tree.leaves({"params": params, "opt_state": opt_state})):
    np.testing.assert_allclose(np.asarray(got.addressable_data(0)), np.asarray(want),
                               rtol=1e-5, atol=1e-6)

  # Every process took part in the save; process 0 committed it.
  assert os.path.isfile(os.path.join(ns["path"], "_CHECKPOINT_METADATA"))
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    assert got.sharding == want.sharding and got.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(got.addressable_data(0)),
                                  np.asarray(want.addressable_data(0)))
