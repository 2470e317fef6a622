"""Which rank arrived last at each collective, and whether one is a straggler (pure functions).

Every rank stamps when it entered each collective (``csrc/core/arrivals.h``);
the k-th collective on a communicator and device is one collective across
its ranks. With the stamps on one clock (rank 0's: ``straggler_watch``
aligns them), the rank that entered last is the one the others waited for,
and it was late by its arrival minus the latest arrival of any other rank:
the time the others waited for it alone.

A rank is named a straggler of a window (a report period, or the whole job)
when all of these hold (``docs/troubleshooting.md`` states the same):

- at least ``MIN_HELD`` (10) of the window's collectives waited at least
  ``FLOOR_NS`` (0.5 ms) for their last rank ("held up");
- this rank was the last one in at least ``COUNT_SHARE`` (half) of those;
- its lateness is at least ``WAIT_SHARE`` (75 %) of the lateness of all of
  them: of the time the job waited for a late rank, three quarters went to
  this one;
- waiting for it took at least ``TIME_SHARE`` (5 %) of the window: its
  lateness summed, over the time from the window's first arrival to its
  last.

With equal ranks the last arrival moves from rank to rank, so no rank is
last in half of the held-up collectives (of more than two ranks) or holds
three quarters of the waiting; a rank behind the others by microseconds
holds up none (the floor); a single stall of one rank may hold three
quarters of the waiting but comes once, not in half of the collectives.
A rank that does more work than the others is last in most collectives,
and when another rank is last instead (its core taken by another process
for a moment), that one is late by little: the waiting stays this rank's.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

FLOOR_NS = 500_000  # a collective waited for its last rank when it came this much later
MIN_HELD = 10  # held-up collectives a window needs before a rank is named
COUNT_SHARE = 0.5  # of them, the share the named rank held up
WAIT_SHARE = 0.75  # of their lateness, the share that was the named rank's
TIME_SHARE = 0.05  # of the window's time, the share spent waiting for it

# The columns of a row from the extension's arrivals_drain().
COLUMNS = ("key", "leader", "device", "per_device", "comm_size", "seq", "ns")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective with every member's arrival known."""

  last: int  # the rank that arrived last
  late_ns: int  # its arrival minus the latest arrival of any other rank
  ranks: tuple[int, ...]  # the ranks that took part
  first_ns: int  # the earliest arrival
  end_ns: int  # the latest arrival


def collective(members: Mapping[tuple[int, int], int]) -> Collective | None:
  """The collective of ``{(rank, device): arrival}``; None when one rank made it all.

  A rank with several members arrives with its last one.
  """
  by_rank: dict[int, int] = {}
  for (rank, _), ns in members.items():
    by_rank[rank] = max(ns, by_rank.get(rank, ns))
  if len(by_rank) < 2:
    return None
  # The highest rank on a tie: any choice would do, this one is reproducible.
  order = sorted(by_rank.items(), key=lambda item: (item[1], item[0]))
  (last, t_last), (_, t_before) = order[-1], order[-2]
  return Collective(last, t_last - t_before, tuple(sorted(by_rank)), order[0][1], t_last)


@dataclasses.dataclass(frozen=True)
class Batch:
  """Collectives that came complete, as arrays (one entry per collective)."""

  last: np.ndarray  # the rank that arrived last
  late_ns: np.ndarray  # how much after the latest of the other ranks
  first_ns: np.ndarray  # the earliest arrival
  end_ns: np.ndarray  # the latest arrival
  ranks: np.ndarray  # the ranks that took part, collective after collective
  counts: np.ndarray  # how many of ``ranks`` each collective has

  def __len__(self) -> int:
    return len(self.last)

  def collectives(self) -> list[Collective]:
    ranks = np.split(self.ranks, np.cumsum(self.counts)[:-1]) if len(self) else []
    return [
      Collective(int(a), int(b), tuple(sorted(int(r) for r in rs)), int(c), int(d))
      for a, b, c, d, rs in zip(self.last, self.late_ns, self.first_ns, self.end_ns, ranks)
    ]


def _starts(*cols: np.ndarray) -> np.ndarray:
  """True where a row of the sorted columns begins a new run of equal values."""
  new = np.zeros(len(cols[0]), bool)
  if len(new):
    new[0] = True
  for c in cols:
    new[1:] |= c[1:] != c[:-1]
  return new


# The columns of Pairing's table.
_KEY, _LEADER, _GROUP, _SEQ, _SIZE, _RANK, _DEVICE, _NS, _BORN = range(9)


class Pairing:
  """Holds the ranks' arrival stamps until each collective has all of its members.

  The stamps come from the ranks at different times (arrays, as the
  extension drains them). The k-th collective of a communicator is (its
  key, its leader, the device where each device's calls are collectives of
  their own, k); it is complete when as many (rank, device) members as its
  size reported. A stamp that stays unpaired for ``max_age`` rounds (a
  member's stamps were overwritten before a drain, or its rank never sent
  them) is dropped, and so are the oldest once more than ``max_pending``
  wait. Array operations throughout: rank 0 pairs every rank's stamps
  without holding Python's lock for long.
  """

  def __init__(self, *, max_age: int = 3, max_pending: int = 1_000_000) -> None:
    self.max_age = max_age
    self.max_pending = max_pending
    self._table = np.empty((0, 9), np.int64)
    self._new: list[np.ndarray] = []
    self._round = 0

  def __len__(self) -> int:
    """The stamps waiting for the rest of their collective."""
    return len(self._table) + sum(len(t) for t in self._new)

  def add(self, rank: int, rows: Any, offset_ns: int = 0) -> None:
    """Adds ``rank``'s rows (``COLUMNS``), their times moved by ``offset_ns`` (to rank 0's clock)."""
    rows = np.asarray(rows, np.int64).reshape(-1, len(COLUMNS))
    t = np.empty((len(rows), 9), np.int64)
    t[:, _KEY], t[:, _LEADER] = rows[:, 0], rows[:, 1]
    t[:, _GROUP] = np.where(rows[:, 3] != 0, rows[:, 2], -1)
    t[:, _SEQ], t[:, _SIZE] = rows[:, 5], rows[:, 4]
    t[:, _RANK], t[:, _DEVICE], t[:, _NS] = rank, rows[:, 2], rows[:, 6] + offset_ns
    t[:, _BORN] = self._round
    self._new.append(t)

  def complete(self) -> Batch:
    """Takes out the collectives whose members have all come, and ages the rest."""
    t = np.concatenate([self._table, *self._new])
    self._new = []
    self._round += 1
    t = t[
      np.lexsort((t[:, _DEVICE], t[:, _RANK], t[:, _SEQ], t[:, _GROUP], t[:, _LEADER], t[:, _KEY]))
    ]
    collective_cols = (t[:, _KEY], t[:, _LEADER], t[:, _GROUP], t[:, _SEQ])
    t = t[_starts(*collective_cols, t[:, _RANK], t[:, _DEVICE])]  # a member once
    new = _starts(t[:, _KEY], t[:, _LEADER], t[:, _GROUP], t[:, _SEQ])
    which = np.cumsum(new) - 1
    begin = np.flatnonzero(new)
    members = np.diff(np.append(begin, len(t)))
    done = (members >= t[begin, _SIZE])[which]
    rest = t[~done]
    rest = rest[self._round - rest[:, _BORN] < self.max_age]
    if len(rest) > self.max_pending:
      rest = rest[np.argsort(rest[:, _BORN], kind="stable")[len(rest) - self.max_pending :]]
    self._table = rest
    t, which = t[done], which[done]
    # A rank arrives with its last member.
    first_of_rank = _starts(which, t[:, _RANK])
    at = np.flatnonzero(first_of_rank)
    rank_ns = np.maximum.reduceat(t[:, _NS], at) if len(at) else t[:0, _NS]
    rank, group = t[at, _RANK], which[at]
    order = np.lexsort((rank, rank_ns, group))
    rank, rank_ns, group = rank[order], rank_ns[order], group[order]
    begin = np.flatnonzero(_starts(group))
    counts = np.diff(np.append(begin, len(group)))
    several = counts >= 2  # one rank's devices alone compare nothing
    took = rank[np.repeat(several, counts)]
    begin, counts = begin[several], counts[several]
    end = begin + counts - 1
    return Batch(
      rank[end], rank_ns[end] - rank_ns[end - 1], rank_ns[begin], rank_ns[end], took, counts
    )


class StepPairing:
  """Holds the ranks' training-step call times until every rank's of a step came."""

  def __init__(self, ranks: int, *, max_age: int = 3) -> None:
    self.ranks = ranks
    self.max_age = max_age
    self._table = np.empty((0, 4), np.int64)  # step, rank, ns, born
    self._new: list[np.ndarray] = []
    self._round = 0

  def add(self, rank: int, steps: Any, offset_ns: int = 0) -> None:
    """Adds ``rank``'s (step number, call ns) rows, their times moved by ``offset_ns``."""
    steps = np.asarray(steps, np.int64).reshape(-1, 2)
    t = np.empty((len(steps), 4), np.int64)
    t[:, 0], t[:, 1], t[:, 2], t[:, 3] = steps[:, 0], rank, steps[:, 1] + offset_ns, self._round
    self._new.append(t)

  def complete(self) -> tuple[np.ndarray, np.ndarray]:
    """(ranks, call ns) of the complete steps: two arrays of shape (steps, ranks)."""
    t = np.concatenate([self._table, *self._new])
    self._new = []
    self._round += 1
    t = t[np.lexsort((t[:, 1], t[:, 0]))]
    t = t[_starts(t[:, 0], t[:, 1])]
    new = _starts(t[:, 0])
    which = np.cumsum(new) - 1
    members = np.diff(np.append(np.flatnonzero(new), len(t)))
    done = (members >= self.ranks)[which]
    rest = t[~done]
    self._table = rest[self._round - rest[:, 3] < self.max_age]
    t = t[done].reshape(-1, self.ranks, 4)
    return t[:, :, 1], t[:, :, 2]


@dataclasses.dataclass
class Tally:
  """A window's collectives, per rank, and the training steps' input time."""

  collectives: int = 0
  took_part: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  last: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  held: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  held_ns: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_ns: int | None = None
  end_ns: int | None = None
  # mpijax.train's steps: per rank, how much later than the median of the
  # other ranks it called them, summed, and over how many steps.
  call_late_ns: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)

  def add(self, c: Collective) -> None:
    self.collectives += 1
    self.took_part.update(c.ranks)
    self.last[c.last] += 1
    if c.late_ns >= FLOOR_NS:
      self.held[c.last] += 1
      self.held_ns[c.last] += c.late_ns
    self.first_ns = c.first_ns if self.first_ns is None else min(self.first_ns, c.first_ns)
    self.end_ns = c.end_ns if self.end_ns is None else max(self.end_ns, c.end_ns)

  def add_batch(self, b: Batch) -> None:
    if not len(b):
      return
    self.collectives += len(b)
    _count(self.took_part, b.ranks)
    _count(self.last, b.last)
    held = b.late_ns >= FLOOR_NS
    _count(self.held, b.last[held])
    _count(self.held_ns, b.last[held], b.late_ns[held])
    first, end = int(b.first_ns.min()), int(b.end_ns.max())
    self.first_ns = first if self.first_ns is None else min(self.first_ns, first)
    self.end_ns = end if self.end_ns is None else max(self.end_ns, end)

  def add_steps(self, ranks: np.ndarray, calls: np.ndarray) -> None:
    """Training steps: ``calls[s, i]`` is when rank ``ranks[s, i]`` called step s (one clock).

    Each rank's call is compared with the median of the other ranks' calls.
    """
    steps, n = calls.shape if calls.ndim == 2 else (0, 0)
    if not steps or n < 2:
      return
    order = np.argsort(calls, axis=1, kind="stable")
    v = np.take_along_axis(calls, order, axis=1).astype(np.float64)
    who = np.take_along_axis(ranks, order, axis=1)
    # The median of a sorted row without its i-th element: index k of the
    # other n - 1 is element k + (k >= i) of the row.
    i = np.arange(n)
    m = n - 1
    if m % 2:
      median = v[:, m // 2 + (m // 2 >= i)]
    else:
      lo, hi = m // 2 - 1, m // 2
      median = (v[:, lo + (lo >= i)] + v[:, hi + (hi >= i)]) / 2
    _count(self.call_late_ns, who.ravel(), (v - median).ravel())
    _count(self.steps, who.ravel())

  def add_step(self, calls: Mapping[int, int]) -> None:
    """One training step: when each rank called it (one clock)."""
    self.add_steps(np.array([list(calls)], np.int64), np.array([list(calls.values())], np.int64))

  def merge(self, other: Tally) -> None:
    self.collectives += other.collectives
    for mine, theirs in (
      (self.took_part, other.took_part),
      (self.last, other.last),
      (self.held, other.held),
      (self.held_ns, other.held_ns),
      (self.call_late_ns, other.call_late_ns),
      (self.steps, other.steps),
    ):
      mine.update(theirs)
    if other.first_ns is not None:
      self.first_ns = (
        other.first_ns if self.first_ns is None else min(self.first_ns, other.first_ns)
      )
    if other.end_ns is not None:
      self.end_ns = other.end_ns if self.end_ns is None else max(self.end_ns, other.end_ns)

  @property
  def span_ns(self) -> int:
    if self.first_ns is None or self.end_ns is None:
      return 0
    return self.end_ns - self.first_ns


def _count(
  counter: collections.Counter, keys: np.ndarray, weights: np.ndarray | None = None
) -> None:
  """Adds one (or ``weights``) per key to ``counter``."""
  if not len(keys):
    return
  uniq, inverse = np.unique(keys, return_inverse=True)
  sums = np.bincount(inverse, weights=weights) if weights is not None else np.bincount(inverse)
  for k, v in zip(uniq.tolist(), sums.tolist()):
    counter[k] += round(v) if weights is not None else v


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a window says: the straggler, if any, and the figures of its report line."""

  rank: int | None  # the straggler, or None
  collectives: int  # compared
  ranks: int  # that took part
  held: int  # held up >= FLOOR_NS for their last rank
  most: int | None  # the rank whose lateness summed is the largest (the straggler, if any)
  most_held: int  # the collectives it held up
  late_ns: float  # its mean lateness in those
  wait_share: float  # its summed lateness over that of every held-up collective
  time_share: float  # its summed lateness over the window's time
  input_ns: float | None  # of late_ns: the part from mpijax.train's input, when known
  compute_ns: float | None


def _input_split(tally: Tally, rank: int, late_ns: float) -> tuple[float | None, float | None]:
  """(input, compute) of ``late_ns`` where the loop ran in mpijax.train.

  Input: how much later than the other ranks (their median) the rank called
  its training steps, on average, at most ``late_ns``: its loop was still
  getting the batch. The rest of its lateness came after the call: compute.
  """
  steps = tally.steps[rank]
  if not steps:
    return None, None
  part = min(max(tally.call_late_ns[rank] / steps, 0.0), late_ns)
  return part, late_ns - part


def verdict(tally: Tally) -> Verdict:
  """The window's straggler under the thresholds above, with its figures."""
  held = sum(tally.held.values())
  waited = sum(tally.held_ns.values())
  most, most_held, late, wait_share, time_share = None, 0, 0.0, 0.0, 0.0
  if tally.held:
    most = max(tally.held, key=lambda r: (tally.held_ns[r], tally.held[r], r))
    most_held = tally.held[most]
    late = tally.held_ns[most] / most_held
    wait_share = tally.held_ns[most] / waited if waited else 0.0
    span = tally.span_ns
    time_share = tally.held_ns[most] / span if span > 0 else 0.0
  named = (
    most is not None
    and held >= MIN_HELD
    and most_held >= COUNT_SHARE * held
    and wait_share >= WAIT_SHARE
    and time_share >= TIME_SHARE
  )
  input_ns, compute_ns = _input_split(tally, most, late) if named else (None, None)
  return Verdict(
    most if named else None,
    tally.collectives,
    len(tally.took_part),
    held,
    most,
    most_held,
    late,
    wait_share,
    time_share,
    input_ns,
    compute_ns,
  )


def _ms(ns: float) -> str:
  ms = ns / 1e6
  return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def _duration(ns: int) -> str:
  s = ns / 1e9
  return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def line(v: Verdict, hostnames: Sequence[str], *, window: str) -> str:
  """The report line of a verdict; ``window`` says over what ("in the last 60 s", "over the job")."""
  floor = _ms(FLOOR_NS)
  if v.rank is None:
    text = (
      f"stragglers {window}: none; {v.collectives} collectives compared across "
      f"{v.ranks} ranks, {v.held} waited >= {floor} for one rank"
    )
    if v.most is not None:
      text += (
        f"; the latest, rank {v.most}: last in {v.most_held} of them, "
        f"{100 * v.wait_share:.0f} % of the waiting, {100 * v.time_share:.0f} % of the time"
      )
    return text
  host = hostnames[v.rank] if 0 <= v.rank < len(hostnames) else "?"
  text = (
    f"straggler {window}: rank {v.rank} (host {host}) arrived last in "
    f"{100 * v.most_held / v.held:.0f} % of the {v.held} collectives that waited >= "
    f"{floor} for one rank, {_ms(v.late_ns)} late on average"
  )
  if v.input_ns is not None and v.compute_ns is not None:
    text += f" (input {_ms(v.input_ns)}, compute {_ms(v.compute_ns)})"
  return text + (
    f"; waiting for it took {100 * v.time_share:.0f} % of the time, "
    f"{100 * v.wait_share:.0f} % of all waiting for a late rank"
  )
