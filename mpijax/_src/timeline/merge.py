"""Merging the ranks' timeline events into one Chrome trace (pure functions).

Each rank records, per mpijax call, when it entered and left the handler and
the call's number on its (communicator, local device). Every rank of a
communicator makes the same collective calls in the same order, so the k-th
call on (communicator, device) is one collective across ranks: once the
clocks are aligned, the last rank to enter it is known. A rank that entered
earlier spent ``last arrival - its arrival`` waiting for the others and the
rest moving and reducing data. Exits before the last arrival (a root-less
rank of a rooted op, whose send completed eagerly) count as all wait.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from mpijax._src.timeline import straggler

# The C++ path bits (csrc/core/timeline.h) and their names.
PATHS = ((1, "mpi"), (2, "ring"), (4, "shared memory"), (8, "cross-memory attach"))

STEPS_TID = 0  # the Python row of each rank (steps and user spans); devices are 1 + index


def path_name(bits: int) -> str:
  """'ring', 'shared memory', 'cma+mpi'-style names of a call's path bits."""
  names = [n for b, n in PATHS if bits & b]
  return "+".join(names) if names else "none"


@dataclasses.dataclass
class Call:
  """One handler call on one rank (times in ns on the rank's own clock)."""

  rank: int
  name: str
  dtype: str
  shape: tuple[int, ...] | None
  nbytes: int
  path: int
  site: int
  key: int
  device: int
  comm_size: int
  seq: int
  enter: int
  exit: int

  @classmethod
  def from_tuple(cls, rank: int, t: Sequence[Any]) -> Call:
    name, dtype, shape, nbytes, path, site, key, device, comm_size, seq, enter, exit_ = t
    return cls(
      rank,
      name,
      dtype,
      None if shape is None else tuple(shape),
      int(nbytes),
      int(path),
      int(site),
      int(key),
      int(device),
      int(comm_size),
      int(seq),
      int(enter),
      int(exit_),
    )


@dataclasses.dataclass
class ClockSync:
  """Offsets to add to a rank's clock to get rank 0's, measured at two times."""

  t1: int  # the rank's clock at the first measurement
  offset1: int
  t2: int | None = None  # the second measurement, if it happened
  offset2: int | None = None

  def to_reference(self, t: int) -> int:
    """``t`` (the rank's clock) on rank 0's clock: the offset interpolated linearly (drift)."""
    if self.t2 is None or self.offset2 is None or self.t2 == self.t1:
      return t + self.offset1
    frac = (t - self.t1) / (self.t2 - self.t1)
    return t + round(self.offset1 + (self.offset2 - self.offset1) * frac)


def offset_from_pingpong(samples: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
  """(offset, round trip) of the sample with the shortest round trip.

  Each sample is ``(t_send, t_peer, t_back)``: rank 0's clock when it sent,
  the peer's clock when it answered, rank 0's clock when the answer came.
  The peer's reading is taken as the midpoint of the round trip, so the
  offset (peer -> rank 0) is ``(t_send + t_back) / 2 - t_peer``, off by at
  most half the round trip.
  """
  best = min(samples, key=lambda s: s[2] - s[0])
  t_send, t_peer, t_back = best
  return round((t_send + t_back) / 2 - t_peer), t_back - t_send


@dataclasses.dataclass
class Split:
  """Where one call's time went, on the aligned clock."""

  call: Call
  enter: int
  ready: int  # the last rank's arrival, clamped to [enter, exit]
  exit: int
  waited_for: int | None  # the rank that arrived last, when this one waited
  ranks_seen: int  # how many ranks' events of this collective were found
  group: int = -1  # the collective it is part of, when every member's events were found

  @property
  def wait(self) -> int:
    return self.ready - self.enter

  @property
  def transfer(self) -> int:
    return self.exit - self.ready


def split_calls(calls: Sequence[Call], syncs: dict[int, ClockSync]) -> list[Split]:
  """Every call split into waiting and transfer, on rank 0's clock.

  Point-to-point calls (seq -1) and collectives whose other ranks' events are
  missing (lost from a full buffer, or a rank that died) are all transfer:
  without every rank's arrival there is no wait to compute.
  """
  aligned = []
  for c in calls:
    sync = syncs.get(c.rank)
    enter = sync.to_reference(c.enter) if sync else c.enter
    exit_ = max(sync.to_reference(c.exit) if sync else c.exit, enter)
    aligned.append((c, enter, exit_))
  by_call: dict[tuple[int, int], list[int]] = defaultdict(list)
  for i, (c, _, _) in enumerate(aligned):
    if c.seq >= 0:
      by_call[(c.key, c.seq)].append(i)
  # A communicator's members are (rank, device) pairs: one per rank for
  # mpijax's per-device communicators (a rank's devices share the key: each
  # device's calls are a group of their own), several per rank for XLA's
  # with several devices per rank (one group).
  groups: list[list[int]] = []
  for members in by_call.values():
    if len(members) > aligned[members[0]][0].comm_size:
      per_device: dict[int, list[int]] = defaultdict(list)
      for i in members:
        per_device[aligned[i][0].device].append(i)
      groups += per_device.values()
    else:
      groups.append(members)
  out: list[Split | None] = [None] * len(aligned)
  for g, members in enumerate(groups):
    seen = {(aligned[i][0].rank, aligned[i][0].device) for i in members}
    complete = len(seen) >= aligned[members[0]][0].comm_size
    last_i = max(members, key=lambda i: (aligned[i][1], aligned[i][0].rank))
    last, last_rank = aligned[last_i][1], aligned[last_i][0].rank
    for i in members:
      c, enter, exit_ = aligned[i]
      ready = min(max(last, enter), exit_) if complete else enter
      waited = last_rank if complete and ready > enter and last_rank != c.rank else None
      out[i] = Split(c, enter, ready, exit_, waited, len(members), g if complete else -1)
  for i, (c, enter, exit_) in enumerate(aligned):
    if out[i] is None:
      out[i] = Split(c, enter, enter, exit_, None, 1)
  return [s for s in out if s is not None]


@dataclasses.dataclass
class RankData:
  """What one rank sends to rank 0 at the end."""

  rank: int
  host: str
  devices: int
  calls: list[tuple[Any, ...]]
  spans: list[tuple[str, int, int, dict[str, Any]]]  # (name, start, end, args) on its clock
  sites: dict[int, str]
  lost: int
  sync: ClockSync | None

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["sites"] = {str(k): v for k, v in self.sites.items()}
    return d

  @classmethod
  def from_json(cls, d: dict[str, Any]) -> RankData:
    sync = ClockSync(**d["sync"]) if d.get("sync") else None
    return cls(
      d["rank"],
      d["host"],
      d["devices"],
      [tuple(c) for c in d["calls"]],
      [tuple(s) for s in d["spans"]],
      {int(k): v for k, v in d["sites"].items()},
      d["lost"],
      sync,
    )


def _us(ns: int) -> float:
  return ns / 1000.0


def _flows(splits: Sequence[Split], t0: int) -> list[dict[str, Any]]:
  """Arrows from each collective's last rank (as it enters) to each rank that waited for it."""
  groups: dict[tuple[int, int, int], list[Split]] = defaultdict(list)
  for s in splits:
    if s.call.seq >= 0:
      groups[(s.call.key, s.call.device, s.call.seq)].append(s)
  out: list[dict[str, Any]] = []
  for members in groups.values():
    waiters = [s for s in members if s.waited_for is not None]
    if not waiters:
      continue
    last = next((s for s in members if s.call.rank == waiters[0].waited_for), None)
    if last is None:
      continue
    for w in waiters:
      fid = len(out) // 2
      common = {"cat": "waited_for", "name": "last to arrive", "id": fid}
      out.append(
        {
          "ph": "s",
          "pid": last.call.rank,
          "tid": 1 + last.call.device,
          "ts": _us(last.enter - t0),
          **common,
        }
      )
      out.append(
        {
          "ph": "f",
          "bp": "e",
          "pid": w.call.rank,
          "tid": 1 + w.call.device,
          "ts": _us(w.ready - t0),
          **common,
        }
      )
  return out


def stragglers(
  splits: Sequence[Split], steps: dict[int, list[tuple[int, int]]], hostnames: dict[int, str]
) -> tuple[dict[int, int], dict[str, Any]]:
  """Who arrived last at each complete collective, by how much, and the trace's straggler.

  ``steps`` holds each rank's training-step spans (start, end): how much
  later than the others a rank started its k-th step is its input time
  (straggler.py). Returns the lateness of the
  calls of each collective's last rank (by ``id`` of their split) and the
  ``stragglers`` entry of the file's metadata (straggler.py's thresholds).
  """
  members: dict[int, list[Split]] = defaultdict(list)
  for s in splits:
    if s.group >= 0:
      members[s.group].append(s)
  tally = straggler.Tally()
  late: dict[int, int] = {}
  for group in members.values():
    c = straggler.collective({(s.call.rank, s.call.device): s.enter for s in group})
    if c is None:
      continue
    tally.add(c)
    for s in group:
      if s.call.rank == c.last:
        late[id(s)] = c.late_ns
  starts = {rank: sorted(a for a, _ in spans) for rank, spans in steps.items()}
  for k in range(min((len(v) for v in starts.values()), default=0)):
    tally.add_step({rank: v[k] for rank, v in starts.items()})
  v = straggler.verdict(tally)
  hosts = [hostnames.get(r, "?") for r in range(max(hostnames, default=-1) + 1)]
  summary = {
    "rank": v.rank,
    "report": straggler.line(v, hosts, window="in this trace") if tally.collectives else None,
    "collectives": tally.collectives,
    "held_up": v.held,
    "floor_ns": straggler.FLOOR_NS,
    "by_rank": {
      str(r): {"arrived_last": tally.last[r], "held_up": tally.held[r], "late_ns": tally.held_ns[r]}
      for r in sorted(tally.took_part)
    },
  }
  return late, summary


def chrome_trace(
  ranks: Sequence[RankData], *, job_ranks: int, missing: Sequence[int] = ()
) -> dict[str, Any]:
  """The merged Chrome trace (Perfetto reads it too) of every rank's data."""
  syncs = {r.rank: r.sync for r in ranks if r.sync is not None}
  calls = [Call.from_tuple(r.rank, t) for r in ranks for t in r.calls]
  splits = split_calls(calls, syncs)
  sites = {r.rank: r.sites for r in ranks}
  spans = []
  for r in ranks:
    sync = syncs.get(r.rank)
    for name, start, end, args in r.spans:
      a = sync.to_reference(start) if sync else start
      b = sync.to_reference(end) if sync else end
      spans.append((r.rank, name, a, max(a, b), args))
  step_spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
  for rank, _, a, b, args in spans:
    if args.get("category") == "step":
      step_spans[rank].append((a, b))
  late, straggler_summary = stragglers(splits, step_spans, {r.rank: r.host for r in ranks})
  times = [s.enter for s in splits] + [s[2] for s in spans]
  t0 = min(times) if times else 0
  events: list[dict[str, Any]] = []
  for r in sorted(ranks, key=lambda r: r.rank):
    events.append(
      {
        "ph": "M",
        "name": "process_name",
        "pid": r.rank,
        "args": {"name": f"rank {r.rank} ({r.host})"},
      }
    )
    events.append(
      {"ph": "M", "name": "process_sort_index", "pid": r.rank, "args": {"sort_index": r.rank}}
    )
    events.append(
      {
        "ph": "M",
        "name": "thread_name",
        "pid": r.rank,
        "tid": STEPS_TID,
        "args": {"name": "steps (Python)"},
      }
    )
    for d in range(r.devices):
      events.append(
        {
          "ph": "M",
          "name": "thread_name",
          "pid": r.rank,
          "tid": 1 + d,
          "args": {"name": f"device {d}"},
        }
      )
  for rank, name, a, b, args in spans:
    args = dict(args)
    events.append(
      {
        "ph": "X",
        "cat": args.pop("category", "span"),
        "name": name,
        "pid": rank,
        "tid": STEPS_TID,
        "ts": _us(a - t0),
        "dur": _us(b - a),
        "args": args,
      }
    )
  for s in splits:
    c = s.call
    tid = 1 + c.device
    args = {
      "op": c.name,
      "dtype": c.dtype,
      "shape": list(c.shape) if c.shape is not None else "several arrays",
      "bytes": c.nbytes,
      "path": path_name(c.path),
      "call_site": sites.get(c.rank, {}).get(c.site, f"site {c.site}"),
      "communicator": c.key,
      "comm_size": c.comm_size,
      "call_number": c.seq,
      "duration_ns": s.exit - s.enter,
      "wait_ns": s.wait,
      "transfer_ns": s.transfer,
      "waited_for_rank": s.waited_for,
    }
    if s.group >= 0:
      args["arrived_last"] = id(s) in late
      if id(s) in late:
        args["late_ns"] = late[id(s)]
    if c.seq < 0:
      args["note"] = "point-to-point: no wait computed"
    elif s.ranks_seen < c.comm_size:
      args["note"] = f"only {s.ranks_seen} of {c.comm_size} ranks' events found: no wait computed"
    events.append(
      {
        "ph": "X",
        "cat": "mpijax",
        "name": c.name,
        "pid": c.rank,
        "tid": tid,
        "ts": _us(s.enter - t0),
        "dur": _us(s.exit - s.enter),
        "args": args,
      }
    )
    if s.wait > 0:
      label = f"wait for rank {s.waited_for}" if s.waited_for is not None else "wait"
      events.append(
        {
          "ph": "X",
          "cat": "wait",
          "name": label,
          "pid": c.rank,
          "tid": tid,
          "ts": _us(s.enter - t0),
          "dur": _us(s.wait),
          "args": {},
        }
      )
    if s.transfer > 0:
      events.append(
        {
          "ph": "X",
          "cat": "transfer",
          "name": "transfer",
          "pid": c.rank,
          "tid": tid,
          "ts": _us(s.ready - t0),
          "dur": _us(s.transfer),
          "args": {},
        }
      )
  events += _flows(splits, t0)
  return {
    "traceEvents": events,
    "displayTimeUnit": "ns",
    "otherData": {
      "mpijax": {
        "ranks": job_ranks,
        "ranks_merged": sorted(r.rank for r in ranks),
        "ranks_missing": sorted(missing),
        "devices_per_rank": max((r.devices for r in ranks), default=0),
        "lost_events": {str(r.rank): r.lost for r in ranks},
        "clock_offsets_ns": {str(r.rank): (r.sync.offset1 if r.sync else None) for r in ranks},
        "time_zero_ns": t0,
        "stragglers": straggler_summary,
      },
    },
  }
