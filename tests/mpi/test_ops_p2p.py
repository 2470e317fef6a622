"""mpijax.ops send / recv and the tagged sendrecv: only the ranks that exchange call.

Assertions hold at any rank count: tests that need partners pair up ranks
(2k with 2k + 1) and leave an odd last rank out, or need >= 3 ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpijax import ops
from mpijax._src.ops.sendrecv import tagged_sendrecv
from tests.mpi.test_ops import tiny_chunks  # noqa: F401 (fixture)

# Set before the first test: importing the module must not start MPI (see conftest.py).
R = N = MPI = None
PARTNER = None  # 0<->1, 2<->3, ...; an odd last rank: None


@pytest.fixture(autouse=True, scope="module")
def _rank(rt):
  global R, N, MPI, PARTNER
  from mpi4py import MPI as mpi
  R, N, MPI = rt.rank, rt.size, mpi
  PARTNER = R ^ 1 if (R ^ 1) < N else None
MODES = ["eager", "jit"]


def payload(rank: int, shape=(3,), dtype=jnp.float32):
  return jnp.arange(int(np.prod(shape)), dtype=dtype).reshape(shape) + 10 * rank


@pytest.mark.parametrize("mode", MODES)
def test_send_recv_pairs(mode):
  if PARTNER is not None:
    if R % 2 == 0:
      send = lambda x: ops.send(x, PARTNER, tag=R)  # noqa: E731
      send(payload(R)) if mode == "eager" else jax.jit(send)(payload(R))
    else:
      status = MPI.Status()
      recv = (lambda t: ops.recv(t, PARTNER, tag=PARTNER, status=status))
      got = recv(jnp.zeros(3)) if mode == "eager" else jax.jit(recv)(jnp.zeros(3))
      np.testing.assert_array_equal(got, payload(PARTNER))
      assert (status.Get_source(), status.Get_tag(), status.Get_count(MPI.BYTE)) == (
          PARTNER, PARTNER, 12)
  ops.barrier()


def test_recv_from_any_source_and_tag():
  """Rank 0 takes one message from every other rank, in whatever order they come."""
  if R == 0:
    seen = {}
    for _ in range(N - 1):
      status = MPI.Status()
      got = ops.recv(jax.ShapeDtypeStruct((2, 3), jnp.int32), status=status)
      seen[status.Get_source()] = (status.Get_tag(), np.asarray(got))
    assert sorted(seen) == list(range(1, N))
    for r, (tag, got) in seen.items():
      assert tag == 100 + r
      np.testing.assert_array_equal(got, payload(r, (2, 3), jnp.int32))
  else:
    jax.jit(lambda x: ops.send(x, 0, tag=100 + R))(payload(R, (2, 3), jnp.int32))
  ops.barrier()


def test_tags_keep_messages_apart():
  if PARTNER is not None:
    if R % 2 == 0:
      ops.send(jnp.float32([1, 2]), PARTNER, tag=5)
      ops.send(jnp.float32([3, 4]), PARTNER, tag=6)
    else:
      later = ops.recv(jnp.zeros(2), PARTNER, tag=6)  # the second message first
      first = ops.recv(jnp.zeros(2), PARTNER, tag=5)
      np.testing.assert_array_equal(later, [3, 4])
      np.testing.assert_array_equal(first, [1, 2])
  ops.barrier()


def test_proc_null_is_no_message():
  x = payload(R)
  ops.send(x, MPI.PROC_NULL)
  status = MPI.Status()
  got = jax.jit(lambda t: ops.recv(t, MPI.PROC_NULL, status=status))(x)
  np.testing.assert_array_equal(got, x)  # the buffer comes back unchanged
  assert status.Get_source() == MPI.PROC_NULL
  np.testing.assert_array_equal(tagged_sendrecv(x, x * 0, MPI.PROC_NULL, MPI.PROC_NULL),
                                x * 0)


@pytest.mark.parametrize("mode", MODES)
def test_tagged_sendrecv_ring(mode):
  """Each rank sends to the next and receives from the previous (also at 1 rank: itself)."""
  nxt, prv = (R + 1) % N, (R - 1) % N
  status = MPI.Status()

  def step(x, like):
    return tagged_sendrecv(x, like, prv, nxt, sendtag=7, recvtag=7, status=status)

  like = jnp.zeros(6, jnp.float32)  # another shape, the same bytes
  got = (step if mode == "eager" else jax.jit(step))(jnp.tile(payload(R), (2, 1)), like)
  np.testing.assert_array_equal(got, np.tile(payload(prv), 2))
  assert (status.Get_source(), status.Get_tag()) == (prv, 7)


def test_tagged_sendrecv_autodiff_and_vmap():
  nxt, prv = (R + 1) % N, (R - 1) % N

  def f(x):
    return jnp.sum(tagged_sendrecv(x, x, prv, nxt) * (R + 1))

  x = jnp.ones(3) * (R + 1)
  # Rank r's x reaches rank r+1, whose loss weighs it by r+2.
  np.testing.assert_array_equal(jax.grad(f)(x), np.full(3, float(nxt + 1)))
  _, t = jax.jvp(lambda v: tagged_sendrecv(v, v, prv, nxt), (x,), (jnp.full(3, R + 1.0),))
  np.testing.assert_array_equal(t, np.full(3, prv + 1.0))
  xs = jnp.stack([payload(R), payload(R) + 1])
  got = jax.vmap(lambda v: tagged_sendrecv(v, v, prv, nxt))(xs)
  np.testing.assert_array_equal(got, jnp.stack([payload(prv), payload(prv) + 1]))
  with pytest.raises(ValueError, match="any source"):
    jax.grad(lambda v: tagged_sendrecv(v, v, MPI.ANY_SOURCE, nxt).sum())(x)


def test_messages_in_pieces(tiny_chunks):  # noqa: F811
  """Above max_chunk_bytes a message goes in pieces; from any source too."""
  if PARTNER is not None:
    if R % 2 == 0:
      ops.send(payload(R, (5, 7)), PARTNER, tag=1)
    else:
      status = MPI.Status()
      got = ops.recv(jnp.zeros((5, 7)), status=status)
      np.testing.assert_array_equal(got, payload(PARTNER, (5, 7)))
      assert (status.Get_source(), status.Get_count(MPI.BYTE)) == (PARTNER, 140)
  nxt, prv = (R + 1) % N, (R - 1) % N
  got = tagged_sendrecv(payload(R, (4, 4)), jnp.zeros((4, 4)), prv, nxt)
  np.testing.assert_array_equal(got, payload(prv, (4, 4)))
  ops.barrier()


def test_send_then_recv_against_recv_then_send_in_jit():
  """Program order on each rank: without it XLA may start the independent
  receive first on both ranks and deadlock (1 MiB: no eager buffering)."""
  if PARTNER is not None:
    @jax.jit
    def exchange(x):
      if R % 2 == 0:
        ops.send(x, PARTNER)
        return ops.recv(x, PARTNER)
      got = ops.recv(x, PARTNER)
      ops.send(x, PARTNER)
      return got

    x = jnp.full((1 << 18,), float(R), jnp.float32)
    for _ in range(5):
      np.testing.assert_array_equal(exchange(x)[:3], np.full(3, float(PARTNER)))
  ops.barrier()


def test_calls_in_unused_nested_jit_loop_and_branch_still_run():
  """A nested jax.jit, fori_loop or cond whose results are unused keeps the
  mpijax calls inside (JAX drops such an equation whole when it carries no
  effect: the sends never left, and the receiver waited forever)."""
  if PARTNER is not None:
    if R % 2 == 0:
      send_jit = jax.jit(lambda x: (ops.send(x, PARTNER, tag=11), x)[1])

      @jax.jit
      def step(x):
        send_jit(x)
        jax.lax.fori_loop(0, 2, lambda i, c: (ops.send(c + i, PARTNER, tag=12), c)[1], x)
        jax.lax.cond(x[0] > 0, lambda v: (ops.send(v * 5, PARTNER, tag=13), v)[1],
                     lambda v: v, x)
        return x + 1

      np.testing.assert_array_equal(step(jnp.ones(2)), [2.0, 2.0])
    else:
      got = [ops.recv(jnp.zeros(2), PARTNER, tag=t) for t in (11, 12, 12, 13)]
      np.testing.assert_array_equal(np.stack(got), [[1, 1], [1, 1], [2, 2], [5, 5]])
  ops.barrier()


def test_only_the_pair_calls_while_others_run_collectives():
  """Ranks 0 and 1 exchange before an all-reduce; the others go straight to it.
  (A signature check on the point-to-point calls would pair with the others'
  all-reduce, or wait for them forever.)"""
  x = payload(R)
  if N >= 2 and R < 2:
    x = jax.jit(lambda v: tagged_sendrecv(v, v, 1 - R, 1 - R) + ops.allreduce(v))(x)
    want = payload(1 - R) + sum(payload(r) for r in range(N))
  else:
    x = jax.jit(lambda v: v + ops.allreduce(v))(x)
    want = payload(R) + sum(payload(r) for r in range(N))
  np.testing.assert_array_equal(x, want)


def test_any_source_takes_no_collective_traffic():
  """Rank 1 waits for any message while the others ppermute among themselves
  (their messages to rank 1 travel on mpijax's collective communicator) and
  rank 0 then sends: rank 1 gets rank 0's message, then joins the ppermute."""
  if N < 3:
    pytest.skip("needs 3 ranks: a ppermute in flight while one rank receives")
  ring = [(r, (r + 1) % N) for r in range(N)]
  x = payload(R)
  # Once on every rank first: a call's first run compares its signature across
  # all ranks, which would wait for rank 1.
  ops.ppermute(x, ring).block_until_ready()
  if R == 1:
    got = ops.recv(jnp.zeros(3))
    np.testing.assert_array_equal(got, payload(0) * 2)
    y = ops.ppermute(x, ring)
  else:
    y = ops.ppermute(x, ring)
    if R == 0:
      ops.send(x * 2, 1)
  np.testing.assert_array_equal(y, payload((R - 1) % N))


def test_p2p_argument_errors():
  with pytest.raises(ValueError, match=rf"dest={N}; expected a static integer rank in \[0, {N}\)"):
    ops.send(jnp.ones(2), N)
  with pytest.raises(ValueError, match="source=-5"):
    ops.recv(jnp.ones(2), -5)
  with pytest.raises(ValueError, match=r"tag=-3; expected a static integer tag"):
    ops.send(jnp.ones(2), 0, tag=-3)
  with pytest.raises(TypeError, match="MPI.Status"):
    ops.recv(jnp.ones(2), 0, status="status")
  with pytest.raises(ValueError, match="dest=1.5"):
    ops.send(jnp.ones(2), 1.5)
