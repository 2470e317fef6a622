"""mpijax.ops against NumPy references, under mpirun -n 1 / 2 / 4.

Run: timeout 600 mpirun --allow-run-as-root --oversubscribe -n 4 \
       python -m pytest --with-mpi -q -x tests/mpi/test_ops.py

Every rank knows every rank's input (``rank_input``), so each assertion
computes the exact expected result locally and holds at any rank count.
"""

from __future__ import annotations

import contextlib
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpijax import ops

try:
  from jax import enable_x64
except ImportError:  # JAX 0.7 has it in jax.experimental only
  from jax.experimental import enable_x64


# This rank, the number of ranks and the runtime, set by ``_rank`` before the
# first test: importing the module must not start MPI (see conftest.py).
R = N = RT = None


@pytest.fixture(autouse=True, scope="module")
def _rank(rt):
  global R, N, RT
  R, N, RT = rt.rank, rt.size, rt

FLOATS = ["float32", "float64", "float16", "bfloat16"]
COMPLEX = ["complex64", "complex128"]
INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
ALL = FLOATS + COMPLEX + INTS + ["bool"]
MODES = ["eager", "jit"]


def dtype_modes(dtypes):
  """Each dtype once, eager and jit alternating: every family meets both modes
  across the tests while the 4-rank run stays short (each case compiles)."""
  return [(d, MODES[i % 2]) for i, d in enumerate(dtypes)]


def rank_input(rank: int, shape=(5,), dtype="float32") -> np.ndarray:
  """Small values (no overflow even in int8 for 4 ranks) that differ by rank."""
  k = np.arange(int(np.prod(shape))).reshape(shape)
  if dtype == "bool":
    return ((k + rank) % 3 == 0)
  v = (k + 2 * rank) % 5 + 1
  if dtype.startswith("complex"):
    return (v + 1j * ((k + rank) % 3)).astype(dtype)
  return v.astype(jnp.dtype(dtype))


def all_inputs(shape=(5,), dtype="float32") -> np.ndarray:
  return np.stack([rank_input(r, shape, dtype) for r in range(N)])


def run(mode, fn, *args):
  return fn(*args) if mode == "eager" else jax.jit(fn)(*args)


@pytest.fixture(autouse=True)
def x64(request):
  """64-bit dtypes need jax_enable_x64; switched on only for tests that use them."""
  dtype = getattr(request.node, "callspec", None)
  dtype = dtype.params.get("dtype", "") if dtype else ""
  if "64" in dtype or dtype == "complex128":
    with enable_x64(True):
      yield
  else:
    yield


def assert_close(got, want, dtype):
  got = np.asarray(got)
  assert got.dtype == np.dtype(jnp.dtype(dtype)), (got.dtype, dtype)
  if dtype in ("float16", "bfloat16"):
    np.testing.assert_allclose(got.astype(np.float32), np.asarray(want).astype(np.float32),
                               rtol=1e-2)
  else:
    np.testing.assert_array_equal(got, want)


_NP_REDUCE = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max,
              "and": lambda a, axis: np.bitwise_and.reduce(a, axis=axis),
              "or": lambda a, axis: np.bitwise_or.reduce(a, axis=axis),
              "xor": lambda a, axis: np.bitwise_xor.reduce(a, axis=axis)}


def np_reduce(stack, op, dtype):
  if dtype in ("float16", "bfloat16"):
    return _NP_REDUCE[op](stack.astype(np.float32), axis=0)
  return _NP_REDUCE[op](stack, axis=0).astype(stack.dtype)


def np_mean(stack, dtype):
  """The sum over ranks divided by N; complex parts are divided one by one (as
  the handler does: correctly rounded, where NumPy's complex division by
  N + 0j may be 1 ulp off when N is not a power of two)."""
  total = np_reduce(stack, "sum", dtype)
  if np.iscomplexobj(total):
    return (total.real / N + 1j * (total.imag / N)).astype(total.dtype)
  return (total / N).astype(total.dtype)


# --- allreduce -------------------------------------------------------------------


@pytest.mark.parametrize("dtype,mode", dtype_modes(ALL) + [("float32", "eager")])
def test_allreduce_dtypes(dtype, mode):
  op = "or" if dtype == "bool" else "sum"
  x = rank_input(R, (2, 3), dtype)
  got = run(mode, lambda v: ops.allreduce(v, op), x)
  assert_close(got, np_reduce(all_inputs((2, 3), dtype), op, dtype), dtype)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "and", "or", "xor"])
@pytest.mark.parametrize("dtype", ["int32", "bfloat16", "bool"])
def test_allreduce_ops(op, dtype):
  if op not in ops_for(dtype):
    with pytest.raises(TypeError, match=dtype):
      ops.allreduce(rank_input(R, (4,), dtype), op)
    return
  x = rank_input(R, (4,), dtype)
  got = jax.jit(lambda v: ops.allreduce(v, op))(x)
  assert_close(got, np_reduce(all_inputs((4,), dtype), op, dtype), dtype)


def ops_for(dtype):
  if dtype in FLOATS:
    return ("sum", "prod", "min", "max")
  if dtype == "bool":
    return ("min", "max", "and", "or", "xor")
  return ("sum", "prod", "min", "max", "and", "or", "xor")


@pytest.mark.parametrize("dtype,mode", dtype_modes(["float32", "float64", "bfloat16",
                                                   "complex64", "float16"]))
def test_allreduce_mean(dtype, mode):
  x = rank_input(R, (2, 3), dtype)
  got = run(mode, lambda v: ops.allreduce(v, "mean"), x)
  assert_close(got, np_mean(all_inputs((2, 3), dtype), dtype), dtype)
  with pytest.raises(TypeError, match="op='mean' needs a floating.*int32"):
    ops.allreduce(np.ones(3, np.int32), "mean")


def test_allreduce_mean_grad():
  # mean is linear; its transpose is the mean of the cotangents.
  w = rank_input(R, (4,))
  x = jnp.asarray(rank_input(R, (4,)))
  g = jax.jit(jax.grad(lambda v: jnp.sum(w * ops.allreduce(v, "mean"))))(x)
  np.testing.assert_allclose(g, all_inputs((4,)).sum(0) / N, rtol=1e-6)


def test_in_place_on_intermediates_keeps_other_uses():
  # An intermediate operand is declared aliased to the result (MPI in place).
  # XLA must still copy it where the intermediate is used again.
  x = jnp.asarray(rank_input(R, (3, 4)))
  f = jax.jit(lambda v: ops.allreduce(v * 2))
  assert "output_operand_alias" in f.lower(x).as_text()
  np.testing.assert_array_equal(f(x), 2 * all_inputs((3, 4)).sum(0))

  def reused(v):
    y = v * 2
    return ops.allreduce(y), y, ops.allreduce(ops.allreduce(y) + 1)
  s, y, s2 = jax.jit(reused)(x)
  total = 2 * all_inputs((3, 4)).sum(0)
  np.testing.assert_array_equal(s, total)
  np.testing.assert_array_equal(y, 2 * rank_input(R, (3, 4)))
  np.testing.assert_array_equal(s2, N * (total + 1))
  # A non-donated parameter is not aliased (that would always cost a copy).
  assert "output_operand_alias" not in jax.jit(ops.allreduce).lower(x).as_text()


@pytest.mark.parametrize("mode", MODES)
def test_allreduce_many_mixed_dtypes_in_one_call(mode):
  # The buckets of mpijax.train's fused all-reduce: any dtypes and shapes,
  # one custom call (one FFI target in the HLO), each result exact.
  from mpijax._src.ops.allreduce_many import allreduce_many
  dtypes = ["float32", "bfloat16", "int32", "complex64", "float32"]
  shapes = [(2, 3), (7,), (4,), (3,), ()]
  xs = [rank_input(R, sh, dt) for sh, dt in zip(shapes, dtypes)]
  got = run(mode, lambda v: allreduce_many(v), xs)
  assert len(got) == len(xs)
  for g, sh, dt in zip(got, shapes, dtypes):
    assert_close(g, np_reduce(all_inputs(sh, dt), "sum", dt), dt)
  text = jax.jit(lambda v: allreduce_many([a * 2 for a in v])).lower(xs).as_text()
  assert text.count("@mpijax_allreduce_many") == 1, text
  assert "output_operand_alias" in text  # intermediates are reduced in place
  got = jax.jit(lambda a, b: allreduce_many([a, b], "max"))(xs[0], xs[2])
  assert_close(got[0], np_reduce(all_inputs((2, 3)), "max", "float32"), "float32")
  assert_close(got[1], np_reduce(all_inputs((4,), "int32"), "max", "int32"), "int32")


def test_allreduce_many_grad_vmap_and_errors():
  from mpijax._src.ops.allreduce_many import allreduce_many
  x = jnp.asarray(rank_input(R, (3,)))
  k = jnp.arange(3, dtype=jnp.int32) + R
  # d/dx of sum_r sum(w * allreduce(x)) is sum_r w (the psum convention); the
  # integer operand gets no tangent and does not block the float one.
  w = rank_input(R, (3,))
  g = jax.jit(jax.grad(lambda v: jnp.sum(w * allreduce_many([v, k])[0])))(x)
  np.testing.assert_allclose(g, all_inputs((3,)).sum(0))
  batched = jax.vmap(lambda v: allreduce_many([v, 2 * v]), in_axes=1, out_axes=1)(
      jnp.stack([x, x + 1], axis=1))
  np.testing.assert_allclose(batched[1][:, 1], 2 * (all_inputs((3,)) + 1).sum(0))
  with pytest.raises(ValueError, match="empty list"):
    allreduce_many([])
  with pytest.raises(TypeError, match="op='xor' for dtype float32"):
    allreduce_many([x], "xor")
  with pytest.raises(TypeError, match=r"allreduce_many\(op='max'\) is not differentiable"):
    jax.jvp(lambda v: allreduce_many([v], "max"), (x,), (x,))


def test_allreduce_scalar_and_empty():
  assert float(ops.allreduce(1.0)) == N
  assert ops.allreduce(jnp.zeros((0, 3))).shape == (0, 3)


def test_unsupported_dtype_and_op_errors():
  with pytest.raises(TypeError, match="float8_e4m3fn.*supported dtypes"):
    ops.allreduce(jnp.zeros(2, jnp.float8_e4m3fn))
  with pytest.raises(TypeError, match="complex64"):
    ops.allreduce(jnp.zeros(2, jnp.complex64), "max")
  with pytest.raises(ValueError, match="'avg'"):
    ops.allreduce(jnp.zeros(2), "avg")
  with pytest.raises(ValueError, match="shape"):
    ops.alltoall(jnp.zeros(N + 1))
  with pytest.raises(ValueError, match="root"):
    ops.bcast(jnp.zeros(2), N)
  with pytest.raises(ValueError, match="permutation"):
    ops.ppermute(jnp.zeros(2), [(0, 0), (0, 0)])
  # Values JAX cannot hold: mpijax's message (type, dtype, the fix), not JAX's.
  for bad, what in [(np.array(["a"]), "type ndarray, dtype str32"),
                    (np.array([object()]), "dtype object"), (None, "None")]:
    for op in (ops.allreduce, ops.allgather, lambda v: ops.bcast(v, 0),
               lambda v: ops.sendrecv(v, None, None)):
      with pytest.raises(TypeError, match=rf"mpijax.ops.\w+ got .*{what}.*cannot hold as an "
                         r"array.*jnp.asarray\(x, jnp.float32\)"):
        op(bad)


def test_gpu_and_tpu_lowering_is_a_clear_error():
  # No GPU here: jax.export lowers for another platform without one. mpijax
  # has CPU handlers only, so the error names the call and the fix instead of
  # JAX's "MLIR translation rule ... not found for platform cuda".
  from jax import export  # a submodule that JAX < 0.8 does not import with jax

  from mpijax.train import allreduce_gradients
  spec = jax.ShapeDtypeStruct((4,), jnp.float32)
  grads = allreduce_gradients()
  calls = [(lambda x: ops.allreduce(x), "mpijax.ops.allreduce"),
           (lambda x: ops.ppermute(x, [(0, 0)]), "mpijax.ops.ppermute")]
  if N > 1:  # one rank's fused all-reduce sends nothing
    calls.append((lambda x: grads.update({"w": x}, grads.init({"w": x}))[0]["w"],
                  "mpijax.train's fused allreduce"))
  for platform in ("cuda", "rocm", "tpu"):
    for f, name in calls:
      with pytest.raises(NotImplementedError,
                         match=rf"{name}.*test_ops.py:\d+.*platform '{platform}'.*CPU handlers "
                               r"only.*JAX_PLATFORMS=cpu"):
        export.export(jax.jit(f), platforms=[platform])(spec)
  # The CPU lowering is unchanged.
  assert "mpijax_allreduce" in jax.jit(calls[0][0]).lower(spec).as_text()


# --- the other primitives, per dtype family ------------------------------------------

FAMILIES = ["float32", "bfloat16", "complex128", "int16", "uint64", "bool"]


@pytest.mark.parametrize("dtype,mode", dtype_modes(FAMILIES))
def test_allgather(dtype, mode):
  got = run(mode, ops.allgather, rank_input(R, (2, 3), dtype))
  assert_close(got, all_inputs((2, 3), dtype), dtype)


@pytest.mark.parametrize("dtype,mode", dtype_modes(FAMILIES))
def test_reduce_scatter(dtype, mode):
  op = "xor" if dtype == "bool" else "sum"
  got = run(mode, lambda v: ops.reduce_scatter(v, op), rank_input(R, (N, 3), dtype))
  assert_close(got, np_reduce(all_inputs((N, 3), dtype), op, dtype)[R], dtype)


@pytest.mark.parametrize("dtype,mode", dtype_modes(FAMILIES))
def test_alltoall(dtype, mode):
  got = run(mode, ops.alltoall, rank_input(R, (N, 2), dtype))
  assert_close(got, all_inputs((N, 2), dtype)[:, R], dtype)


@pytest.mark.parametrize("dtype,mode", dtype_modes(FAMILIES))
def test_bcast_and_reduce(dtype, mode):
  root = N - 1
  got = run(mode, lambda v: ops.bcast(v, root), rank_input(R, (3,), dtype))
  assert_close(got, rank_input(root, (3,), dtype), dtype)
  op = "or" if dtype == "bool" else "sum"
  got = run(mode, lambda v: ops.reduce(v, op, root=0), rank_input(R, (3,), dtype))
  want = np_reduce(all_inputs((3,), dtype), op, dtype)
  assert_close(got, want if R == 0 else np.zeros_like(want), dtype)


PERMS = {
    "ring": lambda n: [(i, (i + 1) % n) for i in range(n)],
    "reverse": lambda n: [(i, n - 1 - i) for i in range(n)],
    "partial": lambda n: [(0, n - 1)],
    "identity": lambda n: [(i, i) for i in range(n)],
}


def np_ppermute(stack, perm):
  out = np.zeros_like(stack[0])
  for s, d in perm:
    if d == R:
      out = stack[s]
  return out


@pytest.mark.parametrize("perm,dtype,mode", [
    (perm, ["float32", "complex64", "int8", "bool"][i % 4], MODES[(i // 2) % 2])
    for i, perm in enumerate(sorted(PERMS) * 2)])
def test_ppermute(dtype, perm, mode):
  p = PERMS[perm](N)
  got = run(mode, lambda v: ops.ppermute(v, p), rank_input(R, (2, 2), dtype))
  assert_close(got, np_ppermute(all_inputs((2, 2), dtype), p), dtype)


@pytest.mark.parametrize("mode", MODES)
def test_sendrecv_ring(mode):
  got = run(mode, lambda v: ops.sendrecv(v, source=(R - 1) % N, dest=(R + 1) % N),
            rank_input(R, (3,)))
  np.testing.assert_array_equal(got, rank_input((R - 1) % N, (3,)))


@pytest.mark.parametrize("mode", MODES)
def test_barrier(mode):
  run(mode, lambda: ops.barrier())
  # Inside jit, with unused results: kept and ordered with the other ops.
  f = jax.jit(lambda x: (ops.barrier(), ops.allreduce(x))[1])
  assert "mpijax_barrier" in f.lower(1.0).as_text()
  assert float(f(1.0)) == N


def test_user_comm_is_cloned_and_split():
  from mpi4py import MPI
  sub = MPI.COMM_WORLD.Split(color=R % 2, key=R)
  try:
    got = ops.allreduce(jnp.float32(R), comm=sub)
    want = sum(r for r in range(N) if r % 2 == R % 2)
    assert float(got) == want
    # The user's own traffic on the same communicator does not interleave.
    req = sub.Ibarrier()
    assert float(jax.jit(lambda v: ops.allreduce(v, comm=sub))(jnp.float32(1))) == sub.size
    req.Wait()
  finally:
    sub.Free()


@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("float64", "sum"), ("float32", "mean"),
                                      ("int32", "max"), ("bfloat16", "sum")])
def test_allreduce_on_pairs_of_ranks(dtype, op):
  """Communicators of two ranks (one at odd rank counts): the shared-memory
  path's two-rank float sum and its generic reduction, eager, jitted and
  donated, the same bits on both ranks."""
  from mpi4py import MPI
  sub = MPI.COMM_WORLD.Split(color=R // 2, key=R)
  try:
    members = [r for r in range(N) if r // 2 == R // 2]
    stack = np.stack([rank_input(r, (1001,), dtype) for r in members])
    total = np_reduce(stack, "sum" if op == "mean" else op, dtype)
    want = (total / len(members)).astype(total.dtype) if op == "mean" else total
    x = rank_input(R, (1001,), dtype)
    got = [ops.allreduce(x, op, comm=sub),
           jax.jit(lambda v: ops.allreduce(v, op, comm=sub))(x),
           jax.jit(lambda v: ops.allreduce(v, op, comm=sub), donate_argnums=0)(jnp.asarray(x))]
    for g in got:
      assert_close(g, want, dtype)
      mine = np.asarray(g).tobytes()
      assert all(b == mine for b in sub.allgather(mine))
  finally:
    sub.Free()


# --- vmap ---------------------------------------------------------------------------

VMAP_CASES = {  # "N": the number of ranks
    "allreduce": (lambda v: ops.allreduce(v), (3,)),
    "allgather": (ops.allgather, (3,)),
    "reduce_scatter": (ops.reduce_scatter, ("N", 3)),
    "alltoall": (ops.alltoall, ("N", 3)),
    "bcast": (lambda v: ops.bcast(v, 0), (3,)),
    "reduce": (lambda v: ops.reduce(v, root=0), (3,)),
    "ppermute": (lambda v: ops.ppermute(v, PERMS["ring"](N)), (3,)),
}


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", sorted(VMAP_CASES))
def test_vmap_matches_loop(name, axis):
  fn, shape = VMAP_CASES[name]
  shape = tuple(N if s == "N" else s for s in shape)
  B = 2
  xs = np.stack([rank_input(R, shape) + 10 * b for b in range(B)], axis=axis)
  got = jax.jit(jax.vmap(fn, in_axes=axis, out_axes=axis))(xs)
  want = np.stack([np.asarray(fn(np.take(xs, b, axis=axis))) for b in range(B)], axis=axis)
  np.testing.assert_allclose(got, want)


# --- autodiff -----------------------------------------------------------------------


def test_grad_allreduce_sum_is_sum_of_cotangents():
  # loss_r = sum(w_r * allreduce(x)): d/dx on rank r = sum_s w_s (psum convention).
  w = rank_input(R, (4,))
  x = jnp.asarray(rank_input(R, (4,)))
  g = jax.jit(jax.grad(lambda v: jnp.sum(w * ops.allreduce(v))))(x)
  np.testing.assert_allclose(g, all_inputs((4,)).sum(0))


def test_jvp_vjp_linear_ops():
  x = jnp.asarray(rank_input(R, (N, 2)))
  t = jnp.asarray(rank_input(R, (N, 2)) * 0.5)
  for fn in [ops.allgather, ops.reduce_scatter, ops.alltoall,
             lambda v: ops.bcast(v, 0), lambda v: ops.reduce(v, root=N - 1),
             lambda v: ops.ppermute(v, PERMS["ring"](N)), lambda v: ops.allreduce(v)]:
    y, ty = jax.jvp(fn, (x,), (t,))
    np.testing.assert_allclose(ty, fn(t), rtol=1e-6)  # linear: jvp == f(t)
    # <ct, f(t)> summed over ranks == <f^T(ct), t> summed over ranks.
    ct = jnp.asarray(rank_input(R + 1, y.shape))
    (ft_ct,) = jax.vjp(fn, x)[1](ct)
    lhs = float(ops.allreduce(jnp.vdot(ct, fn(t))))
    rhs = float(ops.allreduce(jnp.vdot(ft_ct, t)))
    np.testing.assert_allclose(lhs, rhs, rtol=1e-6)
    # linear_transpose twice gives back f.
    f_t = jax.linear_transpose(fn, x)
    f_tt = jax.linear_transpose(lambda c: f_t(c)[0], ct)
    np.testing.assert_allclose(f_tt(t)[0], fn(t), rtol=1e-6)


def test_only_sum_reductions_differentiate():
  # reduce / reduce_scatter are linear only for op="sum": other ops name the fix.
  x = jnp.asarray(rank_input(R, (N, 2)))
  for name, fn in [("reduce_scatter", lambda v: ops.reduce_scatter(v, "max")),
                   ("reduce", lambda v: ops.reduce(v, "max", root=0))]:
    with pytest.raises(TypeError, match=rf"mpijax.ops.{name}\(op='max'\) is not differentiable; only op='sum'"):
      jax.jvp(fn, (x,), (x,))
    with pytest.raises(TypeError, match=rf"mpijax.ops.{name}\(op='max'\) is not linear"):
      jax.linear_transpose(fn, x)(fn(x))


def test_grad_min_max_prod():
  x = jnp.asarray(rank_input(R, (5,)), jnp.float32)
  stack = all_inputs((5,)).astype(np.float32)
  # d/dx_r sum(allreduce(x, max)) summed over ranks' losses: N * indicator / ties
  g = jax.grad(lambda v: jnp.sum(ops.allreduce(v, "max")))(x)
  hit = stack == stack.max(0)
  np.testing.assert_allclose(g, N * hit[R] / hit.sum(0), rtol=1e-6)
  g = jax.grad(lambda v: jnp.sum(ops.allreduce(v, "min")))(x)
  hit = stack == stack.min(0)
  np.testing.assert_allclose(g, N * hit[R] / hit.sum(0), rtol=1e-6)
  g = jax.grad(lambda v: jnp.sum(ops.allreduce(v, "prod")))(x)
  others = np.prod(np.delete(stack, R, axis=0), axis=0)
  np.testing.assert_allclose(g, N * others, rtol=1e-5)


def test_control_flow_and_remat():
  x = jnp.asarray(rank_input(R, (3,)))

  def body(c, _):
    return ops.allreduce(c) / N, None

  got = jax.jit(lambda v: jax.lax.scan(body, v, None, length=3)[0])(x)
  np.testing.assert_allclose(got, all_inputs((3,)).mean(0), rtol=1e-6)
  got = jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, c: ops.ppermute(c, PERMS["ring"](N)), v))(x)
  np.testing.assert_allclose(got, rank_input((R - 2) % N, (3,)))
  got = jax.jit(lambda v, p: jax.lax.cond(p, lambda u: ops.allreduce(u), lambda u: u * N, v))(x, True)
  np.testing.assert_allclose(got, all_inputs((3,)).sum(0))
  f = jax.checkpoint(lambda v: jnp.sin(ops.allreduce(v)))
  g = jax.jit(jax.grad(lambda v: jnp.sum(f(v))))(x)
  np.testing.assert_allclose(g, N * np.cos(all_inputs((3,)).sum(0)), rtol=1e-5)


# --- chunking (messages above max_chunk_bytes) --------------------------------------


@contextlib.contextmanager
def transport_settings(**values):
  """Sets transport settings (sent to the C++ handlers) for a block, then
  restores the defaults."""
  from mpijax._src import config
  from mpijax._src.ffi import settings
  for name, value in values.items():
    config.update(name, value)
  settings.push_settings()
  try:
    yield
  finally:
    for name in values:
      config.reset(name)
    settings.push_settings()


def test_waits_know_whether_the_node_has_more_ranks_than_cores():
  # There a polled wait yields the core after every poll (base/idle.h).
  from mpijax._src.ffi import settings
  from mpijax._src.run import rank as rank_env
  settings.push_settings()
  info = rank_env.launch_info()
  assert info is not None and info.local_size is not None
  assert settings._pushed["oversubscribed"] == (info.local_size > os.cpu_count())


@pytest.fixture
def tiny_chunks():
  with transport_settings(max_chunk_bytes=24):  # not a multiple of most message sizes
    yield


@pytest.fixture(params=["nonblocking", "blocking"])
def wait_path(request):
  """Collectives block in MPI (under the watchdog) from MPIJAX_BLOCKING_MIN_BYTES
  on, by default at every size, and are polled nonblocking calls below it.
  Force each."""
  with transport_settings(blocking_min_bytes=1 << 40 if request.param == "nonblocking" else 0,
                          shm_max_bytes=0, cma_min_bytes=0):
    yield request.param


def test_both_wait_paths(wait_path):
  shape = (N, 3000)  # 12 KB rows of float32
  for dtype in ["float32", "bfloat16"]:
    stack = all_inputs(shape, dtype)
    x = rank_input(R, shape, dtype)
    f = jax.jit(lambda v: (ops.allreduce(v), ops.allgather(v), ops.reduce_scatter(v),
                           ops.alltoall(v), ops.bcast(v, N - 1)))
    s, g, rs, a2a, b = f(x)
    assert_close(s, np_reduce(stack, "sum", dtype), dtype)
    assert_close(g, stack, dtype)
    assert_close(rs, np_reduce(stack, "sum", dtype)[R], dtype)
    assert_close(a2a, stack[:, R], dtype)
    assert_close(b, stack[N - 1], dtype)


_PATH_COMMS: dict = {}


@pytest.fixture(params=["cma", "ring", "shm", "mpi"])
def allreduce_path(request):
  """On one node with one device per rank, all-reduces of >= cma_min_bytes run
  by cross-memory attach; else those of >= ring_min_bytes per rank run
  mpijax's ring, smaller ones of <= shm_max_bytes go through node-local shared
  memory, the others MPI_Allreduce. Force each, down to one byte per rank.
  Yields a communicator of the path's own: its first node-local all-reduce
  sets up its segments under these settings (an earlier test's, on the
  default communicator, may have sized them for no shared memory)."""
  limit = 1 if request.param == "ring" else 0
  shm = 1 << 20 if request.param == "shm" else 0
  cma = 1 if request.param == "cma" else 0
  if request.param not in _PATH_COMMS:
    _PATH_COMMS[request.param] = RT.comm.Dup()
  comm = _PATH_COMMS[request.param]
  with transport_settings(ring_min_bytes=limit, ring_in_place_min_bytes=limit, shm_max_bytes=shm,
                          cma_min_bytes=cma):
    yield comm
  if request.param in ("cma", "shm") and N > 1 and len(jax.local_devices()) == 1:
    # The path was set up (all ranks of these jobs share one node): 1 shared
    # memory, 2 also cross-memory attach.
    assert _node_paths(comm)[0] >= (2 if request.param == "cma" else 1)


def _node_paths(comm=None) -> list[int]:
  from mpijax._src import ffi
  from mpijax._src.ops import communicators
  return ffi.load().node_paths(communicators.resolve_comm(comm, "allreduce").id)


@pytest.mark.parametrize("chunked", [False, True])
def test_ring_and_mpi_allreduce(allreduce_path, chunked):
  from mpijax._src.ops.allreduce_many import allreduce_many
  # Chunked, the ring runs on each 24-byte chunk: blocks of 0 to 2 elements.
  with transport_settings(**({"max_chunk_bytes": 24} if chunked else {})):
    # Sizes that do not split evenly into N blocks, and fewer elements than ranks.
    for n, dtype, op in [(1001, "float32", "sum"), (7, "bfloat16", "sum"),
                         (3, "int32", "max"), (999, "float32", "mean"),
                         (30, "complex64", "sum"), (1, "float32", "sum"),
                         # Over 32 KiB read per rank: shared memory reduces in blocks.
                         (9001, "float32", "sum"), (9001, "int32", "max"),
                         (9003, "float32", "mean")]:
      stack = all_inputs((n,), dtype)
      want = (np_reduce(stack, "sum", dtype) / N).astype(stack.dtype) if op == "mean" \
          else np_reduce(stack, op, dtype)
      x = rank_input(R, (n,), dtype)
      comm = allreduce_path
      got = [ops.allreduce(x, op, comm=comm),  # out of place
             jax.jit(lambda v: ops.allreduce(v * 1, op, comm=comm))(x),  # in place, an intermediate
             jax.jit(lambda v: ops.allreduce(v, op, comm=comm), donate_argnums=0)(jnp.asarray(x))]
      if op != "mean":
        got.append(allreduce_many([x, x], op, comm=comm)[1])
        # One ring over an out-of-place parameter and an in-place intermediate.
        both = jax.jit(lambda v: allreduce_many([v, v * 1], op, comm=comm))(x)
        got += list(both)
      for g in got:
        assert_close(g, want, dtype)
        # Every rank gets the same bits (each ring or shared-memory block is
        # reduced by one rank).
        mine = np.asarray(g).tobytes()
        assert all(b == mine for b in RT.comm.allgather(mine))


def _order_sensitive_inputs(n: int):
  """Every rank's float32 input of ``n`` values whose sum depends on the order,
  and their sum in rank order, ((x0 + x1) + x2) + ..."""
  k = np.arange(n, dtype=np.float64)
  x_of = [(np.sin(k * (r + 1)) * 10.0 ** ((k + r) % 7 - 3)).astype(np.float32)
          for r in range(N)]
  want = x_of[0].copy()
  for r in range(1, N):
    want = want + x_of[r]
  return x_of, want


def test_cross_memory_allreduce_sums_in_rank_order_in_place_or_not():
  """Cross-memory attach sums each block in rank order, ((x0 + x1) + x2) + ...,
  whether the outputs are fresh, in place (an intermediate, a donated
  argument) or both in one call: the bits of NumPy's sequential sum, on every
  rank. Values whose sum depends on the order; blocks over 2 chunks."""
  from mpijax._src.ops.allreduce_many import allreduce_many
  x_of, want = _order_sensitive_inputs((1 << 19) + 7)
  x = jnp.asarray(x_of[R])
  with transport_settings(cma_min_bytes=1):
    got = [jax.jit(lambda v: ops.allreduce(v))(x),
           jax.jit(lambda v: ops.allreduce(v * 1))(x),
           jax.jit(lambda v: ops.allreduce(v), donate_argnums=0)(jnp.asarray(x_of[R]))]
    got += list(jax.jit(lambda v: allreduce_many([v, v * 1]))(x))
  for g in got:
    np.testing.assert_array_equal(np.asarray(g), want)


@pytest.mark.parametrize("n", [1, 1001, 9001])
def test_shared_memory_allreduce_sums_in_rank_order(n):
  """Shared memory sums in rank order, ((x0 + x1) + x2) + ..., whether every
  rank reduces the whole message (up to 32 KiB read per rank) or one block
  each, out of place, in place or donated: the bits of NumPy's sequential sum
  on every rank, and a mean divides that sum."""
  x_of, want = _order_sensitive_inputs(n)
  x = jnp.asarray(x_of[R])
  comm = RT.comm.Dup()  # its segments set up under these settings
  with transport_settings(cma_min_bytes=0, ring_min_bytes=0, ring_in_place_min_bytes=0,
                          shm_max_bytes=1 << 20):
    got = [jax.jit(lambda v: ops.allreduce(v, comm=comm))(x),
           jax.jit(lambda v: ops.allreduce(v * 1, comm=comm))(x),
           jax.jit(lambda v: ops.allreduce(v, comm=comm), donate_argnums=0)(jnp.asarray(x_of[R]))]
    mean = jax.jit(lambda v: ops.allreduce(v, "mean", comm=comm))(x)
  for g in got:
    np.testing.assert_array_equal(np.asarray(g), want)
  np.testing.assert_array_equal(np.asarray(mean), want / np.float32(N))
  if N > 1 and len(jax.local_devices()) == 1:
    assert _node_paths(comm)[0] > 0  # the node-local paths are set up


@pytest.mark.parametrize("path", ["shm", "cma", "polled"])
def test_waiting_rank_sleeps(path):
  """A rank that reaches an all-reduce long before the others spins only
  MPIJAX_WAIT_SPIN_US, then sleeps: it leaves its core to ranks still
  computing. Measured in CPU time, which a loaded machine does not inflate.
  (MPI's blocking collectives wait inside MPI, which spins.)"""
  if N == 1:
    pytest.skip("needs another rank to wait for")
  import os
  import time
  settings = {"cma": dict(cma_min_bytes=1, shm_max_bytes=0),
              "shm": dict(cma_min_bytes=0, shm_max_bytes=1 << 20),
              # MPI's own requests, polled (not a blocking MPI call).
              "polled": dict(cma_min_bytes=0, shm_max_bytes=0, ring_min_bytes=0,
                             ring_in_place_min_bytes=0, blocking_min_bytes=1 << 40)}[path]
  late_s = 0.4
  x = rank_input(R, (4096,), "float32")
  want = np_reduce(all_inputs((4096,), "float32"), "sum", "float32")
  # A communicator of its own: its first node-local all-reduce sets up its
  # segments under these settings (earlier tests' may have none).
  comm = RT.comm.Dup()
  f = jax.jit(lambda v: ops.allreduce(v, comm=comm))
  with transport_settings(**settings):
    assert_close(f(x), want, "float32")  # compiled, and the path set up
    if path != "polled":
      from mpijax._src import ffi
      from mpijax._src.ops import communicators
      paths = ffi.load().node_paths(communicators.resolve_comm(comm, "allreduce").id)
      if len(jax.local_devices()) > 1 or (path == "cma" and paths != [2]):
        pytest.skip(f"no node-local {path} path here (paths {paths})")
      assert paths[0] > 0, paths
    RT.comm.Barrier()
    if R == N - 1:
      time.sleep(late_s)
    cpu0, t0 = os.times(), time.perf_counter()
    got = jax.block_until_ready(f(x))
    cpu1, waited = os.times(), time.perf_counter() - t0
  assert_close(got, want, "float32")
  if R != N - 1:
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    assert waited > late_s / 2, waited
    # Spinning, the wait took all the CPU the scheduler gave it.
    assert cpu < 0.25 * waited, f"waited {waited:.3f} s using {cpu:.3f} s of CPU ({path})"


def test_narrow_integer_sums_wrap_around(allreduce_path):
  # Open MPI's AVX kernels add 8/16-bit integers with saturation from 64
  # elements on (int8 100 + 100 gave 127); XLA and jax.lax wrap around.
  for dtype in ("int8", "uint8", "int16", "uint16"):
    info = np.iinfo(dtype)
    x = np.full(N * 40, info.max - R, dtype)
    want = np.sum([np.full(N * 40, info.max - r, np.int64) for r in range(N)], axis=0).astype(dtype)
    assert_close(jax.jit(lambda v: ops.allreduce(v, "sum", comm=allreduce_path))(x), want, dtype)
    assert_close(ops.reduce_scatter(x.reshape(N, 40), "sum"), want.reshape(N, 40)[R], dtype)
    got = ops.reduce(x, "sum", root=0)
    if R == 0:
      assert_close(got, want, dtype)


@pytest.mark.parametrize("path", ["ring", "cma"])
def test_large_all_reduce_runs_in_pieces(path):
  # In place, the ring receives into a 256 KiB scratch, and cross-memory
  # attach reduces 1 MiB chunks straight into the outputs: a 40 MiB
  # intermediate, and a 40 MiB argument into a fresh output, are reduced in
  # many segments or chunks (the default thresholds, but cma_min_bytes for
  # the ring).
  n = 10 * (1 << 20) + 3
  x = jnp.arange(n, dtype=jnp.float32) % 1000 + R
  want = N * (np.arange(n, dtype=np.float32) % 1000) + N * (N - 1) / 2
  with transport_settings(**({"cma_min_bytes": 0} if path == "ring" else {})):
    in_place = np.asarray(jax.jit(lambda v: ops.allreduce(v * 2))(x))
    out_of_place = np.asarray(jax.jit(ops.allreduce)(x))
  np.testing.assert_array_equal(in_place, 2 * want)
  np.testing.assert_array_equal(out_of_place, want)


@pytest.mark.parametrize("count", [50, 300])
def test_fused_all_reduce_of_many_buffers(count):
  # Up to 224 buffers, one cross-memory all-reduce takes them all (on one node
  # with one device per rank), its chunks spanning several buffers;
  # more run the ring. Out of place and in place (intermediates).
  from mpijax._src.ops.allreduce_many import allreduce_many
  sizes = [(i * 7919) % 30000 + 1 for i in range(count)]
  # Made with NumPy and device_put: jnp.full (or jnp.asarray) compiles once per shape.
  xs = [jax.device_put(np.full(n, R + i % 5, np.float32)) for i, n in enumerate(sizes)]
  for got in (allreduce_many(xs), jax.jit(lambda vs: allreduce_many([v * 1 for v in vs]))(xs)):
    assert len(got) == count
    for i, (g, n) in enumerate(zip(got, sizes)):
      np.testing.assert_array_equal(np.asarray(g), np.full(n, N * (i % 5) + N * (N - 1) / 2))


def test_chunked_messages(tiny_chunks):
  shape = (N, 7)  # 28 B rows of float32, 56 B of complex64: several partial chunks
  for dtype in ["float32", "complex64", "bfloat16", "int8"]:
    stack = all_inputs(shape, dtype)
    x = rank_input(R, shape, dtype)
    assert_close(ops.allreduce(x), np_reduce(stack, "sum", dtype), dtype)
    if dtype != "int8":  # the mean divides chunk by chunk
      assert_close(ops.allreduce(x, "mean"), np_mean(stack, dtype), dtype)
    assert_close(ops.allgather(x), stack, dtype)
    assert_close(ops.reduce_scatter(x), np_reduce(stack, "sum", dtype)[R], dtype)
    assert_close(ops.alltoall(x), stack[:, R], dtype)
    assert_close(ops.bcast(x, N - 1), stack[N - 1], dtype)
    red = np_reduce(stack, "sum", dtype)
    assert_close(ops.reduce(x, root=0), red if R == 0 else np.zeros_like(red), dtype)
    assert_close(ops.ppermute(x, PERMS["ring"](N)), stack[(R - 1) % N], dtype)


# --- ordering stress ------------------------------------------------------------------


def test_many_independent_collectives_in_one_program():
  """200 independent collectives of mixed kinds/sizes in one program, 50 runs."""
  K = 200

  def prog(xs):
    outs = []
    for i, x in enumerate(xs):
      k = i % 4
      if k == 0:
        outs.append(ops.allreduce(x))
      elif k == 1:
        outs.append(ops.allgather(x)[0])
      elif k == 2:
        outs.append(ops.bcast(x, i % N))
      else:
        outs.append(ops.ppermute(x, [(j, (j + 1 + i) % N) for j in range(N)]))
    return outs

  xs = [jax.device_put(np.full(1 + (i * 37) % 500, R + i, np.float32)) for i in range(K)]
  f = jax.jit(prog)
  outs = [f(xs) for _ in range(50)][-1]
  for i, o in enumerate(outs):
    want = [sum(j + i for j in range(N)), i, (i % N) + i, ((R - 1 - i) % N) + i][i % 4]
    np.testing.assert_array_equal(o, want)


def test_order_across_control_flow_and_nested_jit():
  """Collectives in cond/while/scan bodies and nested jits keep program order.

  Each pair is an all-reduce at top level and an independent one inside a
  control-flow body or nested jit, of the same shape, each fed by a matmul
  that XLA runs asynchronously: without one order-token chain through the
  bodies, ranks ran the pair in different orders and silently swapped their
  results (a quarter of the pairs, measured at 2 ranks).
  """
  inner_jit = jax.jit(lambda v: ops.allreduce(v))
  bodies = {
      "cond": lambda v, p: jax.lax.cond(p, ops.allreduce, lambda u: u * 0, v),
      "fori_loop": lambda v, p: jax.lax.fori_loop(0, 1, lambda i, u: ops.allreduce(u), v),
      "scan": lambda v, p: jax.lax.scan(lambda c, u: (c, ops.allreduce(u)), 0, v[None])[1][0],
      "nested jit": lambda v, p: inner_jit(v),
  }
  m = jnp.eye(128, dtype=jnp.float32)

  def prog(xs, ys, p):
    outs = []
    for x, y, body in zip(xs, ys, [*bodies.values()] * 2):
      outs.append(ops.allreduce(jnp.tanh(x @ m)[0, :16]))
      outs.append(body(jnp.tanh(y @ m)[0, :16], p))
    return outs

  f = jax.jit(prog)
  text = f.lower([m] * 8, [m] * 8, True).as_text()
  # One chain: every mpijax call is in main, and only the first one starts
  # from a fresh token.
  funcs = text.split("func.func ")[1:]
  assert funcs[0].startswith("public @main") and not any("@mpijax_" in f for f in funcs[1:])
  calls = re.findall(r"custom_call @mpijax_\w+\(([^)]*)\)", text)
  consts = set(re.findall(r"(%[\w#]+) = stablehlo.constant dense<0> : tensor<i32>", text))
  fresh = [c for c in calls if c.split(", ")[-1] in consts]
  assert len(fresh) == 1, (len(calls), fresh)
  for it in range(10):
    xs = [jnp.full((128, 128), 0.001 * (R + 1) + 0.01 * k + 0.05 * it, jnp.float32) for k in range(8)]
    outs = f(xs, [-x for x in xs], True)
    for k, name in enumerate([*bodies] * 2):
      want = sum(np.tanh(np.float32(0.001 * (q + 1) + 0.01 * k + 0.05 * it)) for q in range(N))
      np.testing.assert_allclose(outs[2 * k], want, rtol=1e-5, err_msg=f"top level, pair {k}")
      np.testing.assert_allclose(outs[2 * k + 1], -want, rtol=1e-5, err_msg=f"{name}, pair {k}")


def test_result_used_on_some_ranks_only():
  """A call whose result one rank ignores still runs there (JAX must not drop it)."""
  f = jax.jit(lambda x: (ops.allreduce(x), x * 2)[0 if R == 0 else 1])  # called everywhere
  g = jax.jit(lambda x: (ops.allgather(x), ops.ppermute(x, PERMS["ring"](N)))[R % 2])
  for _ in range(3):
    np.testing.assert_array_equal(f(jnp.full(3, R + 1.0)),
                                  np.full(3, N * (N + 1) / 2 if R == 0 else 2 * (R + 1.0)))
    out = np.asarray(g(jnp.full(2, float(R))))
    if R % 2 == 0:
      np.testing.assert_array_equal(out, np.repeat(np.arange(N, dtype=np.float32), 2).reshape(N, 2))
    else:
      np.testing.assert_array_equal(out, np.full(2, (R - 1) % N))


def test_back_to_back_async_calls():
  """1,000 jitted calls of 4 independent programs, dispatched without blocking."""
  M = jnp.ones((128, 128))
  fs = [jax.jit(lambda x: ops.allreduce(x + 0 * jnp.sum(M @ M))),
        jax.jit(lambda x: ops.allgather(x)[-1]),
        jax.jit(lambda x: ops.bcast(x, 0)),
        jax.jit(lambda x: ops.ppermute(x, PERMS["ring"](N)))]
  xs = [jnp.full((1 + 50 * k,), float(R), jnp.float32) for k in range(4)]
  outs = [(k, fs[k](xs[k])) for i in range(1000) for k in [(i * 7 + i // 3) % 4]]
  jax.block_until_ready([o for _, o in outs])
  want = [sum(range(N)), N - 1, 0, (R - 1) % N]
  for k, o in outs:
    np.testing.assert_array_equal(o, want[k])
