"""mpijax's replacements of JAX's own lowering rules, installed by :func:`install`.

The order-token chain (:mod:`.ordering`) must reach every mpijax call in a
program, and every XLA collective that could run against one. JAX's own
lowering puts some of them out of its reach, so :func:`install` (called once
by ``import mpijax``) replaces these CPU lowering rules:

* JAX's module lowering: wrapped to note whether the program makes an mpijax
  call (:func:`track_programs`); programs that make none lower exactly as JAX
  lowers them.
* ``jit``, ``closed_call`` and ``core_call``: bodies with mpijax calls are
  lowered inline (:func:`inline_calls`).
* ``shard_map``: a multi-device body with mpijax calls gets the token as one
  more operand (:func:`thread_shard_maps`).
* 14 XLA collectives (``psum``, ``all_gather``, ...): in programs that make an
  mpijax call, they join the chain (:func:`order_xla_collectives`).

It also replaces the dead-code rules of calls and control flow whose bodies
make an mpijax call: they are kept whole, results used or not
(:func:`keep_calls_with_mpi`).

On a JAX that lacks an internal one of them needs, that replacement is left
out and a warning says what is lost (:func:`mpijax._src.jax_compat.guarded`).
"""

from __future__ import annotations

import functools
import math

from jax.extend.core import Primitive
from jax.interpreters import mlir

from mpijax._src import ffi as _ffi
from mpijax._src import jax_compat
from mpijax._src.jax_compat import ad_checkpoint
from mpijax._src.jax_compat import conditionals
from mpijax._src.jax_compat import core as core_internal
from mpijax._src.jax_compat import custom_derivatives
from mpijax._src.jax_compat import ir
from mpijax._src.jax_compat import loops
from mpijax._src.jax_compat import mlir as mlir_internal
from mpijax._src.jax_compat import parallel
from mpijax._src.jax_compat import partial_eval as pe
from mpijax._src.jax_compat import pjit
from mpijax._src.jax_compat import shard_map
from mpijax._src.jax_compat import sharding_impls
from mpijax._src.ops import ordering
from mpijax._src.ops.lowering import auto_devices

_installed = False


def install() -> None:
  """Replaces JAX's lowering rules as the module docstring says (idempotent)."""
  global _installed
  if _installed:
    return
  _installed = True
  jax_compat.guarded(
    track_programs,
    "cannot tell which programs make mpijax calls; XLA collectives join "
    "the order-token chain in every program",
  )
  jax_compat.guarded(
    order_xla_collectives,
    "XLA collectives are not ordered against mpijax calls; "
    "independent local and cross-rank collectives in one program can deadlock with "
    "several devices per process",
  )
  jax_compat.guarded(
    inline_calls,
    "nested jax.jit calls are not lowered inline; an mpijax call inside one "
    "is ordered only by data dependencies against the mpijax calls outside it",
  )
  jax_compat.guarded(
    thread_shard_maps,
    "the order token does not enter multi-device shard_map bodies; two "
    "independent such bodies in one jitted function are ordered only by data dependencies",
  )
  jax_compat.guarded(
    keep_calls_with_mpi,
    "a nested jax.jit, loop or branch whose results are unused is "
    "dropped with the mpijax calls inside it",
  )


def keep_calls_with_mpi() -> None:
  """Keeps calls and control flow whose bodies make an mpijax call, used or not.

  The primitives' own dead-code rule keeps every mpijax call (see
  primitive.make_primitive), but JAX drops a whole nested ``jax.jit``, loop
  or branch whose results are unused and which carries no JAX effect, with
  the calls inside: a jitted ``send`` whose result the caller ignores
  never sent, and its receiver waited forever. Such an equation now counts
  all its results as used.
  """
  for prim in (
    pjit.jit_p,
    core_internal.closed_call_p,
    core_internal.call_p,
    conditionals.cond_p,
    loops.while_p,
    loops.scan_p,
    ad_checkpoint.remat_p,
    custom_derivatives.custom_jvp_call_p,
    custom_derivatives.custom_vjp_call_p,
    shard_map.shard_map_p,
  ):
    default = pe.dce_rules.get(prim, pe._default_dce_rule)

    def rule(used_outputs, eqn, default=default):
      if not all(used_outputs) or not eqn.outvars:
        if any(ordering.calls_mpi(j) for j in jax_compat.jaxprs_in_params(eqn.params)):
          if not eqn.outvars:  # JAX's rules drop these whatever they are told
            return [True] * len(eqn.invars), eqn
          used_outputs = [True] * len(used_outputs)
      return default(used_outputs, eqn)

    pe.dce_rules[prim] = rule


def track_programs() -> None:
  """Notes, for each program JAX lowers, whether it makes an mpijax call.

  XLA collectives join the order-token chain only in such programs, so
  programs without mpijax calls lower exactly as JAX lowers them.
  """
  lower = mlir_internal.lower_jaxpr_to_module

  @functools.wraps(lower)
  def wrapped(module_name, jaxpr, *args, **kwargs):
    with ordering.lowering_program(jaxpr):
      return lower(module_name, jaxpr, *args, **kwargs)

  mlir_internal.lower_jaxpr_to_module = wrapped


def inline_calls() -> None:
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
  mlir_internal._uncacheable_primitives.update(
    (
      conditionals.cond_p,
      loops.while_p,
      loops.scan_p,
      ad_checkpoint.remat_p,
      custom_derivatives.custom_jvp_call_p,
      custom_derivatives.custom_vjp_call_p,
      shard_map.shard_map_p,
    )
  )

  def make_rule(default, jaxpr_param, plain):
    def rule(ctx, *args, **params):
      closed = params[jaxpr_param]
      if not plain(params) or not ordering.needs_chain(closed):
        return default(ctx, *args, **params)
      if isinstance(closed, core_internal.Jaxpr):
        closed = core_internal.ClosedJaxpr(closed, ())
      consts = mlir_internal.ir_consts(closed.consts, [v.aval for v in closed.jaxpr.constvars])
      out, tokens = mlir_internal.jaxpr_subcomp(
        ctx.module_context,
        closed.jaxpr,
        ctx.name_stack,
        ctx.tokens_in,
        consts,
        *args,
        dim_var_values=ctx.dim_var_values,
        const_lowering=ctx.const_lowering,
        **jax_compat.subcomp_kwargs(mlir_internal.jaxpr_subcomp, ctx),
      )
      ctx.set_tokens_out(tokens)
      return out

    return rule

  def unsharded(params):
    return (
      all(
        isinstance(s, sharding_impls.UnspecifiedValue)
        for s in (*params["in_shardings"], *params["out_shardings"])
      )
      and all(layout is None for layout in (*params["in_layouts"], *params["out_layouts"]))
      and not params.get("compiler_options_kvs")
    )

  targets = [(pjit.jit_p, pjit._pjit_lowering, "jaxpr", unsharded)]
  for prim, name in (
    (core_internal.closed_call_p, "closed_call"),
    (core_internal.call_p, "core_call"),
  ):  # JAX's own names for them
    targets.append(
      (
        prim,
        functools.partial(mlir_internal.core_call_lowering, name=name),
        "call_jaxpr",
        lambda params: True,
      )
    )
  for prim, default, param, plain in targets:
    mlir.register_lowering(prim, make_rule(default, param, plain), platform="cpu", cacheable=False)


def thread_shard_maps() -> None:
  """Passes the order token through multi-device ``shard_map`` bodies.

  Such a body is an ``sdy.manual_computation``, a region isolated from above:
  it cannot capture the caller's token, so without this each body would start
  its own chain, and two independent bodies in one jitted function (two
  ``mpijax.pmap`` calls, say) would be ordered only by XLA's scheduling. So
  a body that makes an mpijax call gets the token as one more (replicated)
  operand and returns its last token as one more result, which the caller's
  chain continues from: on each device, the bodies' calls run in program
  order. So does a body with XLA collectives in a program that makes
  mpijax calls elsewhere (see :func:`order_xla_collectives`). Other bodies,
  and single-device ones (lowered inline, already in the caller's chain),
  keep JAX's lowering unchanged.
  """
  from jax.sharding import PartitionSpec

  default = shard_map._shard_map_lowering
  token_in_p = Primitive("mpijax_order_token_in")
  token_in_p.multiple_results = True
  token_out_p = Primitive("mpijax_order_token_out")
  token_out_p.multiple_results = True

  def token_in_rule(ctx, token, *, mpi_before):
    chain = ordering.chain_for(ctx)
    state = chain.setdefault(ir.InsertionPoint.current.block, ordering.BlockChain())
    state.token, state.mpi_before = token, mpi_before
    return []

  def token_out_rule(ctx):
    return [ordering.token_for(ordering.chain_for(ctx), ir.InsertionPoint.current.block)]

  mlir.register_lowering(token_in_p, token_in_rule, cacheable=False)
  mlir.register_lowering(token_out_p, token_out_rule, cacheable=False)
  token_aval = ordering.TOKEN_AVAL

  def rule(ctx, *args, jaxpr, mesh, in_specs, out_specs, check_vma, **params):
    manual = math.prod(mesh.shape[a] for a in jax_compat.newly_manual_axes(params))
    if manual == 1 or not ordering.needs_chain(jaxpr):
      return default(
        ctx,
        *args,
        jaxpr=jaxpr,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=check_vma,
        **params,
      )
    chain = ordering.chain_for(ctx)
    block = ir.InsertionPoint.current.block
    token = ordering.token_for(chain, block)
    mpi_before = chain[block].mpi_before
    tok_in, tok_out = core_internal.Var(token_aval), core_internal.Var(token_aval)
    eqns = [
      core_internal.new_jaxpr_eqn(
        [tok_in], [], token_in_p, {"mpi_before": mpi_before}, core_internal.no_effects
      ),
      *jaxpr.eqns,
      core_internal.new_jaxpr_eqn([], [tok_out], token_out_p, {}, core_internal.no_effects),
    ]
    threaded = jaxpr.replace(
      invars=[*jaxpr.invars, tok_in], outvars=[*jaxpr.outvars, tok_out], eqns=eqns
    )
    sub = ctx.replace(avals_in=[*ctx.avals_in, token_aval], avals_out=[*ctx.avals_out, token_aval])
    outs = default(
      sub,
      *args,
      token,
      jaxpr=threaded,
      mesh=mesh,
      in_specs=(*in_specs, PartitionSpec()),
      out_specs=(*out_specs, PartitionSpec()),
      check_vma=check_vma,
      **params,
    )
    if sub.tokens_out is not None:
      ctx.set_tokens_out(sub.tokens_out)
    outs = list(outs)
    state = chain.setdefault(block, ordering.BlockChain())
    state.token = outs[-1]
    state.mpi_before = mpi_before or ordering.calls_mpi(jaxpr)
    return outs[:-1]

  mlir.register_lowering(shard_map.shard_map_p, rule, platform="cpu", cacheable=False)


def order_xla_collectives() -> None:
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
  names = (
    "psum_p",
    "pmax_p",
    "pmin_p",
    "ppermute_p",
    "all_to_all_p",
    "ragged_all_to_all_p",
    "all_gather_p",
    "all_gather_invariant_p",
    "reduce_scatter_p",
    "psum_invariant_p",
    "all_gather_reduced_p",
    "unreduced_reduce_scatter_p",
    "unreduced_psum_p",
    "pbroadcast_p",
  )
  prims = [p for p in (getattr(parallel, n, None) for n in names) if p is not None]

  def wrap(default):
    def rule(ctx, *args, **params):
      if not ordering.program_calls_mpi() or auto_devices(ctx.module_context.axis_context) > 1:
        return default(ctx, *args, **params)
      _ffi.load()  # registers mpijax_gate and mpijax_join
      chain = ordering.chain_for(ctx)
      block = ir.InsertionPoint.current.block
      token = ordering.token_for(chain, block, collective=True)
      state = chain[block]
      if state.mpi_before:
        args = ordering.gate(args, token)
      outs = default(ctx, *args, **params)
      flat = [v for o in outs for v in (o if isinstance(o, (list, tuple)) else (o,))]
      last = ordering.smallest(flat)
      if last is not None:
        state.pending.append(last)
      return outs

    return rule

  for prim in prims:
    entry = mlir_internal._platform_specific_lowerings["cpu"].get(
      prim
    ) or mlir_internal._lowerings.get(prim)
    if entry is None:
      continue
    mlir.register_lowering(prim, wrap(entry.rule), platform="cpu", cacheable=False)
    ordering.XLA_COLLECTIVES.add(prim)
