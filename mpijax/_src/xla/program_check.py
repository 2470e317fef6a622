"""Whether every rank runs the same programs for the devices of several processes.

JAX needs every process to run the same computations on global arrays. A rank
whose rows have another shape (a global batch built without ``global_shape``)
compiles the same function for other shapes; where none of its collectives
changes size, the collectives alone look alike on every rank and the ranks
compute different results. So each program with collectives across
processes that a rank compiles goes to the bridge with its name and the
shapes of its arguments (:func:`note`): the first of its operations on each
of XLA's communicators carries the program's fingerprint in the check the
ranks make on every call, and ranks that run different programs stop there,
before any data moves, with an error on every rank that names the ranks and
each one's program (``ffi/csrc/xla_collectives/operation.h``). The calls
after the first cost nothing more.

That needs a rank to compile a program only once the last one it ran has
finished, as with XLA's programs run inline (``MPIJAX_XLA_DISPATCH=inline``,
the default). With ``async`` dispatch the ranks instead compare the sets of
programs they compiled when the job ends (``mpijax.shutdown()`` or exit),
through JAX's key-value store, and every rank warns of a program that not
every rank compiled.
"""

from __future__ import annotations

import atexit
import json
import re
import threading

from mpijax._src import config
from mpijax._src import log

_PREFIX = "mpijax/compiled_programs"
# How long a rank that ends waits for the others' sets: a rank that ends much
# later (or not at all) is not compared.
_WAIT_MS = 30_000
_SHOWN = 4  # programs named in the warning

_lock = threading.Lock()
_programs: set[str] = set()
_at_exit = False
_compared = False


def layout(hlo_header: str) -> str:
  """The entry layout of an HLO module's first line, without the dimension
  orders: ``(f32[4,3])->f32[3]``."""
  key = "entry_computation_layout={"
  i = hlo_header.find(key)
  if i < 0:
    return ""
  i += len(key)
  depth, j = 1, i
  while j < len(hlo_header) and depth:
    depth += {"{": 1, "}": -1}.get(hlo_header[j], 0)
    j += 1
  return re.sub(r"\{[\d,]*\}", "", hlo_header[i : j - 1])


def describe(module_name: str, hlo_text: str) -> str:
  """A program as the ranks compare it: ``jit_f (f32[2,4])->f32[4]``."""
  return f"{module_name} {layout(hlo_text.split(chr(10), 1)[0])}"


def at_first_collective() -> bool:
  """Whether the ranks' programs are compared at each one's first collective
  (inline dispatch), rather than when the job ends."""
  return config.get("xla_dispatch") == "inline"


def arm() -> None:
  """Where the programs are compared when the job ends: at exit (every rank,
  so that a rank that compiled none still answers the others)."""
  global _at_exit
  with _lock:
    if not _at_exit and not at_first_collective():
      atexit.register(compare)
      _at_exit = True


def note(module_name: str, hlo_text: str, collectives: list[tuple]) -> None:
  """Notes a program with collectives across processes, compiled by this rank;
  ``collectives``: its (kind, dtype, elements, op, label), as ``xla_hlo`` reads them."""
  program = describe(module_name, hlo_text)
  if at_first_collective():
    from mpijax._src import ffi as _ffi

    _ffi.load().xla_program(program, [tuple(c[:4]) for c in collectives])
    return
  with _lock:
    _programs.add(program)


def differences(sets: dict[int, set[str]]) -> list[str]:
  """One line per program that not every rank compiled: which did, which did not."""
  ranks = sorted(sets)
  lines = []
  for program in sorted(set().union(*sets.values())):
    have = [r for r in ranks if program in sets[r]]
    if len(have) == len(ranks):
      continue
    lack = [r for r in ranks if r not in have]
    lines.append(f"{program}: compiled by {_ranks(have)}, not by {_ranks(lack)}")
  return lines


def _ranks(ranks: list[int]) -> str:
  return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def message(lines: list[str]) -> str:
  more = len(lines) - _SHOWN
  shown = "; ".join(lines[:_SHOWN]) + (f"; and {more} more" if more > 0 else "")
  return (
    "the ranks compiled different programs for the devices of several processes, "
    f"so they did not all run the same computations: {shown}. JAX needs every "
    "process to run the same computations on global arrays: ranks that ran "
    "different ones may hold different results without any error (e.g. a global "
    "batch built from rows of another shape on some ranks: pass global_shape to "
    "jax.make_array_from_process_local_data). A program compiled ahead of time on "
    "some ranks only is listed too."
  )


def compare() -> None:
  """Compares this rank's programs with every other rank's (once; collective
  through JAX's key-value store, each wait bounded); warns of differences."""
  global _compared
  with _lock:
    if _compared or not _at_exit:
      return
    _compared = True
    mine = sorted(_programs)
  try:
    from mpijax._src import jax_compat  # imports jax: not before it is needed

    state = jax_compat.distributed.global_state
    client, me, n = state.client, state.process_id, state.num_processes
    if client is None or not n or n < 2:
      return
    client.key_value_set(f"{_PREFIX}/{me}", json.dumps(mine))
    sets = {me: set(mine)}
    for r in range(n):
      if r != me:
        sets[r] = set(json.loads(client.blocking_key_value_get(f"{_PREFIX}/{r}", _WAIT_MS)))
  except Exception as e:  # a rank that ended long before or after: not compared
    log.LOGGER.debug("comparing the ranks' compiled programs failed: %r", e)
    return
  lines = differences(sets)
  if lines:
    log.warning(message(lines))
