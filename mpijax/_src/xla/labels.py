"""Names for XLA's collectives in mpijax's reports: which jitted program each is in.

The bridge sees XLA's collectives as MPI calls (an MPI_Allreduce of 1,024
floats), not as HLO instructions. When XLA's collectives run over MPI,
:func:`install` makes :func:`label` a reader of the compile hook: each program
compiled (or loaded) for devices of several processes has its collective
instructions (``xla_hlo``, parsed once) each handed to the extension with its kind, dtype, size and reduction
and a label from its metadata, e.g. ``jit(train_step)/psum``. Stall reports,
mismatch errors and the timeline then say "XLA all-reduce float32[1024]
(sum) in jit(train_step)/psum" (every candidate, when several programs hold
an operation of that shape).
"""

from __future__ import annotations

import logging

from mpijax._src import ffi as _ffi
from mpijax._src.xla import compile_hook
from mpijax._src.xla import program_check

# The program init() runs to have XLA create the communicators (xla_cliques).
WARM_UP = "mpijax_prepare_communicators"


def label(program: compile_hook.Program) -> None:
  """Hands the extension the collectives of a program over the devices of
  several processes (a compile hook reader; best effort)."""
  if not program.spans_processes:
    return
  try:
    ext = _ffi.load()
    for module in program.hlo:
      if WARM_UP in module.name:  # mpijax's own, not a program of the user's
        continue
      calls = module.calls()
      if calls:
        program_check.note(module.name, module.text, calls)
      for kind, dtype, n, op, label in calls:
        ext.xla_label(kind, dtype, n, op, label)
  except Exception as e:  # labels are names in messages, never a reason to fail
    logging.getLogger("mpijax").debug("naming XLA's collectives failed: %r", e)


def install() -> None:
  """Labels every program JAX compiles for the devices of several processes."""
  compile_hook.add_reader(label)
  program_check.arm()


GLOO_REDUCE_SCATTER = (
  "{program} has a reduce-scatter, and XLA's collectives run over gloo with "
  "{devices} devices per rank: jaxlib 0.10's gloo reduce-scatter between the "
  "devices of one process can return wrong values for chunks of a few MiB "
  "(https://github.com/jax-ml/jax/issues/40830). Unset MPIJAX_XLA_COLLECTIVES=gloo: "
  "over MPI (the default) it is right."
)


class _GlooGuard:
  """Warns, once (rank 0), at the first program with a reduce-scatter when
  XLA's collectives run over gloo with several devices per rank, where
  jaxlib's can be wrong; the warning never stops the job."""

  def __init__(self, local_devices: int) -> None:
    self.local_devices = local_devices
    self.warned = False

  def __call__(self, program: compile_hook.Program) -> None:
    if self.warned:
      return
    from mpijax._src import log

    try:
      for module in program.hlo:
        if any(c.kind == "reduce-scatter" for c in module.collectives):
          self.warned = True
          if log.rank_and_size()[0] == 0:  # every rank compiles the same programs
            log.warning(GLOO_REDUCE_SCATTER.format(program=module.name, devices=self.local_devices))
          return
    except Exception as e:  # a warning's source, never a reason to fail
      logging.getLogger("mpijax").debug("reading a program's collectives failed: %r", e)


_gloo_guard: _GlooGuard | None = None


def guard_gloo_reduce_scatter(local_devices: int) -> None:
  """Installs the gloo reduce-scatter warning (once)."""
  global _gloo_guard
  if _gloo_guard is None:
    _gloo_guard = _GlooGuard(local_devices)
    compile_hook.add_reader(_gloo_guard)
