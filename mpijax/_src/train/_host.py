"""Which communicator, rank and rank count the training layer talks to."""

from __future__ import annotations

from typing import Any

from mpijax._src import runtime


def get_comm(comm: Any | None, what: str) -> Any:
  """``comm`` if given, else mpijax's private communicator (needs ``mpijax.init()``)."""
  if comm is not None:
    return comm
  return runtime.get(what).comm


def rank_and_size(comm: Any | None = None) -> tuple[int, int]:
  """This process' rank and the rank count, without requiring ``mpijax.init()``.

  Logging and progress bars must work in a plain single-process script too, so
  this falls back to (0, 1) when neither a communicator nor the runtime exists.
  """
  if comm is not None:
    return comm.Get_rank(), comm.Get_size()
  if runtime.is_initialized():
    rt = runtime.get()
    return rt.rank, rt.size
  return 0, 1


def idle_barrier(comm: Any, poll_seconds: float = 0.002) -> None:
  """A barrier that sleeps while it waits instead of spinning.

  Blocking MPI calls busy-poll. When ranks share cores (oversubscribed CPU
  runs), a rank that finished compiling and spins in the first all-reduce
  steals the CPU that a slower rank needs to finish compiling.
  """
  import time
  if comm.Get_size() == 1:
    return
  req = comm.Ibarrier()
  while not req.Test():
    time.sleep(poll_seconds)


def _rank_ranges(ranks: list[int]) -> str:
  """[0, 1, 2, 5] -> '0-2, 5'."""
  parts, start = [], 0
  for i in range(1, len(ranks) + 1):
    if i == len(ranks) or ranks[i] != ranks[i - 1] + 1:
      a, b = ranks[start], ranks[i - 1]
      parts.append(str(a) if a == b else f"{a}-{b}")
      start = i
  return ", ".join(parts)


def rank_lines(bad: list[tuple[int, str]], limit: int = 8) -> str:
  """Indented '  rank r: problem' lines, one per distinct problem.

  Ranks that report the same problem share a line ('  ranks 0-3: no
  checkpoint at ...'): a mistake made everywhere reads once, not once per rank.
  """
  by_text: dict[str, list[int]] = {}
  for r, text in bad:
    by_text.setdefault(text, []).append(r)
  lines = [f"  rank{'s' if len(rs) > 1 else ''} {_rank_ranges(rs)}: {text}"
           for text, rs in list(by_text.items())[:limit]]
  if len(by_text) > limit:
    lines.append(f"  ... and {len(by_text) - limit} more different problems")
  return "\n".join(lines)
