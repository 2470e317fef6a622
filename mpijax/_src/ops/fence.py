"""Fences: values passed through a custom call that XLA can see only as a whole.

Not MPI calls: devices for :mod:`mpijax.train`'s overlapped gradient
all-reduce. Both return their operands unchanged, through ``mpijax_gate``
(the results alias the operands: no data moves where the operands are
intermediates), a custom call, into which XLA fuses nothing:

* ``after_calls(xs)``: with the block's current order token, so whatever
  reads the results runs after every mpijax call made before it in program
  order (a data dependency that XLA keeps, where
  ``jax.lax.optimization_barrier`` is removed before buffer assignment);
* ``unfused(xs)``: with a constant token, so nothing that consumes the
  results (such as the concatenation that packs small gradients into a
  bucket) is fused with what computed them. XLA:CPU computes a reduction
  fused into a consumer in another order than alone: without this fence,
  packing the same gradients into other buckets changed their last bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from mpijax._src import ffi as _ffi
from mpijax._src.jax_compat import ir
from mpijax._src.ops import ordering
from mpijax._src.ops import primitive

fence_p = primitive.make_primitive("mpijax_fence", multiple_results=True)


def after_calls(xs: Sequence[jax.Array]) -> list[jax.Array]:
  """``xs``, readable only once every mpijax call before this one has finished."""
  xs = list(xs)
  return fence_p.bind(*xs, ordered=True) if xs else []


def unfused(xs: Sequence[jax.Array]) -> list[jax.Array]:
  """``xs``, computed as they would be with nothing fused after them."""
  xs = list(xs)
  return fence_p.bind(*xs, ordered=False) if xs else []


def _abstract_eval(*xs, ordered):
  return list(xs)


def _lowering(ctx, *args, ordered):
  _ffi.load()  # registers mpijax_gate before XLA compiles it
  if ordered:
    chain = ordering.chain_for(ctx)
    token = ordering.token_for(chain, ir.InsertionPoint.current.block)
  else:
    token = mlir.ir_constant(np.int32(0))
  return ordering.gate(list(args), token)


def _jvp(primals, tangents, *, ordered):
  # The identity: tangents pass through as they are.
  return fence_p.bind(*primals, ordered=ordered), list(tangents)


def _batch(args, dims, *, ordered):
  return fence_p.bind(*args, ordered=ordered), list(dims)


fence_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(fence_p, _lowering, cacheable=False)
ad.primitive_jvps[fence_p] = _jvp
batching.primitive_batchers[fence_p] = _batch
