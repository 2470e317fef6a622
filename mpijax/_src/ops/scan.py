"""scan: rank r gets the reduction of ranks 0..r's ``x`` (MPI_Scan).

Autodiff (op="sum"): linear; the transpose sends each rank's cotangent to
itself and every lower rank, i.e. rank s gets the sum of ranks s..size-1's
cotangents: the total (an allreduce) minus the scan plus its own.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive
from mpijax._src.ops import reduce_ops
from mpijax._src.ops.allreduce import allreduce_p

scan_p = primitive.make_primitive("mpijax_scan")


def scan(x, op: Any = "sum", *, comm: Any = None) -> jax.Array:
  """Inclusive prefix reduction of ``x`` over the ranks of ``comm``.

  Args:
    x: array of a supported dtype; same shape on every rank.
    op: reduction ("sum", "prod", "min", "max", "and", "or", "xor"), or an
      mpi4py ``MPI.Op`` (see :func:`mpijax.ops.allreduce`).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    On rank r, the reduction of ranks 0..r's ``x`` (``x``'s shape and dtype).

  Raises:
    ValueError: ``op`` is not an op name mpijax knows, or an ``MPI.Op`` it
      does not run (``MAXLOC``, ``MINLOC``, ``REPLACE``, user-defined).
    TypeError: ``x``'s dtype is not supported, or ``op`` is not defined for
      it (e.g. ``"xor"`` on floats).

  Examples:
    >>> offset = mpijax.ops.scan(jnp.int32(n_local)) - n_local  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.scan", x)
  info = communicators.resolve_comm(comm, "mpijax.ops.scan")
  return reduce_ops.run_reduction("mpijax.ops.scan", op, x, info.size,
                               lambda x, op: scan_p.bind(x, comm_id=info.id, op=op))


def _same(x, **params):
  return x


def _attrs(*, comm_id, op):
  return dict(comm=primitive.i64(comm_id), op=primitive.i64(dtypes.OP_CODES[op]))


def _batch(args, dims, **params):
  return scan_p.bind(args[0], **params), dims[0]


def _transpose_sum(ct, *, comm_id, op):
  total = allreduce_p.bind(ct, comm_id=comm_id, op="sum", divisor=1)
  return total - scan_p.bind(ct, comm_id=comm_id, op="sum") + ct


scan_p.def_abstract_eval(_same)
lowering.register_ffi_lowering(scan_p, "mpijax_scan", _attrs, in_place_capable=True)
batching.primitive_batchers[scan_p] = _batch
primitive.def_sum_linear_ad(scan_p, "mpijax.ops.scan", _transpose_sum)
