"""The sharded-computation guide, run as printed across the ranks, with its values.

Every code block of the guide (tests/guides.py holds them verbatim) runs on
every rank after ``mpijax.init()``: plain ``jax`` code over all devices of
all ranks. The guide was written for one host with 8 TPU cores; two places
name that count and are adapted to the job's device count ``n`` (see
:func:`_adapted`), everything else runs unchanged, and each value the guide
prints is checked: the job's arrays are global (``jax.Array`` over every
rank's devices), so each rank checks the shards it holds against the
guide's array, and the drawings of ``jax.debug.visualize_array_sharding``
against the devices that hold each block.
"""

from __future__ import annotations

import collections
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import SingleDeviceSharding

from tests import guides

pytestmark = pytest.mark.usefixtures("jax_multiprocess")


def _adapted(n: int) -> dict[str, str]:
  """The guide's blocks, two of them adapted to ``n`` devices."""
  blocks = {name: getattr(guides, name) for name in (
      "DEVICES", "ARR", "ARR_SHARDING", "VISUALIZE_ARR", "MESH_2D", "ARR_SHARDED",
      "F_ELEMENTWISE", "F_CONTRACT", "F_CONTRACT_2", "SHARD_MAP_ELEMENTWISE",
      "SHARD_MAP_LOCAL_SHAPE", "SHARD_MAP_SUM", "SHARD_MAP_PSUM", "LAYER", "LAYER_DATA",
      "LAYER_SHARDED_INPUTS", "LAYER_AUTO", "LAYER_SHARD_MAP")}
  # A 2 x 4 mesh of the guide's 8 devices: 2 x n/2 of ours (1 x 1 for one device).
  rows = 2 if n % 2 == 0 else 1
  blocks["MESH_2D"] = guides.adapt(blocks["MESH_2D"], "create_device_mesh((2, 4))",
                                   f"create_device_mesh(({rows}, {n // rows}))")
  # One axis over all 8 devices: over our n. The guide passes a bare 8, which
  # JAX >= 0.5's create_device_mesh refuses in one process too (it takes a
  # sequence of axis sizes, as the guide's own comment above the line does).
  blocks["F_CONTRACT_2"] = guides.adapt(blocks["F_CONTRACT_2"], "create_device_mesh(8)",
                                        f"create_device_mesh(({n},))")
  return blocks


@pytest.fixture(scope="module")
def guide(jax_multiprocess):
  """Runs the whole guide once, as a notebook; per block: (values, printed, namespace)."""
  n = jax.device_count()
  if 8 % n:
    pytest.skip(f"the guide shards 8 columns and 32 elements evenly over the devices (JAX "
                f"needs even shards); {n} devices do not divide them")
  ns: dict = {}
  ran = {}
  for name, block in _adapted(n).items():
    values, printed = guides.run(block, ns, name)
    ran[name] = (values, printed, dict(ns))
  return ran


def _check_global(arr, want, *, atol=0.0) -> None:
  """``arr`` is the global array ``want``: every shard this rank holds is its slice."""
  want = np.asarray(want)
  assert isinstance(arr, jax.Array) and arr.shape == want.shape, (arr.shape, want.shape)
  assert arr.addressable_shards, "this rank holds no shard"
  for s in arr.addressable_shards:
    np.testing.assert_allclose(np.asarray(s.data), want[s.index], rtol=0, atol=atol,
                               err_msg=f"shard on {s.device} at {s.index}")


def _drawn(printed: str) -> collections.Counter:
  """The device groups of a ``visualize_array_sharding`` drawing ('CPU 0,4' -> {0, 4})."""
  return collections.Counter(frozenset(int(i) for i in m.split(","))
                             for m in re.findall(r"CPU ([\d,]+)", printed))


def _holders(arr) -> collections.Counter:
  """The device groups that hold each block of ``arr``."""
  blocks: dict = {}
  for d, index in arr.sharding.devices_indices_map(arr.shape).items():
    key = tuple((s.start, s.stop) for s in index)
    blocks.setdefault(key, set()).add(d.id)
  return collections.Counter(frozenset(v) for v in blocks.values())


def test_key_concept_data_sharding(guide, rt):
  n, L = jax.device_count(), jax.local_device_count()
  values, _, _ = guide["DEVICES"]
  devices = guides.value(values, "jax.devices()")
  # Every device of every rank, in mpijax's global order (process, then local index).
  assert len(devices) == n == rt.size * L
  assert [d.process_index for d in devices] == [p for p in range(rt.size) for _ in range(L)]
  assert [d for d in devices if d.process_index == rt.rank] == jax.local_devices()

  first = jax.local_devices()[0]  # the guide's "TPU 0": this rank's first device
  values, _, _ = guide["ARR"]
  assert guides.value(values, "arr.devices()") == {first}
  values, _, _ = guide["ARR_SHARDING"]
  assert guides.value(values, "arr.sharding") == SingleDeviceSharding(first)
  _, printed, _ = guide["VISUALIZE_ARR"]
  assert _drawn(printed) == collections.Counter([frozenset([first.id])])

  _, printed, ns = guide["MESH_2D"]
  rows = 2 if n % 2 == 0 else 1
  assert re.search(rf"NamedSharding\(mesh=Mesh\('x': {rows}, 'y': {n // rows}\b", printed), printed
  assert re.search(r"spec=(PartitionSpec|P)\('x', 'y'\)", printed), printed
  _, printed, ns = guide["ARR_SHARDED"]
  arr_sharded = ns["arr_sharded"]
  _check_global(arr_sharded, np.arange(32.0).reshape(4, 8))
  assert arr_sharded.sharding == NamedSharding(ns["mesh"], ns["P"]("x", "y"))
  # One block per device, as the guide draws its 8 (ids: JAX's numbering of CPU devices).
  assert _drawn(printed) == _holders(arr_sharded)
  assert len(_drawn(printed)) == n


def test_1_automatic_parallelism_via_jit(guide):
  _, printed, ns = guide["F_ELEMENTWISE"]
  assert "shardings match: True" in printed
  _check_global(ns["result"], 2 * np.sin(np.arange(32.0, dtype=np.float32).reshape(4, 8)) + 1,
                atol=1e-6)

  _, printed, ns = guide["F_CONTRACT"]
  result = ns["result"]
  _check_global(result, guides.F_CONTRACT_VALUES)
  # "Partially replicated": the devices of one 'x' row hold different blocks,
  # those of one 'y' column the same block (the guide: TPU 0,6 / 1,7 / ...).
  assert _drawn(printed) == _holders(result)
  mesh = ns["mesh"]
  for column in mesh.devices.T:
    assert frozenset(d.id for d in column) in _drawn(printed)


def test_2_semi_automated_sharding_with_constraints(guide):
  _, printed, ns = guide["F_CONTRACT_2"]
  result = ns["result"]
  _check_global(result, guides.F_CONTRACT_VALUES)
  assert len(result.sharding.device_set) == jax.device_count()
  if jax.device_count() > 1:  # JAX writes a one-device sharding as P()
    assert result.sharding.spec == ns["P"]("x")
  assert _drawn(printed) == collections.Counter(frozenset([d.id]) for d in jax.devices())


def test_3_manual_parallel_with_shard_map(guide):
  n = jax.device_count()
  values, _, _ = guide["SHARD_MAP_ELEMENTWISE"]
  _check_global(guides.value(values, "f_elementwise_sharded(arr)"),
                guides.F_ELEMENTWISE_SHARDED_VALUES, atol=1e-6)

  _, printed, _ = guide["SHARD_MAP_LOCAL_SHAPE"]
  assert "global shape: x.shape=(32,)" in printed
  assert f"device local shape: x.shape=({32 // n},)" in printed  # the guide: (4,) on 8

  values, _, _ = guide["SHARD_MAP_SUM"]
  # One partial sum per device (the guide's [6, 22, ..., 118] on 8 devices).
  _check_global(guides.value(values, "shard_map(f"), np.arange(32).reshape(n, -1).sum(1))

  values, _, _ = guide["SHARD_MAP_PSUM"]
  total = guides.value(values, "shard_map(f")
  _check_global(total, np.array(496))
  assert total.dtype == np.int32


def test_comparing_the_three_approaches(guide):
  values, _, _ = guide["LAYER_DATA"]
  np.testing.assert_allclose(guides.value(values, "layer("), guides.LAYER_VALUES, atol=1e-6)
  # Sharded over every device of every rank; the result is replicated on each.
  values, _, ns = guide["LAYER_SHARDED_INPUTS"]
  assert len(ns["x_sharded"].sharding.device_set) == jax.device_count()
  _check_global(guides.value(values, "layer("), guides.LAYER_VALUES, atol=1e-6)
  values, _, _ = guide["LAYER_AUTO"]
  _check_global(guides.value(values, "layer_auto("), guides.LAYER_SHARDED_VALUES, atol=1e-6)
  values, _, _ = guide["LAYER_SHARD_MAP"]
  _check_global(guides.value(values, "layer_sharded("), guides.LAYER_SHARDED_VALUES, atol=1e-6)
