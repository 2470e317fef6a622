"""A Flax NNX model trained data-parallel with plain ``jax.jit``, checkpointed with Orbax.

tests/test_flax_orbax_jobs.py runs this module as a script on 4 ranks to
train and save, and on other rank counts to restore (the recipe in
docs/global-arrays.md, checked in every configuration of tests/mpi, is the
same training)::

    mpijax-run -n 4 -- python -m tests.flax_orbax save PATH
    mpijax-run -n 2 --devices-per-process 2 -- python -m tests.flax_orbax restore PATH

Nothing here is mpijax-specific but ``mpijax.init()``: JAX then knows every
rank, and Flax, optax and Orbax work as in any multi-process JAX program.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

GLOBAL_BATCH = 24  # divisible by 1, 2, 3, 4 and 8 devices
STEPS = 3
FEATURES = 8


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
    self.out = nnx.Linear(16, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))[:, 0]


tx = optax.adam(1e-2)
graphdef, _ = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))))


def create():
  """Parameters and optimizer state (the same on every rank: a fixed seed)."""
  params = nnx.state(MLP(nnx.Rngs(0)), nnx.Param)
  return params, tx.init(params)


def loss_fn(params, x, y):
  return jnp.mean((nnx.merge(graphdef, params)(x) - y) ** 2)


@jax.jit
def train_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def data():
  """The global batches: (STEPS, GLOBAL_BATCH, FEATURES) inputs and their targets."""
  rng = np.random.default_rng(0)
  x = rng.normal(size=(STEPS, GLOBAL_BATCH, FEATURES)).astype(np.float32)
  return x, (x @ np.linspace(-1, 1, FEATURES, dtype=np.float32)).astype(np.float32)


def data_parallel():
  """Trains on every device of every rank; returns (params, opt_state, losses, mesh).

  The parameters are replicated; each rank loads only its rows of each global
  batch, and ``jax.make_array_from_process_local_data`` makes them one batch
  sharded over all devices. ``jax.jit`` inserts the gradient all-reduce.
  """
  mesh = Mesh(jax.devices(), ("data",))
  replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  params, opt_state = jax.jit(create, out_shardings=replicated)()
  xs, ys = data()
  k = GLOBAL_BATCH // jax.process_count()
  mine = slice(jax.process_index() * k, (jax.process_index() + 1) * k)
  losses = []
  for x, y in zip(xs, ys):
    x = jax.make_array_from_process_local_data(rows, x[mine])
    y = jax.make_array_from_process_local_data(rows, y[mine])
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(float(loss.addressable_data(0)))
  return params, opt_state, losses, mesh


def one_device():
  """The same training in this process alone, on one device, on the whole batches."""
  device = jax.local_devices()[0]
  params, opt_state = jax.device_put(jax.jit(create)(), device)
  losses = []
  for x, y in zip(*data()):
    params, opt_state, loss = train_step(params, opt_state, jax.device_put(x, device),
                                         jax.device_put(y, device))
    losses.append(float(loss))
  return params, opt_state, losses


def local_values(tree):
  """Each leaf's value as NumPy (replicated leaves: this rank's copy)."""
  return jax.tree.map(lambda a: np.asarray(a.addressable_data(0))
                      if isinstance(a, jax.Array) and a.is_fully_replicated else np.asarray(a),
                      tree)


def assert_close_to_one_device(params, opt_state, losses) -> None:
  ref_params, ref_opt, ref_losses = one_device()
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for got, want in zip(jax.tree.leaves(local_values((params, opt_state))),
                       jax.tree.leaves(local_values((ref_params, ref_opt)))):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def abstract_state(mesh):
  """The checkpoint's tree as ShapeDtypeStructs on ``mesh``: what Orbax restores into."""
  params, opt_state = jax.eval_shape(create)
  replicated = NamedSharding(mesh, P())
  like = {"params": params, "opt_state": opt_state}
  out = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), like)
  x, _ = data()
  # A leaf sharded over the devices, restored onto however many this job has.
  out["inputs"] = jax.ShapeDtypeStruct(x.shape, x.dtype,
                                       sharding=NamedSharding(mesh, P(None, "data")))
  return out


def state_to_save(params, opt_state, mesh):
  x, _ = data()
  inputs = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P(None, "data")),
                                        lambda index: x[index])
  return {"params": params, "opt_state": opt_state, "inputs": inputs}


def save(path: str, state) -> None:
  import orbax.checkpoint as ocp
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, state)
  checkpointer.wait_until_finished()


def restore(path: str, mesh):
  import orbax.checkpoint as ocp
  return ocp.StandardCheckpointer().restore(path, abstract_state(mesh))


def check_restored(restored, mesh, params, opt_state, *, exact: bool) -> None:
  """``restored`` holds ``params``/``opt_state`` (bit for bit, or to float32 tolerance)
  replicated on ``mesh``, and the inputs sharded over its devices."""
  for a in jax.tree.leaves((restored["params"], restored["opt_state"])):
    assert a.is_fully_replicated and a.sharding.is_equivalent_to(NamedSharding(mesh, P()), a.ndim)
  for got, want in zip(jax.tree.leaves(local_values((restored["params"], restored["opt_state"]))),
                       jax.tree.leaves(local_values((params, opt_state)))):
    if exact:
      np.testing.assert_array_equal(got, want)
    else:
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  x, _ = data()
  inputs = restored["inputs"]
  assert inputs.shape == x.shape and inputs.sharding.spec == P(None, "data")
  assert len(inputs.sharding.device_set) == len(mesh.devices.flat)
  for s in inputs.addressable_shards:
    np.testing.assert_array_equal(np.asarray(s.data), x[s.index])


# --- as a script: save on one rank count, restore on another ----------------------------


def _main(command: str, path: str) -> None:
  import mpijax
  mpijax.init()
  rank = jax.process_index()
  if command == "save":
    params, opt_state, losses, mesh = data_parallel()
    assert_close_to_one_device(params, opt_state, losses)
    save(path, state_to_save(params, opt_state, mesh))
    print(f"SAVED rank {rank} of {jax.process_count()}", flush=True)
  elif command == "restore":
    mesh = Mesh(jax.devices(), ("data",))
    restored = restore(path, mesh)
    # What the 4-rank job saved is what it matched: the one-device training's
    # result, to float32 tolerance; the inputs bit for bit, cut for this job.
    ref_params, ref_opt, _ = one_device()
    check_restored(restored, mesh, ref_params, ref_opt, exact=False)
    # Training goes on from the restored state on this job's devices, as it
    # would in one process.
    rows = NamedSharding(mesh, P("data"))
    xs, ys = data()
    k = GLOBAL_BATCH // jax.process_count()
    mine = slice(rank * k, (rank + 1) * k)
    _, _, loss = train_step(restored["params"], restored["opt_state"],
                            jax.make_array_from_process_local_data(rows, xs[0][mine]),
                            jax.make_array_from_process_local_data(rows, ys[0][mine]))
    _, _, want = train_step(ref_params, ref_opt, xs[0], ys[0])
    np.testing.assert_allclose(float(loss.addressable_data(0)), float(want), rtol=1e-5)
    print(f"RESTORED rank {rank} of {jax.process_count()} x {jax.local_device_count()} devices",
          flush=True)
  else:
    raise SystemExit(f"usage: python -m tests.flax_orbax (save|restore) PATH, got {command!r}")


if __name__ == "__main__":
  _main(sys.argv[1], os.path.abspath(sys.argv[2]))
