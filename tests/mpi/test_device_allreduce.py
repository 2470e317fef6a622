"""Reductions over every local device of every rank: the node-local all-reduce
among all (rank, device) participants, and the per-device node-local paths.

With L > 1 local devices and the ranks on one node, ``mpijax.lax.psum`` (and
pmax/pmin) over an axis spanning every device is one ``mpijax_device_allreduce``
custom call per device: each block is reduced by one participant, adding the
terms in global device order, so every device gets the bits of NumPy's
sequential float sum in that order. With L = 1 the axis has no local part and
the plain MPI all-reduce runs; every assertion holds at any layout.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpijax
from mpijax import lax as mlax
from mpijax import ops
from mpijax._src import config
from mpijax._src import ffi as _ffi
from mpijax._src.ffi import settings
from mpijax._src.ops import communicators


@contextlib.contextmanager
def _settings(**values):
  for name, value in values.items():
    config.update(name, value)
  settings.push_settings()
  try:
    yield
  finally:
    for name in values:
      config.reset(name)
    settings.push_settings()


def _layout():
  rt = mpijax.init()
  return rt.rank, rt.size, len(rt.local_devices)


def _psum_fn(op="sum"):
  """A jitted mpijax.shard_map reducing over the whole axis, and its mesh."""
  r, n, L = _layout()
  mesh = mpijax.make_mesh((n * L,), ("i",))
  red = {"sum": mlax.psum, "max": mlax.pmax, "min": mlax.pmin}[op]
  f = jax.jit(mpijax.shard_map(lambda x: red(x, "i"), mesh=mesh, in_specs=P("i"),
                               out_specs=P("i")))
  return f, mesh


def _expect_device_path(f, x, mesh) -> bool:
  """Whether the program runs the device all-reduce, checked against when it should."""
  r, n, L = _layout()
  text = f.lower(x).as_text()
  used = "mpijax_device_allreduce" in text
  comm = mesh.process_comm(["i"])
  ready = comm is not None and communicators.device_group(comm)[0]
  if L > 1 and n > 1 and ready:
    assert used, "psum over every device did not take the device all-reduce"
  if L == 1:
    assert not used
  return used


def _inputs(count, dtype, kind):
  """Every global device's input (G, count) and this rank's rows on its devices."""
  r, n, L = _layout()
  G = n * L
  if kind == "int":  # integer-valued: every order of summation is exact
    g = np.stack([np.arange(count) % 7 + d + 1 for d in range(G)]).astype(dtype)
  else:
    g = np.random.default_rng(7).normal(size=(G, count)).astype(dtype)
  mine = g[r * L:(r + 1) * L].reshape(-1)
  lm = Mesh(np.array(mpijax.init().local_devices), ("d",))
  return g, jax.device_put(mine, NamedSharding(lm, P("d")))


def _sequential_sum(g):
  acc = g[0].copy()
  for row in g[1:]:
    acc = (acc + row).astype(g.dtype)  # in the dtype, row after row
  return acc


# 1 and 3 elements: fewer than the participants; 16384 float32 = 64 KiB, where
# cross-memory attach starts; 300000 > 1 MiB, beyond the shared segment.
COUNTS = [1, 3, 1001, 16384, 300_000]


@pytest.mark.parametrize("count", COUNTS)
def test_psum_bits_equal_numpy_in_device_order(count):
  r, n, L = _layout()
  f, mesh = _psum_fn()
  for kind in ("int", "normal"):
    g, x = _inputs(count, np.float32, kind)
    _expect_device_path(f, x, mesh)
    out = np.asarray(f(x)).reshape(L, count)
    want = _sequential_sum(g) if kind == "normal" else g.sum(axis=0)
    for d in range(L):
      if kind == "int" or L > 1:  # L = 1: MPI's own order, compared to tolerance
        np.testing.assert_array_equal(out[d], want)
      else:
        np.testing.assert_allclose(out[d], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.float64, np.int8, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("count", [5, 40_000])
def test_psum_pmax_pmin_dtypes(dtype, count):
  r, n, L = _layout()
  g, x = _inputs(count, dtype, "int")
  g64 = g.astype(np.float64)
  for op, want in (("sum", g64.sum(axis=0)), ("max", g64.max(axis=0)),
                   ("min", g64.min(axis=0))):
    if op == "sum" and dtype == np.int8:
      want = g.astype(np.int64).sum(axis=0).astype(np.int8)  # wraps, as XLA's
    f, mesh = _psum_fn(op)
    out = np.asarray(f(x)).reshape(L, count)
    assert out.dtype == jax.dtypes.canonicalize_dtype(dtype)  # float64: x64 may be off
    for d in range(L):
      np.testing.assert_array_equal(out[d].astype(np.float64), np.asarray(want, np.float64))


def test_same_result_as_the_local_then_mpi_path_and_gradients():
  r, n, L = _layout()
  mesh = mpijax.make_mesh((n * L,), ("i",))
  w = jnp.arange(5000, dtype=jnp.float32) % 5

  def loss(x):
    return (mlax.psum(x, "i") * w).sum()

  def build():  # traced afresh, under the settings in force
    return jax.jit(mpijax.shard_map(lambda x: (mlax.psum(x, "i"), jax.grad(loss)(x)),
                                    mesh=mesh, in_specs=P("i"), out_specs=P("i")))

  g, x = _inputs(5000, np.float32, "int")
  on = [np.asarray(v) for v in build()(x)]
  with _settings(device_allreduce=False):
    f_off = build()
    assert "mpijax_device_allreduce" not in f_off.lower(x).as_text()
    off = [np.asarray(v) for v in f_off(x)]
  np.testing.assert_array_equal(on[0], off[0])
  np.testing.assert_array_equal(on[0].reshape(L, -1)[0], g.sum(axis=0))
  # d/dx_k of sum_j (psum(x) * w): every device's cotangent w, summed.
  np.testing.assert_array_equal(on[1], off[1])
  np.testing.assert_array_equal(on[1].reshape(L, -1)[0], np.asarray(w) * (n * L))


def test_without_cross_memory_attach_large_messages_take_the_other_path():
  r, n, L = _layout()
  with _settings(cma_min_bytes=0):
    f, mesh = _psum_fn()
    small, xs = _inputs(1000, np.float32, "int")
    big, xb = _inputs(300_000, np.float32, "int")  # > the 1 MiB segment
    assert "mpijax_device_allreduce" not in f.lower(xb).as_text()
    _expect_device_path(f, xs, mesh)
    for g, x, count in ((small, xs, 1000), (big, xb, 300_000)):
      out = np.asarray(f(x)).reshape(L, count)
      for d in range(L):
        np.testing.assert_array_equal(out[d], g.sum(axis=0))


def test_back_to_back_calls_and_other_collectives_in_between():
  r, n, L = _layout()
  mesh = mpijax.make_mesh((n * L,), ("i",))

  def body(x):
    s = mlax.psum(x, "i")
    t = ops.allreduce(x)  # per device, over the ranks, on the same communicator
    return mlax.psum(s + t, "i")

  f = jax.jit(mpijax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  for count in (3, 20_000):
    g, x = _inputs(count, np.float32, "int")
    outs = [f(x) for _ in range(20)]  # dispatched back to back
    total = g.sum(axis=0)
    per_device = g.reshape(n, L, count).sum(axis=0)  # device d summed over ranks
    want = (n * L) * total + n * per_device.sum(axis=0)
    for o in outs:
      got = np.asarray(o).reshape(L, count)
      for d in range(L):
        np.testing.assert_array_equal(got[d], want)


@pytest.mark.parametrize("count", [1000, 100_000])
def test_per_device_allreduce_takes_the_node_local_paths(count):
  # ops.allreduce in a shard_map over the local devices: device d of every
  # rank reduces on its own communicator, through its own node-local segments.
  r, n, L = _layout()
  mesh = Mesh(np.array(mpijax.init().local_devices), ("d",))
  f = jax.jit(jax.shard_map(lambda x: ops.allreduce(x), mesh=mesh, in_specs=P("d"),
                            out_specs=P("d"), check_vma=False))
  host = np.stack([np.arange(count) % 5 + 10 * d + r for d in range(L)]).astype(np.float32)
  x = jax.device_put(host.reshape(-1), NamedSharding(mesh, P("d")))
  for _ in range(5):
    out = np.asarray(f(x)).reshape(L, count)
  for d in range(L):
    want = n * (np.arange(count) % 5 + 10 * d) + sum(range(n))
    np.testing.assert_array_equal(out[d], want)
  info = communicators.resolve_comm(None, "test")
  paths = _ffi.load().node_paths(info.id)
  assert len(paths) == L
  if n > 1 and paths[0] > 0:  # the ranks share a node: every device set its paths up
    assert all(p > 0 for p in paths), paths
