"""mpijax.compat.mpi4jax: mpi4jax's API and semantics on mpijax's transport.

mpi4jax's own suite runs against this module in tests/compat/mpi4jax_suite.py;
these tests pin what it does not check (return values on non-root ranks,
the autodiff convention, argument errors, communicators, program order).
Assertions hold at any rank count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpijax

# Set before the first test: importing the module must not start MPI (see
# conftest.py), and importing mpijax.compat.mpi4jax starts the runtime.
R = N = MPI = mpi4jax = PARTNER = None


@pytest.fixture(autouse=True, scope="module")
def _rank(rt):
  global R, N, MPI, mpi4jax, PARTNER
  from mpi4py import MPI as mpi

  import mpijax.compat.mpi4jax as compat
  R, N, MPI, mpi4jax = rt.rank, rt.size, mpi, compat
  PARTNER = R ^ 1 if (R ^ 1) < N else None


def test_public_api_is_mpi4jax_s():
  assert sorted(mpi4jax.__all__) == sorted([
      "allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "recv", "reduce",
      "scan", "scatter", "send", "sendrecv", "has_cuda_support", "has_sycl_support"])
  assert mpi4jax.has_cuda_support() is False and mpi4jax.has_sycl_support() is False
  assert mpi4jax.__version__.startswith("0.9")


def test_rooted_results_on_every_rank():
  """Root gets the result; the others get their input back, the same object."""
  x = jnp.arange(3.0) + R
  b = mpi4jax.bcast(x, root=N - 1)
  assert (b is x) if R == N - 1 else np.array_equal(b, jnp.arange(3.0) + N - 1)
  g = mpi4jax.gather(x, root=0)
  if R == 0:
    np.testing.assert_array_equal(g, np.stack([np.arange(3.0) + r for r in range(N)]))
  else:
    assert g is x
  red = mpi4jax.reduce(x, MPI.MAX, root=0)
  assert np.array_equal(red, jnp.arange(3.0) + N - 1) if R == 0 else red is x
  np.testing.assert_array_equal(mpi4jax.scan(x, MPI.SUM),
                                sum(np.arange(3.0) + r for r in range(R + 1)))
  blocks = jnp.stack([jnp.full(2, r) for r in range(N)]) if R == 0 else jnp.zeros(2, jnp.int32)
  np.testing.assert_array_equal(jax.jit(lambda v: mpi4jax.scatter(v, 0))(blocks), [R, R])
  assert mpi4jax.barrier() == [] and mpi4jax.send(x, MPI.PROC_NULL) == []


def test_allreduce_autodiff_follows_mpi4jax():
  """mpi4jax's convention: the transpose of the sum is the identity, and the
  transpose of that is the sum again (mpijax.ops.allreduce follows psum)."""
  x = jnp.ones(3) * (R + 1)
  g = jax.grad(lambda v: mpi4jax.allreduce(v, op=MPI.SUM).sum())(x)
  np.testing.assert_array_equal(g, np.ones(3))
  np.testing.assert_array_equal(jax.grad(lambda v: mpijax.ops.allreduce(v).sum())(x),
                                np.full(3, float(N)))
  (t,) = jax.linear_transpose(lambda v: mpi4jax.allreduce(v, op=MPI.SUM), x)(x)
  np.testing.assert_array_equal(t, x)
  lt = lambda y: jax.linear_transpose(lambda v: mpi4jax.allreduce(v, op=MPI.SUM), x)(y)[0]  # noqa
  (tt,) = jax.jit(lambda y: jax.linear_transpose(lt, x)(y))(x)
  np.testing.assert_array_equal(tt, np.full(3, sum(r + 1.0 for r in range(N))))
  _, tan = jax.jvp(lambda v: mpi4jax.allreduce(v, op=MPI.SUM), (x,), (jnp.ones(3),))
  np.testing.assert_array_equal(tan, np.full(3, float(N)))
  with pytest.raises(NotImplementedError, match="only defined for op=MPI.SUM"):
    jax.grad(lambda v: mpi4jax.allreduce(v, op=MPI.MAX).sum())(x)
  np.testing.assert_array_equal(jax.vmap(lambda v: mpi4jax.allreduce(v, op=MPI.SUM))(x[:, None]),
                                np.full((3, 1), sum(r + 1.0 for r in range(N))))


def test_only_allreduce_and_sendrecv_are_differentiable():
  """As in mpi4jax; the error comes at trace time, on every rank alike."""
  x = jnp.ones(3)
  for name, f in [("bcast", lambda v: mpi4jax.bcast(v, 0)),
                  ("gather", lambda v: mpi4jax.gather(v, 0)),
                  ("reduce", lambda v: mpi4jax.reduce(v, MPI.SUM, 0)),
                  ("scan", lambda v: mpi4jax.scan(v, MPI.SUM)),
                  ("allgather", mpi4jax.allgather)]:
    for transform in (jax.grad, lambda g: jax.grad(jax.jit(g))):
      with pytest.raises(NotImplementedError, match=f"mpi4jax's {name} is not differentiable"):
        transform(lambda v: f(v).sum())(x)
  # Differentiating around them is fine.
  g = jax.grad(lambda v: jnp.sum(v * mpi4jax.bcast(jax.lax.stop_gradient(v), 0)))(x)
  np.testing.assert_array_equal(g, np.ones(3))


def test_ops_and_dtypes():
  x = jnp.int32([R, 0, 3 + R])
  np.testing.assert_array_equal(mpi4jax.allreduce(x, op=MPI.MIN), [0, 0, 3])
  want = [0, 0, 1 if N > 1 else 3]  # one rank: MPI combines nothing, x comes back
  np.testing.assert_array_equal(mpi4jax.allreduce(x, op=MPI.LAND), want)
  np.testing.assert_array_equal(mpi4jax.allreduce(jnp.float16(1.5), op=MPI.SUM), 1.5 * N)
  with pytest.raises(ValueError, match="MPI.MAXLOC"):
    mpi4jax.allreduce(x, op=MPI.MAXLOC)


def test_removed_token_argument_is_mpi4jax_s_error():
  for call in (lambda: mpi4jax.allreduce(1.0, MPI.SUM, token=None),
               lambda: mpi4jax.barrier(token=object()),
               lambda: mpi4jax.sendrecv(1.0, 1.0, 0, 0, token=None)):
    with pytest.raises(RuntimeError, match="Explicit token management is not supported"):
      call()


def test_argument_types_are_checked_like_mpi4jax():
  with pytest.raises(TypeError, match='bcast got unexpected type for argument "root"'):
    mpi4jax.bcast(1.0, root=0.0)
  with pytest.raises(TypeError, match='(?s)argument "root".*abstract tracer'):
    jax.jit(lambda v, r: mpi4jax.gather(v, r))(1.0, 0)
  with pytest.raises(TypeError, match='allreduce got unexpected type for argument "comm"'):
    mpi4jax.allreduce(1.0, MPI.SUM, comm="world")
  with pytest.raises(TypeError, match='argument "op"'):
    mpi4jax.scan(1.0, op=None)
  with pytest.raises(ValueError, match=r"Alltoall input must have shape \(nproc, \.\.\.\)"):
    mpi4jax.alltoall(jnp.ones(N + 1))
  with pytest.raises(ValueError, match=rf"dest={N}"):
    mpi4jax.send(1.0, N)


def test_communicators():
  """COMM_WORLD and split communicators work; messages on one are never
  received on another (the default is a clone of COMM_WORLD, as in mpi4jax)."""
  sub = MPI.COMM_WORLD.Split(R % 2, R)
  got = mpi4jax.allreduce(jnp.float32(R), op=MPI.SUM, comm=sub)
  assert float(got) == sum(r for r in range(N) if r % 2 == R % 2)
  if PARTNER is not None:
    if R % 2 == 0:
      mpi4jax.send(jnp.float32(1), PARTNER, tag=4)  # default communicator
      mpi4jax.send(jnp.float32(2), PARTNER, tag=4, comm=MPI.COMM_WORLD)
    else:
      on_world = mpi4jax.recv(jnp.float32(0), PARTNER, tag=4, comm=MPI.COMM_WORLD)
      on_default = mpi4jax.recv(jnp.float32(0), PARTNER, tag=4)
      assert (float(on_world), float(on_default)) == (2.0, 1.0)
  mpi4jax.barrier(comm=MPI.COMM_WORLD)


def test_status_and_any_source():
  if PARTNER is not None:
    status = MPI.Status()
    x = jnp.arange(4.0) + R
    if R % 2 == 0:
      got = jax.jit(lambda v: mpi4jax.sendrecv(v, v, source=PARTNER, dest=PARTNER, sendtag=9,
                                               status=status))(x)
      np.testing.assert_array_equal(got, jnp.arange(4.0) + PARTNER)
      assert (status.Get_source(), status.Get_tag()) == (PARTNER, 3)
    else:
      got = mpi4jax.sendrecv(x, x, source=MPI.ANY_SOURCE, dest=PARTNER, sendtag=3,
                             recvtag=9, status=status)
      np.testing.assert_array_equal(got, jnp.arange(4.0) + PARTNER)
      assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.FLOAT)) == (
          PARTNER, 9, 4)
  mpi4jax.barrier()


def test_chain_of_calls_runs_in_program_order():
  """One jitted function with many independent mpi4jax calls of every kind,
  point-to-point among them: every rank runs them in program order (XLA
  would otherwise start independent calls in any order), 5 times."""
  nxt, prv = (R + 1) % N, (R - 1) % N

  def prog(xs):
    outs = []
    for i, x in enumerate(xs):
      k = i % 6
      if k == 0:
        outs.append(mpi4jax.allreduce(x, op=MPI.SUM))
      elif k == 1:
        outs.append(mpi4jax.bcast(x, root=i % N))
      elif k == 2:
        outs.append(mpi4jax.sendrecv(x, x, source=prv, dest=nxt, sendtag=i, recvtag=i))
      elif k == 3:
        outs.append(mpi4jax.allgather(x)[(i + 1) % N])
      elif k == 4:
        outs.append(mpi4jax.scan(x, op=MPI.MAX))
      else:
        outs.append(mpi4jax.alltoall(jnp.broadcast_to(x, (N, *x.shape)))[i % N])
    return outs

  xs = [jax.device_put(np.full(1 + (i * 37) % 300, R + i, np.float32)) for i in range(24)]
  f = jax.jit(prog)
  for _ in range(5):
    outs = f(xs)
  for i, o in enumerate(outs):
    want = [sum(r + i for r in range(N)), (i % N) + i, prv + i, (i + 1) % N + i, R + i,
            i % N + i][i % 6]
    np.testing.assert_array_equal(o, np.full(o.shape, float(want)))
