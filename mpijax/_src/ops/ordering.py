"""The order-token chain: mpijax's MPI calls run in program order on every rank.

XLA:CPU's thunk executor runs independent thunks concurrently and
in any order, side-effecting custom calls included (measured: 200 independent
collectives in one program mismatch across ranks within a few runs; so did a
collective in a `lax.cond` or a nested `jax.jit` against an independent one
outside it, silently swapping their results). So every mpijax custom call
takes an extra int32 scalar "order token" operand and returns a new one: a
plain data dependency that XLA must respect, with no JAX effect (which would
cost the C++ fast dispatch path). One chain runs through each function in
program order:

* within a block, each op consumes the token of the previous one;
* the first op inside a `case`/`while` region (cond branches, loop and scan
  bodies) consumes the enclosing block's token, captured implicitly as
  StableHLO allows, and the next op after that control-flow op first passes
  its token through `mpijax_join` together with one of the op's results, so
  it waits until the whole loop or branch has run;
* nested `jax.jit`s and other calls whose body makes an mpijax call are
  lowered inline, so their ops join the caller's chain;
* a multi-device `shard_map` body (an sdy.manual_computation, which may not
  capture outer values) gets the token as one more operand and returns its
  last one;
* XLA's own collectives (jax.lax.psum, all_gather, ... over the local
  devices of a shard_map or pmap) join the chain too, in programs that make
  an mpijax call: XLA orders them among themselves, not against the MPI
  calls, so an independent pair could run in different orders on two local
  devices and deadlock across ranks.

This module holds the chain; :mod:`mpijax._src.ops.jax_rules` replaces the
JAX lowering rules that let it reach nested calls, ``shard_map`` bodies and
XLA's collectives.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import weakref
from typing import Any

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from mpijax._src.jax_compat import ir
from mpijax._src.jax_compat import jaxprs_in_params
from mpijax._src.jax_compat import mlir as mlir_internal
from mpijax._src.ops.primitive import PRIMITIVES

# XLA's collective primitives whose lowering joins the chain (filled by
# jax_rules.install(); see jax_rules.order_xla_collectives).
XLA_COLLECTIVES: set[Primitive] = set()

TOKEN_AVAL = jax.core.ShapedArray((), np.int32)
_CAPTURING_OPS = ("stablehlo.case", "stablehlo.if", "stablehlo.while")


@dataclasses.dataclass
class BlockChain:
  """The chain's state in one block (a function body or a region) being lowered."""

  token: Any = None  # the last order token produced in this block (ir.Value)
  after: list = dataclasses.field(default_factory=list)  # region ops to wait for
  # Results of XLA collectives since the token, for the next MPI call to wait for.
  pending: list = dataclasses.field(default_factory=list)
  # Whether an MPI call may precede the token (XLA collectives then wait for it).
  mpi_before: bool = False


_chains: collections.OrderedDict[int, tuple[Any, dict[Any, BlockChain]]] = collections.OrderedDict()


def chain_for(ctx) -> dict[Any, BlockChain]:
  """The chain state, per block, of the module ``ctx`` lowers into."""
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


def smallest(values):
  """The smallest ranked-tensor value among ``values`` (what mpijax_join reads), or None."""

  def size(v):
    t = ir.RankedTensorType(v.type)
    return int(np.prod(t.shape)) if t.has_static_shape else 1 << 62

  return min((v for v in values if _is_tensor(v)), key=size, default=None)


def _join(token, op):
  """``token`` passed through mpijax_join with a result of ``op``: waits for ``op``."""
  return _join_value(token, smallest(op.results))


def _join_value(token, after):
  """``token`` passed through mpijax_join with ``after``: waits until it is computed."""
  if after is None:  # an op without tensor results: nothing to wait on
    return token
  i32 = ir.RankedTensorType.get([], ir.IntegerType.get_signless(32))
  call = mlir_internal.custom_call(
    "mpijax_join",
    result_types=[i32],
    operands=[token, after],
    backend_config={},
    api_version=4,
    has_side_effect=False,
  )
  return call.results[0]


def token_for(chain: dict[Any, BlockChain], block, holder=None, collective: bool = False):
  """The order token for the next mpijax op in ``block``.

  With ``holder`` (an op in ``block`` whose region is being lowered) the
  token is the one valid just before ``holder``, and any new op is inserted
  before it; otherwise at the current insertion point. For an XLA
  ``collective`` the token does not wait for the XLA collectives before it
  (XLA orders those itself); for an MPI call it does.
  """
  state = chain.setdefault(block, BlockChain())
  waits = [op for op in state.after if holder is None or op != holder]
  pending = [] if collective else state.pending
  if state.token is not None and not waits and not pending:
    return state.token
  with ir.InsertionPoint(holder) if holder is not None else contextlib.nullcontext():
    token = state.token
    if token is None:
      parent = _region_holder(block)
      if parent is not None and parent.name in _CAPTURING_OPS:
        token = token_for(chain, parent.block, parent)
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


def _wait_for(chain: dict[Any, BlockChain], op) -> None:
  """Marks region op ``op`` (and the region ops around it) as making mpijax calls."""
  while op is not None:
    state = chain.setdefault(op.block, BlockChain())
    if any(o == op for o in state.after):
      return
    state.after.append(op)
    op = _region_holder(op.block)


def _binds(prims: set[Primitive], cache, jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it) binds one of ``prims``."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  hit = cache.get(jaxpr)
  if hit is None:
    hit = any(
      eqn.primitive in prims
      or any(_binds(prims, cache, sub) for sub in jaxprs_in_params(eqn.params))
      for eqn in jaxpr.eqns
    )
    cache[jaxpr] = hit
  return hit


_calls_mpi_cache: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_collective_cache: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def calls_mpi(jaxpr) -> bool:
  """Whether ``jaxpr`` (or a jaxpr nested in it) binds an mpijax primitive."""
  return _binds(PRIMITIVES, _calls_mpi_cache, jaxpr)


def needs_chain(jaxpr) -> bool:
  """Whether ``jaxpr`` has calls the order token must reach.

  Its mpijax calls, and, in a program that makes mpijax calls, its XLA
  collectives (see jax_rules.order_xla_collectives).
  """
  return calls_mpi(jaxpr) or (
    program_calls_mpi() and _binds(XLA_COLLECTIVES, _collective_cache, jaxpr)
  )


# Whether the program being lowered makes an mpijax call (None: unknown, when
# JAX's module lowering could not be wrapped; treated as yes).
_lowering_mpi: contextvars.ContextVar[bool | None] = contextvars.ContextVar(
  "mpijax_lowering_mpi", default=None
)


def program_calls_mpi() -> bool:
  """Whether the program being lowered makes an mpijax call (or that is unknown)."""
  return _lowering_mpi.get() is not False


@contextlib.contextmanager
def lowering_program(jaxpr):
  """Notes, while JAX lowers the program ``jaxpr``, whether it makes an mpijax call."""
  reset = _lowering_mpi.set(calls_mpi(jaxpr))
  try:
    yield
  finally:
    _lowering_mpi.reset(reset)


def gate(args, token):
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
    "mpijax_gate",
    result_types=types,
    operands=[*(args[i] for i in idx), token],
    backend_config={},
    api_version=4,
    has_side_effect=False,
    operand_output_aliases={k: k for k in range(len(idx))},
    operand_layouts=[*layouts, []],
    result_layouts=layouts,
  )
  out = list(args)
  for k, i in enumerate(idx):
    out[i] = call.results[k]
  return out
