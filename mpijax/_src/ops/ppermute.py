"""ppermute: point-to-point exchange by a permutation of ranks.

Semantics of ``jax.lax.ppermute``: ``perm`` is a sequence of ``(src, dst)``
pairs, each rank appearing at most once as a source and once as a
destination; a rank nobody sends to receives zeros. The transpose is the
inverse permutation.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad
from jax.interpreters import batching

from mpijax._src.ops import communicators
from mpijax._src.ops import dtypes
from mpijax._src.ops import lowering
from mpijax._src.ops import primitive

ppermute_p = primitive.make_primitive("mpijax_ppermute")


def normalize_perm(perm, size: int) -> tuple[tuple[int, int], ...]:
  try:
    pairs = tuple((operator.index(s), operator.index(d)) for s, d in perm)
  except (TypeError, ValueError):
    raise TypeError(f"mpijax.ops.ppermute got perm={perm!r}; expected a "
                    "sequence of (src, dst) rank pairs.") from None
  srcs = [s for s, _ in pairs]
  dsts = [d for _, d in pairs]
  for r in srcs + dsts:
    if not 0 <= r < size:
      raise ValueError(f"mpijax.ops.ppermute perm={pairs} names rank {r}, "
                       f"outside the communicator of size {size}.")
  if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
    raise ValueError(f"mpijax.ops.ppermute perm={pairs} is not a permutation: "
                     "each rank may appear at most once as a source and once "
                     "as a destination.")
  return pairs


def ppermute(x, perm: Sequence[tuple[int, int]], *, comm: Any = None) -> jax.Array:
  """Sends ``x`` from ``src`` to ``dst`` for every pair in ``perm``.

  Args:
    x: array of a supported dtype; same shape and dtype on every rank.
    perm: ``(src, dst)`` rank pairs (cycles and partial maps allowed).
    comm: an mpi4py communicator (default: the runtime's).

  Returns:
    What the rank's source sent, or zeros if no pair targets this rank.

  Raises:
    TypeError: ``perm`` is not a sequence of integer pairs, or ``x``'s dtype
      is not supported.
    ValueError: a rank outside the communicator, or one that appears twice
      as a source or as a destination.

  Examples:
    >>> ring = [(r, (r + 1) % size) for r in range(size)]  # doctest: +SKIP
    >>> y = mpijax.ops.ppermute(x, ring)  # doctest: +SKIP
  """
  x = dtypes.as_array("mpijax.ops.ppermute", x)
  dtypes.check_dtype("mpijax.ops.ppermute", x.dtype)
  info = communicators.resolve_comm(comm, "mpijax.ops.ppermute")
  pairs = normalize_perm(perm, info.size)
  if not pairs:
    return jnp.zeros_like(x)
  return ppermute_p.bind(x, comm_id=info.id, perm=pairs, rank_view=False)


def _abstract_eval(x, *, comm_id, perm, rank_view):
  return x


def _attrs(*, comm_id, perm, rank_view):
  srcs = np.array([s for s, _ in perm], np.int64)
  dsts = np.array([d for _, d in perm], np.int64)
  return dict(comm=primitive.i64(comm_id), srcs=srcs, dsts=dsts)


def _batch(args, dims, **params):
  return ppermute_p.bind(args[0], **params), dims[0]


def _transpose(ct, x, *, comm_id, perm, rank_view):
  if type(ct) is ad.Zero:
    return (ad.Zero(x.aval),)
  inverse = tuple((d, s) for s, d in perm)
  return (ppermute_p.bind(ct, comm_id=comm_id, perm=inverse, rank_view=rank_view),)


ppermute_p.def_abstract_eval(_abstract_eval)
lowering.register_ffi_lowering(ppermute_p, "mpijax_ppermute", _attrs)
batching.primitive_batchers[ppermute_p] = _batch
ad.deflinear2(ppermute_p, _transpose)
