"""What every rank runs: a Python program under ``python -m mpijax``, any other
program after ``python -m mpijax --exec`` (which sets the rank's variables)."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

from mpijax._src.run.common import Options

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)?)?$")

# CPython options that consume the next argument (``python -W error x.py``).
_PY_OPTS_WITH_ARG = frozenset({"-W", "-X", "--check-hash-based-pycs"})

# The abort-on-exception wrapper (``python -m mpijax``), and the modules that
# already are one.
WRAPPER = "mpijax"

_WRAPPERS = frozenset({"mpijax", "mpi4py", "mpi4py.run"})


def is_python(program: str) -> bool:
  """``python``, ``python3``, ``python3.11`` (any directory) or this interpreter."""
  if os.path.basename(program) and _PYTHON_RE.match(os.path.basename(program)):
    return True
  try:
    return os.path.realpath(program) == os.path.realpath(sys.executable)
  except OSError:
    return False


def wrap_program(argv: Sequence[str]) -> list[str]:
  """Runs a Python program under ``python -m mpijax``; other programs unchanged.

  ``python [opts] X args`` -> ``python [opts] -m mpijax X args``,
  ``python [opts] -m mod args`` -> ``python [opts] -m mpijax -m mod args``,
  ``python [opts] -c code args`` -> ``python [opts] -m mpijax -c code args``.
  Already-wrapped programs (``-m mpijax``, ``-m mpi4py``) and an interactive
  ``python`` are left alone.
  """
  argv = list(argv)
  if not argv or not is_python(argv[0]):
    return argv
  i = 1
  while i < len(argv):
    a = argv[i]
    if a in ("-m", "-c"):
      if i + 1 >= len(argv):
        return argv
      if a == "-m" and argv[i + 1] in _WRAPPERS:
        return argv
      return argv[:i] + ["-m", WRAPPER] + argv[i:]
    if a.startswith("-m") or a.startswith("-c"):  # -mpkg / -cCODE
      if a.startswith("-m") and a[2:] in _WRAPPERS:
        return argv
      return argv[:i] + ["-m", WRAPPER, a[:2], a[2:]] + argv[i + 1 :]
    if a == "-":
      return argv[:i] + ["-m", WRAPPER] + argv[i:]
    if a == "--":
      i += 1
      break
    if a.startswith("-"):
      i += 2 if a in _PY_OPTS_WITH_ARG else 1
      continue
    break
  if i >= len(argv):
    return argv  # interactive interpreter: nothing to wrap
  return argv[:i] + ["-m", WRAPPER] + argv[i:]


def rank_program(opts: Options) -> list[str]:
  """What every rank runs: the (wrapped) program, after the rank wrapper.

  A Python program runs under ``python -m mpijax``, which also sets the
  rank's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``;
  any other program gets them from ``python -m mpijax --exec`` first.
  ``--no-wrap`` runs the program exactly as given.
  """
  if not opts.wrap:
    return opts.rank_wrapper + list(opts.program)
  program = wrap_program(opts.program)
  if program != list(opts.program) or _runs_the_wrapper(program):
    return opts.rank_wrapper + program
  return [sys.executable, "-m", WRAPPER, "--exec"] + opts.rank_wrapper + program


def _runs_the_wrapper(argv: Sequence[str]) -> bool:
  """``python ... -m mpijax``: it sets the variables itself."""
  return (
    bool(argv)
    and is_python(argv[0])
    and any(a == WRAPPER and i > 0 and argv[i - 1] == "-m" for i, a in enumerate(argv))
  )
