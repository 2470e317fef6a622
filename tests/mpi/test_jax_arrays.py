"""GlobalArray and global jax.Array are one world.

``GlobalArray.to_jax()`` / ``from_jax()`` hand over the same device buffers
(checked by address) when the layout allows, and ``mpijax.shard_map`` /
``mpijax.pmap`` take global ``jax.Array``s (sharded over every device of
every rank) and give global ``jax.Array``s back, so mpijax's collectives and
JAX's own ``jit`` partitioning mix in one program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpijax
from mpijax import lax as mlax
from mpijax._src.sharding.global_array import jax_mesh

pytestmark = pytest.mark.usefixtures("jax_multiprocess")


@pytest.fixture(scope="module")
def grid(rt):
  return mpijax.make_mesh((rt.size, rt.local_device_count), ("data", "model"))


def _buffers(a) -> dict:
  return {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def _check_global(arr, want) -> None:
  want = np.asarray(want)
  assert isinstance(arr, jax.Array) and arr.shape == want.shape
  for s in arr.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), want[s.index], err_msg=str(s.device))


def _global_values(rt):
  n = rt.size * rt.local_device_count
  return np.arange(4 * rt.size * 2 * n, dtype=np.float32).reshape(4 * rt.size, 2 * n)


@pytest.mark.parametrize(
  "spec", [P("data", "model"), P(), P(None, "model"), P("model", "data"), P(("data", "model"))]
)
def test_to_jax_and_from_jax_hand_over_the_same_buffers(rt, grid, spec):
  g = _global_values(rt)
  ga = mpijax.GlobalArray.from_global(g, grid, spec)
  arr = ga.to_jax()
  assert arr.sharding.spec == ga.spec and arr.is_fully_addressable == (rt.size == 1)
  _check_global(arr, g)
  assert _buffers(arr) == _buffers(ga.local)  # no copy: the same memory on each device
  back = mpijax.GlobalArray.from_jax(arr, grid)
  assert back.spec == ga.spec and _buffers(back.local) == _buffers(arr)
  np.testing.assert_array_equal(back.gather(), g)


def test_from_jax_of_arrays_jax_made(rt, grid):
  g = _global_values(rt)
  # JAX's own global array over JAX's devices in their usual order: mpijax's order.
  mesh = Mesh(np.array(jax.devices()).reshape(rt.size, rt.local_device_count), ("data", "model"))
  arr = jax.make_array_from_callback(
    g.shape, NamedSharding(mesh, P("model", "data")), lambda index: g[index]
  )
  ga = mpijax.GlobalArray.from_jax(arr, grid)
  assert ga.spec == P("model", "data") and _buffers(ga.local) == _buffers(arr)
  np.testing.assert_array_equal(ga.gather(), g)
  # Devices in another order: the layout differs, JAX moves the data (a copy).
  flipped = Mesh(
    np.array(jax.devices()[::-1]).reshape(rt.size, rt.local_device_count), ("data", "model")
  )
  moved = jax.device_put(arr, NamedSharding(flipped, P("data", None)))
  ga = mpijax.GlobalArray.from_jax(moved, grid)
  assert ga.spec == P("data", None)
  np.testing.assert_array_equal(ga.gather(), g)
  # A layout given explicitly (mesh and spec): laid out so, by JAX.
  ga = mpijax.GlobalArray.from_jax(arr, grid, spec=P(None, ("data", "model")))
  assert ga.spec == P(None, ("data", "model"))
  np.testing.assert_array_equal(ga.gather(), g)


def test_shard_map_takes_and_returns_global_jax_arrays(rt, grid):
  g = _global_values(rt)
  mesh = jax_mesh(grid)
  arr = jax.make_array_from_callback(
    g.shape, NamedSharding(mesh, P("data", "model")), lambda index: g[index]
  )
  col_sums = mpijax.shard_map(
    lambda x: mlax.psum(x.sum(0, keepdims=True), "data"),
    mesh=grid,
    in_specs=P("data", "model"),
    out_specs=P(None, "model"),
  )(arr)
  # A global jax.Array comes back: plain JAX code goes on with it.
  assert isinstance(col_sums, jax.Array) and not isinstance(col_sums, mpijax.GlobalArray)
  assert col_sums.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)
  _check_global(col_sums, g.sum(0, keepdims=True))
  total = jax.jit(lambda c: c.sum(), out_shardings=NamedSharding(mesh, P()))(col_sums)
  assert float(total.addressable_data(0)) == g.sum()
  # An array laid out otherwise than in_specs says: JAX reshards it first, as jax.shard_map.
  by_rows = jax.device_put(arr, NamedSharding(mesh, P(("data", "model"))))
  doubled = mpijax.shard_map(
    lambda x: x * 2, mesh=grid, in_specs=P("data", "model"), out_specs=P("data", "model")
  )(by_rows)
  _check_global(doubled, 2 * g)
  # Pytrees mixing global jax.Arrays and GlobalArrays give jax.Arrays. (In a
  # one-rank job every jax.Array is also this rank's part: GlobalArrays then.)
  ga = mpijax.GlobalArray.from_global(g, grid, P("data", "model"))
  out = mpijax.shard_map(
    lambda t: {"sum": t["a"] + t["b"]},
    mesh=grid,
    in_specs=P("data", "model"),
    out_specs=P("data", "model"),
  )({"a": arr, "b": ga})
  if rt.size > 1:
    _check_global(out["sum"], 2 * g)
  else:
    np.testing.assert_array_equal(out["sum"].gather(), 2 * g)


def test_pmap_takes_and_returns_global_jax_arrays(rt):
  n, L = rt.size * rt.local_device_count, rt.local_device_count
  g = np.arange(n * 3, dtype=np.float32).reshape(n, 3)  # one row per device of the job
  mesh = Mesh(jax.devices(), ("rows",))
  arr = jax.make_array_from_callback(
    g.shape, NamedSharding(mesh, P("rows")), lambda index: g[index]
  )
  out = mpijax.pmap(lambda x: mlax.psum(x, "i") + mlax.axis_index("i"), axis_name="i")(arr)
  assert isinstance(out, jax.Array) and out.shape == g.shape
  _check_global(out, g.sum(0) + np.arange(n)[:, None])
  # out_axes=None: one replicated result, global too.
  total = mpijax.pmap(lambda x: mlax.psum(x, "i"), axis_name="i", out_axes=None)(arr)
  assert total.shape == (3,) and total.is_fully_replicated
  _check_global(total, g.sum(0))
  # This rank's rows (a plain local array) still give this rank's rows.
  local = mpijax.pmap(lambda x: mlax.psum(x, "i"), axis_name="i")(
    jnp.asarray(g[rt.rank * L : (rt.rank + 1) * L])
  )
  np.testing.assert_array_equal(np.asarray(local), np.broadcast_to(g.sum(0), (L, 3)))


def _xla_scatter(mesh):
  """JAX's own reduce-scatter of each device's row over mesh axis "x", jitted."""
  return jax.jit(
    jax.shard_map(
      lambda b: jax.lax.psum_scatter(b, "x", scatter_dimension=1, tiled=True),
      mesh=mesh,
      in_specs=P("x"),
      out_specs=P("x"),
    )
  )


def test_xla_narrow_int_sums_across_ranks_wrap_as_in_one_process():
  """JAX's own 8/16-bit sums across ranks wrap around, as in one process.

  They run over MPI through mpijax's bridge, where Open MPI's AVX kernels
  would saturate them (100 + 100 in int8 gave 127).
  """
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  rng = np.random.default_rng(8)
  for dtype, scale in ((np.int8, 1), (np.uint8, 2), (np.int16, 300), (np.uint16, 600)):
    g = (rng.integers(90, 110, size=(n, 4096 * n)) * scale).astype(dtype)
    x = jax.make_array_from_callback(g.shape, rows, lambda i, g=g: g[i])
    total = g.sum(0, dtype=dtype)  # wraps
    psum = jax.jit(
      jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    )
    _check_global(psum(x), total[None])
    _check_global(_xla_scatter(mesh)(x), total.reshape(n, -1))
    reduced = jax.jit(lambda a: a.sum(0, dtype=dtype), out_shardings=NamedSharding(mesh, P()))
    _check_global(reduced(x), total)


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_xla_reduce_scatter_equals_the_sum_on_every_path(dtype):
  """JAX's reduce-scatter across ranks: this rank's block of the exact sum.

  Blocks from 1 KiB (node-local shared memory) to past 1 MiB, an odd count
  (cross-memory attach, in more than one chunk); int8 wraps.
  """
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  rng = np.random.default_rng(9)
  scatter = _xla_scatter(mesh)
  es = np.dtype(dtype).itemsize
  for block_bytes in (1024, 96 << 10, (1 << 20) + 4 * 12345):
    count = block_bytes // es
    g = rng.integers(-100, 100, size=(n, count * n)).astype(dtype)
    x = jax.make_array_from_callback(g.shape, rows, lambda i, g=g: g[i])
    _check_global(scatter(x), g.sum(0, dtype=dtype).reshape(n, -1))


def test_xla_small_and_large_all_reduces_back_to_back():
  """Independent small and large all-reduces, call after call.

  A small one is reduced whole by every rank (one flag wait), so a rank may
  leave it while another still compares its headers; the next call (by
  cross-memory attach, or shared memory) must not overwrite them before every
  rank is done. Values change every round, so a stale or torn result shows.
  """
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  both = jax.jit(
    jax.shard_map(
      lambda s, b: (jax.lax.psum(s, "x"), jax.lax.psum(b, "x")),
      mesh=mesh,
      in_specs=(P("x"), P("x")),
      out_specs=(P(), P()),
    )
  )
  for step in range(60):
    small = (np.arange(n * 36, dtype=np.int32).reshape(n, 36) + step) % 1000
    big = (np.arange(n * 32768, dtype=np.int32).reshape(n, 32768) * (step + 1)) % 977
    s = jax.make_array_from_callback(small.shape, rows, lambda i, g=small: g[i])
    b = jax.make_array_from_callback(big.shape, rows, lambda i, g=big: g[i])
    got_s, got_b = both(s, b)
    _check_global(got_s, small.sum(0, keepdims=True))
    _check_global(got_b, big.sum(0, keepdims=True))
