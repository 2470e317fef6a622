"""CPU lowering of mpijax's primitives to XLA FFI custom calls.

Each call is a custom call marked ``has_side_effect`` that takes and returns
an order token (:mod:`.ordering`) and carries its call site and signature
(:mod:`.call_sites`). A call that XLA would partition over several devices
(outside ``shard_map``), or that is compiled for a platform without mpijax
handlers, is a clear error at lowering.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from mpijax._src import ffi as _ffi
from mpijax._src.jax_compat import ir
from mpijax._src.jax_compat import sharding_impls
from mpijax._src.ops import call_sites
from mpijax._src.ops import ordering
from mpijax._src.ops.primitive import i64


def _is_donated(value) -> bool:
  """Whether ``value`` is a donated parameter of the function being lowered."""
  try:
    if not isinstance(value, ir.BlockArgument):
      return False
    func = value.owner.owner
    attrs = ir.DictAttr(ir.ArrayAttr(func.attributes["arg_attrs"])[value.arg_number])
    return "tf.aliasing_output" in attrs or "jax.buffer_donor" in attrs
  except (KeyError, IndexError, TypeError, ValueError, AttributeError):
    return False


def _reusable(value) -> bool:
  """Whether XLA may hand ``value``'s buffer to the result (an in-place call).

  True for a donated parameter and for an intermediate (a value some op in
  this function computed, such as a gradient inside a training step). XLA's
  copy insertion still copies the operand first where that would be wrong
  (the intermediate is used again later, or is a constant), so the alias is
  always safe; where it is free, MPI runs in place and writes no fresh
  buffer. A non-donated parameter is not aliased: that would always cost a
  copy, more than an out-of-place call.
  """
  return not isinstance(value, ir.BlockArgument) or _is_donated(value)


def register_ffi_lowering(
  prim: Primitive,
  target: str,
  attrs: Callable[..., dict[str, Any]],
  in_place_capable: bool = False,
  signature_avals: Callable[[Any], Any] | None = None,
) -> None:
  """CPU lowering of ``prim`` to FFI target ``target``, with an order token.

  ``attrs(**params)`` gives the custom call's named attributes. With
  ``in_place_capable`` (result i has operand i's shape and dtype), each
  donated or intermediate operand is declared aliased to its result
  (:func:`_reusable`), so XLA hands the handler one buffer and MPI runs in
  place (no copy, no fresh output). ``signature_avals(ctx)`` gives the
  avals that describe the call in its signature when the operands' differ
  between ranks (a scatter's root holds every rank's block).
  """
  lowerings: dict[tuple[int, ...], Callable] = {}

  def lowering(aliased: tuple[int, ...]) -> Callable:
    low = lowerings.get(aliased)
    if low is None:
      low = jax.ffi.ffi_lowering(
        target, has_side_effect=True, operand_output_aliases={i: i for i in aliased} or None
      )
      lowerings[aliased] = low
    return low

  kind = target.removeprefix("mpijax_")

  def rule(ctx, *args, **params):
    if auto_devices(ctx.module_context.axis_context) > 1:
      raise _multi_device_error(ctx, kind, params)
    _ffi.load()  # registers the FFI targets before XLA compiles the call
    chain = ordering.chain_for(ctx)
    block = ir.InsertionPoint.current.block
    token = ordering.token_for(chain, block)
    token_ctx = ctx.replace(
      avals_in=[*ctx.avals_in, ordering.TOKEN_AVAL], avals_out=[*ctx.avals_out, ordering.TOKEN_AVAL]
    )
    site, sig = call_sites.call_site(
      ctx if signature_avals is None else ctx.replace(avals_in=signature_avals(ctx)), kind, params
    )
    aliased = tuple(i for i, a in enumerate(args) if _reusable(a)) if in_place_capable else ()
    outs = lowering(aliased)(
      token_ctx, *args, token, **attrs(**params), site=i64(site), sig=i64(sig)
    )
    chain[block].token = outs[-1]
    chain[block].mpi_before = True
    return list(outs[:-1])

  # cacheable=False: jax would otherwise lower identical equations once into a
  # shared out-of-line function, without the equation's traceback (so no call
  # site) and outside the caller's block (so outside its order-token chain).
  mlir.register_lowering(prim, rule, platform="cpu", cacheable=False)

  def other_platform(ctx, *args, **params):
    raise _platform_error(ctx, kind, params)

  # Every other platform (cuda, rocm, tpu) gets this rule: without it JAX's
  # own error ("MLIR translation rule ... not found for platform cuda") names
  # neither mpijax nor a fix.
  mlir.register_lowering(prim, other_platform)


# Multi-device computations. A jax.jit whose computation spans several devices
# (a multi-device shard_map or mpijax.pmap inside it, or an argument sharded or
# replicated over several local devices) is partitioned by XLA, which demands
# a sharding on every side-effecting op outside manual (shard_map) regions and
# otherwise fails with an internal "Side-effect HLO must have sharding". No
# sharding is right for an MPI call there: a replicated or tiled one would run
# it once per local device on the same communicator (mixed data or a
# deadlock), and a MAXIMAL one (one device, as JAX does for io_callback) is
# dropped by Shardy for any custom call but JAX's own callbacks; it would
# also not be ordered against the shard_map body's calls on that device's
# communicator. So it is refused here, at lowering (once per compile, never
# per call), with the same message on every rank, which lowers the same program.


def auto_devices(axis_context) -> int:
  """How many devices the partitioner shares one (non-manual) value among."""
  if isinstance(axis_context, sharding_impls.ShardingContext):
    return axis_context.num_devices
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    # Inside a shard_map: only the axes it does not map are partitioned.
    manual = axis_context.manual_axes
    # mesh.shape (name -> size): a concrete Mesh and an AbstractMesh both have it.
    return math.prod(size for name, size in axis_context.mesh.shape.items() if name not in manual)
  return 1  # jax.pmap replicas and other contexts: one device per computation


def _call_name(ctx, kind: str, params: dict[str, Any]) -> str:
  """The call as the user wrote it, e.g. "mpijax.ops.allreduce(float32[4], sum)"."""
  human, _ = call_sites.describe(kind, ctx.avals_in, params)
  return "mpijax.train's fused " + human if kind == "allreduce_many" else "mpijax.ops." + human


def _platform_error(ctx, kind: str, params: dict[str, Any]) -> NotImplementedError:
  """The error for a call lowered for a platform without mpijax handlers (GPU, TPU)."""
  name = _call_name(ctx, kind, params)
  platforms = ", ".join(ctx.module_context.platforms)
  return NotImplementedError(
    f"{name} at {call_sites.user_location(ctx)} (primitive mpijax_{kind}) is compiled for "
    f"platform {platforms!r}, but mpijax's MPI transport has CPU handlers only (the GPU "
    "handler is a build option that is not implemented yet; see the README, 'The "
    "transport'). Fix: run the program on CPU devices (JAX_PLATFORMS=cpu, or "
    "jax.config.update('jax_platforms', 'cpu') before any JAX call), or, on GPUs, use "
    "JAX's own collectives (jax.distributed with jax.lax.psum over a global mesh)."
  )


def _multi_device_error(ctx, kind: str, params: dict[str, Any]) -> ValueError:
  """The error for a call lowered where XLA partitions it over several devices."""
  axis_context = ctx.module_context.axis_context
  n = auto_devices(axis_context)
  name = _call_name(ctx, kind, params)
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    auto = tuple(a for a in axis_context.mesh.axis_names if a not in axis_context.manual_axes)
    where = (
      f"inside a shard_map that leaves mesh axes {auto} unmapped, so the call is "
      f"partitioned over {n} devices"
    )
  else:
    where = (
      f"in a computation partitioned over {n} devices, outside any shard_map (a "
      "jax.jit that also contains a multi-device mpijax.pmap or shard_map, or an "
      "argument sharded or replicated over several devices)"
    )
  return ValueError(
    f"{name} at {call_sites.user_location(ctx)} (primitive mpijax_{kind}) is called {where}. "
    "mpijax.ops calls act on one device's rank-local array; here XLA would have to run "
    "the MPI call once per device on one communicator, or on one device without "
    "ordering it against the others. Fix: call it inside the mpijax.pmap / "
    "mpijax.shard_map / jax.shard_map body (each local device then calls MPI on its own "
    "communicator), use the mpijax.lax collectives over a mesh axis (psum, all_gather, "
    "...), call it outside the multi-device jax.jit on an array on one device "
    "(jax.device_put(x, mpijax.local_devices()[0])), or run one device per process "
    "(mpijax.init(devices_per_process=1), mpijax-run --devices-per-process 1)."
  )
