"""mpijax's warnings and notices, through the standard ``logging`` module.

Everything goes to the ``"mpijax"`` logger, tagged with the rank that says it
(``mpijax[rank 2/4]: warning: ...``); under ``mpijax-run``, which starts each
line of a rank's output with the rank (``[rank2]: ``), without it
(``mpijax: warning: ...``). Warnings are logged on every rank that
has one; notices at level INFO on rank 0 and at DEBUG on the others, so at
the default level INFO one copy shows, and ``MPIJAX_LOG_LEVEL=DEBUG`` (or
``logging.getLogger("mpijax").setLevel(logging.DEBUG)``) shows every rank's.

As long as the program has configured no logging of its own (no handler on
the root logger or on ``"mpijax"``), mpijax's default handler prints the
records to stderr, so they show without any setup; once it has, they go to
the program's handlers only.

Examples:
  >>> import logging
  >>> logging.basicConfig(format="%(asctime)s %(message)s")  # mpijax's too  # doctest: +SKIP
  >>> logging.getLogger("mpijax").setLevel(logging.WARNING)  # no notices  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import sys

from mpijax._src import config

LOGGER = logging.getLogger("mpijax")

# Where the launchers put a process' rank and the job's size, for messages
# before MPI is initialized (or after it is finalized).
_RANK_VARS = (
  ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
  ("PMI_RANK", "PMI_SIZE"),
  ("PMIX_RANK", None),
  ("SLURM_PROCID", "SLURM_NTASKS"),
)


def rank_and_size() -> tuple[int | None, int | None]:
  """This process' rank and the job's size, as far as known (MPI, else the launcher)."""
  mpi = sys.modules.get("mpi4py.MPI")
  if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
    return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
  for rank_var, size_var in _RANK_VARS:
    rank = os.environ.get(rank_var, "").strip()
    if rank.isdigit():
      size = os.environ.get(size_var, "").strip() if size_var else ""
      return int(rank), int(size) if size.isdigit() else None
  return None, None


def rank_label() -> str:
  """``rank 2/4`` (``rank 2`` without a known size, ``rank ?`` outside a job)."""
  rank, size = rank_and_size()
  if rank is None:
    return "rank ?"
  return f"rank {rank}" if size is None else f"rank {rank}/{size}"


def tagged_by_launcher() -> bool:
  """Whether mpijax-run tags each line of this process's output with its rank."""
  try:
    return bool(config.get("run"))
  except ValueError:
    return False


def _tag() -> str:
  rank, _ = rank_and_size()
  return "mpijax" if rank is None or tagged_by_launcher() else f"mpijax[{rank_label()}]"


def warning(text: str) -> None:
  """Logs ``text`` as a warning of this rank, at level WARNING."""
  LOGGER.warning("%s: warning: %s", _tag(), text)


def notice(text: str) -> None:
  """Logs ``text`` as a notice: at INFO on rank 0 (and outside a job), at DEBUG elsewhere.

  For what every rank would say alike: the default level shows one copy.
  """
  rank, _ = rank_and_size()
  LOGGER.log(logging.INFO if not rank else logging.DEBUG, "%s: %s", _tag(), text)


_settings_checked = False


def warn_unknown_settings() -> None:
  """Warns, once per process, of each ``MPIJAX_*`` variable that is no setting,
  naming the closest one (mpijax-run did so before the launch: not again)."""
  global _settings_checked
  if _settings_checked:
    return
  _settings_checked = True
  if tagged_by_launcher():
    return
  for name, closest in config.unknown():
    warning(config.unknown_message(name, closest))


class _DefaultHandler(logging.Handler):
  """Prints mpijax's records to stderr while the program has configured no logging."""

  def __init__(self) -> None:
    super().__init__()
    self.setFormatter(logging.Formatter("%(message)s"))  # the message carries the tag

  def emit(self, record: logging.LogRecord) -> None:
    if logging.getLogger().handlers or any(h is not self for h in LOGGER.handlers):
      return  # the program's own handlers get the record
    try:
      stream = sys.stderr  # looked up now: it may have been replaced since
      stream.write(self.format(record) + "\n")
      stream.flush()
    except Exception:  # logging must not raise
      self.handleError(record)


def install() -> None:
  """Gives the ``"mpijax"`` logger its default stderr handler and its level (once).

  The level is ``MPIJAX_LOG_LEVEL`` when set, else INFO unless the program
  already set one.
  """
  level = config.get("log_level")
  if level:
    LOGGER.setLevel(level)
  elif LOGGER.level == logging.NOTSET:
    LOGGER.setLevel(logging.INFO)
  if not any(isinstance(h, _DefaultHandler) for h in LOGGER.handlers):
    LOGGER.addHandler(_DefaultHandler())
