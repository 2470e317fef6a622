"""Which rank arrived last at each collective, and whether one is a straggler (pure functions).

Every rank stamps when it entered each collective (``csrc/arrivals.h``);
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
import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

FLOOR_NS = 500_000  # a collective waited for its last rank when it came this much later
MIN_HELD = 10  # held-up collectives a window needs before a rank is named
COUNT_SHARE = 0.5  # of them, the share the named rank held up
WAIT_SHARE = 0.75  # of their lateness, the share that was the named rank's
TIME_SHARE = 0.05  # of the window's time, the share spent waiting for it

# The columns of a row from the extension's arrivals_drain().
COLUMNS = ("key", "leader", "device", "per_device", "comm_size", "seq", "ns")


@dataclasses.dataclass(frozen=True)
class Arrival:
  """One rank's (or one of its devices') entry into one collective, on rank 0's clock."""

  rank: int
  device: int
  group: tuple[int, int, int, int]  # the collective: (key, leader, device or -1, seq)
  comm_size: int  # the members the collective has
  ns: int


def arrivals(rank: int, rows: Sequence[Sequence[int]], offset_ns: int = 0) -> list[Arrival]:
  """The extension's rows of ``rank`` (``COLUMNS``), their times moved by ``offset_ns``."""
  out = []
  for key, leader, device, per_device, comm_size, seq, ns in rows:
    group = (int(key), int(leader), int(device) if per_device else -1, int(seq))
    out.append(Arrival(rank, int(device), group, int(comm_size), int(ns) + offset_ns))
  return out


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


def step_calls(members: Mapping[tuple[int, int], int]) -> dict[int, int]:
  """``{rank: when it called the step}`` of one training step's ``{(rank, 0): ns}``."""
  return {rank: ns for (rank, _), ns in members.items()}


class Pairing:
  """Holds what the ranks report of each collective (or training step) until all of it came.

  Reports come from the ranks at different times; an item is complete when
  as many (rank, device) members as its size reported, and ``make`` turns
  it into the result (None: nothing). One that stays incomplete for
  ``max_age`` rounds (a member's stamps were overwritten before a drain, or
  the rank never sent them) is dropped, and so is the oldest part once more
  than ``max_pending`` items wait.
  """

  def __init__(
    self,
    make: Callable[[dict[tuple[int, int], int]], Any] = collective,
    *,
    max_age: int = 3,
    max_pending: int = 200_000,
  ) -> None:
    self.make = make
    self.max_age = max_age
    self.max_pending = max_pending
    self._members: dict[Hashable, dict[tuple[int, int], int]] = {}
    self._size: dict[Hashable, int] = {}
    self._born: dict[Hashable, int] = {}
    self._round = 0

  def __len__(self) -> int:
    return len(self._members)

  def add(self, items: Iterable[Arrival]) -> None:
    for a in items:
      self.add_one(a.group, (a.rank, a.device), a.comm_size, a.ns)

  def add_one(self, group: Hashable, member: tuple[int, int], size: int, ns: int) -> None:
    members = self._members.get(group)
    if members is None:
      members = self._members[group] = {}
      self._size[group] = size
      self._born[group] = self._round
    members[member] = ns

  def complete(self) -> list[Any]:
    """Takes out the complete items (oldest first) as ``make`` builds them, and ages the rest."""
    done = [g for g, m in self._members.items() if len(m) >= self._size[g]]
    out = []
    for g in sorted(done, key=lambda g: min(self._members[g].values())):
      c = self.make(self._members.pop(g))
      del self._size[g], self._born[g]
      if c is not None:
        out.append(c)
    self._round += 1
    old = [g for g, born in self._born.items() if self._round - born >= self.max_age]
    if len(self._members) - len(old) > self.max_pending:
      keep = sorted((g for g in self._born if g not in set(old)), key=self._born.__getitem__)
      old += keep[: len(keep) - self.max_pending]
    for g in old:
      del self._members[g], self._size[g], self._born[g]
    return out


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

  def add_step(self, calls: Mapping[int, int]) -> None:
    """One training step: when each rank called it (one clock)."""
    if len(calls) < 2:
      return
    times = sorted(calls.values())
    for rank, ns in calls.items():
      others = list(times)
      others.remove(ns)
      self.call_late_ns[rank] += ns - statistics.median(others)
      self.steps[rank] += 1

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
