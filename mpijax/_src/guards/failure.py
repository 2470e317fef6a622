"""Abort-on-failure: one rank's uncaught exception ends the whole job.

Without this, a rank that raises exits while the others wait forever in
their next collective. Like ``python -m mpi4py``, the hook prints the
rank, the exception and its message in one line, then the traceback (each
line prefixed with the rank, except under ``mpijax-run``, which prefixes
every line of a rank's output itself), and calls ``MPI.COMM_WORLD.Abort`` so that
the launcher stops every rank, non-zero, within seconds (for a mismatched
collective, which every rank raises, half a second after the report, so that
every rank's report is out first). The traceback is written to stderr
directly, not through the ``"mpijax"`` logger: the abort follows at once,
and a handler of the program's (or a logging lock held by the thread that
raised) must not stand between the report and the abort.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from types import TracebackType

from mpijax._src import log

# Errors that every rank raises at about the same time (a mismatched
# collective: the exchange shows every rank every signature). A rank that
# reports one waits ABORT_GRACE_S before its abort, so the others report it
# too instead of being killed mid-report. The texts are the messages' starts
# in ffi/csrc/core/call_check.cc and ffi/csrc/xla_collectives/operation.cc,
# member_collectives.cc.
RAISED_TOGETHER = ("mpijax: collective mismatch on", "mpijax: mismatch in XLA's collectives")
ABORT_GRACE_S = 0.5

_installed = False
_agreed_exit_codes: set[int] = set()
_previous_excepthook = None
_previous_threading_excepthook = None
# (text in an exception's message, what to tell the user): errors that come
# from deep inside JAX/XLA without a word about the fix.
_hints: list[tuple[str, str]] = []


def add_hint(match: str, hint: str) -> None:
  """Adds ``hint`` to the report of an uncaught exception whose message has ``match``."""
  if (match, hint) not in _hints:
    _hints.append((match, hint))


def report_and_abort(
  exc_type: type[BaseException],
  exc: BaseException,
  tb: TracebackType | None,
  *,
  exit_code: int = 1,
  where: str = "",
) -> None:
  """Prints ``exc`` prefixed with this rank, then aborts every rank.

  The first line names the rank, the exception and its message, so it leads
  whatever the launcher and the other ranks print after it; the traceback
  follows without the frames of mpijax's own wrapper (``python -m mpijax``).
  """
  label = log.rank_label()
  prefix = "" if log.tagged_by_launcher() else f"[{label}] "
  message = str(exc).strip().split("\n", 1)[0] if str(exc).strip() else ""
  _drop_jax_notes(exc)
  lines = "".join(traceback.format_exception(exc_type, exc, _user_frames(tb)))
  lines = lines.rstrip("\n").split("\n")
  lines += [f"mpijax: {hint}" for match, hint in _hints if match in str(exc)]
  head = (
    f"{prefix}mpijax: uncaught {exc_type.__name__}{where} on {label}, aborting the job "
    f"(exit code {exit_code})" + (f": {message}" if message else "")
  )
  try:
    sys.stdout.flush()
    sys.stderr.write(head + "\n" + "\n".join(prefix + line for line in lines) + "\n")
    sys.stderr.flush()
  except Exception:  # a broken stderr must not stop the abort
    pass
  mpi = sys.modules.get("mpi4py.MPI")
  if any(m in str(exc) for m in RAISED_TOGETHER) and mpi is not None and mpi.Is_initialized():
    time.sleep(ABORT_GRACE_S)
  abort(exit_code)


# The note JAX adds to an exception whose traceback it shortened; it says
# "the following exception", but the notes come after it.
_JAX_NOTE = "JAX has removed its internal frames from the traceback"


def _drop_jax_notes(exc: BaseException) -> None:
  """Removes JAX's note on shortened tracebacks from ``exc`` and the exceptions it chains."""
  seen: set[int] = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
      notes[:] = [n for n in notes if not (isinstance(n, str) and _JAX_NOTE in n)]
      if not notes:
        del exc.__notes__
    exc = exc.__cause__ or exc.__context__


def _wrapper_frame(tb: TracebackType) -> bool:
  name = tb.tb_frame.f_code.co_filename
  return (
    name == __file__ or name.startswith("<frozen runpy>") or os.path.basename(name) == "runpy.py"
  )


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
  """``tb`` from the first frame that is not :func:`run_main`'s or runpy's."""
  while tb is not None and tb.tb_next is not None and _wrapper_frame(tb):
    tb = tb.tb_next
  return tb


def abort(exit_code: int = 1) -> None:
  """Aborts the MPI job if MPI is up, else exits this process.

  A one-process world has nobody else to stop: it exits without
  ``MPI_Abort`` and its banner, removing its Open MPI segment files first.
  """
  mpi = sys.modules.get("mpi4py.MPI")
  if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
    if mpi.COMM_WORLD.Get_size() > 1:
      mpi.COMM_WORLD.Abort(exit_code)
    from mpijax._src import mpi_util

    mpi_util.remove_singleton_segments()
  os._exit(exit_code)


def agree_exit_code(code: int) -> None:
  """Lets ``sys.exit(code)`` end this rank normally under :func:`run_main`.

  For a status every rank reaches together (a collective decision, such as
  a preemption stop): the ranks finalize MPI and exit with it, instead of
  one rank's exit aborting the others.
  """
  _agreed_exit_codes.add(code)


def _excepthook(exc_type, exc, tb):
  if issubclass(exc_type, KeyboardInterrupt):
    _previous_excepthook(exc_type, exc, tb)
    abort(130)
  report_and_abort(exc_type, exc, tb)


def _threading_excepthook(args):
  if args.exc_type is SystemExit:
    return
  where = f" in thread {args.thread.name!r}" if args.thread is not None else ""
  report_and_abort(args.exc_type, args.exc_value, args.exc_traceback, where=where)


def install() -> None:
  """Installs the abort hooks for the main thread and for other threads."""
  global _installed, _previous_excepthook, _previous_threading_excepthook
  if _installed:
    return
  _previous_excepthook = sys.excepthook
  _previous_threading_excepthook = threading.excepthook
  sys.excepthook = _excepthook
  threading.excepthook = _threading_excepthook
  _installed = True


def uninstall() -> None:
  global _installed
  if not _installed:
    return
  sys.excepthook = _previous_excepthook
  threading.excepthook = _previous_threading_excepthook
  _installed = False


def run_main(argv: list[str]) -> None:
  """``python -m mpijax [-m module | -c code | script.py] args...``."""
  import runpy

  usage = "usage: python -m mpijax (script.py | -m module | -c code | --exec PROGRAM) [args ...]"
  if not argv or argv[0] in ("-h", "--help"):
    print(usage)
    sys.exit(0 if argv else 2)
  install()
  try:
    if argv[0] == "-m":
      if len(argv) < 2:
        sys.exit(usage)
      sys.argv = argv[1:]
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
      if len(argv) < 2:
        sys.exit(usage)
      sys.argv = ["-c"] + argv[2:]
      exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
      sys.argv = argv
      sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
      runpy.run_path(argv[0], run_name="__main__")
  except SystemExit as e:
    code = e.code
    if code is None or code == 0 or code in _agreed_exit_codes:
      raise
    if not isinstance(code, int):
      print(code, file=sys.stderr)
      code = 1
    # A non-zero exit of one rank would leave the others waiting: abort all.
    sys.stderr.flush()
    abort(code)
  except BaseException:
    report_and_abort(*sys.exc_info())
