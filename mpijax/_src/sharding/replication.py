"""Gradient bookkeeping for values replicated across the ranks of a mesh axis.

``jax.shard_map`` gives a replicated input (its spec omits an axis) the sum
of the devices' cotangents, and a replicated output (its spec omits an axis)
1/size of each cotangent, so that e.g. ``grad`` of a ``psum`` returned with
``out_specs=P()`` is the true derivative. JAX does this for the local part of
each axis; these two identity primitives do it for the process part: their
transposes are an MPI sum over the axes' process communicator and a scaling.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from mpijax._src.ops.allreduce import allreduce


def _identity_primitive(name: str) -> Primitive:
  p = Primitive(name)
  p.def_impl(lambda x, **_: x)
  p.def_abstract_eval(lambda x, **_: x)
  mlir.register_lowering(p, lambda ctx, x, **_: [x])
  batching.defvectorized(p)
  return p


# Forward: identity. Transpose: sum of the cotangents over the process group.
replicated_input_p = _identity_primitive("mpijax_replicated_input")
# Forward: identity. Transpose: cotangent / number of processes holding a copy.
replicated_output_p = _identity_primitive("mpijax_replicated_output")


def _sum_ct(ct, x, *, mesh, axes):
  if type(ct) is ad.Zero:
    return [ct]
  return [allreduce(ct, "sum", comm=mesh.process_comm(axes))]


def _scale_ct(ct, x, *, copies):
  if type(ct) is ad.Zero:
    return [ct]
  return [ct / jnp.asarray(copies, ct.dtype)]


ad.deflinear2(replicated_input_p, _sum_ct)
ad.deflinear2(replicated_output_p, _scale_ct)


def _inexact(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def mark_input(x, mesh, axes: tuple[str, ...]):
  """``x`` is the same on every process of ``axes``' process parts."""
  if not axes or not _inexact(x):
    return x
  return replicated_input_p.bind(x, mesh=mesh, axes=axes)


def mark_output(x, copies: int):
  """``x`` is returned once although ``copies`` processes hold it."""
  if copies == 1 or not _inexact(x):
    return x
  return replicated_output_p.bind(x, copies=copies)
