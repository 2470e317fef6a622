"""mpijax.ops gather, scatter, scan and mpi4py MPI.Op objects, under 1 / 2 / 3 / 4 ranks.

Every rank knows every rank's input, so each assertion computes the exact
expected result locally and holds at any rank count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpijax import ops
from tests.mpi.test_ops import assert_close
from tests.mpi.test_ops import enable_x64
from tests.mpi.test_ops import np_reduce
from tests.mpi.test_ops import rank_input
from tests.mpi.test_ops import run
from tests.mpi.test_ops import tiny_chunks  # noqa: F401 (fixture)
from tests.mpi.test_ops import transport_settings

# This rank, the number of ranks and mpi4py's MPI, set before the first test:
# importing the module must not start MPI (see conftest.py).
R = N = MPI = None


@pytest.fixture(autouse=True, scope="module")
def _rank(rt):
  global R, N, MPI
  from mpi4py import MPI as mpi
  R, N, MPI = rt.rank, rt.size, mpi


def all_inputs(shape=(5,), dtype="float32") -> np.ndarray:
  """Every rank's input, stacked."""
  return np.stack([rank_input(r, shape, dtype) for r in range(N)])


@pytest.mark.parametrize("dtype,mode,root", [("float32", "jit", 0), ("bfloat16", "eager", -1),
                                             ("int8", "jit", -1), ("bool", "eager", 0)])
def test_gather(dtype, mode, root):
  root %= N
  stack = all_inputs((2, 3), dtype)
  got = run(mode, lambda v: ops.gather(v, root), rank_input(R, (2, 3), dtype))
  if R == root:
    assert_close(got, stack, dtype)
  else:
    assert got.shape == (0, 2, 3) and got.dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("dtype,mode,root", [("float32", "eager", -1), ("float16", "jit", 0),
                                             ("uint16", "eager", 0), ("complex64", "jit", -1)])
def test_scatter(dtype, mode, root):
  root %= N
  stack = all_inputs((2, 3), dtype)
  x = stack if R == root else np.zeros((2, 3), stack.dtype)  # the others: block-shaped
  assert_close(run(mode, lambda v: ops.scatter(v, root), x), stack[R], dtype)


@pytest.mark.parametrize("dtype,op,mode", [("float32", "sum", "jit"), ("float64", "prod", "eager"),
                                           ("int32", "max", "jit"), ("uint8", "xor", "eager"),
                                           ("bool", "or", "jit")])
def test_scan(dtype, op, mode):
  with enable_x64(dtype == "float64"):
    stack = all_inputs((4,), dtype)
    got = run(mode, lambda v: ops.scan(v, op), rank_input(R, (4,), dtype))
    assert_close(got, np_reduce(stack[:R + 1], op, dtype), dtype)


def test_rooted_ops_in_pieces(tiny_chunks):  # noqa: F811
  shape = (3, 7)  # 84 B of float32 in 24-byte pieces
  stack = all_inputs(shape, "float32")
  x = rank_input(R, shape, "float32")
  g = ops.gather(x, N - 1)
  if R == N - 1:
    np.testing.assert_array_equal(g, stack)
  np.testing.assert_array_equal(ops.scatter(stack if R == 0 else x, 0), stack[R])
  np.testing.assert_array_equal(ops.scan(x), stack[:R + 1].sum(0))


@pytest.mark.parametrize("blocking", [False, True])
def test_rooted_ops_both_wait_paths(blocking):
  with transport_settings(blocking_min_bytes=0 if blocking else 1 << 40):
    stack = all_inputs((500,), "float32")
    x = rank_input(R, (500,), "float32")
    g, s, c = jax.jit(lambda v, b: (ops.gather(v, 0), ops.scatter(b, N - 1), ops.scan(v)))(
        x, stack if R == N - 1 else x)
    if R == 0:
      np.testing.assert_array_equal(g, stack)
    np.testing.assert_array_equal(s, stack[R])
    np.testing.assert_array_equal(c, stack[:R + 1].sum(0))


def test_rooted_ops_autodiff():
  """gather and scatter are each other's transposes; scan's is a suffix sum."""
  x = jnp.asarray(rank_input(R, (3,), "float32"))
  # d/dx_r of sum_s w_s * gather(x)[s] at the root is w_r, on every rank r.
  w = (jnp.arange(N, dtype=jnp.float32) + 1)[:, None]
  g = jax.grad(lambda v: jnp.sum(ops.gather(v, 0) * (w if R == 0 else 0)))(x)
  np.testing.assert_array_equal(g, np.full(3, R + 1.0))
  blocks = jnp.asarray(all_inputs((3,), "float32"))
  g = jax.grad(lambda b: jnp.sum(ops.scatter(b, 0)) * (R + 1))(blocks if R == 0 else x)
  if R == 0:
    np.testing.assert_array_equal(g, np.repeat(np.arange(1.0, N + 1)[:, None], 3, 1))
  else:
    np.testing.assert_array_equal(g, np.zeros(3))  # the non-root x is only a shape
  # d/dx_r of sum_s c_s * scan(x)_s is sum over s >= r of c_s.
  g = jax.grad(lambda v: jnp.sum(ops.scan(v)) * (R + 1))(x)
  np.testing.assert_allclose(g, np.full(3, sum(s + 1 for s in range(R, N))))
  _, t = jax.jvp(lambda v: ops.scan(v), (x,), (jnp.ones(3),))
  np.testing.assert_array_equal(t, np.full(3, R + 1.0))
  with pytest.raises(TypeError, match="only op='sum'"):
    jax.grad(lambda v: ops.scan(v, "max").sum())(x)


def test_rooted_ops_vmap():
  xs = jnp.asarray(np.stack([rank_input(R, (3,), "float32") + i for i in range(2)]))
  for axis in (0, 1):
    v = jnp.moveaxis(xs, 0, axis)
    got = jax.vmap(lambda t: ops.scan(t), in_axes=axis)(v)
    np.testing.assert_array_equal(got, jnp.stack([ops.scan(t) for t in xs]))
    got = jax.vmap(lambda t: ops.gather(t, 0), in_axes=axis, out_axes=1)(v)
    assert got.shape == ((N if R == 0 else 0), 2, 3)
    if R == 0:
      np.testing.assert_array_equal(got[:, 1], all_inputs((3,), "float32") + 1)
  blocks = np.stack([all_inputs((3,), "float32") + i for i in range(2)])  # (2, N, 3)
  got = jax.vmap(lambda b: ops.scatter(b, 0))(blocks if R == 0 else blocks[:, 0])
  np.testing.assert_array_equal(got, blocks[:, R])


def test_rooted_op_errors():
  if R == 0:  # raised before any MPI call: only the root checks its blocks
    with pytest.raises(ValueError, match=r"shape \(nproc, \.\.\.\)"):
      ops.scatter(jnp.ones((N + 1, 2)), 0)
  for fn in (lambda: ops.gather(jnp.ones(2), N), lambda: ops.scatter(jnp.ones(2), -1)):
    with pytest.raises(ValueError, match="root="):
      fn()
  with pytest.raises(TypeError, match="op='min' for dtype complex64"):
    ops.scan(jnp.ones(2, jnp.complex64), "min")


# --- mpi4py MPI.Op objects ------------------------------------------------------------


def test_mpi_ops_match_names():
  cases = [("SUM", "sum", "float32"), ("PROD", "prod", "int32"), ("MIN", "min", "float32"),
           ("MAX", "max", "int8"), ("BAND", "and", "uint8"), ("BOR", "or", "int16"),
           ("BXOR", "xor", "bool"), ("LAND", "and", "bool"), ("LOR", "or", "bool"),
           ("LXOR", "xor", "bool")]
  for i, (mpi_name, name, dtype) in enumerate(cases):
    mpi_op = getattr(MPI, mpi_name)
    stack = all_inputs((5,), dtype)
    x = rank_input(R, (5,), dtype)
    want = np_reduce(stack, name, dtype)
    assert_close(ops.allreduce(x, mpi_op), want, dtype)
    if i % 3 == 0:  # the other reductions resolve ops the same way
      assert_close(jax.jit(lambda v: ops.reduce(v, mpi_op, root=N - 1))(x),
                   want if R == N - 1 else np.zeros_like(want), dtype)
      assert_close(ops.scan(x, mpi_op), np_reduce(stack[:R + 1], name, dtype), dtype)


@pytest.mark.parametrize("mpi_name,fn", [("LAND", np.logical_and), ("LOR", np.logical_or),
                                         ("LXOR", np.logical_xor)])
def test_logical_mpi_ops_on_integers(mpi_name, fn):
  """MPI's logical ops on integers: nonzero is true, the result is 1 or 0 (and,
  on one rank, where MPI combines nothing, x itself)."""
  mpi_op = getattr(MPI, mpi_name)
  stack = np.stack([np.array([0, 3, 5, 0, 2 + r % 2], np.int32) * (r + 1) for r in range(N)])
  x = stack[R]
  want = fn.reduce(stack != 0, axis=0).astype(np.int32) if N > 1 else x
  np.testing.assert_array_equal(ops.allreduce(x, mpi_op), want)
  np.testing.assert_array_equal(jax.jit(lambda v: ops.allreduce(v, mpi_op))(x), want)
  np.testing.assert_array_equal(ops.reduce_scatter(np.tile(x, (N, 1)), mpi_op), want)
  with pytest.raises(TypeError, match=r"MPI.LAND for dtype float32.*integers and bool"):
    ops.allreduce(jnp.ones(2), MPI.LAND)


def test_unsupported_mpi_ops_are_named():
  for op in (MPI.MAXLOC, MPI.MINLOC, MPI.REPLACE, MPI.NO_OP):
    name = [n for n in ("MAXLOC", "MINLOC", "REPLACE", "NO_OP") if getattr(MPI, n) == op][0]
    with pytest.raises(ValueError, match=rf"op=MPI\.{name}, which mpijax does not support.*"
                                         r"MPI\.SUM"):
      ops.allreduce(jnp.ones(2), op)
  user_op = MPI.Op.Create(lambda a, b, t: None, commute=True)
  try:
    with pytest.raises(ValueError, match="user-defined"):
      ops.scan(jnp.ones(2), user_op)
  finally:
    user_op.Free()
  with pytest.raises(ValueError, match="op=3 of type int"):
    ops.allreduce(jnp.ones(2), 3)


def test_mpi_op_in_fused_allreduce():
  from mpijax._src.ops.allreduce_many import allreduce_many
  xs = [np.int32([R, 0, 1]), np.float32([R + 1.0])]
  got = allreduce_many(xs, MPI.MAX)
  np.testing.assert_array_equal(got[0], [N - 1, 0, 1])
  np.testing.assert_array_equal(got[1], [float(N)])
