"""mpijax.ops under shard_map over several local CPU devices per rank.

Each local device d calls MPI on its own sub-communicator (clone number d), so
device d of every rank talks to device d of the others. Runs in the
2 ranks x 2 devices configuration of tests/test_multirank.py (XLA_FLAGS=
--xla_force_host_platform_device_count=2); with one local device it checks the
same with L = 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpijax
from mpijax import ops


def _layout():
  """(rank, ranks, local devices, a 1-D mesh "d" over this rank's devices)."""
  rt = mpijax.init()
  return rt.rank, rt.size, len(rt.local_devices), Mesh(np.array(rt.local_devices), ("d",))


def test_each_local_device_uses_its_own_subcommunicator():
  r, n, L, mesh = _layout()

  def body(x):  # (1, 3) per device
    ring = [(i, (i + 1) % n) for i in range(n)]
    return ops.allreduce(x), ops.allgather(x[0])[None], ops.ppermute(x, ring)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"),
                            out_specs=(P("d"), P("d"), P("d")), check_vma=False))
  x = jnp.stack([jnp.full((3,), 100.0 * d + r) for d in range(L)])
  x = jax.device_put(x, NamedSharding(mesh, P("d")))
  for _ in range(20):  # devices call MPI concurrently, repeatedly
    s, g, p = f(x)
  s, g, p = np.asarray(s), np.asarray(g), np.asarray(p)
  for d in range(L):
    np.testing.assert_array_equal(s[d], n * 100.0 * d + sum(range(n)))
    np.testing.assert_array_equal(g[d][:, 0], 100.0 * d + np.arange(n))
    np.testing.assert_array_equal(p[d], 100.0 * d + (r - 1) % n)


def test_op_outside_shard_map_in_a_multi_device_jit_is_a_clear_error():
  # XLA's partitioner would stop with an internal "Side-effect HLO must have
  # sharding"; every rank must raise mpijax's message instead, before any MPI.
  import re

  import pytest

  r, n, L, mesh = _layout()
  x = jnp.arange(2.0 * L) + r

  def after_shard_map(x):
    y = jax.shard_map(lambda b: b * 2, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)
    return ops.allreduce(y.sum())

  def barrier_before_pmap(x):
    ops.barrier()
    return mpijax.pmap(lambda v: v + 1)(x.reshape(L, 2))

  sharded = jax.device_put(x, NamedSharding(mesh, P("d")))
  partial = jax.jit(jax.shard_map(ops.allreduce, mesh=Mesh(mesh.devices.reshape(1, L), ("p", "q")),
                                  in_specs=P("p"), out_specs=P("p"), axis_names={"p"},
                                  check_vma=False))
  programs = [("allreduce", lambda: jax.jit(after_shard_map)(x)),
              ("barrier", lambda: jax.jit(barrier_before_pmap)(x)),
              ("allreduce", lambda: ops.allreduce(sharded)),  # eager, on a sharded array
              ("allreduce", lambda: partial(x))]  # shard_map leaving axis "q" to XLA
  if L > 1:
    for kind, run in programs:
      with pytest.raises(ValueError, match=re.escape(f"(primitive mpijax_{kind})")) as e:
        run()
      msg = str(e.value)
      assert f"over {L} devices" in msg, msg
      assert "mpijax.pmap / mpijax.shard_map / jax.shard_map body" in msg, msg
      assert "devices_per_process=1" in msg, msg
      assert "Side-effect" not in msg, msg
  else:  # one device per rank: the same programs are plain rank-local MPI calls
    total = sum(2 * (np.arange(2.0).sum() + 2 * k) for k in range(n))
    np.testing.assert_allclose(programs[0][1](), total)
    np.testing.assert_allclose(programs[1][1](), np.asarray(x).reshape(1, 2) + 1)
    want = sum(np.arange(2.0) + k for k in range(n))
    np.testing.assert_allclose(programs[2][1](), want)
    np.testing.assert_allclose(programs[3][1](), want)
  # No rank entered MPI above: the next collective pairs up as usual.
  f = jax.jit(jax.shard_map(lambda b: ops.allreduce(b), mesh=mesh, in_specs=P("d"),
                            out_specs=P("d"), check_vma=False))
  np.testing.assert_allclose(f(sharded), sum(np.arange(2.0 * L) + k for k in range(n)))


def test_order_token_runs_through_shard_map_bodies():
  """Independent multi-device bodies in one jit are chained in program order.

  A multi-device shard_map body cannot capture the caller's token, so each
  body gets it as an extra operand and returns its last one. Without that,
  two independent bodies (two mpijax.pmap calls) would each start a fresh
  chain, ordered against each other only by XLA's scheduling; here the first
  body waits on a rank-dependent loop, which is what would make ranks run
  the two in different orders.
  """
  import re

  r, n, L, mesh = _layout()
  m = jnp.eye(64, dtype=jnp.float32)

  def slow(v, iters):  # rank-dependent work before the first body's collective
    return jax.lax.fori_loop(0, iters, lambda i, u: jnp.tanh(u @ m) * 0 + u, v)

  first = mpijax.pmap(lambda v, it: ops.allreduce(slow(v, it[0])[0, :8]), axis_name="i")
  second = mpijax.pmap(lambda w: ops.allreduce(w), axis_name="i")
  third = jax.shard_map(lambda w, p: jax.lax.cond(p[0], ops.allreduce, lambda u: u * 0, w),
                        mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d"), check_vma=False)
  f = jax.jit(lambda x, w, it, p: (first(x, it), second(w), third(w * 3, p)))
  x = jnp.full((L, 64, 64), 1.0 + r, jnp.float32)
  w = jnp.full((L, 8), 100.0 * (1 + r), jnp.float32)
  it = jnp.full((L, 1), 30 if r == 0 else 0, jnp.int32)
  p = jnp.ones((L,), bool)
  text = f.lower(x, w, it, p).as_text()
  calls = re.findall(r"custom_call @mpijax_(?!join|gate)\w+\(([^)]*)\)", text)  # MPI calls
  consts = set(re.findall(r"(%[\w#]+) = stablehlo.constant dense<0> : tensor<i32>", text))
  fresh = [c for c in calls if c.split(", ")[-1] in consts]
  assert len(calls) == 3, calls
  # One chain: with one device the bodies are inline and the first call starts
  # it; with several, the chain starts outside and enters every body.
  assert len(fresh) == (1 if L == 1 else 0), (L, fresh)
  s = sum(range(1, n + 1))
  for _ in range(5):
    a, b, c = f(x, w, it, p)
    np.testing.assert_allclose(a, np.full((L, 8), s), rtol=1e-6)
    np.testing.assert_allclose(b, np.full((L, 8), 100.0 * s), rtol=1e-6)
    np.testing.assert_allclose(c, np.full((L, 8), 300.0 * s), rtol=1e-6)


def test_xla_collectives_join_the_order_token_chain():
  """XLA's local collectives run in one order with the MPI calls on every device.

  In a program that calls MPI, each XLA collective reads its operands through
  mpijax_gate (after the MPI calls before it) and the next MPI call joins its
  result; here an independent psum, a nested jit's all_gather and a second
  shard_map body holding only a psum. A program without MPI calls is lowered
  as JAX lowers it.
  """
  import re

  r, n, L, mesh = _layout()
  sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d"))

  def mixed(x):  # x: (1, 4), this device's row
    a = ops.allreduce(x)
    b = jax.lax.psum(x, "d")  # independent of a
    c = jax.jit(lambda v: jax.lax.all_gather(v, "d", tiled=True))(x)[:1]
    return a + 10 * b + 100 * c + ops.allreduce(b)

  f = jax.jit(lambda x, w: (sm(mixed)(x), sm(lambda v: jax.lax.psum(v, "d"))(w)))
  d = np.arange(L, dtype=np.float32)[:, None]
  x = np.broadcast_to(r * L + d + 1, (L, 4)).astype(np.float32)
  text = f.lower(x, 2 * x).as_text()
  gates = re.findall(r"custom_call @mpijax_gate\(", text)
  joins = re.findall(r"custom_call @mpijax_join\(", text)
  if L > 1:
    # psum, all_gather and the second body's psum start after an MPI call;
    # the second allreduce waits for the psum and the all_gather, the second
    # body's last token for its psum.
    assert (len(gates), len(joins)) == (3, 3), (len(gates), len(joins))
  plain = jax.jit(sm(lambda v: jax.lax.psum(v, "d") + jax.lax.all_gather(v, "d").sum(0)))
  assert "mpijax" not in plain.lower(x).as_text()

  ranks_sum = L * n * (n - 1) / 2 + n * (d + 1)  # allreduce of x over the ranks
  local_sum = L * r * L + L * (L + 1) / 2  # psum of x over this rank's devices
  ranks_local_sum = L * L * n * (n - 1) / 2 + n * L * (L + 1) / 2  # allreduce of the psum
  want = ranks_sum + 10 * local_sum + 100 * (r * L + 1) + ranks_local_sum
  for _ in range(20):
    got, second = f(x, 2 * x)
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(want, (L, 4)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(second), np.full((L, 4), 2 * local_sum), rtol=1e-6)


def test_independent_back_to_back_multi_device_calls_do_not_stall():
  """Hundreds of independent multi-device calls, dispatched without waiting.

  XLA's CPU client launches a multi-device execution with one thread per
  device, and those block while a device's queue of in-flight executions is
  full; the device parts then need as many threads again, at once (they meet
  in collectives). mpijax.init() gives the client two threads per local
  device (PJRT_NPROC): with max(cores, devices), here 2, these calls stalled
  within 5-42 calls at 2 ranks x 2 devices (the MPI program), and JAX's own
  psum over the local devices aborted in XLA's rendezvous. Also with an
  independent sharded reduction that XLA's partitioner turns into its own
  collective, beside the MPI-calling body.
  """
  import os

  r, n, L, mesh = _layout()
  if L > 1:
    assert int(os.environ["PJRT_NPROC"]) >= 2 * L or len(os.sched_getaffinity(0)) >= 2 * L
  sharding = NamedSharding(mesh, P("d"))
  body = jax.shard_map(ops.allreduce, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                       check_vma=False)
  local = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh, in_specs=P("d"),
                                out_specs=P("d"), check_vma=False))
  mixed = jax.jit(lambda x, y: (body(x), y.sum(0)))
  calls = 300
  xs = [jax.device_put(jnp.full((L, 4), 10.0 * i + r), sharding) for i in range(calls)]
  ys = [jax.device_put(jnp.arange(3.0 * L).reshape(L, 3) + i, sharding) for i in range(calls)]
  jax.block_until_ready((xs, ys))
  outs = [jax.jit(body)(x) for x in xs]  # none waits for the one before
  psums = [local(y) for y in ys]
  pairs = [mixed(x, y) for x, y in zip(xs, ys)]
  for i in range(calls):
    want = sum(10.0 * i + k for k in range(n))
    np.testing.assert_array_equal(outs[i], np.full((L, 4), want), err_msg=f"call {i}")
    y = np.arange(3.0 * L).reshape(L, 3) + i
    np.testing.assert_array_equal(psums[i], np.broadcast_to(y.sum(0), (L, 3)))
    np.testing.assert_array_equal(pairs[i][0], np.full((L, 4), want))
    np.testing.assert_array_equal(pairs[i][1], y.sum(0))
