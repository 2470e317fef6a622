"""mpi4jax's autodiff rules on mpijax's primitives.

* ``allreduce_p``: mpijax's all-reduce (the same FFI handler, in the same
  order-token chain) with mpi4jax's convention. mpi4jax treats
  ``allreduce(x, MPI.SUM)`` as a linear map whose transpose is the identity
  (each rank's cotangent stays on the rank), and the transpose of that
  identity is the all-reduce again; mpijax's own ``allreduce`` follows
  ``jax.lax.psum`` (its transpose sums the cotangents), which gives other
  gradients. The JVP is an all-reduce of the tangents in both; other ops than
  the sum are not differentiable, as in mpi4jax.
* ``no_derivative_p``: the identity, whose derivative is an error. mpi4jax
  defines derivatives for ``allreduce`` and ``sendrecv`` only; the other
  functions pass their input through it, so differentiating them fails on
  every rank alike, at trace time, as in mpi4jax. (Their mpijax primitives
  are differentiable, but a root's or a non-root's result that the program
  does not use gets no transposed call on that rank, while the others make
  one.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive

allreduce_p = primitive.make_primitive("mpi4jax_allreduce")
# allreduce_p's transpose: the identity, no MPI call; its transpose is allreduce_p.
allreduce_transposed_p = Primitive("mpi4jax_allreduce_transposed")


def _same(x, **params):
  return x


def _attrs(*, comm_id, op):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]), divisor=primitive.i64(1))


def _batcher(prim):
  def rule(args, dims, **params):
    return prim.bind(args[0], **params), dims[0]
  return rule


def _not_differentiable(op):
  return NotImplementedError(
      f"The adjoint of allreduce is only defined for op=MPI.SUM (got op {op!r}); "
      "differentiate through an MPI.SUM all-reduce instead.")


def _jvp(primals, tangents, *, comm_id, op):
  (x,), (t,) = primals, tangents
  out = allreduce_p.bind(x, comm_id=comm_id, op=op)
  if type(t) is ad.Zero or not jnp.issubdtype(x.dtype, jnp.inexact):
    return out, primitive.zero_tangent(out)
  if op != "sum":
    raise _not_differentiable(op)
  return out, allreduce_p.bind(t, comm_id=comm_id, op=op)


def _transpose(ct, x, *, comm_id, op):
  if op != "sum":
    raise _not_differentiable(op)
  return (allreduce_transposed_p.bind(ad.instantiate_zeros(ct), comm_id=comm_id, op=op),)


def _transposed_transpose(ct, x, *, comm_id, op):
  # Every rank makes the all-reduce, also one whose cotangent is a symbolic zero.
  return (allreduce_p.bind(ad.instantiate_zeros(ct), comm_id=comm_id, op=op),)


def _identity_lowering(ctx, x, **params):
  return [x]


no_derivative_p = Primitive("mpi4jax_no_derivative")


def no_derivative(x, name: str):
  """``x``, marked: differentiating through it names mpi4jax's ``name``."""
  return no_derivative_p.bind(x, name=name)


def _no_derivative_jvp(primals, tangents, *, name):
  raise NotImplementedError(
      f"mpi4jax's {name} is not differentiable (mpi4jax defines derivatives for allreduce "
      f"and sendrecv only), and neither is mpijax.compat.mpi4jax's. Differentiate a "
      f"computation around it, or use jax.lax.stop_gradient on its input.")


allreduce_p.def_abstract_eval(_same)
lowering.register_ffi_lowering(allreduce_p, "mpijax_allreduce", _attrs, in_place_capable=True)
batching.primitive_batchers[allreduce_p] = _batcher(allreduce_p)
ad.primitive_jvps[allreduce_p] = _jvp
ad.primitive_transposes[allreduce_p] = _transpose

allreduce_transposed_p.def_impl(_same)
allreduce_transposed_p.def_abstract_eval(_same)
mlir.register_lowering(allreduce_transposed_p, _identity_lowering)
batching.primitive_batchers[allreduce_transposed_p] = _batcher(allreduce_transposed_p)
ad.deflinear2(allreduce_transposed_p, _transposed_transpose)

no_derivative_p.def_impl(_same)
no_derivative_p.def_abstract_eval(_same)
mlir.register_lowering(no_derivative_p, _identity_lowering)
batching.primitive_batchers[no_derivative_p] = _batcher(no_derivative_p)
ad.primitive_jvps[no_derivative_p] = _no_derivative_jvp
