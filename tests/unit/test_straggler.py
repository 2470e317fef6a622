"""The straggler report's logic: pairing the ranks' arrivals, the thresholds, the line, the trace."""

from __future__ import annotations

import random

from mpijax._src.timeline import merge
from mpijax._src.timeline import straggler

MS = 1_000_000


def _row(seq, ns, *, key=5, leader=0, device=0, per_device=1, size=4):
  return (key, leader, device, per_device, size, seq, ns)


def test_the_last_arrival_is_late_by_the_time_after_the_one_before_it():
  c = straggler.collective({(0, 0): 100, (1, 0): 400, (2, 0): 250, (3, 0): 900})
  assert (c.last, c.late_ns, c.ranks, c.first_ns, c.end_ns) == (3, 500, (0, 1, 2, 3), 100, 900)
  # A rank with several members arrives with its last one; its own devices do not count.
  c = straggler.collective({(0, 0): 100, (0, 1): 700, (1, 0): 500, (1, 1): 600})
  assert (c.last, c.late_ns) == (0, 100)
  assert straggler.collective({(2, 0): 5, (2, 1): 9}) is None  # one rank made it all


def _pairs(batch):
  return [(c.last, c.late_ns) for c in batch.collectives()]


def test_pairing_waits_for_every_member_and_keeps_communicators_apart():
  p = straggler.Pairing()
  # Two communicators share key 5 (disjoint sub-communicators may): their leaders differ.
  p.add(0, [_row(0, 10, size=2), _row(0, 50, size=2, leader=2)])
  p.add(1, [_row(0, 30, size=2)])
  assert _pairs(p.complete()) == [(1, 20)]
  assert len(p) == 1  # the other communicator's rank 3 has not reported
  p.add(3, [_row(0, 40, size=2, leader=2)], offset_ns=100)
  assert [(c.last, c.late_ns, c.ranks) for c in p.complete().collectives()] == [(3, 90, (0, 3))]
  # The same stamp twice (a rank's payloads overlap) counts once.
  p.add(0, [_row(1, 10, size=2)] * 2)
  assert _pairs(p.complete()) == [] and len(p) == 1


def test_pairing_per_device_and_across_a_process_s_devices():
  p = straggler.Pairing()
  # mpijax's per-device communicators: each device's k-th call is a collective of its own.
  for rank, (t0, t1) in ((0, (0, 20)), (1, (7, 14))):
    p.add(rank, [_row(0, t0, device=0, size=2), _row(0, t1, device=1, size=2)])
  assert sorted(_pairs(p.complete())) == [(0, 6), (1, 7)]
  # XLA's with several devices per process: one collective of every (rank, device).
  p.add(0, [_row(3, 10, device=d, per_device=0) for d in (0, 1)])
  p.add(1, [_row(3, 12, device=0, per_device=0)])
  assert _pairs(p.complete()) == []
  p.add(1, [_row(3, 30, device=1, per_device=0)])
  assert _pairs(p.complete()) == [(1, 20)]
  # A collective of one rank's devices alone compares no ranks.
  p.add(2, [_row(4, 10, device=d, per_device=0, size=2, leader=2) for d in (0, 1)])
  assert _pairs(p.complete()) == [] and len(p) == 0


def test_pairing_drops_what_stays_incomplete():
  p = straggler.Pairing(max_age=2)
  p.add(0, [_row(0, 1, size=2)])
  assert _pairs(p.complete()) == [] and len(p) == 1
  assert _pairs(p.complete()) == [] and len(p) == 0  # its other member's stamps never came
  p = straggler.Pairing(max_pending=3)
  p.add(0, [_row(s, s, size=2) for s in range(5)])
  p.complete()
  assert len(p) == 3


def test_pairing_in_arrays_agrees_with_one_collective_at_a_time():
  rng = random.Random(3)
  ranks, devices, calls = 4, 2, 60
  stamps = {}  # (rank, device, seq) -> ns
  for seq in range(calls):
    for r in range(ranks):
      for d in range(devices):
        stamps[(r, d, seq)] = seq * 10 * MS + rng.randrange(4 * MS)
  p = straggler.Pairing()
  for r in range(ranks):
    p.add(
      r, [_row(seq, ns, device=d, size=ranks) for (rr, d, seq), ns in stamps.items() if rr == r]
    )
  batch, one_by_one = straggler.Tally(), straggler.Tally()
  batch.add_batch(p.complete())
  for seq in range(calls):
    for d in range(devices):
      one_by_one.add(straggler.collective({(r, d): stamps[(r, d, seq)] for r in range(ranks)}))
  assert batch == one_by_one and batch.collectives == calls * devices


def test_steps_pair_by_number_and_compare_each_rank_with_the_others():
  p = straggler.StepPairing(3)
  p.add(0, [(0, 100), (1, 200)])
  p.add(1, [(0, 130), (1, 260)], offset_ns=-10)
  p.add(2, [(0, 160)])
  t = straggler.Tally()
  t.add_steps(*p.complete())  # step 1 waits for rank 2
  # Step 0 at 100, 120, 160: each against the median of the other two.
  assert t.call_late_ns == {0: 100 - 140, 1: 120 - 130, 2: 160 - 110} and t.steps == {
    0: 1,
    1: 1,
    2: 1,
  }
  p.add(2, [(1, 230)])
  t.add_steps(*p.complete())
  assert t.call_late_ns[2] == 50 + 230 - 225 and t.steps == {0: 2, 1: 2, 2: 2}


def _tally(lasts, late_ns, *, step_ns=50 * MS, ranks=4):
  """A window of one collective per step: ``lasts[i]`` arrives ``late_ns[i]`` after the others."""
  t = straggler.Tally()
  for i, (last, late) in enumerate(zip(lasts, late_ns)):
    start = i * step_ns
    members = {(r, 0): start for r in range(ranks)}
    members[(last, 0)] = start + late
    t.add(straggler.collective(members))
  return t


def test_a_consistently_late_rank_is_named():
  v = straggler.verdict(_tally([2] * 20, [10 * MS] * 20))
  assert v.rank == 2 and v.held == 20 and v.most_held == 20
  assert v.late_ns == 10 * MS and v.wait_share == 1.0
  assert 0.19 < v.time_share < 0.21  # 10 ms of every 50 ms step


def test_equal_ranks_name_none():
  rng = random.Random(0)
  for ranks in (2, 4):
    for _ in range(200):
      lasts = [rng.randrange(ranks) for _ in range(50)]
      assert straggler.verdict(_tally(lasts, [5 * MS] * 50, ranks=ranks)).rank is None


def test_each_threshold_decides():
  late = [10 * MS] * 20
  assert straggler.verdict(_tally([1] * 10, late)).rank == 1
  assert straggler.verdict(_tally([1] * 9, late)).rank is None  # fewer than MIN_HELD
  # Below the floor a collective did not wait for its last rank.
  floor = straggler.FLOOR_NS
  assert straggler.verdict(_tally([1] * 20, [floor] * 20, step_ns=5 * MS)).rank == 1
  assert straggler.verdict(_tally([1] * 20, [floor - 1] * 20, step_ns=5 * MS)).rank is None
  # Last in half of the held-up collectives (and all the waiting) is enough, less is not.
  assert straggler.verdict(_tally([1, 0] * 10, [10 * MS, MS] * 10)).rank == 1
  assert straggler.verdict(_tally([1, 0, 0] * 7, [10 * MS, MS, MS] * 7)).rank is None
  # Last in most of them but with three quarters of the waiting only just, or not.
  lasts = [1] * 15 + [0] * 5
  assert straggler.verdict(_tally(lasts, [10 * MS] * 15 + [10 * MS] * 5)).rank == 1  # 75 %
  assert straggler.verdict(_tally(lasts, [10 * MS] * 15 + [11 * MS] * 5)).rank is None
  # Waiting for it must take 5 % of the time: from the first arrival to the last, 19 steps
  # of 50 ms and the last lateness; 20 x 2.4 ms is 5.04 % of that, 20 x 2.3 ms 4.8 %.
  assert straggler.verdict(_tally([1] * 20, [2_400_000] * 20)).rank == 1
  assert straggler.verdict(_tally([1] * 20, [2_300_000] * 20)).rank is None


def test_a_single_stall_is_not_a_straggler():
  rng = random.Random(1)
  lasts = [rng.randrange(4) for _ in range(40)]
  late = [2 * MS] * 40
  lasts[7], late[7] = 3, 900 * MS  # one rank stalled once for most of the window's waiting
  v = straggler.verdict(_tally(lasts, late))
  assert v.rank is None and v.most == 3 and v.wait_share > 0.75


def test_input_and_compute_split_the_lateness():
  t = _tally([1] * 20, [10 * MS] * 20)
  for k in range(20):  # rank 1 calls its steps 8 ms after the others (its batch came late)
    t.add_step({0: k * 50 * MS, 1: k * 50 * MS + 8 * MS, 2: k * 50 * MS + 1, 3: k * 50 * MS - 1})
  v = straggler.verdict(t)
  assert v.rank == 1 and v.input_ns == 8 * MS and v.compute_ns == 2 * MS
  t = _tally([1] * 20, [10 * MS] * 20)
  for _ in range(20):  # its calls are early: all of its lateness is compute
    t.add_step({0: 5, 1: 0, 2: 5, 3: 5})
  v = straggler.verdict(t)
  assert (v.input_ns, v.compute_ns) == (0, 10 * MS)
  t = _tally([1] * 20, [10 * MS] * 20, ranks=2)
  for _ in range(20):  # never more than the lateness itself
    t.add_step({0: 0, 1: 30 * MS})
  assert (straggler.verdict(t).input_ns, straggler.verdict(t).compute_ns) == (10 * MS, 0)
  assert straggler.verdict(_tally([1] * 20, [10 * MS] * 20)).input_ns is None  # no steps


def test_tallies_merge_into_the_job_s():
  a, b = _tally([2] * 12, [3 * MS] * 12), _tally([0] * 4, [MS] * 4)
  a.add_step({0: 0, 1: 10})
  b.add_step({0: 0, 1: 30})
  whole = straggler.Tally()
  whole.merge(a)
  whole.merge(b)
  assert whole.collectives == 16 and whole.held == {2: 12, 0: 4}
  assert whole.held_ns == {2: 36 * MS, 0: 4 * MS} and whole.last == {2: 12, 0: 4}
  assert whole.call_late_ns == {1: 40, 0: -40} and whole.steps == {0: 2, 1: 2}
  assert whole.span_ns == max(a.span_ns, b.span_ns)


def test_the_lines_say_who_where_how_often_how_late():
  hosts = ["h0", "h1", "node-c", "h3"]
  t = _tally([2] * 19 + [0], [12 * MS] * 19 + [MS])
  for _ in range(20):
    t.add_step({0: 0, 1: 0, 2: 3 * MS, 3: 0})
  text = straggler.line(straggler.verdict(t), hosts, window="in the last 60 s")
  assert text.startswith(
    "straggler in the last 60 s: rank 2 (host node-c) arrived last in 95 % "
    "of the 20 collectives that waited >= 0.50 ms for one rank, 12 ms late "
    "on average (input 3.0 ms, compute 9.0 ms); waiting for it took "
  )
  assert text.endswith("% of the time, 100 % of all waiting for a late rank")
  none = straggler.line(
    straggler.verdict(_tally([0, 1, 2, 3] * 5, [MS] * 20)), hosts, window="over the job"
  )
  assert none == (
    "stragglers over the job: none; 20 collectives compared across 4 ranks, 20 "
    "waited >= 0.50 ms for one rank; the latest, rank 3: last in 5 of them, 25 % "
    "of the waiting, 1 % of the time"
  )


def test_the_trace_marks_the_last_arrival_and_names_the_straggler():
  calls = {r: [] for r in range(3)}
  spans = {r: [] for r in range(3)}
  for k in range(12):
    t = k * 40 * MS
    for r in range(3):
      enter = t + (9 * MS if r == 2 else r * 1000)
      calls[r].append((0, k, enter, t + 10 * MS))
      spans[r].append(
        (
          "DataParallel.step",
          t - MS + (5 * MS if r == 2 else 0),
          t + 11 * MS,
          {"category": "step", "step": k},
        )
      )
  ranks = [
    merge.RankData(
      rank=r,
      host=f"h{r}",
      devices=1,
      calls=[
        ("allreduce", "float32", (4,), 16, 4, 7, 0, d, 3, seq, a, b) for d, seq, a, b in calls[r]
      ],
      spans=spans[r],
      sites={7: "allreduce at x.py:3"},
      lost=0,
      sync=None,
    )
    for r in range(3)
  ]
  trace = merge.chrome_trace(ranks, job_ranks=3)
  meta = trace["otherData"]["mpijax"]["stragglers"]
  assert meta["rank"] == 2 and meta["held_up"] == 12
  assert meta["report"].startswith(
    "straggler in this trace: rank 2 (host h2) arrived last in 100 % of the 12 collectives"
  )
  assert "(input 5.0 ms, compute 4.0 ms)" in meta["report"]
  events = [e for e in trace["traceEvents"] if e.get("cat") == "mpijax"]
  late = {(e["pid"], e["args"]["call_number"]): e["args"].get("late_ns") for e in events}
  assert all(late[(2, k)] == 9 * MS - 1000 for k in range(12))
  assert all(late[(r, k)] is None for r in (0, 1) for k in range(12))
  assert {e["args"]["arrived_last"] for e in events if e["pid"] == 2} == {True}
