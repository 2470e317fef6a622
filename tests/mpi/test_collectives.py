"""mpijax.lax over N ranks x L devices == jax.lax over N*L devices in one process.

The reference runs the same function under ``jax.vmap(axis_name='i')`` over
all N*L "devices" on this rank (vmap gives collectives the semantics of
``jax.pmap``); mpijax runs it under ``mpijax.pmap`` with each rank holding its
L rows. Integer ops and max/min must match bitwise, float sums to tolerance,
gradients included.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mpijax
from mpijax import lax as mlax


def _global(shape, dtype, seed):
  n = mpijax.process_count() * mpijax.local_device_count()
  rng = np.random.default_rng(seed)
  if np.dtype(dtype).kind in "iu":
    return rng.integers(-50 if np.dtype(dtype).kind == "i" else 0, 50, size=(n,) + shape).astype(dtype)
  return rng.normal(size=(n,) + shape).astype(dtype)


def _mine(g):
  L, r = mpijax.local_device_count(), mpijax.process_index()
  return g[r * L:(r + 1) * L]


def _compare(f, g, *, exact, rtol=1e-5):
  ref = _mine(np.asarray(jax.vmap(f, axis_name="i")(g)))
  out = np.asarray(mpijax.pmap(f, axis_name="i")(_mine(g)))
  assert out.shape == ref.shape and out.dtype == ref.dtype
  if exact:
    np.testing.assert_array_equal(out, ref)
  else:
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol)


SHAPES = [(), (3,), (2, 5)]


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("shape", SHAPES)
def test_reductions(shape, dtype):
  g = _global(shape, dtype, 1)
  exact = np.dtype(dtype).kind != "f"
  _compare(lambda x: mlax.psum(x, "i"), g, exact=exact)
  _compare(lambda x: mlax.pmax(x, "i"), g, exact=True)
  _compare(lambda x: mlax.pmin(x, "i"), g, exact=True)
  if not exact:
    _compare(lambda x: mlax.pmean(x, "i"), g, exact=False)


@pytest.fixture
def no_device_allreduce():
  """Reductions over every device take the local + MPI path, not the
  node-local all-reduce among all devices (tests/mpi/test_device_allreduce.py)."""
  from mpijax._src import config
  config.update("device_allreduce", False)
  yield
  config.reset("device_allreduce")


@pytest.mark.parametrize("device_path", [False, True])
def test_large_psum_takes_the_hierarchical_path(device_path, request):
  # 64 KiB and up reduce-scatter locally first (when L > 1); same result.
  if not device_path:
    request.getfixturevalue("no_device_allreduce")
  g = _global((5000,), np.float32, 2)
  _compare(lambda x: mlax.psum(x, "i"), g, exact=False)
  _compare(lambda x: mlax.pmax(x, "i"), g, exact=True)
  _compare(lambda x: mlax.pmin(x, "i"), g, exact=True)
  _compare(lambda x: mlax.psum(x, "i") * mlax.axis_index("i"), g, exact=False)
  # Its gradient: every device's cotangent summed (L times too small with
  # the local gather typed invariant outside check_vma).
  w = np.arange(5000, dtype=np.float32)
  _compare(jax.grad(lambda x: (mlax.psum(x, "i") * w).sum()), g, exact=False)


def test_axis_index_and_size():
  n = mpijax.process_count() * mpijax.local_device_count()
  g = _global((), np.int32, 3)
  _compare(lambda x: mlax.axis_index("i") + 0 * x, g, exact=True)
  assert mpijax.pmap(lambda x: x * 0 + mlax.axis_size("i"), axis_name="i")(_mine(g))[0] == n


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("axis", [0, 1])
def test_all_gather(axis, tiled):
  g = _global((3, 2), np.int32, 4)
  _compare(lambda x: mlax.all_gather(x, "i", axis=axis, tiled=tiled), g, exact=True)


def test_ppermute_ring_and_partial():
  n = mpijax.process_count() * mpijax.local_device_count()
  g = _global((4,), np.float32, 5)
  ring = [(i, (i + 1) % n) for i in range(n)]
  _compare(lambda x: mlax.ppermute(x, "i", ring), g, exact=True)
  # Pairs that move by several rank distances at once (one MPI round each).
  for perm in ([(i, (i + 3) % n) for i in range(n)], [(i, n - 1 - i) for i in range(n)]):
    _compare(lambda x, perm=perm: mlax.ppermute(x, "i", perm), g, exact=True)
  # A partial map (vmap cannot do these): everybody else gets zeros.
  partial = [(0, n - 1)] + ([(n - 1, 1)] if n > 2 else [])
  ref = np.zeros_like(g)
  for s, d in partial:
    ref[d] = g[s]
  out = mpijax.pmap(lambda x: mlax.ppermute(x, "i", partial), axis_name="i")(_mine(g))
  np.testing.assert_array_equal(np.asarray(out), _mine(ref))
  # One pair: with ranks x devices, the ranks that receive nothing must still
  # make the MPI call (a result they do not use must not be dropped).
  ref = np.zeros_like(g)
  ref[n - 1] = g[0]
  out = mpijax.pmap(lambda x: mlax.ppermute(x, "i", [(0, n - 1)]), axis_name="i")(_mine(g))
  np.testing.assert_array_equal(np.asarray(out), _mine(ref))


@pytest.mark.parametrize("tiled", [False, True])
def test_psum_scatter(tiled):
  n = mpijax.process_count() * mpijax.local_device_count()
  g = _global((n * (2 if tiled else 1), 3), np.int32, 6)
  _compare(lambda x: mlax.psum_scatter(x, "i", scatter_dimension=0, tiled=tiled), g, exact=True)


@pytest.mark.parametrize("tiled", [False, True])
def test_all_to_all(tiled):
  n = mpijax.process_count() * mpijax.local_device_count()
  g = _global((3, n * (2 if tiled else 1)), np.int32, 7)
  _compare(lambda x: mlax.all_to_all(x, "i", 1, 0, tiled=tiled), g, exact=True)


def test_pmap_in_and_out_axes_pytrees_and_negative():
  """in_axes/out_axes as pytree prefixes with negative and None entries, as jax.pmap/vmap."""
  n, L = mpijax.process_count() * mpijax.local_device_count(), mpijax.local_device_count()  # noqa: F841
  g = _global((2, 3), np.float32, 13)
  pm = mpijax.pmap(lambda d, c: (mlax.psum(d["a"] * c, "i"), {"g": mlax.all_gather(d["b"], "i")}),
                   axis_name="i", in_axes=({"a": -1, "b": 0}, None), out_axes=(None, {"g": -1}))
  total, out = pm({"a": np.moveaxis(_mine(g), 0, -1), "b": _mine(g)}, np.float32(2))
  np.testing.assert_allclose(np.asarray(total), 2 * g.sum(0), rtol=1e-5)  # None: once
  np.testing.assert_array_equal(np.asarray(out["g"]), np.broadcast_to(g[..., None], g.shape + (L,)))
  # Keyword arguments are mapped over their leading axis, as in jax.pmap.
  kw = mpijax.pmap(lambda c, *, d: mlax.psum(d * c, "i"), axis_name="i", in_axes=None)
  for _ in range(2):  # the second call reuses the compiled map
    np.testing.assert_allclose(np.asarray(kw(np.float32(3), d=_mine(g))),
                               np.broadcast_to(3 * g.sum(0), (L, 2, 3)), rtol=1e-5)


def test_pbroadcast():
  n = mpijax.process_count() * mpijax.local_device_count()
  g = _global((2,), np.float32, 8)
  out = np.asarray(mpijax.pmap(lambda x: mlax.pbroadcast(x, "i", n - 1), axis_name="i")(_mine(g)))
  np.testing.assert_array_equal(out, np.broadcast_to(g[n - 1], out.shape))


def test_bool_zero_size_and_extremum_gradients():
  """What used to depend on the layout of ranks x devices, against jax.lax."""
  n = mpijax.process_count() * mpijax.local_device_count()
  b = _global((3,), np.int32, 10) > 0
  _compare(lambda x: mlax.psum(x, "i"), b, exact=True)  # an int32 count, as jax.lax
  _compare(lambda x: mlax.pmean(x, "i"), b, exact=False)
  _compare(lambda x: mlax.psum(x, "i"), _global((70000,), np.int32, 11) > 0, exact=True)
  _compare(lambda x: mlax.pbroadcast(x, "i", n - 1), b, exact=True)  # stays bool
  # Complex pmax/pmin: lexicographic as in jax.lax (real parts tie on purpose).
  c = (np.round(_global((3,), np.float32, 13)) + 1j * _global((3,), np.float32, 14)).astype(
      np.complex64)
  _compare(lambda x: mlax.pmax(x, "i"), c, exact=True)
  _compare(lambda x: mlax.pmin(x, "i"), c, exact=True)
  z = np.zeros((n, 2, 0), np.float32)
  for tiled in (False, True):
    _compare(lambda x: mlax.all_gather(x, "i", axis=1, tiled=tiled), z, exact=True)
  _compare(lambda x: mlax.ppermute(x, "i", [(i, (i + 1) % n) for i in range(n)]), z, exact=True)
  for tiled in (False, True):  # a zero-size block per device (was a ZeroDivisionError)
    _compare(lambda x: mlax.psum_scatter(x, "i", scatter_dimension=1, tiled=tiled),
             np.zeros((n, 0, n), np.float32), exact=True)
  # pmax/pmin gradients (jax.lax has none under pmap or vmap), with ties
  # between devices: shared evenly by every device holding the extremum, as
  # jnp.max does; every device's loss counts (psum's transpose convention).
  for shape in [(4,), (20000,)]:  # the plain and the hierarchical path
    t = np.round(_global(shape, np.float32, 12))
    w = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    for fn, extremum in ((mlax.pmax, np.max), (mlax.pmin, np.min)):
      grad = mpijax.pmap(jax.grad(lambda x: (fn(x, "i") * w).sum()), axis_name="i")
      hit = t == extremum(t, axis=0)
      np.testing.assert_allclose(np.asarray(grad(_mine(t))), _mine(n * w * hit / hit.sum(0)),
                                 rtol=1e-6)


def test_gradients_match():
  g = _global((3,), np.float32, 9)
  w = jnp.arange(3.0) + 1

  def loss(x):
    y = mlax.psum(x * x, "i") + mlax.all_gather(x, "i").sum(0) * mlax.axis_index("i")
    y = y + mlax.ppermute(x, "i", [(i, (i + 1) % mlax.axis_size("i"))
                                   for i in range(mlax.axis_size("i"))])
    return (y * w).sum()

  _compare(jax.grad(loss), g, exact=False)


def test_shard_map_examples_from_the_guide():
  n = mpijax.process_count() * mpijax.local_device_count()
  if 32 % n:
    pytest.skip(f"the guide's arange(32) example needs a device count dividing 32, not {n}")
  mesh = mpijax.make_mesh((n,), ("x",))
  r, k = mpijax.process_index(), 32 // mpijax.process_count()
  mine = np.arange(32)[r * k:(r + 1) * k]
  out = mpijax.shard_map(lambda x: x * 2, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(mine)
  np.testing.assert_array_equal(np.asarray(out), mine * 2)
  total = mpijax.shard_map(lambda x: mlax.psum(x.sum(), "x"), mesh=mesh, in_specs=P("x"),
                           out_specs=P())(mine)
  assert int(total) == 496

  rng = np.random.default_rng(0)
  x = rng.normal(size=(32,)).astype(np.float32)
  w = rng.normal(size=(32, 4)).astype(np.float32)
  b = rng.normal(size=(4,)).astype(np.float32)

  @jax.jit
  @functools.partial(mpijax.shard_map, mesh=mesh, in_specs=(P("x"), P("x", None), P(None)),
                     out_specs=P(None))
  def layer_sharded(x, w, b):
    return jax.nn.sigmoid(mlax.psum(x @ w, "x") + b)

  out = layer_sharded(x[r * k:(r + 1) * k], w[r * k:(r + 1) * k], b)
  np.testing.assert_allclose(np.asarray(out), [0.02138912, 0.893112, 0.59892005, 0.97742504],
                             rtol=1e-5)


def test_two_axis_mesh():
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  mesh = mpijax.make_mesh((Pn, L), ("data", "model"))
  r = mpijax.process_index()
  g = np.arange(Pn * 3 * L * 2, dtype=np.float32).reshape(Pn * 3, L * 2)
  mine = g[r * 3:(r + 1) * 3]  # rows of this rank, all columns

  def f(block):
    return (mlax.psum(block.sum(), "data")[None], mlax.psum(block.sum(), ("data", "model")),
            (mlax.axis_index("data") * 10 + mlax.axis_index("model"))[None])

  per_data, total, idx = mpijax.shard_map(
      f, mesh=mesh, in_specs=P("data", "model"),
      out_specs=(P("model"), P(), P(("data", "model"))))(mine)
  assert float(total) == g.sum()
  cols = g.reshape(Pn * 3, L, 2).sum(axis=(0, 2))
  np.testing.assert_allclose(np.asarray(per_data), cols)
  np.testing.assert_array_equal(np.asarray(idx), [r * 10 + m for m in range(L)])


def test_ppermute_and_all_to_all_over_a_tuple_of_axes():
  """Indices row-major over the names, as axis_index and all_gather number them."""
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  n = Pn * L
  mesh = mpijax.make_mesh((Pn, L), ("data", "model"))
  for names in (("data", "model"), ("model", "data")):
    ring = [(j, (j + 1) % n) for j in range(n)]

    def f(x):
      i = mlax.axis_index(names)
      a2a = mlax.all_to_all(i * 100 + jnp.arange(n), names, 0, 0)  # chunk i of every j
      ok = (mlax.ppermute(i, names, ring) == (i - 1) % n) & jnp.all(a2a == jnp.arange(n) * 100 + i)
      # The gradient of x_j is the weight at its destination, (j + 1) % n + 1.
      grad = jax.grad(lambda v: (mlax.ppermute(v, names, ring) * (i + 1.0)).sum())(x)
      return ok[None], grad

    ok, grad = jax.jit(mpijax.shard_map(f, mesh=mesh, in_specs=P(("data", "model")),
                                        out_specs=P(("data", "model"))))(np.ones(L, np.float32))
    assert np.asarray(ok).all(), (names, ok)
    i = np.asarray(jax.jit(mpijax.shard_map(lambda x: mlax.axis_index(names)[None], mesh=mesh,
                                            in_specs=P(("data", "model")),
                                            out_specs=P(("data", "model"))))(np.ones(L)))
    np.testing.assert_array_equal(np.asarray(grad), (i + 1) % n + 1)


def test_check_vma_and_all_gather_to():
  # Under shard_map(check_vma=True) an out_specs of P() needs a result typed
  # invariant over the axis: psum's (also on the hierarchical path, 80 KB per
  # device) and all_gather(to='invarying')'s, as with jax.lax.
  n, L = mpijax.process_count() * mpijax.local_device_count(), mpijax.local_device_count()
  mesh = mpijax.make_mesh((n,), ("x",))
  g = _global((20000,), np.float32, 9)

  def f(x):
    return mlax.psum(x, "x"), mlax.all_gather(x, "x", tiled=True, to="invarying")

  total, gathered = jax.jit(mpijax.shard_map(f, mesh=mesh, in_specs=P("x"),
                                             out_specs=(P(), P()), check_vma=True))(_mine(g))
  np.testing.assert_allclose(np.asarray(total)[0], g.sum(0), rtol=1e-4, atol=1e-3)
  np.testing.assert_array_equal(np.asarray(gathered), g)
  # jax.grad of the map: each P() output counts once, as with jax.shard_map
  # (every device's gradient: w1 plus its own block of w2).
  w1 = np.linspace(0, 1, 20000, dtype=np.float32)
  w2 = np.linspace(-1, 1, n * 20000, dtype=np.float32).reshape(n, 20000)
  mapped = mpijax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=(P(), P()),
                            check_vma=True)
  grad = jax.jit(jax.grad(lambda x: (lambda t, a: (t * w1).sum() + (a * w2).sum())(
      *mapped(x))))(_mine(g))
  np.testing.assert_allclose(np.asarray(grad), _mine(w1 + w2), rtol=1e-5, atol=1e-6)
  out = mpijax.pmap(lambda x: mlax.all_gather(x, "i", to="invarying"), axis_name="i")(
      _mine(g[:, :3]))
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(g[:, :3], (L,) + g[:, :3].shape))
  with pytest.raises(ValueError, match="to='reduced'"):
    mpijax.pmap(lambda x: mlax.all_gather(x, "i", to="reduced"), axis_name="i")(np.ones(L))


def test_jax_lax_inside_mpijax_maps_spans_every_rank():
  # A jax.pmap program ports by changing one word: jax.lax's collectives on
  # mpijax's axes run as mpijax.lax's (the vmap reference runs jax.lax's own).
  n = mpijax.process_count() * mpijax.local_device_count()
  g = _global((n, 2), np.float32, 11)
  ring = [(i, (i + 1) % n) for i in range(n)]
  for f in (lambda x: jax.lax.psum(x, "i"), lambda x: jax.lax.pmean(x, "i"),
            lambda x: jax.lax.pmax(x, "i"), lambda x: jax.lax.pmin(x, "i"),
            lambda x: jax.lax.all_gather(x, "i"), lambda x: jax.lax.all_gather(x, "i", tiled=True),
            lambda x: jax.lax.psum_scatter(x, "i"), lambda x: jax.lax.all_to_all(x, "i", 0, 1),
            lambda x: jax.lax.ppermute(x, "i", ring), lambda x: jax.lax.pshuffle(x, "i", [
                (i + 1) % n for i in range(n)]),
            lambda x: jax.lax.pswapaxes(x, "i", 0), lambda x: x * jax.lax.axis_index("i"),
            lambda x: x * jax.lax.axis_size("i"), lambda x: jax.lax.pbroadcast(x, "i", n - 1)):
    _compare(f, g, exact=False)
  # The same under mpijax.shard_map, over a tuple of axes spanning ranks and devices.
  mesh = mpijax.make_mesh((mpijax.process_count(), mpijax.local_device_count()), ("p", "l"))
  out = mpijax.shard_map(lambda x: jax.lax.psum(x.sum(0), ("p", "l")), mesh=mesh,
                         in_specs=P(("p", "l")), out_specs=P())(_mine(g[:, 0]))
  np.testing.assert_allclose(np.asarray(out), g[:, 0].sum(0), rtol=1e-5)
  # ... and jax.lax is JAX's own again outside the maps.
  from mpijax._src.collectives import routing as lax_routing
  assert jax.lax.psum is lax_routing.original("psum")


def test_jax_lax_that_cannot_reach_mpijax_names_the_fix():
  from jax.lax import psum as psum_taken_early  # bound to JAX's own, before any map ran

  L = mpijax.local_device_count()
  early = mpijax.pmap(lambda x: psum_taken_early(x, "i"), axis_name="i")
  if mpijax.process_count() == 1:  # an axis inside one rank is JAX's own: it just works
    np.testing.assert_array_equal(np.asarray(early(np.ones(L))), np.full(L, float(L)))
    return
  with pytest.raises(NameError, match=r"Call mpijax.lax.psum\(x, 'i'\)"):
    early(np.ones(L))
  with pytest.raises(NameError, match="enclosing mpijax.pmap maps \\['i'\\]") as e:
    mpijax.pmap(lambda x: jax.lax.psum(x, "j"), axis_name="i")(np.ones(L))
  assert "under `jax.shard_map`" not in str(e.value)  # JAX's advice does not apply here
  with pytest.raises(NotImplementedError, match="mpijax.lax.ppermute"):
    mpijax.pmap(lambda x: jax.lax.psend(x, "i", [(0, 0)]), axis_name="i")(np.ones(L))


def test_unbound_axis_is_a_clear_error():
  with pytest.raises(NameError, match="axis_name 'j'") as e:
    mpijax.pmap(lambda x: mlax.psum(x, "j"), axis_name="i")(np.ones(mpijax.local_device_count()))
  assert "under `jax.shard_map`" not in str(e.value)  # JAX's advice does not apply here
  with pytest.raises(NameError, match="no mpijax.pmap"):
    jax.jit(lambda x: mlax.psum(x, "i"))(1.0)
  with pytest.raises(NameError, match="pbroadcast got axis_name 'j'"):  # not 'axis_size'
    mpijax.pmap(lambda x: mlax.pbroadcast(x, "j", 0), axis_name="i")(
        np.ones(mpijax.local_device_count()))


def test_shard_map_under_grad_and_vmap():
  n = mpijax.process_count() * mpijax.local_device_count()
  mesh = mpijax.make_mesh((n,), ("x",))
  L, r = mpijax.local_device_count(), mpijax.process_index()
  g = np.arange(n * 2, dtype=np.float32).reshape(n, 2) / 7
  mine = g[r * L:(r + 1) * L]

  def total(x):
    return mpijax.shard_map(lambda b: mlax.psum((b * b).sum(), "x"), mesh=mesh,
                            in_specs=P("x"), out_specs=P())(x)

  assert np.allclose(float(jax.jit(total)(mine)), (g * g).sum(), rtol=1e-6)
  # The true derivative, as jax.shard_map gives on one host: a psum'd value
  # returned replicated (out_specs=P()) counts once, not once per device.
  grad = jax.grad(total)(mine)
  np.testing.assert_allclose(np.asarray(grad), 2 * mine, rtol=1e-6)
  # A replicated input (in_specs=P()) gets the sum of every device's cotangent.
  def scaled(x, b):
    return mpijax.shard_map(lambda x, b: (x * b).sum()[None], mesh=mesh,
                            in_specs=(P("x"), P()), out_specs=P("x"))(x, b).sum()
  grad_b = jax.jit(jax.grad(scaled, argnums=1))(mine, np.float32(3.0))
  local_sums = np.asarray(jax.jit(scaled)(mine, np.float32(1.0)))
  np.testing.assert_allclose(float(grad_b), g.sum(), rtol=1e-5)
  assert np.isclose(float(local_sums), mine.sum(), rtol=1e-5)
  batched = jax.vmap(total)(np.stack([mine, 2 * mine]))
  np.testing.assert_allclose(np.asarray(batched), [(g * g).sum(), 4 * (g * g).sum()], rtol=1e-5)


def test_shard_map_spec_prefixes_and_none_leaves():
  """A spec may cover a whole subtree (a pytree prefix, as in jax.shard_map); None leaves pass."""
  n = mpijax.process_count() * mpijax.local_device_count()
  mesh = mpijax.make_mesh((n,), ("x",))
  L, r = mpijax.local_device_count(), mpijax.process_index()
  g = np.arange(n * 2, dtype=np.float32)
  mine = g[r * L * 2:(r + 1) * L * 2]
  out = mpijax.shard_map(
      lambda d, t: {"s": mlax.psum(d["a"].sum(), "x"), "t": (t[0] * 2, None)}, mesh=mesh,
      in_specs=({"a": P("x"), "b": P()}, (P("x"), None)),
      out_specs={"s": P(), "t": (P("x"), None)})({"a": mine, "b": np.float32(3)}, (mine, None))
  assert float(out["s"]) == g.sum() and out["t"][1] is None
  np.testing.assert_array_equal(np.asarray(out["t"][0]), 2 * mine)
  (total, top), same = mpijax.shard_map(
      lambda b: ((mlax.psum(b.sum(), "x"), mlax.pmax(b.max(), "x")), b), mesh=mesh,
      in_specs=P("x"), out_specs=(P(), P("x")))(mine)  # P() for a (replicated) pair
  assert (float(total), float(top)) == (g.sum(), g.max())
  np.testing.assert_array_equal(np.asarray(same), mine)
  nested = mpijax.shard_map(lambda t: t[0] + t[1]["k"] + t[2], mesh=mesh,
                            in_specs=((P("x"), P("x"), P()),), out_specs=P("x"))
  np.testing.assert_array_equal(np.asarray(nested((mine, {"k": mine}, np.float32(1)))),
                                2 * mine + 1)
  # One spec for a tuple of replicated inputs: each gets every device's cotangent.
  loss = lambda w: mpijax.shard_map(lambda b, w: mlax.psum((b * w[0] + w[1]).sum(), "x"),
                                    mesh=mesh, in_specs=(P("x"), P()), out_specs=P())(mine, w)
  gw = jax.grad(loss)((np.float32(2), np.float32(1)))
  np.testing.assert_allclose([float(gw[0]), float(gw[1])], [g.sum(), g.size], rtol=1e-6)


def _groups(n: int):
  """Groups that partition range(n): uneven (evens, odds) and equal-sized, reordered."""
  uneven = [g for g in (list(range(0, n, 2)), list(range(1, n, 2))) if g]
  equal = ([[i + n // 2, i] for i in range(n // 2)] if n >= 4 and n % 2 == 0
           else [list(reversed(range(n)))])
  return uneven, equal


def test_axis_index_groups():
  """jax.lax's axis_index_groups over an axis spanning ranks, against NumPy."""
  n = mpijax.process_count() * mpijax.local_device_count()
  uneven, equal = _groups(n)
  group_of = lambda groups, i: next(g for g in groups if i in g)
  pm = lambda f: mpijax.pmap(f, axis_name="i")
  g = _global((3,), np.float32, 9)
  for dtype in (np.float32, np.int32):
    v = g.astype(dtype) if dtype == np.float32 else (g * 10).astype(dtype)
    for fn, red in ((mlax.psum, np.sum), (mlax.pmax, np.max), (mlax.pmin, np.min)):
      ref = np.stack([red(v[group_of(uneven, i)], axis=0) for i in range(n)])
      out = pm(lambda x: fn(x, "i", axis_index_groups=uneven))(_mine(v))
      np.testing.assert_allclose(np.asarray(out), _mine(ref), rtol=1e-6)
  ref = np.stack([g[group_of(uneven, i)].mean(axis=0) for i in range(n)])
  np.testing.assert_allclose(pm(lambda x: mlax.pmean(x, "i", axis_index_groups=uneven))(_mine(g)),
                             _mine(ref), rtol=1e-6)
  # Equal groups: gathers in the group's order, scatters and exchanges within it.
  k = len(equal[0])
  pos = {i: grp.index(i) for grp in equal for i in grp}
  for tiled in (False, True):
    ref = np.stack([np.concatenate([g[m] for m in group_of(equal, i)]) if tiled
                    else np.stack([g[m] for m in group_of(equal, i)]) for i in range(n)])
    out = pm(lambda x: mlax.all_gather(x, "i", axis_index_groups=equal, tiled=tiled))(_mine(g))
    np.testing.assert_array_equal(np.asarray(out), _mine(ref))
    c = 2 if tiled else 1
    s = _global((k * c, 3), np.int32, 10)
    ref = []
    for i in range(n):
      tot = sum(s[m] for m in group_of(equal, i))
      ref.append(tot[pos[i] * c:(pos[i] + 1) * c] if tiled else tot[pos[i]])
    out = pm(lambda x: mlax.psum_scatter(x, "i", axis_index_groups=equal, tiled=tiled))(_mine(s))
    np.testing.assert_array_equal(np.asarray(out), _mine(np.stack(ref)))
    a = _global((3, k * c), np.int32, 11)
    ref = []
    for i in range(n):
      chunks = [a[m][:, pos[i] * c:(pos[i] + 1) * c] for m in group_of(equal, i)]
      ref.append(np.concatenate(chunks, axis=0) if tiled else np.stack([ch[:, 0] for ch in chunks]))
    out = pm(lambda x: mlax.all_to_all(x, "i", 1, 0, axis_index_groups=equal, tiled=tiled))(_mine(a))
    np.testing.assert_array_equal(np.asarray(out), _mine(np.stack(ref)))
  # Derivatives: d/dx_i of sum_j w_j * psum_group(x)_j is the sum of w over i's group.
  w = np.arange(1, n + 1, dtype=np.float32)
  grad = pm(jax.grad(lambda x: mlax.psum(x, "i", axis_index_groups=uneven)
                     * (mlax.axis_index("i") + 1.0)))(_mine(g[:, 0]))
  np.testing.assert_allclose(np.asarray(grad), _mine(np.array(
      [w[group_of(uneven, i)].sum() for i in range(n)])))
  bad = [[0]] if n > 1 else [[0, 0]]  # not a partition of range(n)
  # Bools: jax.lax.psum_scatter has no sum for them, at every layout (a size-1
  # axis, e.g. at 1 rank, used to return them unsummed).
  with pytest.raises(TypeError, match="psum_scatter over 'i' got a bool array"):
    pm(lambda x: mlax.psum_scatter(x, "i", axis_index_groups=equal))(_mine(s) > 0)
  with pytest.raises(TypeError, match="psum_scatter over 'i' got a bool array"):
    pm(lambda x: mlax.psum_scatter(x, "i", tiled=True))(_mine(s) > 0)
  with pytest.raises(ValueError, match=rf"psum got axis_index_groups={re.escape(str(bad))}; "
                     r"the groups must .* exactly once"):
    pm(lambda x: mlax.psum(x, "i", axis_index_groups=bad))(_mine(g))
  if n > 2:  # uneven groups exist from 3 devices on
    with pytest.raises(ValueError, match="all_gather needs groups of equal size"):
      pm(lambda x: mlax.all_gather(x, "i", axis_index_groups=[[0], list(range(1, n))]))(_mine(g))


def _negative_dimension_checks(x, names, k):
  """[7 x 2] bools: negative vs non-negative dimensions of all_to_all/psum_scatter
  over ``names``, and all_to_all's gradient as its transpose, untiled and tiled."""
  out = []
  for tiled in (False, True):
    s = x[:, :k] if not tiled else x
    out += [mlax.all_to_all(s, names, -2, -3, tiled=tiled) ==
            mlax.all_to_all(s, names, 1, 0, tiled=tiled),
            mlax.all_to_all(s, names, -2, -1, tiled=tiled) ==
            mlax.all_to_all(s, names, 1, 2, tiled=tiled),
            mlax.psum_scatter(s, names, scatter_dimension=-2, tiled=tiled) ==
            mlax.psum_scatter(s, names, scatter_dimension=1, tiled=tiled)]
    # The derivative: all_to_all's transpose swaps split and concat axes
    # (jax.lax's own untiled transpose fails here, on the local axis).
    w = jnp.cos(jnp.arange(s.size, dtype=jnp.float32).reshape(s.shape)
                + mlax.axis_index(names)).swapaxes(0, 1)
    grad = jax.grad(lambda v: (mlax.all_to_all(v, names, 1, 0, tiled=tiled) * w).sum())(
        s.astype(jnp.float32))
    out.append(grad == mlax.all_to_all(w, names, 0, 1, tiled=tiled))
  return jnp.stack([o.all() for o in out])


def _negative_dimension_programs():
  """(axis names, jitted program of the checks, input) for a local, a process and a mixed axis."""
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  mesh = mpijax.make_mesh((Pn, L), ("data", "model"))
  spec = P(("data", "model"))
  programs = []
  for names in ("model", "data", ("data", "model")):
    k = {"model": L, "data": Pn}.get(names, Pn * L)
    x = np.arange(L * 2 * 2 * k * 3, dtype=np.int32).reshape(L, 2, 2 * k, 3)
    f = lambda b, names=names, k=k: _negative_dimension_checks(b[0], names, k)[None]
    programs.append((names, jax.jit(mpijax.shard_map(f, mesh=mesh, in_specs=spec,
                                                     out_specs=spec)), x))
  return programs


def test_negative_split_and_concat_axes_on_every_kind_of_axis():
  """all_to_all/psum_scatter take negative dimensions on a local, a process and a mixed axis.

  On an axis inside a rank (``model`` at 2 ranks x 2 devices) all_to_all
  once handed them to jax.lax, which does not normalize them (verifier
  errors, wrong shapes, or a crash).
  """
  for names, program, x in _negative_dimension_programs():
    ok = program(x)
    assert np.asarray(ok).all(), (names, np.asarray(ok))


def test_independent_local_and_cross_rank_collectives_in_one_program():
  """The programs above, each run 40 times: 20-odd collectives, mostly independent.

  Before XLA's collectives joined mpijax's order-token chain, two local
  devices could run an XLA collective and an MPI call in opposite orders and
  deadlock across ranks: at 2 ranks x 2 devices, the ("data", "model")
  program did within 50 calls in each of 4 runs (XLA aborted after 40 s).
  """
  for names, program, x in _negative_dimension_programs():
    for i in range(40):
      ok = np.asarray(program(x + i))
      assert ok.all(), (names, i, ok)

def test_narrow_int_sums_wrap_and_pmax_pmin_skip_nan():
  """8/16-bit sums wrap as in jax.lax; pmax/pmin skip NaN as XLA's all-reduce does.

  Open MPI's AVX kernels saturate 8/16-bit sums (100 + 100 in int8 gave 127),
  and MPI's MAX/MIN let a NaN win or lose by the order of the operands.
  """
  n = mpijax.process_count() * mpijax.local_device_count()
  rng = np.random.default_rng(15)
  for dtype, size in ((np.int8, 69000), (np.uint8, 12), (np.int16, 33000)):  # big: hierarchical
    g = (rng.integers(90, 110, size=(n, size)) * (1 if dtype != np.int16 else 300)).astype(dtype)
    _compare(lambda x: mlax.psum(x, "i"), g, exact=True)
    _compare(lambda x: mlax.psum_scatter(x, "i", tiled=True), g[:, :size // n * n], exact=True)
  pm = lambda f: mpijax.pmap(f, axis_name="i")
  uneven, _ = _groups(n)
  for size in (5, 20000):
    g = np.round(_global((size,), np.float32, 16))
    g[0, 0] = g[:, 1] = g[n - 1, 2] = np.nan
    for fn, red, fill in ((mlax.pmax, np.fmax, -np.inf), (mlax.pmin, np.fmin, np.inf)):
      want = lambda rows: np.where(np.isnan(rows).all(0), fill, red.reduce(rows, axis=0))
      out = pm(lambda x: fn(x, "i"))(_mine(g))
      np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(want(g), out.shape))
      if size == 5:
        out = pm(lambda x: fn(x, "i", axis_index_groups=uneven))(_mine(g))
        ref = np.stack([want(g[next(grp for grp in uneven if i in grp)]) for i in range(n)])
        np.testing.assert_array_equal(np.asarray(out), _mine(ref))


def test_check_vma_with_a_size_one_axis():
  """Under check_vma=True a collective over a size-1 axis types its result varying there,
  as in JAX; a spec naming that axis must then hold (it was dropped from the local spec)."""
  n = mpijax.process_count() * mpijax.local_device_count()
  mesh = mpijax.make_mesh((1, n), ("one", "all"))
  spec = P(("one", "all"))
  names = ("one", "all")

  def f(x):
    ring = [(j, (j + 1) % n) for j in range(n)]
    return (mlax.all_gather(x, names, tiled=True)[None], mlax.ppermute(x, names, ring),
            mlax.all_to_all(jnp.tile(x, n), names, 0, 0, tiled=True), mlax.all_gather(x, "one"),
            mlax.psum(x, "one"))  # typed invariant over 'one': its spec may omit it

  g = np.arange(n, dtype=np.float32)
  gathered, shifted, exchanged, one, summed = jax.jit(mpijax.shard_map(
      f, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec, P(None, names), P("all")),
      check_vma=True))(_mine(g))
  L = mpijax.local_device_count()
  np.testing.assert_array_equal(np.asarray(gathered), np.broadcast_to(g, (L, n)))
  np.testing.assert_array_equal(np.asarray(shifted), _mine(np.roll(g, 1)))
  np.testing.assert_array_equal(np.asarray(exchanged), np.tile(g, L))
  np.testing.assert_array_equal(np.asarray(one), _mine(g)[None])
  np.testing.assert_array_equal(np.asarray(summed), _mine(g))
