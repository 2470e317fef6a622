"""GlobalArray under N ranks x L devices: constructors, gather, maps, reshard, visualize, save/load.

Every global array here is a known NumPy array ``g``; whatever path the data
takes, ``gather()`` must give back ``g`` exactly. Assertions hold at any rank
count.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import mpijax
from mpijax import lax as mlax
from mpijax._src import mpi_util
from mpijax._src.runtime import state as runtime
from mpijax._src.train.replicated_checkpoint import CheckpointError

GlobalArray = mpijax.GlobalArray


def _n():
  return mpijax.process_count() * mpijax.local_device_count()


@pytest.fixture(scope="module")
def meshes():
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  # Creating meshes is collective: once per module, same order on every rank.
  return {"x": mpijax.make_mesh((Pn * L,), ("x",)),
          "dm": mpijax.make_mesh((Pn, L), ("data", "model"))}


def _cases(meshes):
  n, Pn, L = _n(), mpijax.process_count(), mpijax.local_device_count()
  x, dm = meshes["x"], meshes["dm"]
  return [
      (x, P("x"), (2 * n, 3), np.float32),
      (x, P(None, "x"), (3, n), np.int32),
      (x, P(), (5,), np.float32),
      (x, P("x"), (n,), np.int64),
      (dm, P("data", "model"), (2 * Pn, 3 * L), np.float32),
      (dm, P("model", "data"), (L, 2 * Pn, 2), np.int32),
      (dm, P(("data", "model")), (n, 2), np.float32),
      (dm, P(None, "model"), (3, 2 * L), jnp.bfloat16),
  ]


def _value(shape, dtype):
  return (np.arange(int(np.prod(shape))).reshape(shape) % 251).astype(dtype)


def test_constructors_round_trip_through_gather(meshes):
  rank = mpijax.process_index()
  for mesh, spec, shape, dtype in _cases(meshes):
    g = _value(shape, dtype)
    a = GlobalArray.from_global(g, mesh, spec)
    assert a.shape == shape and a.mesh == mesh
    assert a.dtype == a.local.dtype == jax.dtypes.canonicalize_dtype(dtype)
    assert a.local.sharding.mesh == mesh.local_mesh
    np.testing.assert_array_equal(np.asarray(a.local), g.astype(a.dtype)[a.local_index])
    # Each shard is the block of g at its global index, on its device.
    shards = a.addressable_shards
    assert [s.device for s in shards] == mpijax.local_devices()
    for s in shards:
      np.testing.assert_array_equal(np.asarray(s.data), g[s.index])
      assert s.global_device_index == rank * mpijax.local_device_count() + \
          mpijax.local_devices().index(s.device)
    built = {
        "from_global": a,
        "from_callback": GlobalArray.from_callback(shape, dtype, mesh, spec, lambda i: g[i]),
        "from_process_local": GlobalArray.from_process_local(np.asarray(a.local), mesh, spec),
    }
    for how, b in built.items():
      assert b.shape == shape and b.spec == a.spec, how
      np.testing.assert_array_equal(b.gather(), g.astype(a.dtype), err_msg=f"{how} {spec} {shape}")
    root = mpijax.process_count() - 1
    out = a.gather(root=root)
    if rank == root:
      np.testing.assert_array_equal(out, g.astype(a.dtype))
    else:
      assert out is None
    z = GlobalArray.zeros(shape, dtype, mesh=mesh, spec=spec)
    f = GlobalArray.full(shape, 7, dtype, mesh=mesh, spec=spec)
    np.testing.assert_array_equal(z.gather(), np.zeros(shape, dtype))
    np.testing.assert_array_equal(f.gather(), np.full(shape, 7, dtype))
    assert z.local.sharding == a.local.sharding


def test_attributes_repr_and_pytree(meshes):
  mesh = meshes["x"]
  a = GlobalArray.from_global(np.ones((2 * _n(), 2), np.float32), mesh, P("x"))
  r = repr(a)
  assert f"shape=({2 * _n()}, 2)" in r and "float32" in r and "'x'" in r and "GlobalMesh" in r
  assert len(a.global_devices) == _n()
  assert a.is_fully_replicated == (_n() == 1)
  assert GlobalArray.from_global(np.ones(3), mesh, P()).is_fully_replicated
  leaves, treedef = jax.tree.flatten(a)
  assert leaves == [a.local]
  b = jax.tree.unflatten(treedef, leaves)
  assert b.shape == a.shape and b.spec == a.spec and b.mesh == a.mesh
  with pytest.raises(TypeError, match="gather"):
    np.asarray(a)
  # Shape-changing functions used to give a GlobalArray claiming the old global
  # shape around a scalar part (gather() then read garbage).
  with pytest.raises(ValueError, match=r"gave this rank's part shape \(\), but it must keep"):
    jax.tree.map(jnp.sum, a)
  with pytest.raises(ValueError, match="shape-preserving"):
    jax.jit(lambda t: jax.tree.map(lambda u: u.reshape(-1), t))(a)
  with pytest.raises(TypeError, match=r"does not implement __add__.*jax.tree.map"):
    a + 1
  with pytest.raises(TypeError, match=r"cannot be indexed.*ga.local"):
    a[0]
  with pytest.raises(TypeError, match="mpijax.save"):
    pickle.dumps(a)
  c = copy.deepcopy(a)  # used to fail pickling the mesh's communicators
  assert c.mesh is a.mesh and c.local is not a.local
  np.testing.assert_array_equal(c.block_until_ready().gather(), a.gather())
  assert a.nbytes == 2 * _n() * 2 * 4
  with pytest.raises(TypeError, match=r"Pass e.g. P\('x'\)"):
    GlobalArray.zeros((_n(),), mesh=mesh, spec="x")  # was P('x'); "xy" became P('x', 'y')
  with pytest.raises(TypeError, match="needs a mpijax.GlobalMesh"):
    GlobalArray.zeros((_n(),), mesh=mesh.local_mesh, spec=P())


def test_from_process_local_mismatch_raises_on_every_rank(meshes):
  mesh = meshes["x"]
  L, rank, size = mpijax.local_device_count(), mpijax.process_index(), mpijax.process_count()
  bad = size - 1
  rows = 2 * L + (L if rank == bad and size > 1 else 0)
  if size > 1:
    with pytest.raises(ValueError, match=f"rank {bad}'s part"):
      GlobalArray.from_process_local(np.zeros((rows, 3), np.float32), mesh, P("x"))
  # A part not divisible over the rank's own devices: every rank hears which rank.
  cols = 3 if L == 1 else (L + 1 if rank == bad else L)
  if L > 1:
    with pytest.raises(ValueError, match=f"rank {bad}: dimension 1"):
      GlobalArray.from_process_local(np.zeros((2, cols), np.float32), mesh, P(None, "x"))
  ok = GlobalArray.from_process_local(np.zeros((2 * L, 3), np.float32), mesh, P("x"))
  assert ok.shape == (2 * L * size, 3)


def test_zero_size_arrays(meshes):
  n = _n()
  z = GlobalArray.zeros((0, 2 * n), mesh=meshes["x"], spec=P(None, "x"))
  t = jax.tree.map(jnp.tanh, z)  # jax.jit hands each device a (0, 2n) shard here
  for a in [z, t, mpijax.reshard(t, P())]:
    # gather used to read the wrongly cut shards: "could not broadcast (0,4) into (0,2)".
    assert a.gather().shape == (0, 2 * n)
  assert [s.data.shape for s in z.addressable_shards] == [(0, 2)] * mpijax.local_device_count()


def test_not_divisible_is_a_clear_error(meshes):
  n = _n()
  if n == 1:
    pytest.skip("every size divides over one device")
  with pytest.raises(ValueError, match=r"not divisible by the .* devices sharding it.*Pad"):
    GlobalArray.from_global(np.zeros((n + 1, 2)), meshes["x"], P("x"))
  with pytest.raises(ValueError, match="mesh axis 'x' more than once"):
    GlobalArray.zeros((n, n), mesh=meshes["x"], spec=P("x", "x"))


def test_shard_map_and_pmap_take_and_return_global_arrays(meshes):
  mesh, n = meshes["x"], _n()
  g = _value((2 * n, 3), np.float32)
  a = GlobalArray.from_global(g, mesh, P("x"))
  doubled, total = mpijax.shard_map(lambda x: (x * 2, mlax.psum(x.sum(0), "x")), mesh=mesh,
                                    in_specs=P("x"), out_specs=(P("x"), P()))(a)
  assert isinstance(doubled, GlobalArray) and doubled.spec == P("x", None)
  np.testing.assert_array_equal(doubled.gather(), g * 2)
  assert isinstance(total, GlobalArray) and total.shape == (3,) and total.is_fully_replicated
  np.testing.assert_allclose(total.gather(), g.sum(0))
  with pytest.raises(ValueError, match=r"has spec .*'x'.* but the in_specs give"):
    mpijax.shard_map(lambda x: x, mesh=mesh, in_specs=P(None, "x"), out_specs=P())(a)
  other = GlobalArray.from_global(g, meshes["dm"], P("data"))
  with pytest.raises(ValueError, match="lives on GlobalMesh"):
    mpijax.shard_map(lambda x: x, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(other)

  pm = mpijax.make_mesh((n,), ("i",))
  b = GlobalArray.from_global(g[:n], pm, P("i"))
  out = mpijax.pmap(lambda x: mlax.psum(x, "i") + mlax.axis_index("i"), axis_name="i")(b)
  assert isinstance(out, GlobalArray) and out.shape == (n, 3)
  np.testing.assert_allclose(out.gather(), g[:n].sum(0) + np.arange(n)[:, None])
  with pytest.raises(ValueError, match="in_specs give"):
    mpijax.pmap(lambda x: x, axis_name="i")(GlobalArray.from_global(g[:n], pm, P()))


def test_elementwise_jit_keeps_the_sharding(meshes):
  mesh = meshes["dm"]
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  g = _value((2 * Pn, 2 * L), np.float32)
  a = GlobalArray.from_global(g, mesh, P("data", "model"))
  b = jax.tree.map(jax.jit(lambda t: jnp.sin(t) * 2), a)
  c = a.with_local(jax.jit(jnp.cos)(a.local))
  d = jax.tree.map(lambda t: t.astype(jnp.int32) + 1, a)
  # A GlobalArray is a pytree: it goes through jax.jit whole and comes back.
  e = jax.jit(lambda t: jax.tree.map(jnp.exp, t))(a)
  for out, want in [(b, np.sin(g) * 2), (c, np.cos(g)), (d, g.astype(np.int32) + 1),
                    (e, np.exp(g))]:
    assert isinstance(out, GlobalArray) and out.spec == a.spec and out.shape == a.shape
    assert out.local.sharding.is_equivalent_to(a.local.sharding, 2)
    np.testing.assert_allclose(out.gather(), want, rtol=1e-6)
  assert d.dtype == np.int32
  with pytest.raises(ValueError, match="shape-preserving"):
    a.with_local(a.local[:1])


def test_reshard_rows_columns_replicated_and_back(meshes):
  n = _n()
  g = _value((2 * n, 3 * n), np.float32)
  rows = GlobalArray.from_global(g, meshes["x"], P("x"))
  cols = mpijax.reshard(rows, P(None, "x"))
  rep = mpijax.reshard(cols, P())
  back = mpijax.reshard(rep, P("x"))
  for a, spec in [(cols, P(None, "x")), (rep, P(None, None)), (back, P("x", None))]:
    assert a.spec == spec
    np.testing.assert_array_equal(a.gather(), g)
  np.testing.assert_array_equal(np.asarray(rep.local), g)  # replicated: whole array here
  Pn, L = mpijax.process_count(), mpijax.local_device_count()
  h = _value((2 * n, 2 * n), np.int32)
  a = GlobalArray.from_global(h, meshes["dm"], P("data", "model"))
  for spec in [P("model", "data"), P(None, ("data", "model")), P(("data", "model")), P(),
               P("data", "model")]:
    a = mpijax.reshard(a, spec)
    np.testing.assert_array_equal(a.gather(), h, err_msg=str(spec))
  assert (Pn, L) == (a.mesh.shape["data"], a.mesh.shape["model"])


def test_visualize_sharding(meshes, capsys):
  n, Pn, L = _n(), mpijax.process_count(), mpijax.local_device_count()
  rows = GlobalArray.from_global(np.zeros((n, 4)), meshes["x"], P("x"))
  text = mpijax.visualize_sharding(rows)
  printed = capsys.readouterr().out
  assert (text in printed) == (mpijax.process_index() == 0)
  lines = text.splitlines()
  assert len(lines) == 2 * n + 1  # one line per block plus the rules
  labels = [line.strip("│ ") for line in lines[1::2]]
  assert labels == [f"P{p}:D{l}" for p in range(Pn) for l in range(L)]
  grid = GlobalArray.from_global(np.zeros((Pn, L)), meshes["dm"], P("data", "model"))
  text = mpijax.visualize_sharding(grid, print_it=False)
  assert text.splitlines()[1].count("│") == L + 1
  for p in range(Pn):
    assert all(f"P{p}:D{l}" in text.splitlines()[1 + 2 * p] for l in range(L))
  rep = mpijax.visualize_sharding(GlobalArray.from_global(np.zeros(4), meshes["x"], P()),
                                  print_it=False)
  assert ", ".join(f"P{p}:D{l}" for p in range(Pn) for l in range(L)) in rep


@pytest.fixture
def shared_dir():
  """A directory every rank sees (rank 0 makes it; the name is broadcast)."""
  comm = runtime.get().comm
  name = tempfile.mkdtemp(prefix="mpijax-ga-") if comm.rank == 0 else None
  name = mpi_util.bcast_str(comm, name)
  yield name
  comm.Barrier()
  if comm.rank == 0:
    shutil.rmtree(name, ignore_errors=True)


def test_save_load_round_trip_with_another_spec(meshes, shared_dir):
  n, mesh = _n(), meshes["x"]
  g = _value((2 * n, 3 * n), np.float32)
  tree = {"w": GlobalArray.from_global(g, mesh, P("x")),
          "b": GlobalArray.from_global(g[0], mesh, P()),
          "step": 3, "key": jax.random.key(1)}
  path = os.path.join(shared_dir, "ckpt")
  assert mpijax.save(path, tree) == path
  files = sorted(os.listdir(path))
  # One file per distinct block (replicated "b" once), plus the plain leaves and metadata.
  assert len(files) == n + 1 + 2 + 1 and "metadata.json" in files
  assert not [f for f in os.listdir(shared_dir) if ".tmp-" in f]
  like = {"w": GlobalArray.zeros(g.shape, np.float32, mesh=meshes["dm"], spec=P(None, "model")),
          "b": GlobalArray.zeros(g[0].shape, np.float32, mesh=mesh, spec=P("x")),
          "step": 0, "key": jax.random.key(0)}
  out = mpijax.load(path, like=like)
  assert out["w"].spec == P(None, "model") and out["w"].mesh == meshes["dm"]
  np.testing.assert_array_equal(out["w"].gather(), g)
  np.testing.assert_array_equal(out["b"].gather(), g[0])
  assert out["step"] == 3 and isinstance(out["step"], int)
  np.testing.assert_array_equal(jax.random.key_data(out["key"]),
                                jax.random.key_data(jax.random.key(1)))
  with pytest.raises(OSError, match="exists"):
    mpijax.save(path, tree)
  tree["step"] = 4
  mpijax.save(path, tree, overwrite=True)
  assert mpijax.load(path, like=like)["step"] == 4
  with pytest.raises(CheckpointError, match="does not fit|has float32"):
    mpijax.load(path, like={**like, "b": GlobalArray.zeros((n + 1,), mesh=mesh, spec=P())})


def test_load_refuses_corrupt_or_partial_checkpoints(meshes, shared_dir):
  n, mesh, comm = _n(), meshes["x"], runtime.get().comm
  g = _value((2 * n,), np.float32)
  tree = {"w": GlobalArray.from_global(g, mesh, P("x"))}
  like = {"w": GlobalArray.zeros(g.shape, mesh=mesh, spec=P())}  # every rank reads every shard
  path = mpijax.save(os.path.join(shared_dir, "c"), tree)
  shard = os.path.join(path, "a0.0")
  comm.Barrier()
  if comm.rank == 0:
    data = bytearray(open(shard, "rb").read())
    data[0] ^= 0xFF
    open(shard, "wb").write(bytes(data))
  comm.Barrier()
  ranks = "rank 0" if comm.size == 1 else f"ranks 0-{comm.size - 1}"  # one line for all
  with pytest.raises(CheckpointError, match=rf"failed:\n  {ranks}: .*a0\.0.* corrupt[^\n]*$"):
    mpijax.load(path, like=like)
  # A save that died before publishing leaves only a .tmp- directory: refused.
  partial = os.path.join(shared_dir, "p.tmp-dead")
  if comm.rank == 0:
    shutil.copytree(path, partial)
    os.remove(os.path.join(partial, "metadata.json"))
  comm.Barrier()
  with pytest.raises(CheckpointError, match="no metadata.json"):
    mpijax.load(partial, like=like)
  with pytest.raises(CheckpointError, match="no checkpoint"):
    mpijax.load(os.path.join(shared_dir, "p"), like=like)
  # The next save to that path deletes such leftovers (named like its own
  # temporaries), so repeated crashes cannot fill the disk; other names stay.
  stale = os.path.join(shared_dir, "p.tmp-" + "0123456789abcdef" * 2)
  if comm.rank == 0:
    shutil.copytree(partial, stale)
  comm.Barrier()
  mpijax.save(os.path.join(shared_dir, "p"), tree)
  comm.Barrier()
  assert not os.path.exists(stale) and os.path.isdir(partial)
  assert sorted(f for f in os.listdir(shared_dir) if f.startswith("p")) == ["p", "p.tmp-dead"]
  # The right name around a user's files is not ours: kept.
  theirs = os.path.join(shared_dir, "p.tmp-" + "f" * 32)
  comm.Barrier()  # every rank has listed the directory above
  if comm.rank == 0:
    os.makedirs(theirs)
    open(os.path.join(theirs, "notes.txt"), "w").close()
  comm.Barrier()
  mpijax.save(os.path.join(shared_dir, "p"), tree, overwrite=True)
  comm.Barrier()
  assert os.path.exists(os.path.join(theirs, "notes.txt"))


def test_overwrite_replaces_only_a_checkpoint(meshes, shared_dir):
  comm = runtime.get().comm
  tree = {"w": GlobalArray.from_global(np.arange(_n(), dtype=np.float32), meshes["x"], P("x"))}
  mine, afile = os.path.join(shared_dir, "user"), os.path.join(shared_dir, "notes.txt")
  if comm.rank == 0:
    os.makedirs(mine)
    open(os.path.join(mine, "precious.txt"), "w").write("keep")
    open(afile, "w").write("keep")
  comm.Barrier()
  # overwrite=True used to move these aside and delete them.
  with pytest.raises(OSError, match=r"not an mpijax checkpoint \(it holds \['precious.txt'\]\)"):
    mpijax.save(mine, tree, overwrite=True)
  with pytest.raises(OSError, match="is not a checkpoint directory"):
    mpijax.save(afile, tree, overwrite=True)
  seen = (open(os.path.join(mine, "precious.txt")).read(), open(afile).read(),
          sorted(os.listdir(shared_dir)))
  comm.Barrier()  # before rank 0 starts the next save in shared_dir
  assert seen == ("keep", "keep", ["notes.txt", "user"]), seen
  # An overwrite that died between its renames: load names the surviving old copy.
  path = mpijax.save(os.path.join(shared_dir, "c"), tree)
  comm.Barrier()
  if comm.rank == 0:
    os.rename(path, path + ".old-dead")
  comm.Barrier()
  with pytest.raises(CheckpointError, match=r"previous checkpoint at .*c\.old-dead"):
    mpijax.load(path, like=tree)
