"""Fused gradient all-reduce and gradient accumulation, as optax transformations.

Gradients of a model arrive as many small leaves. One MPI all-reduce per leaf
pays the per-message latency ~100 times per step; instead the small leaves
are packed, per dtype, into a few flat buckets of at most ``bucket_bytes``
and each bucket is all-reduced once (PyTorch DDP's buckets, Horovod's tensor
fusion), then unpacked. Leaves of at least ``fuse_leaf_bytes`` (256 KiB) are
already big enough to amortize the latency and travel alone: on CPU the
packing copy of a big leaf costs about as much as its all-reduce.
Everything runs inside the caller's ``jax.jit``: the packing is a few XLA
concatenations and slices, and every bucket's MPI all-reduce is made by one
XLA FFI custom call for the whole tree (no host round trip).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpijax._src import config
from mpijax._src.collectives.axes import axis_env
from mpijax._src.ops.allreduce_many import allreduce_many
from mpijax._src.ops.fence import after_calls
from mpijax._src.ops.fence import unfused
from mpijax._src.train import communicator

_COMPRESSION = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
                "fp16": jnp.float16, "float16": jnp.float16}


def _wire_dtype(dtype: Any, compression: str | None) -> Any:
  if compression is None:
    return dtype
  wire = _COMPRESSION[compression]
  # Only real floats wider than 16 bits are compressed; ints, complex and
  # already-16-bit floats travel as they are.
  if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize > 2:
    return wire
  return dtype


def plan_buckets(shapes_dtypes: list[tuple[tuple[int, ...], Any]], bucket_bytes: int,
                 fuse_leaf_bytes: int | None = None) -> list[list[int]]:
  """Groups leaf indices into buckets: same dtype, at most ``bucket_bytes`` each.

  A leaf of at least ``fuse_leaf_bytes`` (or bigger than ``bucket_bytes``)
  gets a bucket of its own: it is big enough to amortize the per-message
  latency, and packing it would cost two extra passes over its memory (on CPU
  the copy costs about as much as the all-reduce itself). Order within a
  dtype follows the tree order, so the plan is identical on every rank.
  """
  if fuse_leaf_bytes is None:
    fuse_leaf_bytes = bucket_bytes
  by_dtype: dict[str, list[int]] = {}
  for i, (_, dtype) in enumerate(shapes_dtypes):
    by_dtype.setdefault(jnp.dtype(dtype).name, []).append(i)
  buckets: list[list[int]] = []
  for name in sorted(by_dtype):
    buckets += _runs(by_dtype[name], shapes_dtypes, bucket_bytes, fuse_leaf_bytes)
  return buckets


def _runs(order: list[int], shapes_dtypes: list[tuple[tuple[int, ...], Any]], bucket_bytes: int,
          alone_bytes: int | None = None) -> list[list[int]]:
  """Cuts ``order`` into runs of consecutive leaves of at most ``bucket_bytes`` each.

  Empty leaves are skipped; a leaf bigger than ``bucket_bytes`` is a run of
  its own. A leaf of at least ``alone_bytes`` is one too, appended at once
  (ahead of the run being filled, which goes on after it).
  """
  buckets: list[list[int]] = []
  current: list[int] = []
  size = 0
  for i in order:
    shape, dtype = shapes_dtypes[i]
    nbytes = int(np.prod(shape, dtype=np.int64)) * jnp.dtype(dtype).itemsize
    if nbytes == 0:
      continue
    if alone_bytes is not None and nbytes >= alone_bytes:
      buckets.append([i])
      continue
    if current and size + nbytes > bucket_bytes:
      buckets.append(current)
      current, size = [], 0
    current.append(i)
    size += nbytes
  if current:
    buckets.append(current)
  return buckets


def _jax_local_axis(name: Any, nranks: int) -> Any:
  """The JAX axis to reduce over locally for ``local_axis_name=name``.

  Under ``mpijax.pmap``/``mpijax.shard_map`` the user's axis name spans the
  ranks, and JAX knows only its local part (a private name): reduce over that
  part, and the MPI sum covers the ranks. A plain ``jax.pmap``/``shard_map``
  axis over this rank's devices is used as it is.
  """
  if name is None:
    return None
  bound = axis_env().get(name) if isinstance(name, str) else None
  if bound is None:
    return name
  info = bound[1]
  if info.proc_size != nranks:
    raise ValueError(
        f"allreduce_gradients(local_axis_name={name!r}): mpijax axis {name!r} spans "
        f"{info.proc_size} of the {nranks} ranks, but the gradients are summed over every rank; "
        f"use mpijax.lax.pmean(grads, {name!r}) for a mean over that axis only")
  return info.local_name


def plan_overlap(shapes_dtypes: list[tuple[tuple[int, ...], Any]], order: list[int],
                 bucket_bytes: int) -> list[list[int]]:
  """Groups leaf indices into the buckets of an overlapped all-reduce.

  ``order`` is the order in which the leaves become ready (for gradients: the
  reverse of the order the forward pass first uses them). Each bucket is a
  run of consecutive leaves of ``order`` of at most ``bucket_bytes`` (a
  bigger leaf is a bucket of its own), like PyTorch DDP's buckets: a bucket is
  ready as soon as its last leaf is, so its all-reduce can start while the
  rest is still being computed. Empty leaves are skipped.
  """
  return _runs(order, shapes_dtypes, bucket_bytes)


def _first_uses(jaxpr: Any, invars: list[Any]) -> list[tuple[int, ...] | None]:
  """Where the forward pass ``jaxpr`` first reads each of ``invars``.

  A position is the index of the equation, followed by the position inside
  it for a call whose body takes the call's operands one for one (a nested
  ``jax.jit``, ``jax.checkpoint``, ``custom_jvp``/``custom_vjp``); None for a
  variable never read.
  """
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  where: dict[Any, tuple[int, ...]] = {}
  wanted = {v for v in invars if isinstance(v, jax.extend.core.Var)}
  for k, eqn in enumerate(jaxpr.eqns):
    reads = [v for v in eqn.invars if isinstance(v, jax.extend.core.Var) and v in wanted
             and v not in where]
    if not reads:
      continue
    body = next((eqn.params[name] for name in ("jaxpr", "call_jaxpr", "fun_jaxpr")
                 if name in eqn.params), None)
    inner_vars = getattr(getattr(body, "jaxpr", body), "invars", None)
    inner = None
    if inner_vars is not None and len(inner_vars) == len(eqn.invars):
      inner = dict(zip(eqn.invars, _first_uses(body, list(inner_vars))))
    for v in reads:
      sub = inner.get(v) if inner is not None else None
      where[v] = (k,) + (sub or ())
  return [where.get(v) for v in invars]


def gradient_ready_order(fn: Any, params: Any) -> list[int]:
  """The leaves of ``params`` in the order a backward pass of ``fn`` finishes their gradients.

  A leaf's gradient is complete once the backward pass has gone back past
  the forward pass's first read of the leaf, so the order is the reverse of
  the first reads in ``jax.make_jaxpr(fn)(params)`` (leaves ``fn`` never
  reads first: their gradient is zero; ties in the reverse tree order).
  What the overlapped all-reduce buckets by: in this order every bucket's
  all-reduce can start as soon as the backward pass has made its leaves.

  Args:
    fn: the forward pass, ``fn(params)`` (its outputs do not matter).
    params: the tree of parameters, as ``fn`` takes it.

  Returns:
    Indices into ``jax.tree_util.tree_leaves(params)``.
  """
  closed = jax.make_jaxpr(fn)(params)
  n = len(jax.tree_util.tree_leaves(params))
  uses = _first_uses(closed.jaxpr, list(closed.jaxpr.invars[:n]))
  return sorted(range(n), key=lambda i: (uses[i] is None, uses[i] or (), i), reverse=True)


def _operands(bucket: list[int], leaves: list[Any], fuse_leaf_bytes: int) -> list[list[int]]:
  """The arrays one overlapped bucket sends: per dtype, its small leaves packed
  into one, each leaf of at least ``fuse_leaf_bytes`` alone (no packing copy)."""
  small: dict[str, list[int]] = {}
  ops: list[list[int]] = []
  for i in bucket:
    if leaves[i].nbytes >= fuse_leaf_bytes:
      ops.append([i])
    else:
      small.setdefault(leaves[i].dtype.name, []).append(i)
  return list(small.values()) + ops


def _check_options(compression: str | None, overlap: bool | None) -> None:
  if compression is not None and compression not in _COMPRESSION:
    raise ValueError(f"compression={compression!r} is not supported; use None, 'bf16' or 'fp16'")
  if overlap is not None and not isinstance(overlap, (bool, np.bool_)):
    raise TypeError(f"overlap={overlap!r} must be True, False or None (the default, "
                    "config.get('overlap'))")


def fused_allreduce(tree: Any, *, average: bool = True, bucket_bytes: int | None = None,
                    compression: str | None = None, local_axis_name: Any = None,
                    comm: Any | None = None, fuse_leaf_bytes: int | None = None,
                    overlap: bool | None = None) -> Any:
  """Sums (or averages) every leaf of ``tree`` over all ranks.

  Call it inside ``jax.jit`` (it also works eagerly). The arguments are
  :func:`allreduce_gradients`'s; with ``overlap`` the buckets follow the
  reverse of the tree order (a tree of layers: the last layer's gradients
  first, as the backward pass computes them). Collective: every rank calls
  it with a tree of the same structure, shapes and dtypes.

  Args:
    tree: a pytree of numeric arrays (not bool).
    average: divide the sum by the number of ranks.
    bucket_bytes: largest bucket (default ``MPIJAX_BUCKET_BYTES``).
    compression: ``None``, ``"bf16"`` or ``"fp16"``: float buckets travel
      in half precision.
    local_axis_name: the axis over this rank's local devices to reduce over
      first, inside ``jax.shard_map``/``jax.pmap`` (or an ``mpijax.pmap``
      axis).
    comm: an mpi4py communicator; default mpijax's.
    fuse_leaf_bytes: leaves at least this big travel alone, unpacked.
    overlap: one call per bucket, in backward-pass order (default
      ``MPIJAX_OVERLAP``).

  Returns:
    A tree like ``tree`` holding the cross-rank sum or mean, same dtypes
    (integer means are floored).

  Raises:
    TypeError: a bool leaf, or ``overlap`` not True, False or None.
    ValueError: an unsupported ``compression``, a ``bucket_bytes`` <= 0, or
      a ``local_axis_name`` mpijax axis that spans only some of the ranks.

  Examples:
    >>> grads = mpijax.train.fused_allreduce(grads)  # inside the jitted step  # doctest: +SKIP
  """
  return _fused_allreduce(tree, average=average, bucket_bytes=bucket_bytes,
                          compression=compression, local_axis_name=local_axis_name, comm=comm,
                          fuse_leaf_bytes=fuse_leaf_bytes, overlap=overlap)


def _fused_allreduce(tree: Any, *, average: bool, bucket_bytes: int | None,
                     compression: str | None, local_axis_name: Any, comm: Any | None,
                     fuse_leaf_bytes: int | None, overlap: bool | None,
                     ready_order: list[int] | None = None) -> Any:
  """:func:`fused_allreduce`; ``ready_order``: the flattened leaves' indices in
  the order they become ready (default: the reverse of the tree order)."""
  _check_options(compression, overlap)
  if overlap is None:
    overlap = bool(config.get("overlap"))
  if bucket_bytes is None:
    bucket_bytes = int(config.get("overlap_bucket_bytes" if overlap else "bucket_bytes"))
  if bucket_bytes <= 0:
    raise ValueError(f"bucket_bytes={bucket_bytes} must be positive (e.g. 64 << 20)")
  if fuse_leaf_bytes is None:
    fuse_leaf_bytes = int(config.get("fuse_leaf_bytes"))
  # The user's communicator (or None = the runtime's) goes to the transport
  # unchanged; here it only tells how many ranks share the sum.
  nranks = communicator.get_comm(comm, "mpijax.train.allreduce_gradients").Get_size()
  local_axis_name = _jax_local_axis(local_axis_name, nranks)

  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  leaves = [jnp.asarray(x) for _, x in with_paths]
  for (path, _), x in zip(with_paths, leaves):
    if x.dtype == jnp.bool_:
      # MPI has no sum of booleans; say which leaf, not just which dtype.
      raise TypeError(
          f"fused_allreduce/allreduce_gradients: leaf {jax.tree_util.keystr(path)} is bool{list(x.shape)}, "
          "which cannot be summed or averaged over ranks; cast it to a number first "
          "(x.astype(jnp.float32) for a fraction, jnp.int32 for a count)")
  if nranks == 1 and local_axis_name is None:
    # A single rank's sum and mean are the tree itself: nothing to pack or send.
    return jax.tree_util.tree_unflatten(treedef, leaves)
  out = list(leaves)
  n_local = 1 if local_axis_name is None else jax.lax.psum(1, local_axis_name)
  shapes = [(x.shape, x.dtype) for x in leaves]

  def send(idx: list[int]) -> jax.Array:
    """The array that carries leaves ``idx`` (one dtype) over the wire."""
    dtype = leaves[idx[0]].dtype
    # A lone leaf keeps its shape: a reshape would make XLA copy the gradient
    # before the in-place all-reduce (copy insertion does not see through the
    # bitcast), one more pass over its memory.
    # Packed leaves come through a fence: XLA would otherwise fuse the ops
    # that computed them (a bias gradient's reduction over the batch) into
    # the packing, where it computes them in another order, so a leaf's bits
    # would depend on the bucket it is packed into.
    flat = jnp.concatenate([x.reshape(-1) for x in unfused([leaves[i] for i in idx])]) \
        if len(idx) > 1 else leaves[idx[0]]
    inexact = jnp.issubdtype(dtype, jnp.inexact)
    if average and not inexact and jnp.dtype(dtype).itemsize < 4:
      # The mean of 8/16-bit integers is summed in int32: in the leaf's own
      # dtype the sum wraps around (uint8: 200 + 200 = 144) before the division.
      flat = flat.astype(jnp.int32)
    if local_axis_name is not None:
      # Several local devices per rank: reduce over them with XLA first, then
      # each device all-reduces over ranks on its own sub-communicator. After
      # the local pmean every local device holds the same value, so the MPI
      # sum over ranks of pmeans / nranks is the global mean.
      flat = jax.lax.pmean(flat, local_axis_name) if average and inexact \
          else jax.lax.psum(flat, local_axis_name)
    wire = _wire_dtype(flat.dtype, compression)
    if _prescaled(average, inexact, dtype, wire):
      # Divide before the cast so half-precision sums cannot overflow.
      flat = flat / nranks
    return flat.astype(wire)

  def receive(idx: list[int], summed: jax.Array) -> None:
    """Unpacks the sum that carried leaves ``idx`` into ``out``, averaged if asked."""
    if len(idx) == 1:
      pieces = [summed]
    else:
      # Each packed leaf comes out through a fence, as it went in, in its
      # own shape: what consumes it (the division below, the optimizer's
      # update) then compiles to the same code whether a leaf travelled
      # packed or alone, and in whichever bucket. (Fused with a slice and a
      # reshape, XLA:CPU contracted an Adam moment's multiply-add into an
      # FMA differently: the last bit changed with the bucket size.)
      offsets = np.cumsum([0] + [leaves[i].size for i in idx])
      pieces = unfused([summed[offsets[k]:offsets[k + 1]].reshape(leaves[i].shape)
                        for k, i in enumerate(idx)])
    for i, piece in zip(idx, pieces):
      out[i] = finish(piece, leaves[i].dtype)

  def finish(summed: jax.Array, dtype: Any) -> jax.Array:
    """The sum as it came over the wire, back in ``dtype``, averaged if asked."""
    # The mean is the sum then an XLA division, not the transport's op="mean":
    # XLA fuses the division into whatever consumes the gradient (the
    # optimizer's update), where it costs nothing, while the transport would
    # make one more pass over every bucket (measured: +3 ms per 40 MB step).
    inexact = jnp.issubdtype(dtype, jnp.inexact)
    sent_as_is = summed.dtype == dtype  # not compressed, so not pre-scaled
    prescaled = _prescaled(average, inexact, dtype, summed.dtype)
    if average and not inexact:
      # Integer leaves: floor of the mean, dtype kept. They were summed (not
      # averaged) over the local devices too, so divide by every device.
      return (summed // (nranks * n_local)).astype(dtype)
    summed = summed.astype(dtype)
    if average and inexact and sent_as_is:
      return summed / jnp.asarray(nranks, dtype)
    if prescaled and not average:
      return summed * jnp.asarray(nranks, dtype)  # the sum, from the mean sent
    return summed

  if overlap:
    # One custom call per bucket, in the order the buckets become ready: each
    # call depends on its own bucket's leaves and on the order token of the
    # call before it, nothing else, so XLA starts it as soon as both are
    # there, while the rest of the backward pass runs (see docs/training.md).
    if ready_order is None:
      ready_order = list(range(len(leaves)))[::-1]
    calls = [_operands(bucket, leaves, fuse_leaf_bytes)
             for bucket in plan_overlap(shapes, list(ready_order), bucket_bytes)]
  else:
    # Three phases: pack every bucket, all-reduce them all in ONE custom call,
    # then unpack and average. One call keeps the phases apart: XLA:CPU would
    # otherwise run bucket k's packing or averaging on another thread while
    # bucket k+1 is inside MPI, stealing the CPU MPI needs to progress (2-3x
    # slower communication measured with 2 ranks on 2 cores).
    plan = plan_buckets(shapes, bucket_bytes, fuse_leaf_bytes)
    calls = [plan] if plan else []
  # Each call: the leaf groups it carries, packed and sent in that order.
  carried, sums = [], []
  for call in calls:
    carried += call
    sums += allreduce_many([send(idx) for idx in call], "sum", comm=comm)
  if overlap:
    # Nothing reads a sum before the last call has run. The optimizer's
    # in-place update of a parameter must come after the backward pass's last
    # read of it; were a bucket's sums readable at once, XLA would copy each
    # bucket's earliest weight at the start of the step to make the early
    # update safe, and hand the memory this frees to later backward ops,
    # which would then wait for that update, i.e. for the bucket's
    # all-reduce (measured: the backward pass stalled during every call).
    sums = after_calls(sums)
  for idx, summed in zip(carried, sums):
    receive(idx, summed)
  return jax.tree_util.tree_unflatten(treedef, out)


def _prescaled(average: bool, inexact: bool, dtype: Any, wire: Any) -> bool:
  """Whether a bucket is sent divided by the rank count (so the sum is the mean).

  Compressed float buckets of a mean always are; a sum sent as float16 is
  too (then multiplied back), since float16 overflows past 65504: a sum of
  values that each fit may not.
  """
  return inexact and wire != dtype and (average or wire == jnp.float16)


def allreduce_gradients(*, average: bool = True, bucket_bytes: int | None = None,
                        compression: str | None = None, local_axis_name: Any = None,
                        comm: Any | None = None, fuse_leaf_bytes: int | None = None,
                        overlap: bool | None = None) -> optax.GradientTransformation:
  """An optax transformation that all-reduces the gradients over every rank.

  Put it first in an ``optax.chain`` so the rest of the optimizer sees the
  global gradient; every rank then applies identical updates and the
  replicated parameters stay equal. Inside the jitted step the gradient leaves
  are packed per dtype into flat buckets of at most ``bucket_bytes`` and each
  bucket is summed over ranks with ONE MPI all-reduce, all buckets in one
  XLA custom call (leaves of at least ``fuse_leaf_bytes`` form a bucket of
  their own, without a copy).

  Args:
    average: divide the sum by the number of ranks (the mean gradient, as if
      the per-rank losses were means over equal per-rank batches).
    bucket_bytes: largest bucket; default ``config.get("bucket_bytes")``
      (``MPIJAX_BUCKET_BYTES``, 64 MiB).
    compression: ``None``, ``"bf16"`` or ``"fp16"``: float32/float64 buckets
      travel in half precision (half the bytes) and are cast back; for
      ``"fp16"`` they are pre-scaled by ``1/ranks`` (a sum is multiplied back
      after) so the half-precision sum cannot overflow.
    local_axis_name: when the step runs under ``jax.shard_map``/``jax.pmap``
      over this rank's local devices, the name of that axis: the gradient is
      first averaged over the local devices (``jax.lax.pmean``), then
      all-reduced over ranks, giving the mean over every device of every rank.
      Under ``mpijax.pmap`` (an axis over every device of every rank) pass
      its axis name.
    comm: an mpi4py communicator; default mpijax's.
    fuse_leaf_bytes: leaves at least this big skip packing and are
      all-reduced on their own (default ``config.get("fuse_leaf_bytes")``,
      ``MPIJAX_FUSE_LEAF_BYTES``, 256 KiB; pass ``bucket_bytes`` to pack
      everything).
    overlap: all-reduce each bucket with its own call, the buckets formed in
      the order the backward pass computes the gradients (the reverse of the
      tree order: a tree of layers in forward order gives the last layer's
      first), so XLA can run each bucket's all-reduce while the rest of the
      backward pass computes (PyTorch DDP's and Horovod's overlap). Then
      ``bucket_bytes`` defaults to ``config.get("overlap_bucket_bytes")``.
      The result is the same, bit for bit, as without overlap. Default
      ``config.get("overlap")`` (``MPIJAX_OVERLAP``).

  Returns:
    An ``optax.GradientTransformation`` (stateless).

  Raises:
    ValueError: an unsupported ``compression`` (here), or a
      ``bucket_bytes`` <= 0 (at the first update).
    TypeError: ``overlap`` is not True, False or None; at the update, a bool
      gradient leaf.

  Examples:
    >>> tx = optax.chain(mpijax.train.allreduce_gradients(), optax.adam(1e-3))  # doctest: +SKIP
  """
  _check_options(compression, overlap)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    return fused_allreduce(updates, average=average, bucket_bytes=bucket_bytes,
                           compression=compression, local_axis_name=local_axis_name,
                           comm=comm, fuse_leaf_bytes=fuse_leaf_bytes, overlap=overlap), state

  return optax.GradientTransformation(init_fn, update_fn)


class AccumulateState(NamedTuple):
  micro_step: jax.Array  # int32 in [0, every_k)
  grads: Any  # running sum of the micro-step gradients
  inner: Any  # state of the wrapped transformation


def accumulate_gradients(inner: optax.GradientTransformation, every_k: int) -> optax.GradientTransformation:
  """Accumulates ``every_k`` micro-step gradients and runs ``inner`` once on their mean.

  Like PyTorch DDP's ``no_sync`` or ``optax.MultiSteps``: with
  ``inner = optax.chain(allreduce_gradients(), optimizer)`` only every k-th
  step communicates. The other steps return zero updates (the parameters do
  not move) and make no MPI call.

  The choice is made with ``jax.lax.cond`` on the micro-step counter kept in
  the optimizer state. That counter is identical on every rank (the state is
  replicated: broadcast at start or restored from one checkpoint, and
  ``shard_batches`` gives every rank the same number of steps), so every rank
  enters the all-reduce at the same micro-step and none waits forever. Under
  ``jax.vmap`` a ``cond`` becomes a ``select`` that runs both branches, so do
  not vmap over the step (it would communicate every micro-step).

  Args:
    inner: the transformation to run every k-th step (usually a chain that
      starts with :func:`allreduce_gradients`).
    every_k: micro-steps per update (>= 1).

  Returns:
    An ``optax.GradientTransformation``.

  Raises:
    ValueError: ``every_k`` is not an integer >= 1.

  Examples:
    >>> tx = mpijax.train.accumulate_gradients(  # doctest: +SKIP
    ...   optax.chain(mpijax.train.allreduce_gradients(), optax.adam(1e-3)), every_k=4)
  """
  if not isinstance(every_k, (int, np.integer)) or every_k < 1:
    raise ValueError(f"every_k={every_k!r} must be an integer >= 1")
  every_k = int(every_k)

  def init_fn(params):
    return AccumulateState(jnp.zeros((), jnp.int32),
                           jax.tree_util.tree_map(jnp.zeros_like, params),
                           inner.init(params))

  def update_fn(updates, state, params=None):
    acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), state.grads, updates)

    def final(_):
      mean = jax.tree_util.tree_map(lambda a: a / every_k, acc)
      new_updates, new_inner = inner.update(mean, state.inner, params)
      return new_updates, new_inner, jax.tree_util.tree_map(jnp.zeros_like, acc)

    shapes = jax.eval_shape(final, None)

    def middle(_):
      zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[0])
      return zeros, state.inner, acc

    new_updates, new_inner, new_acc = jax.lax.cond(
        state.micro_step == every_k - 1, final, middle, None)
    return new_updates, AccumulateState((state.micro_step + 1) % every_k, new_acc, new_inner)

  return optax.GradientTransformation(init_fn, update_fn)
