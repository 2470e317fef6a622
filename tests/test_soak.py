"""Soak: many small collectives and jitted steps in one 4-rank job.

The short soak (10,000 collectives, 100 steps) runs in CI; the long one
(100,000 and 1,000) only with MPIJAX_TEST_SLOW=1. Prints the figures
(pytest -s).

The limits are set per call made, so each size of soak fails on a leak or a
slowdown that is large enough to show in its own calls:

* memory: over each loop, malloc's bytes in use (which show a leak even
  where the allocator reuses memory that is resident already) may grow by
  HEAP_BASE plus PER_CALL bytes per collective or PER_STEP bytes per step,
  resident memory by RSS_BASE plus the same, Python's allocated blocks by
  BLOCKS_BASE plus one per BLOCKS_EVERY calls or per step; open file
  descriptors not at all. Measured on this machine, at 10,000 and at 100,000
  calls: malloc 0-1.6 KiB per loop, resident 0-4 KiB, Python blocks 3-6 over
  the collectives and 47-216 over 100 or 1,000 steps.
* speed: state that grows with every call makes the later calls slower. In
  each half of a loop the time per call is the median of the half's quietest
  stretch (other work on the machine slows some stretches, growing state
  every later one); the second half's may be at most SLOWER times the
  first's (the median over the ranks; measured on the loaded 2-core machine
  0.77-0.99 for the collectives, 0.41-1.08 for the steps). What a run can
  detect is printed: the cost added per call made that reaches the limit, ten
  times finer in the long soak than in the short one. On a machine busy with
  other work a load that lifts in the second half can hide a slowdown: the
  memory limits do not depend on the load.
"""

from __future__ import annotations

import json
import re
import statistics
import sys

import pytest

from tests._launch import REPO
from tests._launch import SLOW
from tests._launch import run_mpi
from tests._launch import tail

HEAP_BASE = 64 << 10  # bytes
RSS_BASE = 1 << 20
PER_CALL = 4  # bytes: a leaked malloc(1) is 32
PER_STEP = 256  # bytes: a leaked copy of the parameters is 8.3 KiB
BLOCKS_BASE, BLOCKS_EVERY = 1024, 100
SLOWER = {"calls": 1.2, "steps": 1.5}


@pytest.mark.parametrize(
  "calls,steps,timeout",
  [
    (10_000, 100, 600),
    pytest.param(100_000, 1_000, 1800, marks=SLOW),
  ],
  ids=["short", "long"],
)
def test_soak_memory_fds_and_speed_stay_flat(calls, steps, timeout):
  result, seconds = run_mpi(
    4,
    [sys.executable, str(REPO / "tests" / "scripts" / "soak.py"), str(calls), str(steps)],
    timeout=timeout,
  )
  assert result.returncode == 0, tail(result.stdout)
  rows = [json.loads(m) for m in re.findall(r"SOAK (\{.*\})", result.stdout)]
  assert len(rows) == 4, tail(result.stdout)
  print(f"\nsoak: 4 ranks, {calls} collectives, {steps} steps, {seconds:.0f}s wall")
  for r in sorted(rows, key=lambda r: r["rank"]):
    print("  " + json.dumps(r))
  problems = []
  for r in rows:
    # Right results first: a fast soak of wrong values proves nothing.
    assert r["calls_ok"] and r["steps_finite"] and r["steps_match_reference"], r
    assert r["steps_same_on_every_rank"], r
    for loop, count, per, blocks in (
      ("calls", calls, PER_CALL, BLOCKS_BASE + calls // BLOCKS_EVERY),
      ("steps", steps, PER_STEP, BLOCKS_BASE + steps),
    ):
      for what, grew, limit in (
        ("malloc's bytes in use", r[f"{loop}_heap_bytes_growth"], HEAP_BASE + per * count),
        ("resident bytes", 1024 * r[f"{loop}_rss_kib_growth"], RSS_BASE + per * count),
        ("Python's allocated blocks", r[f"{loop}_py_blocks_growth"], blocks),
        ("open files", r[f"{loop}_fd_growth"], 0),
      ):
        if grew > limit:
          problems.append(
            f"rank {r['rank']}: {what} grew by {grew} over {count} {loop}, more than {limit}"
          )
  for loop, count, key in (("calls", calls, "call_us"), ("steps", steps, "step_us")):
    ratios = [r[key][1] / r[key][0] for r in rows]  # second half / first half, per rank
    slower = statistics.median(ratios)
    first = statistics.median(r[key][0] for r in rows)
    # A cost d added per call made puts the halves' quietest stretches (at best the
    # first of each) count / 2 calls, so d * count / 2, apart.
    finest = (SLOWER[loop] - 1) * first / (count / 2)
    finest = f"{finest * 1e3:.1f} ns" if finest < 1 else f"{finest:.1f} µs"
    print(
      f"  {loop}: second half / first half "
      + ", ".join(f"{v:.2f}" for v in ratios)
      + f" (median {slower:.2f}, limit {SLOWER[loop]}; this run detects {finest} added per "
      f"{loop[:-1]} made)"
    )
    if slower > SLOWER[loop]:
      problems.append(
        f"{loop}: the second half's calls took {slower:.2f}x the first half's (ranks: "
        + ", ".join(f"{v:.2f}" for v in ratios)
        + f"), more than {SLOWER[loop]}x"
      )
  assert not problems, "\n".join(problems)
