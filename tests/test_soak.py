"""Soak: many small collectives and jitted steps in one 4-rank job.

The short soak (10,000 collectives, 100 steps) runs in CI; the long one
(100,000 and 1,000) only with MPIJAX_TEST_SLOW=1. Prints the figures
(pytest -s).
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests._launch import REPO
from tests._launch import SLOW
from tests._launch import run_mpi
from tests._launch import tail


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
  for r in rows:
    # Right results first: a fast soak of wrong values proves nothing.
    assert r["calls_ok"] and r["steps_finite"] and r["steps_match_reference"], r
    assert r["steps_same_on_every_rank"], r
    assert r["calls_rss_growth_mb"] + r["steps_rss_growth_mb"] < 50, r
    assert r["calls_fd_growth"] <= 0 and r["steps_fd_growth"] <= 0, r
    # Medians over a tenth of the calls; "within noise" on an oversubscribed machine:
    # the last 10 % may not be more than 1.5x slower than the first (plus 20 us).
    assert r["call_us_last10"] <= 1.5 * r["call_us_first10"] + 20, r
    assert r["step_us_last10"] <= 1.5 * r["step_us_first10"] + 50, r
