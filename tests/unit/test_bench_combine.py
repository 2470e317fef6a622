"""benchmarks/_common.combine_jobs: the same rows from several jobs, as one row each."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import _common  # noqa: E402
from _common import Row  # noqa: E402
from _common import Timing  # noqa: E402


def _row(key: str, cells: dict) -> Row:
  return Row(key, key, "mpi", cells)


def _t(median: float, best: float, p90: float | None = None) -> Timing:
  return Timing(
    median_us=median,
    rank_medians_us=[median, median - 1],
    iters=10,
    trials=7,
    best_us=best,
    p90_us=p90,
  )


def test_medians_over_jobs_and_each_jobs_median_kept():
  jobs = [
    [_row("a", {4: _t(10, 9, 12)})],
    [_row("a", {4: _t(30, 8, 40)})],
    [_row("a", {4: _t(20, 7, 25)})],
  ]
  (row,) = _common.combine_jobs(jobs)
  c = row.cells[4]
  assert c.median_us == 20
  assert c.best_us == 7
  assert c.p90_us == 25
  assert c.trials == 21
  assert c.rank_medians_us == [20, 19]
  assert c.job_medians_us == [10, 30, 20]
  t = _common.Targets([row])
  assert t.get("a", 4) == 20
  assert t.jobs("a", 4) == [10, 30, 20]


def test_a_job_that_failed_keeps_its_reason():
  jobs = [[_row("a", {4: _t(10, 9)})], [_row("a", {4: "phase 'mpi' failed (exit code 1): boom"})]]
  (row,) = _common.combine_jobs(jobs)
  assert row.cells[4] == "phase 'mpi' failed (exit code 1): boom"
  jobs = [
    [_row("a", {4: "phase 'mpi' failed (timed out after 900s): "})],
    [_row("a", {4: _common.WRONG + "got 3.0, expected 4.0"})],
  ]
  (row,) = _common.combine_jobs(jobs)
  assert row.cells[4].startswith(_common.WRONG)
  assert _common.exit_status([row]) == 1
  jobs = [[_row("a", {4: _t(10, 9)})], []]
  assert _common.combine_jobs(jobs)[0].cells[4] == "not measured in every job"


def test_one_job_is_returned_as_it_is():
  rows = [_row("a", {4: _t(10, 9)})]
  assert _common.combine_jobs([rows]) == rows
  assert _common.Targets(rows).jobs("a", 4) is None
