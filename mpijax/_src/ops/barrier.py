"""barrier: waits until every rank of the communicator has reached it."""

from __future__ import annotations

from typing import Any

from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive

barrier_p = primitive.make_primitive("mpijax_barrier", multiple_results=True)


def barrier(*, comm: Any = None) -> None:
  """Blocks until all ranks of ``comm`` call it (eagerly or inside jit).

  Inside ``jax.jit`` it runs in program order with the other mpijax ops.
  """
  info = communicators.resolve_comm(comm, "mpijax.ops.barrier")
  barrier_p.bind(comm_id=info.id)


def _abstract_eval(*, comm_id):
  return []


def _attrs(*, comm_id):
  return dict(comm=primitive.i64(comm_id))


def _batch(args, dims, *, comm_id):
  return barrier_p.bind(comm_id=comm_id), []


barrier_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(barrier_p, "mpijax_barrier", _attrs)
batching.primitive_batchers[barrier_p] = _batch
