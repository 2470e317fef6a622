"""Shared machinery of mpijax's MPI primitives (DESIGN.md, layer 3).

* The communicator registry: every op runs on private clones of the user's
  communicator (default: the runtime's), one clone per local device index, so
  user mpi4py traffic can never interleave with ours and several local devices
  can call MPI at once. Clones are made once per user communicator.
* dtype / reduction-op validation at trace time.
* Lowering: an XLA FFI custom call marked ``has_side_effect`` (an HLO
  attribute, so XLA neither removes nor duplicates it) while the primitive
  itself has NO JAX effects, which keeps jitted calls on JAX's C++ fast
  dispatch path. A call that XLA would partition over several devices
  (outside shard_map) is a clear error at lowering.
* Eager execution: a cached ``jax.jit`` per parameter set.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import threading
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from jax.interpreters import partial_eval as pe
from jax._src import sharding_impls
from jax._src.interpreters import mlir as mlir_internal
from jax._src.lib.mlir import ir

try:
  from jax.extend.core import jaxprs_in_params
except ImportError:  # JAX < 0.10 exports it only from its internals
  from jax._src.core import jaxprs_in_params

from mpijax._src import config
from mpijax._src import ffi as _ffi

# --- dtypes and reduction ops --------------------------------------------------

_FLOATS = ("float16", "bfloat16", "float32", "float64")
_COMPLEX = ("complex64", "complex128")
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
SUPPORTED_DTYPES = _FLOATS + _COMPLEX + _INTS + ("bool",)

REDUCE_OPS = ("sum", "prod", "min", "max", "and", "or", "xor")
OP_CODES = {name: i for i, name in enumerate(REDUCE_OPS)}


def _ops_for(dtype_name: str) -> tuple[str, ...]:
  if dtype_name in _FLOATS:
    return ("sum", "prod", "min", "max")
  if dtype_name in _COMPLEX:
    return ("sum", "prod")
  if dtype_name == "bool":
    return ("min", "max", "and", "or", "xor")
  return REDUCE_OPS


def check_dtype(op_name: str, dtype: Any) -> str:
  """The canonical dtype name, or a TypeError naming the supported ones."""
  name = np.dtype(dtype).name
  if name not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{op_name} got an array of dtype {name}, which mpijax cannot send; "
        f"supported dtypes: {', '.join(SUPPORTED_DTYPES)}. Cast first, e.g. "
        "x.astype(jnp.float32).")
  return name


def as_array(op_name: str, x: Any) -> Any:
  """``x`` as a JAX array (tracers pass through); a value JAX cannot hold is
  a TypeError naming its type and dtype, not JAX's internal message."""
  try:
    return jnp.asarray(x)
  except (TypeError, ValueError):
    what = f"a value of type {type(x).__name__}"
    if x is None:
      what = "None"
    else:
      try:
        what += f", dtype {np.asarray(x).dtype.name}"
      except Exception:  # noqa: BLE001 -- only for the message
        pass
    raise TypeError(
        f"{op_name} got {what}, which JAX cannot hold as an array; pass a "
        f"numeric array of one of mpijax's dtypes ({', '.join(SUPPORTED_DTYPES)}), "
        "e.g. jnp.asarray(x, jnp.float32).") from None


def check_reduce_op(op_name: str, op: str, dtype: Any) -> str:
  """Validates a reduction op for a dtype (at trace time)."""
  name = check_dtype(op_name, dtype)
  if op not in REDUCE_OPS:
    raise ValueError(f"{op_name} got op={op!r}; expected one of {REDUCE_OPS}.")
  allowed = _ops_for(name)
  if op not in allowed:
    raise TypeError(
        f"{op_name} got op={op!r} for dtype {name}; ops supported for {name}: "
        f"{allowed}" + (" (and/or/xor are bitwise, for integers and bool)"
                        if op in ("and", "or", "xor") else "") + ".")
  return op


# --- communicator registry -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CommInfo:
  """A registered user communicator: id in the C++ table, size and rank."""
  id: int
  size: int
  rank: int


@dataclasses.dataclass
class _Entry:
  info: CommInfo
  user_comm: Any          # kept alive so its handle is not reused
  clones: list[Any]       # one per local device index


_registry_lock = threading.RLock()
_registry: dict[int, _Entry] = {}
_hook_installed = False
_settings_pushed: tuple[int, float, bool, bool] | None = None
_next_key = 0  # smallest communicator key not used by this process


def _local_device_ids() -> list[int]:
  """The local devices' ids in local index order: XLA's device ordinals.

  That is the local index in a single-process JAX, but a global id under
  jax.distributed (2048, 2049, ... on the second process).
  """
  from mpijax._src import runtime
  if runtime.is_initialized():
    return [d.id for d in runtime.get().local_devices]
  return [d.id for d in jax.local_devices()]


def push_settings() -> None:
  """Sends the transport settings to C++ (again if they changed)."""
  global _settings_pushed
  action = str(config.get("stall_action")).strip().lower()
  if action not in ("abort", "warn"):
    raise ValueError(
        f"MPIJAX_STALL_ACTION={action!r} is not valid: use 'abort' (report the "
        "stall, then end the job) or 'warn' (report it and keep waiting).")
  timeout = config.parse("timeout", config.get("timeout"))  # also after config.update
  settings = (int(config.get("max_chunk_bytes")), timeout,
              action == "abort", bool(config.get("check")),
              int(config.get("blocking_min_bytes")), int(config.get("ring_min_bytes")),
              int(config.get("ring_in_place_min_bytes")), int(config.get("shm_max_bytes")),
              int(config.get("cma_min_bytes")))
  if settings != _settings_pushed:
    _ffi.load().setup(*settings)
    _settings_pushed = settings


def _free_all() -> None:
  """Shutdown hook: forget and free every clone (compiled programs go stale)."""
  global _hook_installed
  ext = _ffi.load()
  with _registry_lock:
    for entry in _registry.values():
      ext.unregister_comms(entry.info.id)
      for c in entry.clones:
        c.Free()
    _registry.clear()
    _hook_installed = False
  resolve_comm.cache_clear()


def _register(comm: Any) -> CommInfo:
  global _hook_installed, _next_key
  from mpijax._src import inspector, mpi_util
  MPI = mpi_util.import_mpi()  # MPI is up (a comm exists); registers the exit cleanup
  ext = _ffi.load()
  push_settings()
  inspector.ensure_started()  # local: the responder's communicator exists since init()
  key = MPI._handleof(comm)
  with _registry_lock:
    entry = _registry.get(key)
    if entry is None:
      # Collective over `comm`: ranks register communicators in program order
      # (first use), so clone ids line up across ranks.
      ordinals = _local_device_ids()
      n = len(ordinals)
      clones = [comm.Clone() for _ in range(n)]
      for i, c in enumerate(clones):
        c.Set_name(f"mpijax-ops-{len(_registry)}-dev{i}")
      # Signature checks run on their own clones (see DevComm in the C++), and
      # all ranks of `comm` agree on a key that names it in stall reports.
      checks = [comm.Clone() for _ in range(n)]
      buf = np.array([_next_key], np.int64)  # a buffer, not a pickled object
      comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
      key = int(buf[0])
      _next_key = key + 1
      cid = ext.register_comms([MPI._handleof(c) for c in clones],
                               [MPI._handleof(c) for c in checks], key, ordinals)
      entry = _Entry(CommInfo(cid, comm.Get_size(), comm.Get_rank()), comm,
                     clones + checks)
      _registry[key] = entry
      if not _hook_installed:
        from mpijax._src import runtime
        runtime.register_shutdown_hook(_free_all)
        _hook_installed = True
    return entry.info


# id(python comm object) -> (object, info): mpi4py communicators are not
# hashable, and this lookup runs on every trace / eager call.
_fast: dict[int, tuple[Any, CommInfo]] = {}


def resolve_comm(comm: Any, op_name: str) -> CommInfo:
  """CommInfo for ``comm`` (default: the runtime's communicator)."""
  from mpijax._src import runtime
  if comm is None:
    comm = runtime.get(op_name).comm
  elif not runtime.is_initialized():
    runtime.get(op_name)  # the same clear "call mpijax.init()" error
  hit = _fast.get(id(comm))
  if hit is not None and hit[0] is comm:
    return hit[1]
  info = _register(comm)
  _fast[id(comm)] = (comm, info)
  return info


resolve_comm.cache_clear = _fast.clear  # type: ignore[attr-defined]


# --- primitives -------------------------------------------------------------------


_PRIMITIVES: set[Primitive] = set()  # every mpijax primitive (for _calls_mpi)


def make_primitive(name: str, multiple_results: bool = False) -> Primitive:
  p = Primitive(name)
  p.multiple_results = multiple_results
  p.def_impl(functools.partial(_eager_impl, p))
  pe.dce_rules[p] = _keep_call
  _PRIMITIVES.add(p)
  return p


def _keep_call(used_outputs, eqn):
  """JAX's dead-code elimination keeps every mpijax call, used or not.

  The primitives carry no JAX effect (see the module docstring), so JAX
  would drop a call whose result is unused, and code that uses a result on
  some ranks only (``y if rank == 0 else x``) would make the MPI call on
  those ranks only: the others would wait forever. Kept, every rank makes it.
  """
  del used_outputs
  return [True] * len(eqn.invars), eqn


@functools.lru_cache(maxsize=4096)
def _jitted(prim: Primitive, params: tuple[tuple[str, Any], ...]) -> Callable:
  kwargs = dict(params)
  return jax.jit(lambda *args: prim.bind(*args, **kwargs))


def _eager_impl(prim: Primitive, *args, **params):
  return _jitted(prim, tuple(sorted(params.items())))(*args)


# Ordering. XLA:CPU's thunk executor runs independent thunks concurrently and
# in any order, side-effecting custom calls included (measured: 200 independent
# collectives in one program mismatch across ranks within a few runs; so did a
# collective in a `lax.cond` or a nested `jax.jit` against an independent one
# outside it, silently swapping their results). So every mpijax custom call
# takes an extra int32 scalar "order token" operand and returns a new one: a
# plain data dependency that XLA must respect, with no JAX effect (which would
# cost the C++ fast dispatch path). One chain runs through each function in
# program order:
# * within a block, each op consumes the token of the previous one;
# * the first op inside a `case`/`while` region (cond branches, loop and scan
#   bodies) consumes the enclosing block's token, captured implicitly as
#   StableHLO allows, and the next op after that control-flow op first passes
#   its token through `mpijax_join` together with one of the op's results, so
#   it waits until the whole loop or branch has run;
# * nested `jax.jit`s and other calls whose body makes an mpijax call are
#   lowered inline (see _inline_calls), so their ops join the caller's chain.
# * a multi-device `shard_map` body (an sdy.manual_computation, which may not
#   capture outer values) gets the token as one more operand and returns its
#   last one (see _thread_shard_maps).
# * XLA's own collectives (jax.lax.psum, all_gather, ... over the local
#   devices of a shard_map or pmap) join the chain too, in programs that make
#   an mpijax call (see _order_xla_collectives): XLA orders them among
#   themselves, not against the MPI calls, so an independent pair could run
#   in different orders on two local devices and deadlock across ranks.
_TOKEN_AVAL = jax.core.ShapedArray((), np.int32)
_CAPTURING_OPS = ("stablehlo.case", "stablehlo.if", "stablehlo.while")


@dataclasses.dataclass
class _BlockChain:
  token: Any = None  # the last order token produced in this block (ir.Value)
  after: list = dataclasses.field(default_factory=list)  # region ops to wait for
  # Results of XLA collectives since the token, for the next MPI call to wait for.
  pending: list = dataclasses.field(default_factory=list)
  # Whether an MPI call may precede the token (XLA collectives then wait for it).
  mpi_before: bool = False


_chains: "collections.OrderedDict[int, tuple[Any, dict[Any, _BlockChain]]]" = (
    collections.OrderedDict())


def _chain_for(ctx) -> dict[Any, _BlockChain]:
  module = ctx.module_context.module
  key = id(module)
  hit = _chains.get(key)
  if hit is None or hit[0] is not module:
    hit = (module, {})
    _chains[key] = hit
    while len(_chains) > 16:  # lowering is sequential; keep a few modules
      _chains.popitem(last=False)
  return hit[1]


def _region_holder(block):
  """The op (case, while, ...) whose region holds ``block``; None at function level."""
  owner = block.owner
  if owner is None or owner.operation.name == "func.func":
    return None
  return owner.operation


def _is_tensor(value) -> bool:
  try:
    ir.RankedTensorType(value.type)
  except ValueError:  # a !stablehlo.token
    return False
  return True


def _smallest(values):
  """The smallest ranked-tensor value among ``values`` (what mpijax_join reads), or None."""
  def size(v):
    t = ir.RankedTensorType(v.type)
    return int(np.prod(t.shape)) if t.has_static_shape else 1 << 62
  return min((v for v in values if _is_tensor(v)), key=size, default=None)


def _join(token, op):
  """``token`` passed through mpijax_join with a result of ``op``: waits for ``op``."""
  return _join_value(token, _smallest(op.results))


def _join_value(token, after):
  """``token`` passed through mpijax_join with ``after``: waits until it is computed."""
  if after is None:  # an op without tensor results: nothing to wait on
    return token
  i32 = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
  call = mlir_internal.custom_call("mpijax_join", result_types=[i32], operands=[token, after],
                                   backend_config={}, api_version=4, has_side_effect=False)
  return call.results[0]


def _token(chain: dict[Any, _BlockChain], block, holder=None, collective: bool = False):
  """The order token for the next mpijax op in ``block``.

  With ``holder`` (an op in ``block`` whose region is being lowered) the
  token is the one valid just before ``holder``, and any new op is inserted
  before it; otherwise at the current insertion point. For an XLA
  ``collective`` the token does not wait for the XLA collectives before it
  (XLA orders those itself); for an MPI call it does.
  """
  state = chain.setdefault(block, _BlockChain())
  waits = [op for op in state.after if holder is None or op != holder]
  pending = [] if collective else state.pending
  if state.token is not None and not waits and not pending:
    return state.token
  with ir.InsertionPoint(holder) if holder is not None else contextlib.nullcontext():
    token = state.token
    if token is None:
      parent = _region_holder(block)
      if parent is not None and parent.name in _CAPTURING_OPS:
        token = _token(chain, parent.block, parent)
        state.mpi_before = chain[parent.block].mpi_before
      else:
        token = mlir.ir_constant(np.int32(0))
      if parent is not None:
        _wait_for(chain, parent)
    for op in waits:
      token = _join(token, op)
    if waits:
      state.mpi_before = True  # regions with mpijax calls or XLA collectives
    for value in pending:
      token = _join_value(token, value)
  state.token = token
  state.after = [op for op in state.after if op not in waits]
  if pending:
    state.pending = []
  return token


def _wait_for(chain: dict[Any, _BlockChain], op) -> None:
  """Marks region op ``op`` (and the region ops around it) as making mpijax calls."""
  while op is not None:
    state = chain.setdefault(op.block, _BlockChain())
    if any(o == op for o in state.after):
      return
    state.after.append(op)
    op = _region_holder(op.block)


def _binds(prims: set[Primitive], cache, jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it) binds one of ``prims``."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  hit = cache.get(jaxpr)
  if hit is None:
    hit = any(eqn.primitive in prims
              or any(_binds(prims, cache, sub) for sub in jaxprs_in_params(eqn.params))
              for eqn in jaxpr.eqns)
    cache[jaxpr] = hit
  return hit


_calls_mpi_cache: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
_XLA_COLLECTIVES: set[Primitive] = set()  # filled by _order_xla_collectives
_collective_cache: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _calls_mpi(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it) binds an mpijax primitive."""
  return _binds(_PRIMITIVES, _calls_mpi_cache, jaxpr)


def _needs_chain(jaxpr) -> bool:
  """Whether ``jaxpr`` has calls the order token must reach.

  Its mpijax calls, and, in a program that makes mpijax calls, its XLA
  collectives (see _order_xla_collectives).
  """
  return _calls_mpi(jaxpr) or (
      _program_calls_mpi() and _binds(_XLA_COLLECTIVES, _collective_cache, jaxpr))


# Whether the program being lowered makes an mpijax call (None: unknown, when
# JAX's module lowering could not be wrapped; treated as yes).
_lowering_mpi: "contextvars.ContextVar[bool | None]" = contextvars.ContextVar(
    "mpijax_lowering_mpi", default=None)


def _program_calls_mpi() -> bool:
  return _lowering_mpi.get() is not False


def _track_programs() -> None:
  """Notes, for each program JAX lowers, whether it makes an mpijax call.

  XLA collectives join the order-token chain only in such programs, so
  programs without mpijax calls lower exactly as JAX lowers them.
  """
  lower = mlir_internal.lower_jaxpr_to_module

  @functools.wraps(lower)
  def wrapped(module_name, jaxpr, *args, **kwargs):
    reset = _lowering_mpi.set(_calls_mpi(jaxpr))
    try:
      return lower(module_name, jaxpr, *args, **kwargs)
    finally:
      _lowering_mpi.reset(reset)

  mlir_internal.lower_jaxpr_to_module = wrapped


def _inline_calls() -> None:
  """Lowers the bodies of calls and control flow inline, where the chain reaches.

  * Nested ``jax.jit`` and ``closed_call`` bodies that make an mpijax call
    (or, in a program that makes one, an XLA collective):
    JAX lowers them to separate functions (``func.call``), which an order
    token cannot enter; XLA inlines those calls anyway, so lowering them
    inline changes nothing else. Other calls, and nested jits with explicit
    shardings, keep JAX's own lowering.
  * Control-flow primitives are marked uncacheable, as JAX's calls are: a
    cacheable one is lowered once into a scratch function, cloned into each
    use, which would also cut its ops from the caller's chain. The price is
    that identical loops or branches in one program are lowered once each.
  """
  from jax._src import ad_checkpoint, core as core_internal, custom_derivatives
  from jax._src import pjit, sharding_impls, shard_map
  from jax._src.lax.control_flow import conditionals, loops

  mlir_internal._uncacheable_primitives.update((
      conditionals.cond_p, loops.while_p, loops.scan_p, ad_checkpoint.remat_p,
      custom_derivatives.custom_jvp_call_p, custom_derivatives.custom_vjp_call_p,
      shard_map.shard_map_p))

  # JAX < 0.9 has no `outer_traceback` (the caller's frames, appended to the
  # inlined equations' tracebacks).
  takes_outer_tb = "outer_traceback" in inspect.signature(mlir_internal.jaxpr_subcomp).parameters

  def make_rule(default, jaxpr_param, plain):
    def rule(ctx, *args, **params):
      closed = params[jaxpr_param]
      if not plain(params) or not _needs_chain(closed):
        return default(ctx, *args, **params)
      if isinstance(closed, core_internal.Jaxpr):
        closed = core_internal.ClosedJaxpr(closed, ())
      consts = mlir_internal.ir_consts(closed.consts, [v.aval for v in closed.jaxpr.constvars])
      extra = {"outer_traceback": ctx.traceback} if takes_outer_tb else {}
      out, tokens = mlir_internal.jaxpr_subcomp(
          ctx.module_context, closed.jaxpr, ctx.name_stack, ctx.tokens_in, consts, *args,
          dim_var_values=ctx.dim_var_values, const_lowering=ctx.const_lowering, **extra)
      ctx.set_tokens_out(tokens)
      return out
    return rule

  def unsharded(params):
    return (all(isinstance(s, sharding_impls.UnspecifiedValue)
                for s in (*params["in_shardings"], *params["out_shardings"]))
            and all(layout is None for layout in (*params["in_layouts"], *params["out_layouts"]))
            and not params.get("compiler_options_kvs"))

  targets = [(pjit.jit_p, pjit._pjit_lowering, "jaxpr", unsharded)]
  for prim, name in ((core_internal.closed_call_p, "closed_call"),
                     (core_internal.call_p, "core_call")):  # JAX's own names for them
    targets.append((prim, functools.partial(mlir_internal.core_call_lowering, name=name),
                    "call_jaxpr", lambda params: True))
  for prim, default, param, plain in targets:
    mlir.register_lowering(prim, make_rule(default, param, plain), platform="cpu",
                           cacheable=False)


def _thread_shard_maps() -> None:
  """Passes the order token through multi-device ``shard_map`` bodies.

  Such a body is an ``sdy.manual_computation``, a region isolated from above:
  it cannot capture the caller's token, so without this each body would start
  its own chain, and two independent bodies in one jitted function (two
  ``mpijax.pmap`` calls, say) would be ordered only by XLA's scheduling. So
  a body that makes an mpijax call gets the token as one more (replicated)
  operand and returns its last token as one more result, which the caller's
  chain continues from: on each device, the bodies' calls run in program
  order. So does a body with XLA collectives in a program that makes
  mpijax calls elsewhere (see _order_xla_collectives). Other bodies, and
  single-device ones (lowered inline, already in the caller's chain), keep
  JAX's lowering unchanged.
  """
  from jax._src import core as core_internal, shard_map
  from jax.sharding import PartitionSpec

  default = shard_map._shard_map_lowering
  token_in_p = Primitive("mpijax_order_token_in")
  token_in_p.multiple_results = True
  token_out_p = Primitive("mpijax_order_token_out")
  token_out_p.multiple_results = True

  def token_in_rule(ctx, token, *, mpi_before):
    chain = _chain_for(ctx)
    state = chain.setdefault(ir.InsertionPoint.current.block, _BlockChain())
    state.token, state.mpi_before = token, mpi_before
    return []

  def token_out_rule(ctx):
    return [_token(_chain_for(ctx), ir.InsertionPoint.current.block)]

  mlir.register_lowering(token_in_p, token_in_rule, cacheable=False)
  mlir.register_lowering(token_out_p, token_out_rule, cacheable=False)

  def rule(ctx, *args, jaxpr, mesh, in_specs, out_specs, check_vma, **params):
    # The axes this shard_map makes manual: `newly_manual_axes` since JAX 0.10,
    # `manual_axes` before.
    newly = params.get("newly_manual_axes", params.get("manual_axes"))
    manual = math.prod(mesh.shape[a] for a in newly)
    if manual == 1 or not _needs_chain(jaxpr):
      return default(ctx, *args, jaxpr=jaxpr, mesh=mesh, in_specs=in_specs,
                     out_specs=out_specs, check_vma=check_vma, **params)
    chain = _chain_for(ctx)
    block = ir.InsertionPoint.current.block
    token = _token(chain, block)
    mpi_before = chain[block].mpi_before
    tok_in, tok_out = core_internal.Var(_TOKEN_AVAL), core_internal.Var(_TOKEN_AVAL)
    eqns = [core_internal.new_jaxpr_eqn([tok_in], [], token_in_p, {"mpi_before": mpi_before},
                                        core_internal.no_effects),
            *jaxpr.eqns,
            core_internal.new_jaxpr_eqn([], [tok_out], token_out_p, {},
                                        core_internal.no_effects)]
    threaded = jaxpr.replace(invars=[*jaxpr.invars, tok_in],
                             outvars=[*jaxpr.outvars, tok_out], eqns=eqns)
    sub = ctx.replace(avals_in=[*ctx.avals_in, _TOKEN_AVAL],
                      avals_out=[*ctx.avals_out, _TOKEN_AVAL])
    outs = default(sub, *args, token, jaxpr=threaded, mesh=mesh,
                   in_specs=(*in_specs, PartitionSpec()),
                   out_specs=(*out_specs, PartitionSpec()), check_vma=check_vma, **params)
    if sub.tokens_out is not None:
      ctx.set_tokens_out(sub.tokens_out)
    outs = list(outs)
    state = chain.setdefault(block, _BlockChain())
    state.token = outs[-1]
    state.mpi_before = mpi_before or _calls_mpi(jaxpr)
    return outs[:-1]

  mlir.register_lowering(shard_map.shard_map_p, rule, platform="cpu", cacheable=False)


def _gate(args, token):
  """``args`` passed through mpijax_gate with ``token``: usable once ``token`` is.

  The results alias the operands (XLA copies an operand first only where it
  is still needed afterwards, or is a parameter), so ordering costs no data
  movement where the operand is an intermediate.
  """
  idx = [i for i, a in enumerate(args) if isinstance(a, ir.Value) and _is_tensor(a)]
  if not idx:
    return args
  types = [args[i].type for i in idx]
  # Row-major layouts, pinned: unpinned, XLA may give a result another layout
  # than its operand (the one the collective prefers) while they share one
  # buffer, and the collective would read the data transposed.
  layouts = [list(reversed(range(ir.RankedTensorType(t).rank))) for t in types]
  call = mlir_internal.custom_call(
      "mpijax_gate", result_types=types, operands=[*(args[i] for i in idx), token],
      backend_config={}, api_version=4, has_side_effect=False,
      operand_output_aliases={k: k for k in range(len(idx))},
      operand_layouts=[*layouts, []], result_layouts=layouts)
  out = list(args)
  for k, i in enumerate(idx):
    out[i] = call.results[k]
  return out


def _order_xla_collectives() -> None:
  """Puts XLA's collectives into the order-token chain of programs that call MPI.

  With several local devices, each device runs its own copy of the program,
  and XLA:CPU starts the independent thunks of each copy in its own order.
  XLA orders its collectives among themselves, and the token orders the MPI
  calls; but an XLA collective (which waits for the rank's other local
  devices) and an independent MPI call (which waits for the same device
  index on the other ranks) could run in opposite orders on two devices:
  each device then waits for a device that waits for it, across ranks (XLA
  aborts after 40 s: "only 1 of them arrived"). So, in a program that makes
  an mpijax call, each XLA collective reads its operands through
  ``mpijax_gate`` with the current token (it starts after the MPI calls
  before it), and the next MPI call joins its result (it starts after the
  collective has finished): one order on every device. Programs without
  mpijax calls lower as JAX lowers them.
  """
  from jax._src.lax import parallel

  names = ("psum_p", "pmax_p", "pmin_p", "ppermute_p", "all_to_all_p",
           "ragged_all_to_all_p", "all_gather_p", "all_gather_invariant_p",
           "reduce_scatter_p", "psum_invariant_p", "all_gather_reduced_p",
           "unreduced_reduce_scatter_p", "unreduced_psum_p", "pbroadcast_p")
  prims = [p for p in (getattr(parallel, n, None) for n in names) if p is not None]

  def wrap(default):
    def rule(ctx, *args, **params):
      if not _program_calls_mpi() or _auto_devices(ctx.module_context.axis_context) > 1:
        return default(ctx, *args, **params)
      _ffi.load()  # registers mpijax_gate and mpijax_join
      chain = _chain_for(ctx)
      block = ir.InsertionPoint.current.block
      token = _token(chain, block, collective=True)
      state = chain[block]
      if state.mpi_before:
        args = _gate(args, token)
      outs = default(ctx, *args, **params)
      flat = [v for o in outs for v in (o if isinstance(o, (list, tuple)) else (o,))]
      last = _smallest(flat)
      if last is not None:
        state.pending.append(last)
      return outs
    return rule

  for prim in prims:
    entry = (mlir_internal._platform_specific_lowerings["cpu"].get(prim)
             or mlir_internal._lowerings.get(prim))
    if entry is None:
      continue
    mlir.register_lowering(prim, wrap(entry.rule), platform="cpu", cacheable=False)
    _XLA_COLLECTIVES.add(prim)


try:
  _track_programs()
except AttributeError as e:  # a JAX without this internal
  import warnings
  warnings.warn(f"mpijax: cannot tell which programs make mpijax calls ({e!r}); XLA "
                "collectives join the order-token chain in every program", RuntimeWarning,
                stacklevel=2)
try:
  _order_xla_collectives()
except (ImportError, AttributeError) as e:
  import warnings
  warnings.warn(f"mpijax: XLA collectives are not ordered against mpijax calls ({e!r}); "
                "independent local and cross-rank collectives in one program can "
                "deadlock with several devices per process", RuntimeWarning, stacklevel=2)
try:
  _inline_calls()
except (ImportError, AttributeError) as e:  # a JAX without these internals
  import warnings
  warnings.warn(f"mpijax: nested jax.jit calls are not lowered inline ({e!r}); an mpijax "
                "call inside one is ordered only by data dependencies against the "
                "mpijax calls outside it", RuntimeWarning, stacklevel=2)
try:
  _thread_shard_maps()
except (ImportError, AttributeError) as e:
  import warnings
  warnings.warn(f"mpijax: the order token does not enter multi-device shard_map bodies "
                f"({e!r}); two independent such bodies in one jitted function are ordered "
                "only by data dependencies", RuntimeWarning, stacklevel=2)


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


def register_ffi_lowering(prim: Primitive, target: str,
                          attrs: Callable[..., dict[str, Any]],
                          in_place_capable: bool = False) -> None:
  """CPU lowering of ``prim`` to FFI target ``target``, with an order token.

  ``attrs(**params)`` gives the custom call's named attributes. With
  ``in_place_capable`` (result i has operand i's shape and dtype), each
  donated or intermediate operand is declared aliased to its result
  (:func:`_reusable`), so XLA hands the handler one buffer and MPI runs in
  place (no copy, no fresh output).
  """
  lowerings: dict[tuple[int, ...], Callable] = {}

  def lowering(aliased: tuple[int, ...]) -> Callable:
    low = lowerings.get(aliased)
    if low is None:
      low = jax.ffi.ffi_lowering(target, has_side_effect=True,
                                 operand_output_aliases={i: i for i in aliased} or None)
      lowerings[aliased] = low
    return low

  kind = target.removeprefix("mpijax_")

  def rule(ctx, *args, **params):
    if _auto_devices(ctx.module_context.axis_context) > 1:
      raise _multi_device_error(ctx, kind, params)
    _ffi.load()  # registers the FFI targets before XLA compiles the call
    chain = _chain_for(ctx)
    block = ir.InsertionPoint.current.block
    token = _token(chain, block)
    token_ctx = ctx.replace(avals_in=[*ctx.avals_in, _TOKEN_AVAL],
                            avals_out=[*ctx.avals_out, _TOKEN_AVAL])
    site, sig = call_site(ctx, kind, params)
    aliased = tuple(i for i, a in enumerate(args) if _reusable(a)) if in_place_capable else ()
    outs = lowering(aliased)(token_ctx, *args, token, **attrs(**params), site=i64(site),
                             sig=i64(sig))
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


def _auto_devices(axis_context) -> int:
  """How many devices the partitioner shares one (non-manual) value among."""
  if isinstance(axis_context, sharding_impls.ShardingContext):
    return axis_context.num_devices
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    # Inside a shard_map: only the axes it does not map are partitioned.
    manual = axis_context.manual_axes
    # mesh.shape (name -> size): a concrete Mesh and an AbstractMesh both have it.
    return math.prod(size for name, size in axis_context.mesh.shape.items()
                     if name not in manual)
  return 1  # jax.pmap replicas and other contexts: one device per computation


def _call_name(ctx, kind: str, params: dict[str, Any]) -> str:
  """The call as the user wrote it, e.g. "mpijax.ops.allreduce(float32[4], sum)"."""
  human, _ = _describe(kind, ctx.avals_in, params)
  return ("mpijax.train's fused " + human if kind == "allreduce_many"
          else "mpijax.ops." + human)


def _platform_error(ctx, kind: str, params: dict[str, Any]) -> NotImplementedError:
  """The error for a call lowered for a platform without mpijax handlers (GPU, TPU)."""
  name = _call_name(ctx, kind, params)
  platforms = ", ".join(ctx.module_context.platforms)
  return NotImplementedError(
      f"{name} at {_user_location(ctx)} (primitive mpijax_{kind}) is compiled for "
      f"platform {platforms!r}, but mpijax's MPI transport has CPU handlers only (the GPU "
      "handler is a build option that is not implemented yet; see the README, 'The "
      "transport'). Fix: run the program on CPU devices (JAX_PLATFORMS=cpu, or "
      "jax.config.update('jax_platforms', 'cpu') before any JAX call), or, on GPUs, use "
      "JAX's own collectives (jax.distributed with jax.lax.psum over a global mesh).")


def _multi_device_error(ctx, kind: str, params: dict[str, Any]) -> ValueError:
  """The error for a call lowered where XLA partitions it over several devices."""
  axis_context = ctx.module_context.axis_context
  n = _auto_devices(axis_context)
  name = _call_name(ctx, kind, params)
  if isinstance(axis_context, sharding_impls.SPMDAxisContext):
    auto = tuple(a for a in axis_context.mesh.axis_names if a not in axis_context.manual_axes)
    where = (f"inside a shard_map that leaves mesh axes {auto} unmapped, so the call is "
             f"partitioned over {n} devices")
  else:
    where = (f"in a computation partitioned over {n} devices, outside any shard_map (a "
             "jax.jit that also contains a multi-device mpijax.pmap or shard_map, or an "
             "argument sharded or replicated over several devices)")
  return ValueError(
      f"{name} at {_user_location(ctx)} (primitive mpijax_{kind}) is called {where}. "
      "mpijax.ops calls act on one device's rank-local array; here XLA would have to run "
      "the MPI call once per device on one communicator, or on one device without "
      "ordering it against the others. Fix: call it inside the mpijax.pmap / "
      "mpijax.shard_map / jax.shard_map body (each local device then calls MPI on its own "
      "communicator), use the mpijax.lax collectives over a mesh axis (psum, all_gather, "
      "...), call it outside the multi-device jax.jit on an array on one device "
      "(jax.device_put(x, mpijax.local_devices()[0])), or run one device per process "
      "(mpijax.init(devices_per_process=1), mpijax-run --devices-per-process 1).")


# Call sites and signatures (issue 8). Each custom call carries a static
# `sig` (a hash of what every rank must agree on: kind, shapes, dtypes, op,
# root, permutation) and a `site`, the id of a description such as
# "allreduce(float32[4], sum) at train.py:42" that C++ prints in stall and
# mismatch reports. Sites are interned by (description, sig, comm), so recompiling
# the same program (on one rank but not another) reuses the site and its
# "already checked" flag instead of triggering an unpaired check.
_sites: dict[tuple[str, int, int | None], int] = {}
_check_slots: dict[tuple[int, int | None], int] = {}


def _package_dir(module: Any) -> str:
  return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# Frames in these directories are library code, not the user's call site.
_LIB_DIRS = tuple(_package_dir(m) for m in (jax, np, jaxlib)) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # mpijax/_src/
_LIB_NAMES = (os.sep + "optax" + os.sep, os.sep + "contextlib.py", os.sep + "runpy.py")


def _user_location(ctx) -> str:
  """file:line of the first frame outside jax, numpy, optax and mpijax/_src."""
  tb = getattr(ctx, "traceback", None)
  for f in ([] if tb is None else tb.frames):
    name = f.file_name
    if name.startswith(_LIB_DIRS) or any(n in name for n in _LIB_NAMES):
      continue
    return f"{os.path.basename(name)}:{f.line_num}"
  return "an unknown location"


def _describe(kind: str, avals, params: dict[str, Any]) -> tuple[str, str]:
  """(human text, canonical signature text) of one call."""
  parts = [f"{a.dtype.name}[{','.join(map(str, a.shape))}]" for a in avals]
  if "op" in params:
    # An allreduce with a divisor is the public op "mean".
    parts.append("mean" if params.get("divisor", 1) != 1 else str(params["op"]))
  if "root" in params:
    parts.append(f"root={params['root']}")
  if "perm" in params:
    perm = str(list(params["perm"]))
    parts.append("perm=" + (perm if len(perm) <= 60 else perm[:57] + "..."))
  shown = parts if len(avals) <= 3 else \
      parts[:2] + [f"... {len(avals)} arrays"] + parts[len(avals):]
  human = f"{kind}({', '.join(shown)})"
  # Not in the signature: the communicator's local id (ranks may number their
  # communicators differently) and the pairs of a sendrecv (`rank_view`: the
  # pairs each rank knows, legitimately different per rank). A ppermute's
  # permutation is global, so every rank must pass the same one.
  skip = ("comm_id", "rank_view") + (("perm",) if params.get("rank_view") else ())
  canon = "|".join([kind] + parts[:len(avals)] +
                   [f"{k}={params[k]!r}" for k in sorted(params) if k not in skip])
  return human, canon


def call_site(ctx, kind: str, params: dict[str, Any]) -> tuple[int, int]:
  """(site id, signature) for a custom call being lowered."""
  human, canon = _describe(kind, ctx.avals_in, params)
  # A stable hash (Python's hash() changes with PYTHONHASHSEED, per rank).
  sig = int.from_bytes(hashlib.blake2b(canon.encode(), digest_size=8).digest(),
                       "little") & ((1 << 63) - 1)
  text = f"{human} at {_user_location(ctx)}"
  # The local communicator id is part of the site (not of the signature): a
  # site's "checked" flag must not carry over from, e.g., a COMM_SELF call on
  # one rank to a call on the world at the same line.
  key = (text, sig, params.get("comm_id"))
  site = _sites.get(key)
  if site is None:
    # The "already compared" flag is per (signature, communicator): ranks
    # agree on those, not on which call site compiled a program first (an
    # eager op's cached program may come from another line on another rank).
    slot = _check_slots.setdefault((sig, params.get("comm_id")), len(_check_slots))
    site = _ffi.load().register_site(text, slot)
    _sites[key] = site
  return site, sig


def zero_tangent(value) -> ad.Zero:
  """The symbolic zero tangent of ``value`` (float0 for integer and bool values)."""
  return ad.Zero(jax.typeof(value).to_tangent_aval())


def def_sum_linear_ad(prim: Primitive, public_name: str,
                      transpose_sum: Callable[..., Any]) -> None:
  """JVP and transpose rules of a reduction collective that is linear for op="sum".

  The tangent of a sum is the same collective applied to the tangents;
  integer and bool results get zero tangents; other ops are not
  differentiable. ``transpose_sum(ct, **params)`` gives the operand's
  cotangent of an op="sum" call.
  """
  def jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    out = prim.bind(x, **params)
    if type(t) is ad.Zero or not jnp.issubdtype(x.dtype, jnp.inexact):
      return out, zero_tangent(out)
    if params["op"] != "sum":
      raise TypeError(f"{public_name}(op={params['op']!r}) is not differentiable; "
                      "only op='sum' is.")
    return out, prim.bind(t, **params)

  def transpose(ct, x, **params):
    if params["op"] != "sum":
      raise TypeError(f"{public_name}(op={params['op']!r}) is not linear; only op='sum' is.")
    if type(ct) is ad.Zero:
      return (ad.Zero(x.aval),)
    return (transpose_sum(ct, **params),)

  ad.primitive_jvps[prim] = jvp
  ad.primitive_transposes[prim] = transpose


def i64(v: int) -> np.int64:
  return np.int64(v)


def zeros_like_aval(aval) -> jax.Array:
  return jnp.zeros(aval.shape, aval.dtype)


def moveaxis(x, src: int, dst: int):
  return x if src == dst else jnp.moveaxis(x, src, dst)
