"""The timeline's merge math: clock offsets, the wait/transfer split, the trace, the PNG."""

from __future__ import annotations

import json
import random

import pytest

from mpijax._src.timeline import merge
from mpijax._src.timeline import render


def test_pingpong_offset_takes_the_shortest_round_trip():
  true_offset = 123_456  # peer clock + offset = rank 0 clock
  rng = random.Random(0)
  samples = []
  for _ in range(20):
    t_send = rng.randrange(10**9)
    out, back = rng.randrange(1000, 90_000), rng.randrange(1000, 90_000)
    samples.append((t_send, t_send + out - true_offset, t_send + out + back))
  samples.append((5_000_000, 5_000_000 + 400 - true_offset, 5_000_000 + 800))  # symmetric, short
  offset, rtt = merge.offset_from_pingpong(samples)
  assert rtt == 800
  assert offset == true_offset


def test_clock_sync_interpolates_drift():
  sync = merge.ClockSync(t1=1_000, offset1=100, t2=11_000, offset2=200)
  assert sync.to_reference(1_000) == 1_100
  assert sync.to_reference(6_000) == 6_150
  assert sync.to_reference(11_000) == 11_200
  assert merge.ClockSync(t1=0, offset1=-7).to_reference(50) == 43


def _call(rank, seq, enter, exit_, *, key=0, device=0, size=3, name="allreduce"):
  return merge.Call(rank, name, "float32", (4,), 16, 1, 5, key, device, size, seq, enter, exit_)


def test_split_waits_for_the_last_arrival_on_aligned_clocks():
  # Rank 1's clock runs 1000 ns behind rank 0's, rank 2's 500 ahead.
  syncs = {0: merge.ClockSync(0, 0), 1: merge.ClockSync(0, 1000), 2: merge.ClockSync(0, -500)}
  calls = [
    _call(0, 0, 100, 900),
    _call(1, 0, 400 - 1000, 950 - 1000),
    _call(2, 0, 300 + 500, 920 + 500),
  ]
  splits = {s.call.rank: s for s in merge.split_calls(calls, syncs)}
  assert (splits[0].enter, splits[0].ready, splits[0].exit) == (100, 400, 900)
  assert splits[0].wait == 300 and splits[0].transfer == 500 and splits[0].waited_for == 1
  assert splits[1].wait == 0 and splits[1].waited_for is None  # it arrived last
  assert splits[2].wait == 100 and splits[2].waited_for == 1


def test_split_pairs_by_communicator_device_and_number():
  calls = [
    _call(0, 0, 0, 50, size=2),
    _call(1, 0, 20, 60, size=2),
    _call(0, 1, 100, 150, size=2),
    _call(1, 1, 90, 160, size=2),
    _call(0, 0, 10, 70, size=2, device=1),
    _call(1, 0, 40, 80, size=2, device=1),
  ]
  got = {
    (s.call.rank, s.call.device, s.call.seq): (s.wait, s.waited_for)
    for s in merge.split_calls(calls, {})
  }
  assert got == {
    (0, 0, 0): (20, 1),
    (1, 0, 0): (0, None),
    (0, 0, 1): (0, None),
    (1, 0, 1): (10, 0),
    (0, 1, 0): (30, 1),
    (1, 1, 0): (0, None),
  }


def test_split_clamps_an_exit_before_the_last_arrival():
  # A rooted op: rank 0's send completed before rank 2 arrived: all of it is wait.
  calls = [_call(0, 0, 0, 30), _call(1, 0, 10, 100), _call(2, 0, 50, 100)]
  s0 = next(s for s in merge.split_calls(calls, {}) if s.call.rank == 0)
  assert (s0.wait, s0.transfer, s0.waited_for) == (30, 0, 2)


def test_split_without_every_rank_or_point_to_point_has_no_wait():
  calls = [
    _call(0, 0, 0, 100),
    _call(1, 0, 60, 100),  # rank 2's event is missing
    _call(0, -1, 200, 300, name="send"),
    _call(1, -1, 250, 300, name="recv"),
  ]
  for s in merge.split_calls(calls, {}):
    assert s.wait == 0 and s.waited_for is None and s.transfer == s.exit - s.enter


def _rank_data(rank, calls, spans=(), devices=1):
  return merge.RankData(
    rank=rank,
    host="h",
    devices=devices,
    calls=[("allreduce", "float32", (4,), 16, 4, 7, 0, d, 2, seq, a, b) for d, seq, a, b in calls],
    spans=list(spans),
    sites={7: "allreduce(float32[4], sum) at x.py:3"},
    lost=0,
    sync=merge.ClockSync(0, 0),
  )


def test_chrome_trace_has_rows_slices_and_exact_split():
  ranks = [
    _rank_data(
      0,
      [(0, 0, 1_000, 5_000), (0, 1, 6_000, 7_000)],
      spans=[("DataParallel.step", 500, 8_000, {"category": "step", "step": 0})],
    ),
    _rank_data(
      1,
      [(0, 0, 3_000, 5_100), (0, 1, 6_500, 7_200)],
      spans=[("DataParallel.step", 2_500, 8_100, {"category": "step", "step": 0})],
    ),
  ]
  ranks = [merge.RankData.from_json(json.loads(json.dumps(r.to_json()))) for r in ranks]
  trace = merge.chrome_trace(ranks, job_ranks=2)
  json.dumps(trace)
  ev = trace["traceEvents"]
  names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
  assert names[(0, merge.STEPS_TID)] == "steps (Python)" and names[(1, 1)] == "device 0"
  calls = [e for e in ev if e.get("cat") == "mpijax"]
  assert len(calls) == 4
  first = next(e for e in calls if e["pid"] == 0 and e["args"]["call_number"] == 0)
  assert first["ts"] == 0.5 and first["dur"] == 4.0  # µs from the earliest event
  a = first["args"]
  assert (a["wait_ns"], a["transfer_ns"], a["waited_for_rank"]) == (2_000, 2_000, 1)
  assert a["path"] == "shared memory" and a["call_site"].endswith("x.py:3")
  waits = [e for e in ev if e.get("cat") == "wait" and e["pid"] == 0]
  assert waits and waits[0]["name"] == "wait for rank 1" and waits[0]["dur"] == 2.0
  # Arrows from the last rank (rank 1 both times) to the waiter, at its arrival.
  flows = [(e["ph"], e["pid"], e["ts"]) for e in ev if e.get("cat") == "waited_for"]
  assert flows == [("s", 1, 2.5), ("f", 0, 2.5), ("s", 1, 6.0), ("f", 0, 6.0)]
  steps = [e for e in ev if e.get("cat") == "step"]
  assert len(steps) == 2 and all(e["tid"] == merge.STEPS_TID for e in steps)
  assert steps[0]["args"] == {"step": 0}


def test_path_names():
  assert merge.path_name(1) == "mpi"
  assert merge.path_name(8) == "cross-memory attach"
  assert merge.path_name(2 | 1) == "mpi+ring"


_STEP = {"category": "step"}


def test_render_draws_the_chosen_step(tmp_path):
  pytest.importorskip("matplotlib")
  ranks = [
    _rank_data(
      0,
      [(0, 0, 1_000, 5_000), (0, 1, 11_000, 14_000)],
      spans=[
        ("DataParallel.step", 500, 6_000, _STEP),
        ("DataParallel.step", 10_500, 15_000, _STEP),
        ("jax compile: f", 600, 900, {"category": "compile"}),
      ],
    ),
    _rank_data(
      1,
      [(0, 0, 3_000, 5_100), (0, 1, 11_500, 14_100)],
      spans=[
        ("DataParallel.step", 2_500, 6_100, _STEP),
        ("DataParallel.step", 10_900, 15_100, _STEP),
      ],
    ),
  ]
  trace_path = tmp_path / "t.json"
  trace_path.write_text(json.dumps(merge.chrome_trace(ranks, job_ranks=2)))
  out = tmp_path / "step.png"
  summary = render.render(str(trace_path), str(out), step=0)
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (
    summary.startswith("step 1 of 2: ")
    and "rank 0 waited 2.0 µs, most for rank 1 (2.0 µs)" in summary
  )
  assert render.render(str(trace_path), str(out)).startswith("step 2 of 2: ")  # the last
  with pytest.raises(ValueError, match="out of range"):
    render.render(str(trace_path), str(out), step=5)
